"""The settings of a training run: `TrainConfig` (one field per `dsv4 train` option, read from the command
line, a JSON / TOML file or a dict) and the defaults that depend on the run (`STANDARD_DEFAULTS`,
`QUICK_CPU_DEFAULTS`)."""

from __future__ import annotations

import dataclasses
import json
import os
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ..errors import UserError


@dataclass
class TrainConfig:
    # model
    preset: str = "tiny"
    model: dict[str, Any] = field(default_factory=dict)  # ModelConfig field overrides
    model_config: str | None = None  # a config.json instead of a preset
    init_from: str | None = None  # continue-train a checkpoint directory or Hub id
    no_mtp: bool = False  # with init_from: leave the checkpoint's MTP block out
    draft: str | None = None  # "none" | "mtp" | "dspark": replace the model's draft
    freeze_main: bool = False  # train the draft only (the main model stays as loaded)
    # data
    data: list[str] = field(default_factory=list)  # files/dirs; empty = the Python stdlib
    tokenizer: str | None = None  # tokenizer.json (or its dir); None = train one
    tokenizer_docs: int | None = None  # documents sampled to train the tokenizer
    max_docs: int | None = None  # documents used (an even spread; 0 = all)
    held_out_pct: float = 2.0
    seq_len: int | None = None
    batch_size: int | None = None
    grad_accum: int = 1  # micro-batches of batch_size per optimizer step (gradient accumulation)
    cache_dir: str | None = None
    # optimization
    steps: int | None = None
    lr: float | None = None
    min_lr_ratio: float = 0.1
    warmup: int | None = None
    schedule: str = "cosine"  # cosine | wsd | constant
    weight_decay: float = 0.1
    grad_clip: float = 1.0
    muon_momentum: float = 0.95
    # losses
    mtp_weight: float = 0.3  # the draft's loss weight (MTP block or DSpark draft)
    dspark_anchors: int = 16  # DSpark blocks drawn per training sequence
    dspark_ce_alpha: float = 0.1  # DSpark loss terms (dsv4.train.dspark_loss)
    dspark_l1_alpha: float = 0.9
    dspark_confidence_alpha: float = 1.0
    dspark_gamma: float = 4.0
    indexer_weight: float = 1.0
    balance_alpha: float = 1e-4  # sequence-wise balance loss (0 = off)
    bias_gamma: float = 1e-3  # aux-loss-free bias update speed (0 = off)
    # precision / speed
    precision: str = "auto"  # auto | bf16 | fp32
    fp8_kv_sim: bool | None = None  # None = as in the model config
    fp4_indexer_sim: bool | None = None
    fp4_experts: bool = False  # FP4 fake-quant of routed experts (STE)
    activation_checkpointing: bool = False
    head_precision: str = "fp32"  # fp32 | bf16: the vocabulary heads' products under bf16 autocast
    compile: bool = False
    cuda_graph: bool = False  # forward + backward replayed from a CUDA graph
    deterministic: bool = False
    backend: str | None = None  # ops backend for every op (None = default)
    device: str = "auto"
    expert_parallel: bool = True
    # bookkeeping
    seed: int = 0
    eval_every: int | None = None
    eval_windows: int | None = None
    diag_every: int | None = None
    save_every: int = 0
    keep_checkpoints: int = 2
    out: str = "runs/train"
    resume: str | None = None  # a checkpoint dir / run dir, or "auto"
    export: str | None = None  # write an inference checkpoint here at the end
    sample_prompt: str = "import os\n\ndef "
    peak_tflops: float | None = None
    time_budget_s: float = 0.0  # >0: cut `steps` so training fits this wall time
    stop_after_s: float = 0.0  # >0: end this invocation after so many seconds of steps, with a checkpoint
    # to resume from (the schedule of `steps` unchanged: a long run in stages)
    threads: int = 0  # CPU threads for torch (0 = torch's default)
    progress: bool = True
    skip_nonfinite: bool = False  # skip a step whose loss or gradients are NaN/Inf
    # (default: stop the run with exit 1 naming it)

    @classmethod
    def from_file(
        cls, path: str | Path, check: Callable[[dict, str], dict] | None = None, **overrides: Any
    ) -> TrainConfig:
        """Read a JSON or TOML file of TrainConfig keys ([model] holds ModelConfig overrides). check(values,
        source): the values' checks before they are used (`dsv4 train` passes its flags' own)."""
        from ..safe_paths import MAX_TEXT_BYTES, read_bytes

        path = Path(path)
        if not os.path.lexists(path):
            raise UserError(f"{path}: no such training config file")
        data = read_bytes(path, MAX_TEXT_BYTES, f"--config {path}")  # a FIFO or device: refused, not read
        try:
            text = data.decode("utf-8")
            if path.suffix == ".toml":
                import tomllib

                raw = tomllib.loads(text)
            else:
                raw = json.loads(text)
        except (ValueError, RecursionError) as e:
            raise UserError(f"{path}: cannot parse ({str(e)[:200]})") from None
        if not isinstance(raw, dict):
            raise UserError(f"{path}: must hold an object of training settings, not {type(raw).__name__}")
        if check is not None:
            raw = check(raw, str(path))
        return cls.from_dict({**raw, **overrides}, source=str(path))

    @classmethod
    def from_dict(cls, raw: dict[str, Any], source: str = "config") -> TrainConfig:
        names = {f.name for f in dataclasses.fields(cls)}
        bad = sorted(set(raw) - names)
        if bad:
            raise UserError(f"{source}: unknown training setting(s) {bad}; known: {sorted(names)}")
        return cls(**raw)

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    def quick_profile(self, device_type: str) -> bool:
        """Whether settings left unset take QUICK_CPU_DEFAULTS: the tiny preset trained on a CPU."""
        return device_type == "cpu" and self.preset == "tiny" and not (self.model_config or self.init_from)

    def resolved(self, device_type: str) -> TrainConfig:
        """A copy with every setting left at None filled from QUICK_CPU_DEFAULTS or STANDARD_DEFAULTS."""
        table = QUICK_CPU_DEFAULTS if self.quick_profile(device_type) else STANDARD_DEFAULTS
        return dataclasses.replace(self, **{k: v for k, v in table.items() if getattr(self, k) is None})


