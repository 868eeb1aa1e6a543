"""What a process that runs an engine builds, from one typed launch spec: the model, its tokenizer and the
engine.

`EngineSpec` is what the command lines of `dsv4 serve`, `dsv4 chat`, `dsv4 generate` and the benchmarks
say about the engine, parsed once (`EngineSpec.from_args`): the model source, the engine's settings and
where it runs. It is frozen and picklable: `dsv4 serve` hands it to its engine process (`build_engine`),
and with --tensor-parallel-size N > 1 to every worker (`dsv4.serve.workers.build_workers`, which calls
`load` and `make_engine` on each); `dsv4 chat`, `dsv4 generate` and the benchmarks call `load` and
`make_engine` (or `build_workers`) in their own process. The HTTP process needs only the tokenizer
(`load_tokenizer`) and the served name (`EngineSpec.served_name`).
"""

from __future__ import annotations

import argparse
import dataclasses
from dataclasses import dataclass, field
from pathlib import Path

from ..errors import UserError
from ..loading import ModelSource
from ..options import SHARED

_WORKER_TIMEOUT: float = SHARED["worker_timeout"].kwargs["default"]


@dataclass(frozen=True)
class EngineSpec:
    """An engine to build: the model (`source`, with its device and dtype), the engine's settings (those of
    `dsv4.engine.EngineConfig`, as the command line names them) and where it runs."""

    source: ModelSource = field(default_factory=ModelSource)
    served_model_name: str | None = None  # the model id clients send (default: see served_name)
    # the engine
    max_num_seqs: int | None = None  # sequences running at once (None: 32)
    max_model_len: int | None = None  # prompt + output per sequence (None: the engine's default)
    max_batch_tokens: int | None = None  # tokens per step (None: the engine's default for the device)
    max_prefill_tokens: int | None = None  # tokens per step of prompts alone (None: the engine's default)
    page_size: int | None = None
    cache_pages: int | None = None
    prefix_caching: bool = True
    deterministic: bool = False
    cuda_graphs: bool = True
    speculative: int = 0  # draft tokens verified per step (0: off)
    speculative_threshold: float = 0.0
    detokenize: bool = True  # outputs carry text (False: the caller makes it, as the server does)
    # where it runs
    threads: int = 0  # compute threads (0: the cores this process may use)
    tensor_parallel_size: int = 1  # worker processes, one per device
    worker_timeout: float = _WORKER_TIMEOUT  # seconds a worker waits for the others in a collective

    @classmethod
    def from_args(cls, args: argparse.Namespace, **changes) -> EngineSpec:
        """The spec a command's parsed options name (options the command does not have take their defaults),
        with `changes` (field=value) applied."""
        get = vars(args).get
        spec = cls(
            source=ModelSource.from_args(args),
            served_model_name=get("served_model_name"),
            max_num_seqs=get("max_num_seqs"),
            max_model_len=get("max_model_len"),
            max_batch_tokens=get("max_batch_tokens"),
            max_prefill_tokens=get("max_prefill_tokens"),
            page_size=get("page_size"),
            cache_pages=get("cache_pages"),
            prefix_caching=not get("no_prefix_caching"),
            deterministic=bool(get("deterministic")),
            cuda_graphs=bool(get("cuda_graph", True)),
            speculative=get("speculative") or 0,
            speculative_threshold=get("speculative_threshold") or 0.0,
            threads=get("threads") or 0,
            tensor_parallel_size=get("tensor_parallel_size") or 1,
            worker_timeout=get("worker_timeout") or _WORKER_TIMEOUT,
        )
        return dataclasses.replace(spec, **changes)

    @property
    def served_name(self) -> str:
        """The model id the server answers to: --served-model-name, else the preset, else the model's
        directory name (the shipped model's without one)."""
        from ..loading import default_model_dir

        if self.served_model_name:
            return self.served_model_name
        if self.source.preset:
            return self.source.preset
        return Path(self.source.model).name if self.source.model else default_model_dir().name

    def on_device(self, device: str) -> EngineSpec:
        """This spec on `device` (a worker's own)."""
        return dataclasses.replace(self, source=dataclasses.replace(self.source, device=device))

    def resolved(self) -> EngineSpec:
        """This spec with its device and dtype named as this machine runs them ("auto" resolved)."""
        from .. import defaults

        device = str(defaults.resolve_device(self.source.device or "auto"))
        dtype = defaults.dtype_name(defaults.resolve_dtype(self.source.dtype or "auto", device))
        return dataclasses.replace(self, source=dataclasses.replace(self.source, device=device, dtype=dtype))

    def engine_config(self):
        """The `EngineConfig` of these settings."""
        from ..engine import EngineConfig

        return EngineConfig(
            max_seqs=self.max_num_seqs or 32,
            max_model_len=self.max_model_len,
            max_batch_tokens=self.max_batch_tokens,
            max_prefill_tokens=self.max_prefill_tokens,
            page_size=self.page_size,
            cache_pages=self.cache_pages,
            prefix_caching=self.prefix_caching,
            deterministic=self.deterministic,
            cuda_graphs=self.cuda_graphs,
            speculative=self.speculative,
            speculative_threshold=self.speculative_threshold,
        )


