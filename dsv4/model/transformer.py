"""DeepSeek-V4: embed -> hc copies -> blocks -> HC head -> norm -> fp32 logits (+ MTP blocks).

Two paths share every module:
- `forward(tokens)`: the full sequence from position 0, differentiable (training, checks);
- `append(tokens, inputs, cache)`: tokens of many sequences at their own positions on a paged cache
  (`dsv4.model.paged`): prefill chunks, decode steps and speculative verifies alike. `prefill` and
  `decode_step` wrap it for b sequences in lockstep (`new_cache`). Generation, sampling and serving
  live in `dsv4.engine`; the model holds no request state.
Parameter names are the official inference names, except that routed experts are stacked per layer.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

import torch
from torch import nn

from .. import defaults
from ..config import ModelConfig
from .block import Block, MTPBlock, hc_head
from .dspark import DSparkDraft, DSparkStage, draft_of
from .int8 import quantize_int8
from .layers import RMSNorm, autocast_dtype, building_on, linear_bf16_fp32, linear_fp32, record
from .moe import Experts, Gate
from .paged import BatchCache, PagedKVCache, StepInputs, plan_step


@dataclass
class ModelOutput:
    logits: torch.Tensor  # [b, s, vocab] fp32
    hidden: torch.Tensor | None = None  # [b, s, hc, dim] before the HC head
    mtp_logits: list[torch.Tensor] = field(default_factory=list)  # depth k: [b, s-1-k, vocab], predicts t+k+2
    indexer_loss: torch.Tensor | None = None  # summed over CSA layers
    balance_loss: torch.Tensor | None = None  # summed over MoE layers (when alpha > 0)
    # per layer [E] token counts (measured in training mode or with autograd on: `MoE.load`)
    expert_load: list[torch.Tensor | None] = field(default_factory=list)
    taps: torch.Tensor | None = None  # [b, s, len(targets) * dim]: a DSpark draft's input


def _capturing(device: torch.device) -> bool:
    """True while the current CUDA stream is being captured into a graph."""
    return device.type == "cuda" and torch.cuda.is_current_stream_capturing()


@contextlib.contextmanager
def _default_dtype(dtype: torch.dtype):
    prev = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        yield
    finally:
        torch.set_default_dtype(prev)


@torch.no_grad()
def init_hc_base(p: torch.Tensor, hc: int) -> None:
    """The initial mHC bias: pre ~ 1/hc (average the copies), comb ~ identity (keep each copy), post 0;
    for the HC head (hc entries) pre ~ 1/hc."""
    if p.numel() == hc:  # HC head: pre = sigmoid(b) ~ 1/hc
        p.fill_(math.log(1 / (hc - 1)) if hc > 1 else 0.0)
        return
    p.zero_()
    p[:hc] = math.log(1 / (hc - 1)) if hc > 1 else 0.0
    comb = torch.full((hc, hc), -4.0)
    comb.fill_diagonal_(4.0)
    p[2 * hc :] = comb.flatten()


HEAD_PRECISIONS = ("fp32", "bf16")


class DeepSeekV4(nn.Module):
    # what a checkpoint loader read into this model (`loaded_from`); None for a model built or initialized here
    checkpoint_plan: dict | None = None
    # what every logits tensor of `append` / `draft` goes through first (`watching_logits`)
    logits_watchers: tuple[Callable[[torch.Tensor], None], ...] = ()
    # the vocabulary heads' products under bf16 autocast (`set_options(head_precision=...)`)
    head_precision: str = "fp32"

    def __init__(
        self,
        cfg: ModelConfig,
        dtype: torch.dtype | None = None,
        device: str | torch.device | None = None,
        init: bool = True,
    ):
        """dtype / device default to `dsv4.defaults` (fp32, cpu), as the command line's --dtype / --device;
        init=False leaves the random init (`reset_parameters`) to the caller."""
        super().__init__()
        self._nonfinite_counts: dict[torch.device, torch.Tensor] = {}  # see `nonfinite_count`
        self.cfg = cfg
        dtype = dtype or defaults.default_dtype()
        device = device or defaults.DEVICE
        with _default_dtype(dtype), torch.device(device), building_on(device):
            self.embed = nn.Embedding(cfg.vocab_size, cfg.dim)
            self.layers = nn.ModuleList(Block(cfg, i) for i in range(cfg.n_layers))
            self.norm = RMSNorm(cfg.dim, cfg.norm_eps)
            self.head = nn.Linear(cfg.dim, cfg.vocab_size, bias=False, dtype=torch.float32)
            self.hc_head_fn = nn.Parameter(torch.zeros(cfg.hc_mult, cfg.hc_mult * cfg.dim, dtype=torch.float32))
            self.hc_head_base = nn.Parameter(torch.zeros(cfg.hc_mult, dtype=torch.float32))
            self.hc_head_scale = nn.Parameter(torch.ones(1, dtype=torch.float32))
            if cfg.dspark:  # Flash-0731: the DSpark draft's stages (dsv4.model.dspark)
                self.mtp = nn.ModuleList(DSparkStage(cfg, k) for k in range(cfg.n_mtp_layers))
            else:  # the first release: MTP blocks
                self.mtp = nn.ModuleList(MTPBlock(cfg, cfg.n_layers + k) for k in range(cfg.n_mtp_layers))
        if init and str(device) != "meta":
            self.reset_parameters()

    # ------------------------------------------------------------------ construction
    @classmethod
    def from_config(cls, cfg: ModelConfig | str, seed: int = 0, init_on_device: bool = False, **kw) -> DeepSeekV4:
        """A randomly initialized model from a ModelConfig or a preset name (with `quant_mode="int8"` its
        linears and routed experts are then requantized to INT8, `dsv4.model.int8`). init_on_device: the
        random numbers are drawn on the model's device (`reset_parameters`)."""
        if isinstance(cfg, str):
            cfg = ModelConfig.preset(cfg)
        model = cls(cfg, init=False, **kw)
        model.reset_parameters(seed, on_device=init_on_device)
        if cfg.quant_mode == "int8":
            quantize_int8(model)
        return model

    @torch.no_grad()
    def reset_parameters(self, seed: int = 0, on_device: bool = False) -> None:
        """Deterministic random init: linears N(0, 1/in), norms 1, mHC mixing near identity, hash
        table of distinct experts per token, zero router bias, sinks and ape.

        The numbers come from a CPU generator, so a seed gives the same weights on every device. on_device:
        from a generator on the model's device instead (seconds, not minutes, for a model of billions of
        parameters; the same weights on every device of that type, not across types: for benchmarks)."""
        cfg = self.cfg
        dev = self.embed.weight.device if on_device else torch.device("cpu")
        gen = torch.Generator(device=dev).manual_seed(seed)

        def normal_(p: torch.Tensor, std: float) -> None:
            if not on_device:
                p.copy_(torch.randn(p.shape, generator=gen) * std)
                return
            rows = p.view(p.size(0), -1)  # (every parameter drawn here is a matrix or more)
            step = max(1, (1 << 26) // max(1, rows.size(1)))  # fp32 draws of at most ~256 MB at a time
            for part in rows.split(step):
                part.copy_(torch.randn(part.shape, generator=gen, device=dev).mul_(std))

        for name, p in self.named_parameters():
            leaf = name.rsplit(".", 1)[-1]
            if name.endswith("norm.weight"):
                p.fill_(1.0)
            elif leaf in ("attn_sink", "ape"):
                p.zero_()
            elif "hc_" in leaf and leaf.endswith("_fn"):
                normal_(p, 0.02 / math.sqrt(p.size(1)))
            elif "hc_" in leaf and leaf.endswith("_scale"):
                p.fill_(1.0)
            elif "hc_" in leaf and leaf.endswith("_base"):
                init_hc_base(p, cfg.hc_mult)
            elif name == "embed.weight":
                normal_(p, 1.0)
            elif p.dim() >= 2:
                normal_(p, p.size(-1) ** -0.5)
            else:
                p.zero_()
        for mod in self.modules():
            if not isinstance(mod, Gate):
                continue
            if mod.hash and on_device:  # distinct experts per token: the first k of a random order
                order = torch.rand(cfg.vocab_size, cfg.n_routed_experts, generator=gen, device=dev).argsort(-1)
                mod.tid2eid.copy_(order[:, : cfg.n_activated_experts].to(torch.int32))
            elif mod.hash:
                table = torch.stack(
                    [
                        torch.randperm(cfg.n_routed_experts, generator=gen)[: cfg.n_activated_experts]
                        for _ in range(cfg.vocab_size)
                    ]
                )
                mod.tid2eid.copy_(table.to(torch.int32))
            else:
                mod.bias.zero_()

    # ------------------------------------------------------------------ options
    def set_options(
        self,
        *,
        activation_checkpointing: bool | None = None,
        fp4_fake_quant: bool | None = None,
        eager_experts_under_compile: bool | None = None,
        head_precision: str | None = None,
        expert_casts=None,
    ) -> DeepSeekV4:
        """Switch the model's run-time options (None leaves one as it is); returns the model.

        activation_checkpointing: every main and MTP block recomputes its forward in backward
        (`Block.activation_checkpointing`); fp4_fake_quant: the routed experts compute with FP4-rounded
        weights, gradients straight through (`Experts.fp4_fake_quant`); eager_experts_under_compile: the
        routed experts stay eager inside a torch.compile'd block (`Experts.eager_under_compile`);
        head_precision: "fp32" (the spec's fp32 logits, `ops.linear_fp32`) or "bf16": inside a bf16 autocast
        region (mixed-precision training) the vocabulary heads take one bf16 product per term, summed and
        returned in fp32 (`ops.linear_bf16_fp32`); outside autocast (inference) the heads stay fp32;
        expert_casts: the routed experts' `cast_cache` (False removes it; `dsv4.train.casts.StepCasts`).
        """
        if head_precision is not None:
            if head_precision not in HEAD_PRECISIONS:
                raise ValueError(f"head_precision must be one of {HEAD_PRECISIONS}, got {head_precision!r}")
            self.head_precision = head_precision
        if activation_checkpointing is not None:
            for block in [*self.layers, *self.mtp]:
                block.activation_checkpointing = activation_checkpointing
        for m in self.modules():
            if isinstance(m, Experts):
                if fp4_fake_quant is not None:
                    m.fp4_fake_quant = fp4_fake_quant
                if eager_experts_under_compile is not None:
                    m.eager_under_compile = eager_experts_under_compile
                if expert_casts is not None:
                    m.cast_cache = expert_casts or None
        return self

    def loaded_from(self, plan: dict) -> DeepSeekV4:
        """Record what a checkpoint loader read into this model as `checkpoint_plan` (`dsv4.checkpoint.
        load_pretrained`: path, layout, files, the experts held, what was read); returns the model."""
        self.checkpoint_plan = dict(plan)
        return self

    @contextlib.contextmanager
    def watching_logits(self, fn: Callable[[torch.Tensor], None]) -> Iterator[None]:
        """Inside the block, every fp32 logits tensor `append` and `draft` return goes through fn(logits)
        first (a check that may raise, `dsv4.check.finite_logits.watch_logits`); nested blocks add theirs."""
        prev = self.logits_watchers
        self.logits_watchers = (*prev, fn)
        try:
            yield
        finally:
            self.logits_watchers = prev

    def nonfinite_count(self, device: torch.device) -> torch.Tensor:
        """A device counter (int64, made once per device and owned by the model) for logits checks that run
        on the device: a CUDA graph that captured a check adds to it on every replay, so it must live as
        long as the model whose steps the graph replays (`dsv4.check.finite_logits`)."""
        device = torch.device(device)
        if device not in self._nonfinite_counts:
            self._nonfinite_counts[device] = torch.zeros((), dtype=torch.int64, device=device)
        return self._nonfinite_counts[device]

    def _watched(self, logits: torch.Tensor) -> torch.Tensor:
        for fn in self.logits_watchers:
            fn(logits)
        return logits

    # ------------------------------------------------------------------ pieces
    def _head(self, h: torch.Tensor, fn, scale, base, norm: RMSNorm) -> torch.Tensor:
        x = norm(hc_head(h, fn, scale, base, self.cfg))
        if self.head_precision == "bf16" and autocast_dtype(x.device.type) == torch.bfloat16:
            return record("head.logits", linear_bf16_fp32(x, self.head.weight))
        return record("head.logits", linear_fp32(x, self.head.weight))

    def _embed(self, tokens: torch.Tensor) -> torch.Tensor:
        e = record("embed", self.embed(tokens))  # [b, s, dim]
        low = autocast_dtype(e.device.type)
        if low is not None:  # mixed precision: bf16 activations, fp32 weights
            e = e.to(low)
        return e.unsqueeze(2).expand(-1, -1, self.cfg.hc_mult, -1).contiguous()  # [b, s, hc, dim]

    def _check_tokens(self, tokens: torch.Tensor) -> None:
        if tokens.dim() != 2 or tokens.dtype not in (torch.int32, torch.int64):
            raise ValueError(f"tokens must be an integer tensor [batch, seq], got {tuple(tokens.shape)} {tokens.dtype}")
        if _capturing(tokens.device):
            return  # a value check would synchronize; graph wrappers check on entry
        if tokens.numel() and (tokens.min() < 0 or tokens.max() >= self.cfg.vocab_size):
            raise ValueError(
                f"token ids must lie in [0, {self.cfg.vocab_size}); got [{int(tokens.min())}, {int(tokens.max())}]"
            )

    # ------------------------------------------------------------------ full sequence
    @property
    def dspark(self) -> DSparkDraft | None:
        """The DSpark draft (`dsv4.model.dspark.DSparkDraft`) when the MTP layers are DSpark stages."""
        return draft_of(self)

    def _taps(self, h: torch.Tensor, i: int, taps: list[torch.Tensor]) -> None:
        """Keep the mean over the mHC copies of layer i's output h [..., hc, dim] when a DSpark draft reads
        it (`dspark_target_layer_ids`)."""
        if i in self.cfg.dspark_target_layer_ids:
            taps.append(h.mean(-2))

    def forward(
        self,
        tokens: torch.Tensor,
        *,
        mtp: bool = False,
        indexer_loss: bool = False,
        balance_alpha: float = 0.0,
        last_only: bool = False,
        taps: bool = False,
    ) -> ModelOutput:
        """tokens [b, s] from position 0 -> ModelOutput (logits [b, s, vocab] fp32, or [b, 1, vocab]).

        mtp: the first release's MTP blocks' logits (`mtp_logits`); taps: the DSpark draft's input
        (`taps`, see `dsv4.model.dspark`; a DSpark draft itself runs through `model.dspark`)."""
        self._check_tokens(tokens)
        if mtp and self.cfg.dspark:
            raise ValueError(
                "this model's draft is DSpark, not MTP blocks: run it through model.dspark "
                "(forward(..., taps=True) gives its input)"
            )
        if taps and not self.cfg.dspark:
            raise ValueError("taps are the input of a DSpark draft, and this model has none")
        s = tokens.size(1)
        positions = torch.arange(s, device=tokens.device)
        h = self._embed(tokens)
        tapped: list[torch.Tensor] = []
        parts: dict[str, list[torch.Tensor]] = {"indexer": [], "balance": []}
        for i, layer in enumerate(self.layers):
            h, losses = layer(
                h, positions, tokens, with_losses=True, indexer_loss=indexer_loss, balance_alpha=balance_alpha
            )  # the losses through the output
            for k, v in losses.items():
                parts[k].append(v)
            if taps:
                self._taps(h, i, tapped)
        out = ModelOutput(
            logits=self._head(
                h[:, -1:] if last_only else h, self.hc_head_fn, self.hc_head_scale, self.hc_head_base, self.norm
            ),
            hidden=h,
            expert_load=[layer.ffn.load for layer in self.layers],
        )
        if indexer_loss:
            out.indexer_loss = torch.stack(parts["indexer"]).sum() if parts["indexer"] else None
        if balance_alpha > 0:
            out.balance_loss = torch.stack(parts["balance"]).sum() if parts["balance"] else None
        if mtp:
            out.mtp_logits = self._mtp(h, tokens, positions)
        if taps:
            out.taps = torch.cat(tapped, -1)
        return out

    def _mtp(self, h: torch.Tensor, tokens: torch.Tensor, positions: torch.Tensor) -> list[torch.Tensor]:
        logits = []
        for k, block in enumerate(self.mtp):
            n = tokens.size(1) - 1 - k
            if n <= 0:
                break
            nxt = tokens[:, k + 1 :]  # [b, n]
            x = block.combine(h[:, :n], self.embed(nxt))  # [b, n, hc, dim]
            h = block(x, positions[:n], nxt)
            logits.append(self._head(h, block.hc_head_fn, block.hc_head_scale, block.hc_head_base, block.norm))
        return logits

    # ------------------------------------------------------------------ incremental
    @torch.no_grad()
    def append(
        self,
        tokens: torch.Tensor,
        inputs: StepInputs,
        cache: PagedKVCache,
        return_hidden: bool = False,
        return_taps: bool = False,
    ) -> torch.Tensor | tuple[torch.Tensor, ...]:
        """Append tokens to many sequences at their own positions: the one incremental entry point.

        tokens [b, s] (b rows of s tokens) or [1, T] (a ragged step) in the flat order `inputs` describes;
        s = 1 is decode, s > 1 a prefill chunk, s = k + 1 a speculative verify. Writes every layer's
        window rows, compressed entries and pending compressor rows into `cache`, then returns fp32 logits
        [n, vocab] of the tokens `inputs.out` names (all T when None), and with return_hidden also the
        hidden states [T, hc, dim] before the HC head (the MTP draft's input), with return_taps the DSpark
        draft's input [T, len(targets) * dim] (`dsv4.model.dspark`; after the hidden states when both).

        No host synchronization: every index is derived on the device from `inputs` (`plan_step`), so a
        fixed-shape step can be captured in a CUDA graph.
        """
        if tokens.dim() != 2 or tokens.dtype not in (torch.int32, torch.int64):
            raise ValueError(
                f"tokens must be an integer tensor [b, s] or [1, T], got {tuple(tokens.shape)} {tokens.dtype}"
            )
        plan = plan_step(inputs, cache.layout)
        if return_taps and not self.cfg.dspark:
            raise ValueError("taps are the input of a DSpark draft, and this model has none")
        h = self._embed(tokens)  # [b, s, hc, dim]
        tapped: list[torch.Tensor] = []
        for i, (layer, pool) in enumerate(zip(self.layers, cache.layers)):
            h = layer(h, None, tokens, plan=plan, pool=pool)
            if return_taps:
                self._taps(h, i, tapped)
        flat = h.flatten(0, 1)  # [T, hc, dim]
        sel = flat if inputs.out is None else flat[inputs.out]
        logits = self._head(sel.unsqueeze(0), self.hc_head_fn, self.hc_head_scale, self.hc_head_base, self.norm)[
            0
        ]  # [n, vocab]
        logits = self._watched(logits)
        out = (logits, flat) if return_hidden else (logits,)
        if return_taps:
            out = (*out, torch.cat(tapped, -1).flatten(0, 1))  # [T, len(targets)*dim]
        return out if len(out) > 1 else logits

    @torch.no_grad()
    def draft(
        self,
        hidden: torch.Tensor,
        tokens: torch.Tensor,
        inputs: StepInputs,
        cache: PagedKVCache,
        depth: int = 0,
        selected: bool = False,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The MTP block as a speculative draft, on the paged cache.

        hidden [T, hc, dim]: the hidden state at each position of `inputs` (the main model's, from
        `append(..., return_hidden=True)`, or this block's own output when drafts are chained); tokens
        [1, T]: the token that follows each position. As in training (`forward(mtp=True)`), the block
        combines the two, runs its window-only layer at the positions of `inputs` (writing its window
        rows into the MTP layer's pool of `cache`), and predicts the token after the next with the main
        model's embedding and head (docs/bugzoo.md Z20). -> (fp32 logits [n, vocab] of the tokens
        `inputs.out` names, the block's output hidden [T, hc, dim] for the next link of a chain; with
        selected, only its n rows that `inputs.out` names [n, hc, dim], the rows the head read: what the next
        link reads, without gathering them twice).
        """
        if self.cfg.dspark:
            raise ValueError(
                "this model's draft is DSpark, not an MTP block: it drafts through "
                "model.dspark (write_context, propose)"
            )
        block = self.mtp[depth]
        plan = plan_step(inputs, cache.layout, compressed=False)
        x = block.combine(hidden.unsqueeze(0), self.embed(tokens))  # [1, T, hc, dim]
        h = block(x, None, tokens, plan=plan, pool=cache.layers[self.cfg.n_layers + depth])[0]  # [T, hc, dim]
        sel = h if inputs.out is None else h[inputs.out]
        logits = self._head(sel.unsqueeze(0), block.hc_head_fn, block.hc_head_scale, block.hc_head_base, block.norm)[
            0
        ]  # [n, vocab]
        return self._watched(logits), sel if selected else h

    def new_cache(self, batch_size: int, max_len: int = 4096) -> BatchCache:
        """A cache for `batch_size` sequences decoded in lockstep (`prefill`, `decode_step`)."""
        p = self.embed.weight
        return BatchCache(self.cfg, batch_size, max_len, p.device, p.dtype)

    @torch.no_grad()
    def prefill(self, tokens: torch.Tensor, cache: BatchCache, last_only: bool = True) -> torch.Tensor:
        """Run the prompt tokens [b, s] from position 0 and fill the cache. -> logits [b, s or 1, vocab]."""
        self._check_tokens(tokens)
        if cache.pos != 0:
            raise ValueError("prefill starts a sequence: use a fresh cache (new_cache)")
        b, s = tokens.shape
        if s > cache.max_len:
            raise ValueError(f"prompt of {s} tokens exceeds the cache's max_len={cache.max_len}")
        if b != cache.batch_size:
            raise ValueError(f"the cache holds {cache.batch_size} sequences, got a batch of {b}")
        inputs = cache.step_inputs(tokens, static_start=0, last_only=last_only)
        logits = self.append(tokens, inputs, cache.kv)
        cache.advance(s)
        return logits.view(b, 1 if last_only else s, -1)

    @torch.no_grad()
    def decode_step(self, tokens: torch.Tensor, cache: BatchCache) -> torch.Tensor:
        """One new token per sequence, tokens [b, 1] at position cache.pos -> logits [b, 1, vocab].

        A fixed sequence of kernels with no host synchronization (the position is read from
        cache.pos_t on the device), so it can be captured in a CUDA graph (`dsv4.bench.graphs`).
        Token ids are checked for shape and dtype only: a value check would synchronize.
        """
        if tokens.dim() != 2 or tokens.size(1) != 1 or tokens.dtype not in (torch.int32, torch.int64):
            raise ValueError(f"decode_step takes integer tokens [batch, 1], got {tuple(tokens.shape)} {tokens.dtype}")
        if cache.pos >= cache.max_len:
            raise ValueError(f"cache is full at max_len={cache.max_len}")
        logits = self.append(tokens, cache.step_inputs(tokens), cache.kv)
        cache.advance(1)
        return logits.view(tokens.size(0), 1, -1)
