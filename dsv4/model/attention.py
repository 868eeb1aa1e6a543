"""V4 attention: sliding window + optional compressed branch (CSA: ratio 4 + Lightning Indexer; HCA: 128).

Shapes: b batch, s tokens, h heads, d head_dim (512), r rope dims (64), c compressed entries.
Every layer keeps a shared single-head KV (`wkv`, 512 dims) used as both key and value.
"""

from __future__ import annotations

import torch
from torch import nn

from .. import ops
from ..config import ModelConfig
from ..ops.precision import acc_dtype
from .layers import Linear, RMSNorm, linear_fp32, record, record_as, rms_normalize
from .paged import LayerPool, Plan, RatioPlan, Ring
from .rope import Rope, apply_rope_tail, in_place_ok


def fp8_nope(kv: torch.Tensor, rope_dim: int, pow2: bool) -> torch.Tensor:
    """The FP8 round trip (block 64) of a key's dims before its RoPE tail, which stays as it is. At
    inference (`in_place_ok`) kv - a tensor the caller has just made and owns - is rewritten in place (one
    launch, no concatenation)."""
    if in_place_ok():
        ops.fp8_round_trip(kv[..., :-rope_dim], 64, pow2, inplace=True)
        return kv
    return torch.cat([ops.fp8_round_trip(kv[..., :-rope_dim], 64, pow2), kv[..., -rope_dim:]], -1)


