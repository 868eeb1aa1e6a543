"""The shared context of the conformance checks: the check model, its tokens and clean stages, the
backends each op may use on the device, and the tolerances."""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from ... import ops
from ...config import ModelConfig
from ...model import DeepSeekV4
from ..capture import Stages, capturing
from ..inputs import attention_inputs, indexer_inputs, moe_inputs, random_tokens

LOW_PRECISION = torch.bfloat16
# relative-L2 bound of a bf16 fast kernel against an fp32 reference of the same (bf16-rounded) inputs
BF16_TOL = 2e-2
# the model ops whose fast backends decide the model's dtype (Triton mHC and MoE take bf16/fp16 only)
MODEL_DTYPE_OPS = ("hc_pre", "hc_post", "moe_experts")
PROBED_OPS = ("sparse_attention", "indexer_topk", "moe_experts", "hc_pre", "hc_post")


def _probe_call(op: str, cfg: ModelConfig, device: torch.device, dtype: torch.dtype) -> tuple[tuple, dict]:
    """Small arguments of `op` on `device` in `dtype`, enough for a backend's `can_run` to decide."""
    if op == "sparse_attention":
        inp = attention_inputs("random", s=4, window=4, device=device, dtype=dtype)
        return (inp["q"], inp["kv"], inp["sink"], inp["idx"], inp["scale"]), {}
    if op == "indexer_topk":
        return (), indexer_inputs(s=8, device=device, dtype=dtype)
    if op == "moe_experts":
        return (), moe_inputs(cfg, tokens=2, device=device, dtype=dtype)
    hc, dim = cfg.hc_mult, cfg.dim
    x = torch.zeros(1, 1, hc, dim, device=device, dtype=dtype)  # [b, s, hc, d]
    mix = torch.zeros(1, 1, hc, device=device)
    if op == "hc_pre":
        return (
            x,
            torch.zeros(2 * hc + hc * hc, hc * dim, device=device),
            torch.ones(3, device=device),
            torch.zeros(2 * hc + hc * hc, device=device),
            cfg.norm_eps,
            cfg.hc_eps,
            cfg.hc_sinkhorn_iters,
        ), {}
    if op == "hc_post":
        return (x[:, :, 0], x, mix, mix.unsqueeze(-1).expand(1, 1, hc, hc)), {}
    raise KeyError(op)


def op_dtypes(cfg: ModelConfig, device: torch.device) -> dict[str, torch.dtype]:
    """Per probed op, the input dtype at which the default backend here is a fast one: fp32 when one takes
    fp32 (or when only the reference runs), else bf16 when a fast backend needs it (Triton MoE / mHC)."""
    out = {}
    for op in PROBED_OPS:
        out[op] = torch.float32
        for dtype in (torch.float32, LOW_PRECISION):
            args, kw = _probe_call(op, cfg, device, dtype)
            if ops.resolve(op, None, *args, **kw).name != "reference":
                out[op] = dtype
                break
    return out


def backend_refusals(name: str, cfg: ModelConfig, device: torch.device) -> dict[str, str]:
    """{op: reason} for the probed ops that have backend `name` but where it cannot run on `device` at
    fp32 nor bf16 (empty: it can run everywhere it is registered)."""
    out = {}
    for op in PROBED_OPS:
        if name not in ops.backends(op):
            continue
        reasons = []
        for dtype in (torch.float32, LOW_PRECISION):
            args, kw = _probe_call(op, cfg, device, dtype)
            reasons.append(ops.refusal(op, name, *args, **kw))
        if all(r is not None for r in reasons):
            out[op] = reasons[0] if reasons[0] == reasons[1] else "; ".join(dict.fromkeys(reasons))
    return out


