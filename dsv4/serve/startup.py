"""What a serving process builds from `dsv4 serve`'s options: the model, its tokenizer and the engine.

`dsv4 serve` runs `build_engine` in its engine process (`build_workers` in `dsv4.serve.workers` with
--tensor-parallel-size N > 1, which calls `load` and `make_engine` on every worker); `dsv4 chat` and the
benchmarks call `load` and `make_engine` in their own process. The HTTP process needs only the tokenizer
(`load_tokenizer`) and the served name (`model_name`).
"""

from __future__ import annotations

import argparse
from pathlib import Path

from ..errors import UserError


def model_name(args) -> str:
    from ..loading import default_model_dir

    if getattr(args, "served_model_name", None):
        return args.served_model_name
    if getattr(args, "preset", None):
        return args.preset
    return Path(args.model).name if args.model else default_model_dir().name


def load_tokenizer(args):
    """The tokenizer alone (the server process encodes prompts; the engine process holds the model)."""
    from ..loading import default_model_dir, resolve_config
    from ..train.tokenizer import ByteTokenizer, Tokenizer

    if getattr(args, "model", None) or not (getattr(args, "preset", None) or getattr(args, "config", None)):
        from ..checkpoint.hub import resolve_model_path

        path = resolve_model_path(args.model, weights=False) if args.model else default_model_dir()
        if path is not None and (path / "tokenizer.json").exists():
            return Tokenizer.from_file(path)
    cfg = resolve_config(args)
    return ByteTokenizer(cfg.bos_token_id, cfg.eos_token_id)


def check_engine_options(args, cfg) -> None:
    """Refuse, in one line and before any weights are read, the engine options this model cannot run."""
    from ..loading import speculative_problem

    problem = speculative_problem(cfg, getattr(args, "speculative", 0) or 0,
                                  getattr(args, "speculative_threshold", 0.0) or 0.0)
    if problem:
        raise UserError(problem)
    for flag in ("max_num_seqs", "max_batch_tokens"):
        if getattr(args, flag, None) is not None and getattr(args, flag) < 1:
            raise UserError(f"--{flag.replace('_', '-')} must be >= 1")
    if getattr(args, "max_model_len", None) is not None and not 2 <= args.max_model_len <= cfg.max_seq_len:
        raise UserError(f"--max-model-len must be in [2, {cfg.max_seq_len}] (the model's context)")


def load(args, rank: int = 0, world_size: int = 1):
    """(model, tokenizer, served name, description); resolves args.device / args.dtype ("auto") in place."""
    from .. import defaults
    from ..loading import load_model
    from ..train.tokenizer import ByteTokenizer

    args.device = str(defaults.resolve_device(getattr(args, "device", None) or "auto"))
    args.dtype = defaults.dtype_name(defaults.resolve_dtype(getattr(args, "dtype", None) or "auto", args.device))
    model, tokenizer, desc = load_model(args, rank=rank, world_size=world_size)
    if tokenizer is None:
        tokenizer = ByteTokenizer(model.cfg.bos_token_id, model.cfg.eos_token_id)
    return model, tokenizer, model_name(args), desc


def make_engine(args, model, tokenizer, detokenize: bool = True, mirror=None):
    from ..engine import Engine, EngineConfig

    check_engine_options(args, model.cfg)
    config = EngineConfig(max_seqs=args.max_num_seqs or 32, max_model_len=args.max_model_len,
                          max_batch_tokens=args.max_batch_tokens, page_size=args.page_size,
                          cache_pages=args.cache_pages, prefix_caching=not args.no_prefix_caching,
                          deterministic=args.deterministic, cuda_graphs=getattr(args, "cuda_graph", True),
                          speculative=getattr(args, "speculative", 0) or 0,
                          speculative_threshold=getattr(args, "speculative_threshold", 0.0) or 0.0)
    try:
        return Engine(model, config, tokenizer=tokenizer, detokenize=detokenize, mirror=mirror)
    except ValueError as e:
        raise UserError(str(e)) from None


def engine_info(engine, desc: str, threads: int | None, graphs: int) -> dict:
    """What the engine process reports at start-up: printed by the server, its limits, /metrics."""
    from .capacity import longest_sequence

    return {"desc": desc, "device": str(engine.device), "max_model_len": engine.max_model_len,
            "max_seqs": engine.config.max_seqs, "cache_mib": engine.cache.nbytes() / 2**20,
            "vocab_size": engine.vocab, "max_n": engine.config.max_n,
            "max_sequence_tokens": longest_sequence(engine), "threads": threads,
            "graphs": graphs, "warmup_s": engine.runner.warmup_seconds}


def ignore_interrupts() -> None:
    """Ctrl-C in a terminal reaches the whole process group: the HTTP process handles it (a graceful
    shutdown) and stops the engine process through its pipe."""
    import signal

    signal.signal(signal.SIGINT, signal.SIG_IGN)


def _http_reserve() -> int:
    """Cores the engine leaves to the HTTP process: one, except on a machine of two cores or fewer, where the
    engine's prefill needs them more (BENCHMARKS.md, the 2-core serving table: at 16 clients both cores gave
    +21% tokens/s and a 40% shorter time to first token than one)."""
    from ..defaults import cores

    return 1 if cores() > 2 else 0


def build_engine(opts: dict):
    """(engine, info) from `dsv4 serve`'s options: what the engine process runs first (one worker)."""
    from ..defaults import set_threads

    ignore_interrupts()
    args = argparse.Namespace(**opts)
    threads = set_threads(args.threads, reserve=_http_reserve())   # the compute threads (--threads)
    model, tokenizer, _name, desc = load(args)
    engine = make_engine(args, model, tokenizer, detokenize=False)     # text is made in the server's process
    graphs = engine.warmup()
    return engine, engine_info(engine, desc, threads, graphs)