def load_tokenizer(source: ModelSource):
    """The tokenizer alone (the server process encodes prompts; the engine process holds the model)."""
    from ..loading import default_model_dir, resolve_config
    from ..tokenizer import ByteTokenizer, Tokenizer

    if source.model or not (source.preset or source.config):
        from ..checkpoint.hub import resolve_model_path

        path = resolve_model_path(source.model, weights=False) if source.model else default_model_dir()
        if path is not None and (path / "tokenizer.json").exists():
            return Tokenizer.from_file(path)
    cfg = resolve_config(source)
    return ByteTokenizer(cfg.bos_token_id, cfg.eos_token_id)


def check_engine_options(spec: EngineSpec, cfg) -> None:
    """Refuse, in one line and before any weights are read, the engine options this model cannot run."""
    from ..loading import speculative_problem

    problem = speculative_problem(cfg, spec.speculative, spec.speculative_threshold)
    if problem:
        raise UserError(problem)
    for flag in ("max_num_seqs", "max_batch_tokens", "max_prefill_tokens"):
        if getattr(spec, flag) is not None and getattr(spec, flag) < 1:
            raise UserError(f"--{flag.replace('_', '-')} must be >= 1")
    if spec.max_prefill_tokens is not None and spec.max_prefill_tokens < (spec.max_batch_tokens or 0):
        raise UserError(
            f"--max-prefill-tokens ({spec.max_prefill_tokens}) must be at least --max-batch-tokens "
            f"({spec.max_batch_tokens}): a step of prompts alone may always take a full step"
        )
    if spec.max_model_len is not None and not 2 <= spec.max_model_len <= cfg.max_seq_len:
        raise UserError(f"--max-model-len must be in [2, {cfg.max_seq_len}] (the model's context)")


def load(spec: EngineSpec, rank: int = 0, world_size: int = 1):
    """(model, tokenizer, served name, description) of the spec's model, on its device and dtype ("auto":
    resolved here; `spec.resolved()` names them)."""
    from ..loading import load_model
    from ..tokenizer import ByteTokenizer

    model, tokenizer, desc = load_model(spec.resolved().source, rank=rank, world_size=world_size)
    if tokenizer is None:
        tokenizer = ByteTokenizer(model.cfg.bos_token_id, model.cfg.eos_token_id)
    return model, tokenizer, spec.served_name, desc


def make_engine(spec: EngineSpec, model, tokenizer, mirror=None):
    from ..engine import Engine

    check_engine_options(spec, model.cfg)
    try:
        return Engine(model, spec.engine_config(), tokenizer=tokenizer, detokenize=spec.detokenize, mirror=mirror)
    except ValueError as e:
        raise UserError(str(e)) from None


def engine_info(engine, desc: str, threads: int | None, graphs: int) -> dict:
    """What the engine process reports at start-up: printed by the server, its limits, /metrics."""
    from .capacity import longest_sequence

    return {
        "desc": desc,
        "device": str(engine.device),
        "max_model_len": engine.max_model_len,
        "max_seqs": engine.config.max_seqs,
        "cache_mib": engine.cache.nbytes() / 2**20,
        "vocab_size": engine.vocab,
        "max_n": engine.config.max_n,
        "max_sequence_tokens": longest_sequence(engine),
        "threads": threads,
        "graphs": graphs,
        "warmup_s": engine.runner.warmup_seconds,
    }


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


def build_engine(spec: EngineSpec):
    """(engine, info) from the server's spec: what the engine process runs first (one worker)."""
    from ..defaults import set_threads

    ignore_interrupts()
    threads = set_threads(spec.threads, reserve=_http_reserve())  # the compute threads (--threads)
    model, tokenizer, _name, desc = load(spec)
    engine = make_engine(spec, model, tokenizer)
    graphs = engine.warmup()
    return engine, engine_info(engine, desc, threads, graphs)
