"""The engine on N worker processes (`--tensor-parallel-size N`): one per device, one scheduler.

Rank 0 is the engine process the server talks to; it starts ranks 1..N-1, and every rank joins the
workers' group (`dsv4.parallel.init_workers`: gloo on CPUs, NCCL on GPUs, worker r on cuda:r), loads the
model with only its share of the routed experts (`load_pretrained(..., rank=r, world_size=N)`; a preset is
built whole and cut), applies `parallelize_for_serving` (experts split by expert, attention replicated:
`dsv4.parallel`'s docstring says why that split suits V4) and builds the same engine. Rank 0 serves; the
others follow its runner step by step (`dsv4.engine.mirror`). Every collective waits at most --worker-timeout
seconds, and rank 0 watches the others: a worker that dies takes the engine process down with one line,
and the server with it.
"""

from __future__ import annotations

import logging
import multiprocessing as mp
import os
import sys
import threading

from .startup import EngineSpec, engine_info, ignore_interrupts, load, make_engine

log = logging.getLogger("dsv4.serve")


def _join(spec: EngineSpec, rank: int, world: int, port: int, on_stop=None):
    """This worker's group, model and engine (the same on every rank but for the experts it holds).
    on_stop (rank 0): called when the engine tells the others to stop."""
    from .. import defaults
    from ..engine.mirror import Mirror
    from ..parallel import init_workers, parallelize_for_serving

    device = defaults.resolve_device(spec.source.device or "auto").type  # worker r takes cuda:r
    threads = spec.threads
    if device == "cpu" and not threads:  # N processes share the cores (one for HTTP)
        threads = max(1, (defaults.cores() - 1) // world)
    threads = defaults.set_threads(threads, reserve=1)
    w = init_workers(rank, world, master_port=port, device=device, timeout_s=spec.worker_timeout)
    spec = spec.on_device(str(w.device))
    model, tokenizer, name, desc = load(spec, rank=rank, world_size=world)
    parallelize_for_serving(model, w.group, attention="replicated")
    engine = make_engine(spec, model, tokenizer, mirror=Mirror(w.group, w.device, on_stop=on_stop))
    return engine, desc, threads


def _follower(spec: EngineSpec, rank: int, world: int, port: int) -> None:
    """Ranks 1..N-1: build, capture the same graphs as rank 0, then follow its runner until STOP."""
    from ..parallel import shutdown_workers

    ignore_interrupts()
    try:
        engine, _, _ = _join(spec, rank, world, port)
        engine.warmup()
        engine.follow()
    except Exception as e:  # noqa: BLE001 - one line, then exit
        print(f"dsv4 serve: worker {rank} failed: {type(e).__name__}: {e}", file=sys.stderr, flush=True)
        os._exit(1)
    shutdown_workers()


def _watch(procs: list[mp.Process], stopping: threading.Event, poll_s: float = 0.2) -> None:
    """Rank 0: end the engine process when another worker exits (its collectives would fail or hang), until
    the engine stops them itself (`stopping`): from then on they exit, or are ended with this process, as
    they should."""
    while not stopping.is_set():
        for rank, p in enumerate(procs, start=1):
            if p.exitcode is not None and not stopping.is_set():
                print(
                    f"dsv4 serve: worker {rank} exited (code {p.exitcode}): stopping the engine",
                    file=sys.stderr,
                    flush=True,
                )
                os._exit(3)
        stopping.wait(poll_s)


def build_workers(spec: EngineSpec, own_process: bool = True):
    """Rank 0's (engine, info) with ranks 1..N-1 (N = spec.tensor_parallel_size) started and following: what
    the engine process runs first when N > 1 (own_process), or what `dsv4 generate` and `dsv4 chat` run in
    their own process (Ctrl-C stays theirs). `engine.close()` stops the other workers. spec.detokenize: the
    engine makes text (generate and chat; the server makes it in its HTTP process). The spec crosses the
    spawn into every worker as it is."""
    from ..parallel import free_port

    if own_process:
        ignore_interrupts()
    world = spec.tensor_parallel_size
    port = free_port()
    ctx = mp.get_context("spawn")
    procs = [
        ctx.Process(target=_follower, args=(spec, r, world, port), name=f"dsv4-worker-{r}", daemon=True)
        for r in range(1, world)
    ]
    for p in procs:
        p.start()
    stopping = threading.Event()
    threading.Thread(target=_watch, args=(procs, stopping), name="dsv4-worker-watch", daemon=True).start()
    engine, desc, threads = _join(spec, 0, world, port, on_stop=stopping.set)
    graphs = engine.warmup()
    info = engine_info(engine, desc, threads, graphs)
    info.update(device=f"{engine.device} and {world - 1} more worker(s)", workers=world)
    return engine, info