@dataclass
class Context:
    cfg: ModelConfig
    model: DeepSeekV4
    tokens: torch.Tensor
    compiler: Callable | str = "aot_eager"
    seed: int = 0
    current: Stages | None = None  # stages of the model as it is now (reset when a mutant is planted)
    device: torch.device | None = None  # where the model, the tokens and every check's inputs live
    dtypes: dict[str, torch.dtype] = field(default_factory=dict)  # op-level input dtype per op (op_dtypes)
    planted: bool = False  # a mutant is planted: `clean` must already exist
    clean_backends: dict[str, list[str]] = field(default_factory=dict)  # op -> backends of the clean run
    _clean: Stages | None = None

    def __post_init__(self) -> None:
        if self.device is None:
            self.device = self.tokens.device
        self.device = torch.device(self.device)

    @property
    def clean(self) -> Stages:
        """Stages of the clean run (computed once, before any mutant is planted)."""
        if self._clean is None:
            if self.planted:
                raise RuntimeError("the clean stages must be computed before a mutant is planted")
            with ops.which_ran() as ran:
                self._clean = run_stages(self.model, self.tokens)
            self.clean_backends = ran
        return self._clean

    def stages(self) -> Stages:
        if self.current is None:
            self.current = self.clean if not self.planted else run_stages(self.model, self.tokens)
        return self.current

    @property
    def model_dtype(self) -> torch.dtype:
        return self.model.embed.weight.dtype

    def dtype(self, op: str) -> torch.dtype:
        """Input dtype of op-level checks of `op` (fp32 unless the fast backend here needs bf16)."""
        return self.dtypes.get(op, torch.float32)

    @classmethod
    def build(
        cls,
        cfg: ModelConfig,
        batch: int = 2,
        seq: int = 40,
        seed: int = 0,
        device: torch.device | str = "cpu",
        dtype: torch.dtype | None = None,
    ) -> Context:
        """The check model on `device`: in `dtype`, by default fp32 unless the device's fast backends for
        the model's mHC / MoE ops need bf16 (CUDA with Triton), so that the checks exercise them."""
        device = torch.device(device)
        dtypes = op_dtypes(cfg, device)
        if dtype is None:
            dtype = LOW_PRECISION if any(dtypes[op] != torch.float32 for op in MODEL_DTYPE_OPS) else torch.float32
        model = DeepSeekV4.from_config(cfg, seed=seed, dtype=dtype, device=device).eval()
        return cls(
            cfg, model, random_tokens(cfg, batch, seq, seed, device=device), seed=seed, device=device, dtypes=dtypes
        )


def tolerance(dtype: torch.dtype, fp32: float) -> float:
    """A check's bound for inputs of `dtype`: its fp32 bound, or BF16_TOL for half types."""
    return fp32 if dtype in (torch.float32, torch.float64) else max(fp32, BF16_TOL)


def run_stages(model: DeepSeekV4, tokens: torch.Tensor) -> Stages:
    with torch.no_grad(), capturing() as cap:
        model(tokens)
    return cap.stages


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.detach().double(), b.detach().double()
    if not bool(torch.isfinite(a).all()):
        return math.inf
    return float((a - b).norm() / b.norm().clamp_min(1e-30))


def fast_moe_backend() -> str | None:
    """The MoE backend a check exercises: the one requested in this block (`use_backend`), else the
    static-shape grouped path where it is registered (the reference loops over experts with `where`)."""
    requested = ops.requested("moe_experts")
    if requested is not None:
        return requested
    return "grouped" if "grouped" in ops.backends("moe_experts") else None


def moe_backends(inp: dict) -> list[str]:
    """The MoE backends a check exercises on these inputs: the one requested in this block (a mutant),
    else the default here (Triton on CUDA) and the static-shape grouped path where they can run; the
    reference only when neither does (it loops over experts with `where`)."""
    requested = ops.requested("moe_experts")
    if requested is not None:
        return [requested]
    out = []
    default = ops.resolve("moe_experts", None, **inp).name
    if default != "reference":
        out.append(default)
    if (
        "grouped" in ops.backends("moe_experts")
        and "grouped" not in out
        and ops.refusal("moe_experts", "grouped", **inp) is None
    ):
        out.append("grouped")
    return out or ["reference"]
