"""The bug zoo as mutants: each entry of docs/bugzoo.md planted through a clean injection point, never by
editing files. `MUTANTS` is the catalogue: per entry the bug, its symptom, the checks that catch it and how
the mutant plants it; `catalogue()` renders it as the table docs/bugzoo.md holds.

Injection points: an ops backend registered for the duration of a `with` block and selected with
`ops.use_backend` (a buggy primitive), an attribute patched on a model instance or a module (restored on
exit), a compiler backend handed to `torch.compile`. `plant(mutant, ctx)` is a context manager; the
checks in `dsv4.check.zoo` run inside it and must fail, and pass outside it.

On any device: a planted backend is requested explicitly, so it replaces the device's fast backend (on
CUDA the checks then exercise the planted bug, not the Triton kernel; the clean code's run of the same
check is what exercises Triton) and builds its tensors on its inputs' device. The report lists, per check
and per mutant, the backends that ran.
"""

from __future__ import annotations

import contextlib
import operator
import types
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from .. import ops
from ..ops import reference as ref


# ------------------------------------------------------------------------------ injection helpers
@contextlib.contextmanager
def temporary_backend(op: str, name: str, fn: Callable, deterministic: bool = True) -> Iterator[None]:
    """Register backend `name` for op and make it the default inside the block (on top of any choice in
    force); unregister after. It replaces the fast backend too: the checks exercise the planted bug."""
    ops.register(op, name, fn, deterministic=deterministic, priority=-100)
    try:
        with ops.use_backend({op: name}, inherit=True):
            yield
    finally:
        ops.unregister(op, name)


@contextlib.contextmanager
def patched(obj: object, **attrs) -> Iterator[None]:
    """Set attributes on obj (module, class or instance) inside the block, restore them after."""
    missing = object()
    # modules and classes: the attribute as stored (a class's staticmethod stays a staticmethod)
    stored = isinstance(obj, (torch.nn.Module, type))
    old = {k: obj.__dict__.get(k, missing) if stored else getattr(obj, k, missing) for k in attrs}
    for k, v in attrs.items():
        setattr(obj, k, v)
    try:
        yield
    finally:
        for k, v in old.items():
            if v is missing:
                delattr(obj, k)
            else:
                setattr(obj, k, v)