def model_config_of(c: TrainConfig, base=None):
    """The ModelConfig a run of `c` trains: `base` (a checkpoint's, for init_from), else its config.json
    or its preset; then its [model] overrides, its draft and its simulation flags."""
    from ..config import ModelConfig

    if base is not None:
        mcfg = base
    elif c.model_config:
        from ..checkpoint import read_config_file

        mcfg = read_config_file(c.model_config)
    else:
        mcfg = ModelConfig.preset(c.preset)
    if c.model:
        known = {f.name for f in dataclasses.fields(mcfg)}
        unknown = sorted(set(c.model) - known)
        if unknown:
            raise UserError(
                f"unknown model setting(s) {unknown} in --set / [model] (ModelConfig fields, e.g. dim, n_layers, "
                "n_routed_experts; `dsv4 info --preset tiny --json` lists them under config)"
            )
        try:
            mcfg = mcfg.replace(**c.model)
        except TypeError as e:
            raise UserError(f"bad model override: {e}") from None
    if c.draft is not None:
        mcfg = mcfg.with_draft(c.draft)
    if c.fp8_kv_sim is not None:
        mcfg = mcfg.replace(fp8_kv_sim=c.fp8_kv_sim)
    if c.fp4_indexer_sim is not None:
        mcfg = mcfg.replace(fp4_indexer_sim=c.fp4_indexer_sim)
    return mcfg


# Settings whose default depends on the run. STANDARD: any preset on a GPU, and presets other than tiny
# (or a --model-config / --init-from model) on a CPU. QUICK_CPU: the tiny preset on a CPU, sized so that a
# bare `dsv4 train --preset tiny` (tokenizer, data, training, evaluation) ends within about two minutes
# on two cores with a clear drop of the held-out loss.
STANDARD_DEFAULTS: dict[str, Any] = dict(
    tokenizer_docs=300,
    max_docs=500,
    seq_len=256,
    batch_size=8,
    steps=200,
    lr=3e-3,
    warmup=20,
    eval_every=50,
    eval_windows=32,
    diag_every=1,
)
QUICK_CPU_DEFAULTS: dict[str, Any] = dict(
    tokenizer_docs=100,
    max_docs=150,
    seq_len=128,
    batch_size=4,
    steps=40,
    lr=5e-3,
    warmup=4,
    eval_every=20,
    eval_windows=8,
    diag_every=10,
)