# ------------------------------------------------------------------------------------------ compressor
class Compressor(nn.Module):
    """Learned gated pooling of `ratio` consecutive tokens into one KV entry.

    ratio 4 overlaps: each entry pools 2*ratio slots - the previous group's first-half channels and the
    current group's second-half channels (coff = 2). Entry j covers tokens [j*r, (j+1)*r), is roped at
    position j*r and is visible to query t only when complete: j < (t+1) // r.
    """

    def __init__(self, cfg: ModelConfig, ratio: int, head_dim: int, rope: Rope, rotate: bool):
        super().__init__()
        self.ratio, self.head_dim, self.rope, self.rotate = ratio, head_dim, rope, rotate
        self.overlap = ratio == 4
        self.coff = 2 if self.overlap else 1
        self.fp8_sim, self.fp4_sim = cfg.fp8_kv_sim, cfg.fp4_indexer_sim
        self.kv_pow2 = cfg.kv_scale_pow2
        self.rope_dim = cfg.rope_head_dim
        # computed in fp32: parameters are fp32
        self.ape = nn.Parameter(torch.zeros(ratio, self.coff * head_dim, dtype=torch.float32))
        self.wkv = Linear(cfg.dim, self.coff * head_dim, dtype=torch.float32)
        self.wgate = Linear(cfg.dim, self.coff * head_dim, dtype=torch.float32)
        self.norm = RMSNorm(head_dim, cfg.norm_eps)

    def project(
        self, x: torch.Tensor, positions: torch.Tensor, slot: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """x [b, s, dim] -> raw kv, gate score (+ ape of each token's slot) [b, s, coff*c] fp32. slot:
        positions % ratio where the caller has it (a paged step's plan)."""
        kv = linear_fp32(x, self.wkv.weight)
        score = linear_fp32(x, self.wgate.weight) + self.ape[positions % self.ratio if slot is None else slot]
        return kv, score

    def pool(
        self,
        kv: torch.Tensor,
        score: torch.Tensor,
        prev_kv: torch.Tensor | None = None,
        prev_score: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Pool complete groups kv, score [b, g, r, coff*c] -> [b, g, c] (fp32).

        prev_kv / prev_score [b, r, coff*c]: the group before the first one (overlap only).
        """
        if kv.size(1) == 0:
            return kv.new_zeros(kv.size(0), 0, self.head_dim)
        if self.overlap:
            c = self.head_dim
            if prev_kv is None:
                prev_kv = kv.new_zeros(kv[:, 0].shape)
                prev_score = score.new_full(score[:, 0].shape, float("-inf"))
            before_kv = torch.cat([prev_kv.unsqueeze(1), kv[:, :-1]], 1)[..., :c]  # [b, g, r, c]
            before_score = torch.cat([prev_score.unsqueeze(1), score[:, :-1]], 1)[..., :c]
            kv = torch.cat([before_kv, kv[..., c:]], 2)  # [b, g, 2r, c]
            score = torch.cat([before_score, score[..., c:]], 2)
        return ops.compress_pool(kv, score)

    def finish(self, pooled: torch.Tensor, entry_ids: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """Norm, rope at j*r for entry j, then (indexer, FP4 simulation) Hadamard + FP4 round trip or
        (attention) FP8. Without the FP4 round trip the rotation is skipped: orthogonal, it leaves every
        indexer score unchanged."""
        entries = self.norm(pooled.to(dtype))
        entries = apply_rope_tail(entries, self.rope, entry_ids * self.ratio)
        if self.rotate:
            if self.fp4_sim:
                entries = ops.fp4_round_trip(ops.hadamard(entries), 32)
        elif self.fp8_sim:
            entries = fp8_nope(entries, self.rope_dim, self.kv_pow2)
        return entries

    def forward(self, x: torch.Tensor, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Full sequence from position 0: x [b, s, dim] -> (entries [b, s//r, c], raw kv, raw score)."""
        b, s, _ = x.shape
        r = self.ratio
        kv, score = self.project(x, positions)
        g = s // r
        groups_kv = kv[:, : g * r].unflatten(1, (g, r))
        groups_score = score[:, : g * r].unflatten(1, (g, r))
        entries = self.finish(self.pool(groups_kv, groups_score), torch.arange(g, device=x.device), x.dtype)
        return entries, kv, score

    # ---------------------------------------------------------------- incremental (paged)
    def append(
        self,
        x: torch.Tensor,
        positions: torch.Tensor,
        rp: RatioPlan,
        entries: torch.Tensor,
        ring: Ring,
        tail: Ring | None = None,
    ) -> None:
        """Add T tokens x [1, T, dim] at positions [T] to the paged state; write the entries of the
        groups they complete into `entries` (entry-region rows).

        Each group's rows come from this step's tokens (`rp.group_new`) or from the ring (`rp.group_ring`,
        written by earlier steps); the pooled entry is written only when the group is complete (else, as
        zeros, to the trash row), so decode and verify steps keep static shapes.
        """
        kv, score = self.project(x, positions, rp.slot)  # [1, T, coff*c] fp32
        kv, score = kv[0], score[0]  # [T, W]
        if rp.group_new.size(0):  # (an unpadded step that completes no group has none: nothing to pool)
            # [G, c]: each group's coff*r rows from this step's tokens or the ring (overlap: the previous group's
            # first half of channels, the current group's second); 0 for the groups that stay incomplete
            pooled = ops.pool_groups(
                kv, score, ring.kv, ring.score, rp.group_new, rp.group_ring, rp.group_live, self.coff
            )
            out = self.finish(pooled.unsqueeze(0), rp.group_j, x.dtype).squeeze(0)
            ops.write_rows((out.to(entries.dtype),), None, (entries,), rp.entry_write)
        # raw rows kept for later steps (a prompt chunk's earlier tokens leave none: `keep_tok` lists the others)
        ops.write_rows((kv, score), rp.keep_tok, (ring.kv, ring.score), rp.ring_write)
        if tail is not None and rp.tail_write is not None:
            ops.write_rows((kv, score), rp.keep_tok, (tail.kv, tail.score), rp.tail_write)


# ------------------------------------------------------------------------------------------ indexer
class Indexer(nn.Module):
    """Lightning Indexer: picks the top-k compressed entries per query for CSA layers.

    q from the query LoRA output qr (64 heads x 128), roped, Hadamard-rotated, FP4 round trip;
    keys from its own rotating compressor; score[t, j] = sum_h w[t, h] relu(q[t, h] . k[j]).
    Its inputs are detached: the indexer trains only through its own loss.
    """

    def __init__(self, cfg: ModelConfig, rope: Rope):
        super().__init__()
        self.n_heads, self.head_dim, self.topk = cfg.index_n_heads, cfg.index_head_dim, cfg.index_topk
        self.ratio = 4
        self.rope, self.fp4_sim = rope, cfg.fp4_indexer_sim
        self.wq_b = Linear(cfg.q_lora_rank, self.n_heads * self.head_dim)
        self.weights_proj = Linear(cfg.dim, self.n_heads)
        self.weight_scale = self.head_dim**-0.5 * self.n_heads**-0.5
        self.compressor = Compressor(cfg, self.ratio, self.head_dim, rope, rotate=True)

    def queries(self, x: torch.Tensor, qr: torch.Tensor, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """-> q [b, s, H, D] (rotated and FP4-simulated, or neither), head weights [b, s, H]."""
        q = self.wq_b(qr).unflatten(-1, (self.n_heads, self.head_dim))
        q = apply_rope_tail(q, self.rope, positions)
        if self.fp4_sim:
            q = ops.fp4_round_trip(ops.hadamard(q), 32)
        weights = self.weights_proj(x).float() * self.weight_scale
        return q, weights


# ------------------------------------------------------------------------------------------ attention
class Attention(nn.Module):
    def __init__(self, cfg: ModelConfig, layer_id: int):
        super().__init__()
        self.cfg = cfg
        self.layer_id = layer_id
        self.n_heads, self.head_dim, self.rope_dim = cfg.n_heads, cfg.head_dim, cfg.rope_head_dim
        self.window, self.ratio, self.eps = cfg.window_size, cfg.compress_ratios[layer_id], cfg.norm_eps
        self.o_groups, self.o_lora_rank = cfg.o_groups, cfg.o_lora_rank
        self.scale = self.head_dim**-0.5
        self.rope = Rope(cfg, compressed=self.ratio > 0)

        self.attn_sink = nn.Parameter(torch.zeros(self.n_heads, dtype=torch.float32))
        self.wq_a = Linear(cfg.dim, cfg.q_lora_rank)
        self.q_norm = RMSNorm(cfg.q_lora_rank, self.eps)
        self.wq_b = Linear(cfg.q_lora_rank, self.n_heads * self.head_dim)
        self.wkv = Linear(cfg.dim, self.head_dim)
        self.kv_norm = RMSNorm(self.head_dim, self.eps)
        self.wo_a = Linear(self.n_heads * self.head_dim // self.o_groups, self.o_groups * self.o_lora_rank)
        self.wo_b = Linear(self.o_groups * self.o_lora_rank, cfg.dim)
        self.compressor = Compressor(cfg, self.ratio, self.head_dim, self.rope, rotate=False) if self.ratio else None
        self.indexer = Indexer(cfg, self.rope) if self.ratio == 4 else None
        self.stage = f"layers.{layer_id}.attn"

    # ---------------------------------------------------------------- shared pieces
    def _q_kv(self, x: torch.Tensor, positions: torch.Tensor, shape: tuple[int, int] | None = None):
        qr = self.q_norm(self.wq_a(x))  # [b, s, q_lora]
        q = rms_normalize(self.wq_b(qr).unflatten(-1, (self.n_heads, self.head_dim)), self.eps)
        q = apply_rope_tail(q, self.rope, positions)  # [b, s, h, d]
        kv = self._kv(x, positions)  # [b, s, d]
        return qr, record_as(f"{self.stage}.q", q, shape), record_as(f"{self.stage}.kv", kv, shape)

    def _kv(self, x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """The shared key/value head of x [b, s, dim] at positions: norm, RoPE tail, FP8 round trip of the
        non-RoPE dims (QAT) -> [b, s, d]."""
        kv = apply_rope_tail(self.kv_norm(self.wkv(x)), self.rope, positions)
        if self.cfg.fp8_kv_sim:
            kv = fp8_nope(kv, self.rope_dim, self.cfg.kv_scale_pow2)
        return kv

    def _output(self, o: torch.Tensor, positions: torch.Tensor, shape: tuple[int, int] | None = None) -> torch.Tensor:
        o = apply_rope_tail(o, self.rope, positions, inverse=True)  # [b, s, h, d]
        o = record_as(f"{self.stage}.core", o, shape)
        b, s = o.shape[:2]
        o = o.reshape(b, s, self.o_groups, -1)  # [b, s, g, h/g*d]
        wo_a = self.wo_a.weight.view(self.o_groups, self.o_lora_rank, -1)  # [g, R, h/g*d]
        if acc_dtype() == torch.float64:
            # exact accumulation: a bf16 batched GEMM's fp32 order follows the batch on CUDA (cuBLAS picks its
            # kernel by the row count), so each group is an `ops.linear` (float64, or the fixed-plan GEMM)
            o = torch.stack([ops.linear(o[:, :, i], wo_a[i]) for i in range(self.o_groups)], 2)
        else:  # in o's dtype (fp32 or bf16), as the official code
            o = torch.einsum("bsgd,grd->bsgr", o, wo_a)
        return record_as(f"{self.stage}.out", self.wo_b(o.flatten(2)), shape)

    def _window_idx(self, s: int, device) -> torch.Tensor:
        """[s, w] keys of the window for queries 0..s-1 (positions into the prefill kv), -1 = none."""
        w = min(s, self.window)
        t = torch.arange(s, device=device).unsqueeze(1)
        idx = t - w + 1 + torch.arange(w, device=device)
        return idx.clamp_min(-1)

    def _select(self, x, qr, positions, kv_index, q_ctx, with_scores: bool = False):
        """Indexer top-k over its compressed keys kv_index [b, n, D] for queries at positions; with_scores
        also keeps the differentiable scores in q_ctx["scores"] (the indexer loss needs them)."""
        q, w = self.indexer.queries(x.detach(), qr.detach(), positions)
        if with_scores:
            scores = ops.indexer_scores(q, kv_index, w, positions, self.ratio)  # [b, s, n]
            sel = ops.reference.select_topk(scores.detach(), self.indexer.topk)
            q_ctx["scores"] = scores
        else:
            sel = ops.indexer_topk(q, kv_index, w, positions, self.ratio, self.indexer.topk)
        return record(f"{self.stage}.indexer.topk", sel)

    # ---------------------------------------------------------------- full sequence (train / prefill)
    def forward(
        self,
        x: torch.Tensor,
        positions: torch.Tensor,
        losses: dict[str, torch.Tensor] | None = None,
        indexer_loss: bool = False,
    ) -> torch.Tensor:
        """The whole sequence: x [b, s, dim], positions = arange(s) (training, checks). indexer_loss (in
        training mode, on a layer with an indexer): the Lightning Indexer's KL goes into losses["indexer"]
        (a dict the caller gives, a block's training forward; the module keeps nothing)."""
        if indexer_loss and losses is None:
            raise ValueError("indexer_loss=True needs a losses dict to put the loss into")
        b, s, _ = x.shape
        qr, q, kv = self._q_kv(x, positions)
        idx = self._window_idx(s, x.device).unsqueeze(0).expand(b, -1, -1)  # [b, s, w]
        kv_all, q_ctx = kv, {}
        if self.ratio:
            comp, raw_kv, raw_score = self.compressor(x, positions)  # [b, s//r, d]
            comp = record(f"{self.stage}.compressed_kv", comp)
            n = comp.size(1)
            if self.indexer is not None:
                k_index, ik, isc = self.indexer.compressor(x.detach(), positions)
                want = indexer_loss and self.training
                sel = self._select(x, qr, positions, k_index, q_ctx, want) if n else idx.new_zeros(b, s, 0)
            else:
                vis = ops.reference.compressed_visible(positions, n, self.ratio)  # [s, n]
                sel = torch.where(vis, torch.arange(n, device=x.device), -1).expand(b, -1, -1)
            idx = torch.cat([idx, (sel + s).masked_fill(sel < 0, -1)], -1)
            kv_all = torch.cat([kv, comp], 1)
        o, lse = ops.sparse_attention(q, kv_all, self.attn_sink, idx, self.scale)
        if "scores" in q_ctx:
            losses["indexer"] = self._indexer_loss(
                q, kv_all, idx[..., -sel.size(-1) :] if sel.size(-1) else None, lse, q_ctx["scores"], s
            )
        return self._output(o, positions)

    def _indexer_loss(self, q, kv_all, comp_idx, lse, scores, offset) -> torch.Tensor:
        """KL(main attention over the selected compressed entries || indexer softmax over them).

        The target (heads summed, renormalized) is detached; lse is non-differentiable by contract.
        """
        if comp_idx is None:
            return scores.sum() * 0
        valid = comp_idx >= 0  # [b, s, k]
        b, s, h, d = q.shape
        comp = kv_all[:, offset:]  # [b, n, d]
        with torch.no_grad():
            if h * comp.size(1) <= comp_idx.size(-1) * d:
                # every query against every compressed entry ([b, s, h, n]: one GEMM), then the selected
                # columns: less to write than the selected keys of each query ([b, s, k, d]: 2 GB at 64 x
                # 1024 tokens, top-64 of 256 entries, d 128), the same products
                logits = torch.einsum("bshd,bnd->bshn", q.float(), comp.float())
                logits = logits.gather(-1, (comp_idx - offset).clamp_min(0).unsqueeze(2).expand(b, s, h, -1))
            else:  # (long sequences: many entries, few selected)
                keys = comp.float()[torch.arange(b, device=q.device).view(b, 1, 1), (comp_idx - offset).clamp_min(0)]
                logits = torch.einsum("bshd,bskd->bshk", q.float(), keys)
            logits = logits * self.scale  # [b, s, h, k]
            p = torch.exp(logits - lse.unsqueeze(-1)).masked_fill(~valid.unsqueeze(2), 0).sum(2)  # [b, s, k]
            target = p / p.sum(-1, keepdim=True).clamp_min(1e-30)
        sel_scores = scores.gather(-1, (comp_idx - offset).clamp_min(0)).masked_fill(~valid, float("-inf"))
        log_q = torch.log_softmax(sel_scores, -1).masked_fill(~valid, 0)
        rows = valid.any(-1)  # [b, s]
        kl = (target * (torch.log(target.clamp_min(1e-30)) - log_q)).masked_fill(~valid, 0).sum(-1)
        return (kl * rows).sum() / rows.sum().clamp_min(1)

    # ---------------------------------------------------------------- incremental (paged)
    def append(self, x: torch.Tensor, plan: Plan, pool: LayerPool) -> torch.Tensor:
        """Tokens x [b, s, dim] laid out as the plan's flat list of T tokens; keys from the paged pool.

        Writes this step's window rows and compressed entries first, then attends: a token sees the
        window positions and the complete groups up to and including itself.
        """
        shape = x.shape[:2]
        positions = plan.inputs.positions  # [T]
        T = positions.numel()
        x = x.reshape(1, T, -1)  # [1, T, dim]
        qr, q, kv = self._q_kv(x, positions, shape)
        ops.write_rows((kv[0].to(pool.kv.dtype),), None, (pool.kv,), plan.window_write)
        idx = plan.window_idx  # [T, w]
        if self.ratio:
            rp = plan.ratios[self.ratio]
            self.compressor.append(x, positions, rp, pool.kv[pool.entry_offset :], pool.rows, pool.tails)
            if self.indexer is not None:
                self.indexer.compressor.append(x, positions, rp, pool.index_keys, pool.index_rows, pool.index_tails)
                sel = self._select_paged(x, qr, plan, rp, pool.index_keys)  # [T, topk] entry slots
            else:
                sel = rp.visible  # [T, n] entry slots
            idx = ops.attend_rows(idx, sel, pool.entry_offset)  # [T, w + n] rows of pool.kv
        o, _ = ops.sparse_attention(q, pool.kv.unsqueeze(0), self.attn_sink, idx.unsqueeze(0), self.scale)
        return self._output(o, positions, shape).view(*shape, -1)

    def _select_paged(
        self, x: torch.Tensor, qr: torch.Tensor, plan: Plan, rp: RatioPlan, keys: torch.Tensor
    ) -> torch.Tensor:
        """Indexer top-k per token over its own sequence's entries -> [T, min(index_topk, entries)] slots, -1 none.

        Tokens are scored in groups that share a dense layout (`plan.inputs.index_maps`): the decode rows
        together, each prefill chunk on its own; candidates are the row's entries in entry order, so the
        candidate index is the entry id and `positions` decides visibility. What the groups' layout alone
        decides (`RatioPlan.index_cells`) is planned once per step for every indexer layer.
        """
        inp = plan.inputs
        T = inp.positions.numel()
        q, w = self.indexer.queries(x, qr, inp.positions)  # [1, T, H, D], [1, T, H]
        q, w = q[0], w[0]
        # a row selects min(topk, candidates) entries: no wider, so attention walks no column that is -1
        # for every token (the candidate width is the layout's entries per sequence, fixed per engine)
        width = min(self.indexer.topk, rp.cand[0].size(1)) if rp.cand else 0
        out = torch.full((T + 1, width), -1, dtype=torch.long, device=x.device)
        for (tok, pos, dst), cand in zip(rp.index_cells, rp.cand, strict=True):
            sel = ops.indexer_topk(q[tok], keys, w[tok], pos, self.ratio, self.indexer.topk, cand)  # keys[cand]
            sel = record(f"{self.stage}.indexer.topk", sel)  # [b_g, s_g, k] entry ids
            ops.select_rows(out, sel, cand, dst)  # out[dst, :k]: the chosen entries' slots
        return out[:T]