# ------------------------------------------------------------------------------ sparse attention with a backward
class _SparseAttention(torch.autograd.Function):
    """Reference forward with an explicit backward; `mode` plants backward bugs (Z13, Z14, Z15, Z19)."""

    @staticmethod
    def forward(ctx, q, kv, sink, idx, scale, mode):
        o, lse = ref.sparse_attention(q.detach(), kv.detach(), sink.detach(), idx, scale)
        ctx.save_for_backward(q, kv, sink, idx, o, lse)
        ctx.scale, ctx.mode = scale, mode
        if mode == "lse_differentiable":
            ctx.set_materialize_grads(False)
        return o, lse

    @staticmethod
    def backward(ctx, grad_o, grad_lse):
        q, kv, sink, idx, o, lse = ctx.saved_tensors
        scale, mode = ctx.scale, ctx.mode
        if mode == "lse_differentiable" and grad_lse is not None:
            raise RuntimeError("sparse attention backward: grad_lse is not supported by this kernel")
        b, s, h, d = q.shape
        dev = q.device
        valid = idx >= 0
        batch = torch.arange(b, device=dev).view(b, 1, 1)
        kv_sel = kv[batch, idx.clamp_min(0).long()].float()  # [b, s, k, d]
        scores = torch.einsum("bshd,bskd->bshk", q.float(), kv_sel) * scale
        scores = scores.masked_fill(~valid.unsqueeze(2), float("-inf"))
        if mode == "zero_lse":  # Z14: stale / zero LSE
            p = torch.exp(scores)
        elif mode == "unstable_window_only" and kv.size(1) == s:  # Z13: no compressed KV
            p = torch.exp(scores) / torch.exp(lse).unsqueeze(-1)
        else:
            p = torch.exp(scores - lse.unsqueeze(-1))
        go = grad_o.float()
        dp = torch.einsum("bshd,bskd->bshk", go, kv_sel)
        delta = (go * o.float()).sum(-1, keepdim=True)  # [b, s, h, 1]
        ds = p * (dp - delta)
        dq = torch.einsum("bshk,bskd->bshd", ds, kv_sel) * scale
        dsel = torch.einsum("bshk,bshd->bskd", p, go) + torch.einsum("bshk,bshd->bskd", ds, q.float()) * scale
        dsel = dsel * valid.unsqueeze(-1)
        n = kv.size(1)
        if mode == "aliased_buffers":  # Z19: dKV shares dQ's buffer
            buf = torch.zeros(b, s * h + n, d, device=dev)
            buf[:, : s * h] = dq.reshape(b, s * h, d)
            dkv = buf[:, s * h - n // 2 : s * h - n // 2 + n]
        else:
            dkv = torch.zeros(b, n, d, device=dev)
        dkv = dkv.index_put((batch.expand_as(idx), idx.clamp_min(0).long()), dsel, accumulate=True)
        p_sink = torch.exp(sink.float().view(1, 1, h) - lse)  # [b, s, h]
        dsink = -(p_sink * delta.squeeze(-1)).sum((0, 1))
        return dq.to(q.dtype), dkv.to(kv.dtype), dsink.to(sink.dtype), None, None, None


def sparse_attention_with(mode: str) -> Callable:
    def fn(q, kv, sink, idx, scale):
        o, lse = _SparseAttention.apply(q, kv, sink, idx, scale, mode)
        return (o, lse) if mode == "lse_differentiable" else (o, lse.detach())

    return fn


# ------------------------------------------------------------------------------ buggy primitives
def moe_no_clamp(x, weights, indices, w1, w2, w3, swiglu_limit, expert_offset=0):
    """Z05: the experts run without swiglu_limit."""
    return ref.moe_experts(x, weights, indices, w1, w2, w3, 0.0, expert_offset)


def moe_grouped_unmasked(x, weights, indices, w1, w2, w3, swiglu_limit, expert_offset=0):
    """Z09: grouped GEMM whose rows past the last group (other ranks' slots) are never masked."""
    from ..ops import moe_shared

    plan = moe_shared.moe_plan(weights, indices, w1.size(0), expert_offset)
    xs = x[plan.token]
    gate = torch._grouped_mm(xs, w1.transpose(1, 2), offs=plan.ends)
    up = torch._grouped_mm(xs, w3.transpose(1, 2), offs=plan.ends)
    h = (moe_shared.clamped_swiglu(gate, up, swiglu_limit) * plan.weight.unsqueeze(-1)).to(x.dtype)
    out = torch._grouped_mm(h, w2.transpose(1, 2), offs=plan.ends).float()
    slots = torch.empty_like(out).index_copy_(0, plan.order, out)
    return slots.view(-1, plan.topk, out.size(1)).sum(1)


def moe_host_split(x, weights, indices, w1, w2, w3, swiglu_limit, expert_offset=0):
    """Z24: token counts per expert read back to the host to size the groups (a data-dependent size)."""
    local = indices.reshape(-1) - expert_offset
    counts = torch.bincount(local.clamp(0, w1.size(0) - 1), minlength=w1.size(0)).tolist()
    order = torch.argsort(local, stable=True)
    y = torch.zeros(x.shape, dtype=torch.float32, device=x.device)
    tok_all, w_all = order // indices.size(1), weights.reshape(-1)[order]
    start = 0
    for e, c in enumerate(counts):
        tok, w = tok_all[start : start + c], w_all[start : start + c]
        start += c
        if c:
            y = y.index_add(0, tok, ref.expert_ffn(x[tok], w1[e], w2[e], w3[e], swiglu_limit, w.unsqueeze(-1)).float())
    return y


def indexer_topk_unpadded(q, k, weights, positions, ratio, topk, cand=None):
    """Z12: top-k padding slots hold whatever the sort left there instead of -1 (invisible entries leak)."""
    score = ref.indexer_scores(q, k if cand is None else k[cand], weights, positions, ratio)
    kk = min(topk, score.size(-1))
    return torch.sort(score.nan_to_num(neginf=-3.0e38), dim=-1, descending=True, stable=True).indices[..., :kk]


def sinkhorn_random_order(mixes, scale, base, hc, iters, eps):
    """Z18: Sinkhorn whose row/column sums accumulate in a random order on every call."""
    pre = torch.sigmoid(mixes[..., :hc] * scale[0] + base[:hc]) + eps
    post = 2 * torch.sigmoid(mixes[..., hc : 2 * hc] * scale[1] + base[hc : 2 * hc])
    comb = mixes[..., 2 * hc :].unflatten(-1, (hc, hc)) * scale[2] + base[2 * hc :].view(hc, hc)
    comb = comb.softmax(-1) + eps

    def rsum(t: torch.Tensor, dim: int) -> torch.Tensor:
        perm = torch.randperm(hc, device=t.device)
        parts = t.index_select(dim, perm).unbind(dim)
        acc = parts[0]
        for p in parts[1:]:
            acc = acc + p
        return acc.unsqueeze(dim)

    comb = comb / (rsum(comb, -2) + eps)
    for _ in range(iters - 1):
        comb = comb / (rsum(comb, -1) + eps)
        comb = comb / (rsum(comb, -2) + eps)
    return pre, post, comb


def hc_pre_random_order(x, fn, scale, base, norm_eps, hc_eps, iters):
    hc = x.size(-2)
    _, mixes = ref._hc_mixes(x, fn, norm_eps)
    pre, post, comb = sinkhorn_random_order(mixes, scale, base, hc, iters, hc_eps)
    y = (pre.unsqueeze(-1) * x.float()).sum(-2)
    return y.to(x.dtype), post, comb


# ------------------------------------------------------------------------------ model-level plants
def _hash_by_gate(gate):
    """Z06: a hash layer that selects experts by the gate's top-k instead of tid2eid[token]."""

    def forward(x, token_ids):
        scores = gate.scores(x)
        indices = scores.detach().topk(gate.topk, dim=-1).indices
        weights = scores.gather(1, indices)
        weights = weights / weights.sum(-1, keepdim=True)
        return weights * gate.route_scale, indices, scores

    return forward


def entry_at_raw_position(pos: torch.Tensor, ratio: int) -> torch.Tensor:
    """Z11: a completed group's compressed entry written at the raw token position's slot instead of
    entry pos // ratio."""
    return pos


def pages_by_logical_id(table: torch.Tensor, rows: torch.Tensor, col: torch.Tensor) -> torch.Tensor:
    """Z10: logical page ids used as physical page ids (+1: page 0 is the trash page), ignoring the
    sequence's page table. One sequence alone owning pages 1..n does not notice; sequences sharing the
    pool overwrite each other."""
    return torch.where((col >= 0) & (col < table.size(1)), col + 1, -1)


def filter_bool_mask(scaled, top_k, top_p, min_p):
    """Z23: top-p filtering through boolean-mask indexing (a data-dependent shape), row by row."""
    out = torch.full_like(scaled, float("-inf"))
    for i, row in enumerate(scaled):
        sorted_x, order = row.sort(descending=True)
        p = sorted_x.softmax(-1)
        keep = (p.cumsum(-1) - p) < top_p[i]
        out[i, order[keep]] = sorted_x[keep]
    return out


@contextlib.contextmanager
def _contexts(*cms) -> Iterator[None]:
    with contextlib.ExitStack() as stack:
        for cm in cms:
            stack.enter_context(cm)
        yield


# ------------------------------------------------------------------------------ compiler passes
def compiler_drop_aliasing(gm: torch.fx.GraphModule, example_inputs):
    """Z16: a 'fusion' that turns an in-place accumulator update into a fresh buffer: the aliased input
    (the accumulator) is never written."""
    for node in gm.graph.nodes:
        if node.op == "call_function" and node.target in (operator.iadd, torch.Tensor.add_):
            node.target = operator.add
        elif node.op == "call_method" and node.target == "add_":
            node.op, node.target = "call_function", operator.add
    gm.recompile()
    return gm.forward


def compiler_drop_rounding(gm: torch.fx.GraphModule, example_inputs):
    """Z17: a 'fusion' that removes an explicit bf16 rounding that is followed by a cast to fp32."""
    for node in list(gm.graph.nodes):
        is_bf16 = node.op == "call_method" and (
            (node.target == "to" and torch.bfloat16 in node.args[1:]) or node.target == "bfloat16"
        )
        if is_bf16 and all(u.op == "call_method" and u.target in ("float", "to") for u in node.users):
            node.replace_all_uses_with(node.args[0])
            gm.graph.erase_node(node)
    gm.recompile()
    return gm.forward


# ------------------------------------------------------------------------------ the catalogue
@dataclass
class Mutant:
    id: str
    title: str  # the bug, in a line
    checks: list[str]  # checks expected to catch it (all are run)
    plant: Callable[..., contextlib.AbstractContextManager] | None = None
    pending: str = ""  # why it cannot be planted yet (code does not exist)
    notes: list[str] = field(default_factory=list)
    symptom: str = ""  # what the people running the port where it happened saw
    mutant: str = ""  # how `plant` puts the bug into the correct code


def _gates(model):
    return [layer.ffn.gate for layer in list(model.layers) + list(model.mtp)]


def _plant_z05(ctx):
    shared = [layer.ffn.shared_experts for layer in ctx.model.layers if layer.ffn.shared_experts is not None]
    return _contexts(
        temporary_backend("moe_experts", "mutant_no_clamp", moe_no_clamp),
        *(patched(s, swiglu_limit=0.0) for s in shared),
    )


def _plant_z06(ctx):
    return _contexts(*(patched(g, forward=_hash_by_gate(g)) for g in _gates(ctx.model) if g.hash))


def _plant_z07(ctx):
    return _contexts(*(patched(g, route_scale=g.route_scale**2) for g in _gates(ctx.model)))


def _plant_z10(ctx):
    """The plan's references patched, and the plan ops on their references (the kernels compute pages
    themselves)."""
    from ..ops import reference_plan

    on_reference = ops.use_backend(dict.fromkeys(reference_plan.PLAN_OPS, "reference"), inherit=True)
    return _contexts(patched(reference_plan, lookup_page=pages_by_logical_id), on_reference)


def _plant_z11(ctx):
    from ..ops import reference_plan

    on_reference = ops.use_backend(dict.fromkeys(reference_plan.PLAN_OPS, "reference"), inherit=True)
    return _contexts(patched(reference_plan, entry_index=entry_at_raw_position), on_reference)


def draft_from_token_zero_with_own_head(draft: Callable) -> Callable:
    """Z20: the MTP draft fed token 0 instead of the token after each position, and predicting through a
    head of its own (untrained, random) instead of the main model's."""

    def mutant(self, hidden, tokens, inputs, cache, depth: int = 0, selected: bool = False):
        g = torch.Generator().manual_seed(20)
        w = self.head.weight
        own = (torch.randn(w.shape, generator=g) * w.size(1) ** -0.5).to(w.device, w.dtype)
        kept = w.detach().clone()
        with torch.no_grad():
            w.copy_(own)
        try:
            return draft(self, hidden, torch.zeros_like(tokens), inputs, cache, depth, selected)
        finally:
            with torch.no_grad():
                w.copy_(kept)

    return mutant


def _plant_z20(ctx):
    from ..model import DeepSeekV4

    return patched(DeepSeekV4, draft=draft_from_token_zero_with_own_head(DeepSeekV4.draft))


def _plant_z21(ctx):
    from ..model import transformer

    return patched(transformer, _default_dtype=lambda dtype: contextlib.nullcontext())


def _plant_z22(ctx):
    from ..model import attention

    shim = types.ModuleType("dsv4.ops")
    shim.__dict__.update({k: v for k, v in vars(ops).items() if not k.startswith("__")})
    shim.sparse_attention = lambda *a, backend=None, **k: ref.sparse_attention(*a, **k)
    return patched(attention, ops=shim)


def _plant_z23(ctx):
    from ..engine import sampling

    return patched(sampling.Sampler, _filter=staticmethod(filter_bool_mask))


def _fp4_unpack_blocked(packed: torch.Tensor) -> torch.Tensor:
    """Z01: all low nibbles of the row, then all high nibbles (instead of interleaved per byte)."""
    from ..formats import fp4

    b = fp4.as_packed_bytes(packed)
    return torch.cat([b & 0x0F, b >> 4], dim=-1)


def _e8m0_decode_by_value(t: torch.Tensor) -> torch.Tensor:
    """Z02: scale bytes converted by value (uint8 -> float) instead of reinterpreted bit for bit."""
    from ..formats import e8m0

    return e8m0.as_e8m0_bytes(t).float().to(torch.float8_e4m3fn).float()


def _plant_z01(ctx):
    from ..formats import fp4

    return patched(fp4, unpack_fp4=_fp4_unpack_blocked)


def _plant_z02(ctx):
    from ..formats import e8m0, fp8

    return _contexts(patched(e8m0, e8m0_decode=_e8m0_decode_by_value), patched(fp8, e8m0_decode=_e8m0_decode_by_value))


def _plant_writer(bad_names: Callable[[str], bool], fix: Callable) -> contextlib.AbstractContextManager:
    from ..checkpoint.layouts import release  # the layout whose writer encodes each tensor

    original = release.encode

    def encode(spec, name, v, target, expert_dtype):
        out = original(spec, name, v, target, expert_dtype)
        return fix(name, v, out) if bad_names(name) else out

    return patched(release, encode=encode)


def _plant_z03(ctx):
    """Z03: wo_a's FP8 block scale written transposed."""
    from ..checkpoint.names import scale_name

    def fix(name, v, out):
        s = scale_name(name)
        if s in out:
            out[s] = out[s].t().contiguous()
        return out

    return _plant_writer(lambda n: n.endswith("attn.wo_a.weight"), fix)


def _plant_z04(ctx):
    """Z04: the LM head stored as FP8 codes without its scale."""
    from .. import formats as fm

    def fix(name, v, out):
        q, _ = fm.quantize_fp8(v.dequantize())
        return {name: q}

    return _plant_writer(lambda n: n == "head.weight", fix)


def _plant_z08(ctx):
    from ..parallel import expert

    return patched(expert, _ep_rank=lambda group=None: 0)


def _plant_z25(ctx):
    """Z25: the DSpark block roped one position early (at p - 1 + i instead of the anchor's p + i)."""
    from ..model.dspark import DSparkAttention

    original = DSparkAttention.block

    def block(self, x, positions, ctx_kv, ctx_idx, block_size):
        return original(self, x, positions - 1, ctx_kv, ctx_idx, block_size)

    return patched(DSparkAttention, block=block)


def quantize_rows_per_tensor(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Z26: one INT8 scale for the whole weight (its largest element / 127), repeated for every row."""
    wf = w.detach().float()
    s = wf.abs().amax((-2, -1), keepdim=True).clamp_min(ref.INT8_AMAX_FLOOR) / ref.INT8_MAX  # [..., 1, 1]
    q = torch.round(wf / s).clamp(-ref.INT8_MAX, ref.INT8_MAX).to(torch.int8)
    return q, s.squeeze(-1).expand(wf.shape[:-1]).contiguous()


def int8_quant_batch_scale(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Z27: INT8 activations with one scale over the whole batch (all tokens), repeated for every token."""
    xf = x.detach().float()
    s = xf.abs().amax().clamp_min(ref.INT8_AMAX_FLOOR) / ref.INT8_MAX
    q = torch.round(xf / s).clamp(-ref.INT8_MAX, ref.INT8_MAX).to(torch.int8)
    return q, s.expand(*xf.shape[:-1], 1).contiguous()


@contextlib.contextmanager
def _plant_z27(ctx) -> Iterator[None]:
    # the INT8 linears too: a fused kernel of `int8_linear` quantizes inside its GEMM, around int8_quant
    with temporary_backend("int8_quant", "mutant_batch_scale", int8_quant_batch_scale):
        with ops.use_backend({"int8_linear": "parts"}, inherit=True):
            yield


def _plant_z26(ctx):
    from ..model import int8

    return patched(int8, quantize_rows=quantize_rows_per_tensor)


def _ep_pending() -> str:
    try:
        import torch.testing._internal.distributed.fake_pg  # noqa: F401

        from ..train import distributed  # noqa: F401
    except ImportError as e:
        return f"expert-parallel code not importable: {e}"
    return ""


MUTANTS: list[Mutant] = [
    Mutant(
        "Z01",
        "MXFP4 nibbles unpacked blocked instead of interleaved",
        ["fp4-known-bytes"],
        _plant_z01,
        symptom="the model loaded and ran, then answered every prompt with one special token",
        mutant="`formats.fp4.unpack_fp4` returns a row's low nibbles, then its high nibbles",
    ),
    Mutant(
        "Z02",
        "E8M0 scale bytes cast by value",
        ["e8m0-bytes"],
        _plant_z02,
        symptom="expert scales near 2^7 instead of 1e-3; the draft's second expert GEMM overflowed to NaN",
        mutant="`e8m0_decode` converts each scale byte by value (uint8 -> float -> E4M3), not bit for bit",
    ),
    Mutant(
        "Z03",
        "FP8 block scale stored transposed (wo_a)",
        ["checkpoint-roundtrip"],
        _plant_z03,
        symptom="a K-mismatch error in the output projection, then, once forced to fit, wrong output",
        mutant="the checkpoint writer stores `attn.wo_a`'s FP8 block scale transposed",
    ),
    Mutant(
        "Z04",
        "LM head stored as FP8 without a scale",
        ["checkpoint-roundtrip"],
        _plant_z04,
        symptom="hidden states fine, logits random: the head used a scale that was never loaded",
        mutant="the checkpoint writer stores `head.weight` as FP8 codes with no scale tensor",
    ),
    Mutant(
        "Z05",
        "swiglu_limit not applied (routed and shared experts)",
        ["swiglu-limit", "swiglu-formula", "stage-compare"],
        _plant_z05,
        symptom="expert activations saturated at the FP16 maximum in the first layers; garbled text",
        mutant="a `moe_experts` backend that runs the experts with limit 0, and the shared experts' limit set to 0",
    ),
    Mutant(
        "Z06",
        "hash layers routed by the gate's top-k",
        ["router-contract", "stage-compare"],
        _plant_z06,
        symptom="no error; the first layers' experts followed the router scores and the text was wrong",
        mutant="each hash layer's gate picks the top-k of its scores instead of `tid2eid[token]`",
    ),
    Mutant(
        "Z07",
        "route_scale applied twice",
        ["router-contract", "stage-compare"],
        _plant_z07,
        symptom="the shared expert's share of every MoE output off by 1.5, compounding over the layers",
        mutant="every gate's `route_scale` squared (the scale applied twice)",
    ),
    Mutant(
        "Z08",
        "expert-parallel rank cached as 0",
        ["ep-ranges"],
        _plant_z08,
        pending=_ep_pending(),
        symptom="every rank served experts 0..31; rank 0 took all the tokens and one layer's output exploded",
        mutant="`parallel.expert._ep_rank` answers 0 in every process",
    ),
    Mutant(
        "Z09",
        "grouped GEMM rows past the last group not masked",
        ["poisoned-memory"],
        lambda ctx: temporary_backend("moe_experts", "mutant_unmasked", moe_grouped_unmasked),
        symptom="six identical prompts, six different first tokens: garbage rows reached the combine",
        mutant="a `moe_experts` backend whose grouped-GEMM rows past the last group are never masked",
    ),
    Mutant(
        "Z10",
        "paged cache: logical page ids used as physical ids",
        ["paged-batching"],
        _plant_z10,
        symptom="decode read the wrong cache blocks from the second block on; the draft later crashed "
        "on an out-of-range address",
        mutant="`ops.reference_plan.lookup_page` (the plan ops on their references) takes a sequence's logical "
        "page id for the physical one, ignoring its page table",
    ),
    Mutant(
        "Z11",
        "compressed-KV slot = raw token position",
        ["teacher-forcing", "paged-batching"],
        _plant_z11,
        symptom="an index-out-of-range crash once a request passed 32 tokens",
        mutant="`ops.reference_plan.entry_index` (the plan ops on their references) gives a finished compressed "
        "entry the raw token position's slot, not `pos // ratio`",
    ),
    Mutant(
        "Z12",
        "indexer top-k padding slots not -1",
        ["indexer-padding", "stage-compare"],
        lambda ctx: temporary_backend("indexer_topk", "mutant_unpadded", indexer_topk_unpadded),
        symptom="loss NaN at step 1: inf written past the padding slots into a neighbouring parameter",
        mutant="an `indexer_topk` backend whose padding slots keep the sort's indices instead of -1",
    ),
    Mutant(
        "Z13",
        "attention backward unstable only without compressed KV",
        ["attention-backward-random", "attention-backward-structured"],
        lambda ctx: temporary_backend("sparse_attention", "mutant_z13", sparse_attention_with("unstable_window_only")),
        symptom="gradients 4-45x too large in window-only layers on real inputs; random-input tests passed",
        mutant="a `sparse_attention` backward that divides by exp(lse) instead of subtracting the LSE, "
        "only when there are no compressed keys",
    ),
    Mutant(
        "Z14",
        "attention backward with a zero LSE",
        ["attention-backward-random"],
        lambda ctx: temporary_backend("sparse_attention", "mutant_z14", sparse_attention_with("zero_lse")),
        symptom="gradients near 9e9 and NaN at step 1",
        mutant="a `sparse_attention` backward that takes exp(scores) as the probabilities (an LSE of 0)",
    ),
    Mutant(
        "Z15",
        "LSE differentiable; kernel rejects grad_lse",
        ["lse-contract", "compile-attention"],
        lambda ctx: temporary_backend("sparse_attention", "mutant_z15", sparse_attention_with("lse_differentiable")),
        symptom="a fullgraph compile of training failed inside the attention kernel's backward",
        mutant="a `sparse_attention` whose LSE carries a gradient and whose backward raises when given one",
    ),
    Mutant(
        "Z16",
        "compiler drops the aliasing of an in-place accumulator",
        ["compile-parity"],
        lambda ctx: patched(ctx, compiler=compiler_drop_aliasing),
        symptom="a compiled metric off by about 1000x; no error anywhere",
        mutant="a `torch.compile` backend that turns in-place adds into out-of-place ones",
    ),
    Mutant(
        "Z17",
        "compiler removes an explicit bf16 rounding",
        ["compile-parity"],
        lambda ctx: patched(ctx, compiler=compiler_drop_rounding),
        symptom="the compiled indexer loss drifted from eager",
        mutant="a `torch.compile` backend that deletes a bf16 cast followed by a cast to fp32",
    ),
    Mutant(
        "Z18",
        "nondeterministic reduction order (Sinkhorn)",
        ["determinism"],
        lambda ctx: temporary_backend("hc_pre", "mutant_random_order", hc_pre_random_order),
        symptom="same input, same cotangent: a different gradient hash on every run",
        mutant="an `hc_pre` backend whose Sinkhorn sums rows and columns in a fresh random order",
    ),
    Mutant(
        "Z19",
        "attention backward: dKV aliases dQ's buffer",
        ["attention-backward-random"],
        lambda ctx: temporary_backend("sparse_attention", "mutant_z19", sparse_attention_with("aliased_buffers")),
        symptom="NaN dQ and dKV at the first backward; forward and rollout finite",
        mutant="a `sparse_attention` backward whose dKV buffer overlaps dQ's",
    ),
    Mutant(
        "Z20",
        "draft uses token 0 / its own head",
        ["draft-acceptance"],
        _plant_z20,
        symptom="speculative decoding accepted 1.4% of the drafted tokens",
        mutant="`DeepSeekV4.draft` embeds token 0 instead of the next token and predicts through a random "
        "head of its own",
    ),
    Mutant(
        "Z21",
        "fp32 model built when bf16 was asked",
        ["live-dtype"],
        _plant_z21,
        symptom="step 1 ran, step 2 ran out of memory once the optimizer state existed",
        mutant="`model.transformer._default_dtype` does nothing, so a bf16 model is built in fp32",
    ),
    Mutant(
        "Z22",
        "backend flag accepted, another implementation ran",
        ["backend-evidence"],
        _plant_z22,
        symptom="a compiler backend option was accepted by a build without that backend; another one ran",
        mutant="attention sees a `dsv4.ops` whose `sparse_attention` ignores `backend=` and runs the reference",
    ),
    Mutant(
        "Z23",
        "boolean-mask indexing in sampling",
        ["static-shapes"],
        _plant_z23,
        symptom="graph capture failed on the cache writes; a logprobs request killed the serving engine",
        mutant="the engine's sampler (`engine.sampling.Sampler`) filters top-p with boolean-mask indexing",
    ),
    Mutant(
        "Z24",
        "host-side expert token counts (data-dependent size)",
        ["static-shapes", "compile-moe"],
        lambda ctx: temporary_backend("moe_experts", "mutant_host_split", moe_host_split),
        symptom="the compiler failed: it could not guard on a data-dependent expression",
        mutant="a `moe_experts` backend that reads each expert's token count to the host to size its group",
    ),
    Mutant(
        "Z25",
        "DSpark block roped at the last context position",
        ["dspark-goldens"],
        _plant_z25,
        symptom="a port's reference for the DSpark draft roped the block one position early; nothing "
        "failed, the drafts looked plausible and its parity test compared the device with itself",
        mutant="`DSparkAttention.block` ropes the block's queries, keys and output at positions p - 1 + i "
        "instead of the anchor's p + i",
    ),
    Mutant(
        "Z26",
        "INT8 weights with one scale per tensor, not per row",
        ["int8-weight-rows"],
        _plant_z26,
        symptom="none seen in a port yet (planted with INT8 mode); on the shipped model, whose weight rows are "
        "of one size, no measurable change: it waits for a checkpoint whose rows are not",
        mutant="`model.int8.quantize_rows` takes one scale over the whole weight and repeats it for every row",
    ),
    Mutant(
        "Z27",
        "INT8 activation scale over the whole batch, not per token",
        ["int8-per-token"],
        _plant_z27,
        symptom="none seen in a port yet (planted with INT8 mode); on the shipped model a sequence's logits "
        "move 4.9% with three others in its batch, 8% of its greedy tokens change",
        mutant="an `int8_quant` backend that takes one scale over all the tokens of the call",
    ),
]


def _cell(text: str) -> str:
    return text.replace("|", "\\|")


def catalogue(mutants: list[Mutant] | None = None) -> str:
    """The bug zoo as a Markdown table, one row per entry: the bug, its symptom where it happened, the
    checks that catch it and the mutant that proves they do (`dsv4 check conformance --list`; the same
    table stands in docs/bugzoo.md, and a test keeps the two equal)."""
    rows = ["| id | bug | symptom where it happened | caught by | mutant |", "|---|---|---|---|---|"]
    for m in mutants if mutants is not None else MUTANTS:
        checks = ", ".join(f"`{c}`" for c in m.checks) or "-"
        how = f"pending: {m.pending}" if m.pending else m.mutant
        rows.append(f"| {m.id} | {_cell(m.title)} | {_cell(m.symptom)} | {checks} | {_cell(how)} |")
    return "\n".join(rows)


__all__ = ["MUTANTS", "Mutant", "catalogue", "patched", "temporary_backend", "sparse_attention_with", "F"]
