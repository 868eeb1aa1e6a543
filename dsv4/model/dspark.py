"""DSpark: the speculative draft of DeepSeek-V4-Flash-0731, stored under `mtp.*` (semi-autoregressive
drafting with a confidence head; DeepSeek's DeepSpec paper).

What the draft computes, for a sequence whose tokens up to position p - 1 the main model has run and
whose next token x_p (the *anchor*: the last token sampled, not yet run) is known:

1. The main model's *taps*: at every target layer i (`dspark_target_layer_ids`) the mean over the mHC
   copies of that layer's output, concatenated: taps[t] [len(targets) * dim] for each position t.
2. `main_x = main_norm(main_proj(taps))` (first stage). Every stage turns main_x into its own *context*
   keys: its `wkv`, `kv_norm`, RoPE at the position, FP8 round trip of the non-RoPE dims, exactly as a
   window-only layer's keys; they live in the stage's window rows (the paged cache's pools of the MTP
   layers, `write_context`), position by position.
3. The block: tokens [x_p, noise, ..., noise] (`dspark_block_size` B of them, noise =
   `dspark_noise_token_id`) at positions p ... p + B - 1, embedded with the main model's embedding,
   expanded to the mHC copies, through the stages in order. A stage is a window-only V4 block (mHC,
   attention with its sink, the MoE) whose attention queries are the block's tokens and whose keys are
   the context of positions p - window ... p - 1 plus *all* B keys of the block (not causal inside it).
4. The last stage's HC head and norm, the main model's head: base logits U [B, vocab] (fp32); h, the HC
   head's output before the norm, is kept.
5. The Markov head makes the drafts sequential: slot i's logits are U_i + markov_w2 . markov_w1[prev_i],
   prev_0 = x_p and prev_i = the token drafted at slot i - 1; slot i's draft predicts x_{p+i+1}.
6. The confidence head: c_i = proj([h_i, markov_w1[prev_i]]) (a logit, fp32, no bias); sigmoid(c_i) is
   the probability that draft i survives verification given the drafts before it survived; the product
   over 0..i (the *survival*) is the probability that the first i + 1 drafts are all accepted.
   `verify_length` picks how many drafts to verify from it.

Which public source each part follows:
- The stage structure, the weight names and which stage holds them, the taps (mean over the mHC copies
  of the target layers' outputs), main_proj / main_norm, the context keys from main_x through each
  stage's own wkv + kv_norm + RoPE + FP8 round trip, the key set (the window of context positions before
  the block, then every block key) and the head path (HC head -> pre-norm h; logits = head(norm(h));
  confidence from (h, Markov embedding)): the Flash-0731 release's `inference/model.py`
  (`DSparkAttention`, `get_dspark_topk_idxs`, `DSparkMarkovHead`, `DSparkConfidenceHead`,
  `DSparkBlock.forward_embed` / `forward_head`, `Transformer.forward` / `forward_spec`). That file ships
  with the checkpoint on the Hugging Face Hub, not in a GitHub repository; what it does was read from the
  ports of it: `vllm-project/vllm` `vllm/models/deepseek_v4/nvidia/dspark.py` (`DSparkDeepseekV4Model`:
  `combine_hidden_states`, `precompute_and_store_context_kv`, `compute_logits`, `compute_confidence`,
  `_remap_dspark_name`) and `sgl-project/sglang` `python/sglang/srt/models/deepseek_v4_dspark.py`
  (`DSparkAttention`, `DSparkV4MarkovHead`). The building blocks the stages share with the main model
  (mHC, window attention with sinks, the MoE, the HC head) are the first release's official
  `inference/model.py` (`Nicooo-Wang/DeepSeek-V4-Pro-code`), as everywhere in dsv4.
- The Markov head (`markov_w1` an embedding, `markov_w2` a projection, bias = w2(w1[prev])) and the
  sequential sampling loop, the confidence predictor (a linear map of [hidden, Markov embedding]), the
  training objective (anchors sampled where a target exists, the block's teacher-forced previous tokens,
  cross-entropy + L1 distance to the target distribution + confidence BCE against 1 - TV distance,
  position weights exp(-k / gamma)): `deepseek-ai/DeepSpec` `deepspec/modeling/dspark/markov_head.py`
  (`VanillaMarkov`), `deepspec/modeling/dspark/common.py` (`AcceptRatePredictor`,
  `sample_anchor_positions`, `create_noise_embed`), `deepspec/modeling/dspark/qwen3/modeling.py`
  (`forward`), `deepspec/modeling/dspark/loss.py`, `config/dspark/dspark_qwen3_4b.py`.
- The verify length: `vllm-project/vllm` `vllm/v1/worker/gpu/spec_decode/dspark/scheduler.py`
  (`allocate_widths`: the survival is the cumulative product of the per-slot probabilities; a static
  threshold tau keeps the drafts whose survival is >= tau).

Where they disagree, and what this module does:
- Confidence input. DeepSpec's Qwen3/Gemma drafts feed the *normed* final hidden state to the confidence
  head; the V4 release feeds the HC head's output *before* the norm (vLLM: "return the PRE-norm head
  hidden"). The V4 checkpoint was trained with the latter: followed here. The V4 head has no bias
  (`confidence_head.proj.weight` only), DeepSpec's `AcceptRatePredictor` has one.
- Verify length. DeepSpec's evaluator (`deepspec/eval/dspark/draft_ops.py`, `_confident_prefix_length`)
  stops at the first slot whose own probability is below the threshold; vLLM thresholds the survival
  (the cumulative product), which is what the paper's prefix scheduler ranks. `verify_length` does the
  latter by default and the former with `rule="per_position"`.
- Taps. The later V4.1 code (a different model, with Engram layers) taps the *input* of its target
  layers; the Flash-0731 code taps their *output* (vLLM captures after the layer, as DeepSpec's
  `hidden_states[layer_id + 1]`): followed here.
- Block width. vLLM allows proposing fewer tokens than the block; the release always drafts a whole
  block and the stages attend all of it, so a narrower block would change every draft. The block here
  is always `dspark_block_size` wide; an engine verifies a prefix of it.
- MoE of the stages: the release's stages are full MoE layers like the main ones (layer ids
  n_layers + k, score-routed, 256 experts in Flash-0731); nothing here differs from a main layer.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import nn

from .. import ops
from ..config import ModelConfig
from .attention import Attention
from .block import Block, hc_head
from .layers import Linear, RMSNorm, autocast_dtype, linear_fp32, record
from .paged import PagedKVCache, StepInputs, plan_step


# ------------------------------------------------------------------------------------------ modules
class DSparkAttention(Attention):
    """A stage's window-only attention: keys from the main model's context and the block's own tokens."""

    def context(self, main_x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """main_x [1, T, dim] at positions [T] -> context keys [1, T, head_dim] (the window rows)."""
        return self._kv(main_x, positions)

    def block(
        self, x: torch.Tensor, positions: torch.Tensor, ctx: torch.Tensor, ctx_idx: torch.Tensor, block_size: int
    ) -> torch.Tensor:
        """x [1, N*B, dim]: N blocks of B tokens at positions [N*B]; ctx [1, M, head_dim] context keys and
        ctx_idx [N*B, W] the context rows each token sees (-1: none). Every token also sees the B keys of
        its own block, after the context. -> [1, N*B, dim]."""
        _, q, kv = self._q_kv(x, positions)  # [1, T, h, d], [1, T, d]
        T = positions.numel()
        first = torch.div(torch.arange(T, device=x.device), block_size, rounding_mode="floor") * block_size
        own = ctx.size(1) + first.unsqueeze(1) + torch.arange(block_size, device=x.device)  # [T, B]
        idx = torch.cat([ctx_idx, own], -1).unsqueeze(0)  # [1, T, W + B]
        o, _ = ops.sparse_attention(q, torch.cat([ctx, kv], 1), self.attn_sink, idx, self.scale)
        return self._output(o, positions)


class MarkovHead(nn.Module):
    """Low-rank token-transition bias: bias(prev) = markov_w2 . markov_w1[prev] over the whole vocabulary."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.markov_w1 = nn.Embedding(cfg.vocab_size, cfg.dspark_markov_rank)
        self.markov_w2 = nn.Linear(cfg.dspark_markov_rank, cfg.vocab_size, bias=False, dtype=torch.float32)

    def forward(self, prev: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """prev [...] token ids -> (bias [..., vocab] fp32, embedding [..., rank])."""
        e = self.markov_w1(prev)
        return linear_fp32(e.float(), self.markov_w2.weight), e


class ConfidenceHead(nn.Module):
    """c = proj([h, markov embedding]) in fp32: the logit of a draft's survival given its prefix's."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.proj = nn.Linear(cfg.dim + cfg.dspark_markov_rank, 1, bias=False, dtype=torch.float32)

    def forward(self, h: torch.Tensor, embed: torch.Tensor) -> torch.Tensor:
        """h [..., dim], embed [..., rank] -> [...] fp32 logits."""
        return linear_fp32(torch.cat([h.float(), embed.float()], -1), self.proj.weight).squeeze(-1)


class DSparkStage(Block):
    """Stage k of the draft (checkpoint `mtp.{k}`): a window-only block; the first stage also holds
    `main_proj` / `main_norm`, the last the HC head, `norm`, the Markov and confidence heads."""

    attention_cls = DSparkAttention

    def __init__(self, cfg: ModelConfig, k: int):
        super().__init__(cfg, cfg.n_layers + k)
        self.stage = f"mtp.{k}"
        if k == 0:
            self.main_proj = Linear(cfg.dim * len(cfg.dspark_target_layer_ids), cfg.dim)
            self.main_norm = RMSNorm(cfg.dim, cfg.norm_eps)
        if k == cfg.n_mtp_layers - 1:
            self.norm = RMSNorm(cfg.dim, cfg.norm_eps)
            self.hc_head_fn = nn.Parameter(torch.zeros(cfg.hc_mult, cfg.hc_mult * cfg.dim, dtype=torch.float32))
            self.hc_head_base = nn.Parameter(torch.zeros(cfg.hc_mult, dtype=torch.float32))
            self.hc_head_scale = nn.Parameter(torch.ones(1, dtype=torch.float32))
            self.markov_head = MarkovHead(cfg)
            self.confidence_head = ConfidenceHead(cfg)

    def forward(
        self,
        x: torch.Tensor,
        token_ids: torch.Tensor,  # type: ignore[override]
        attend: Callable[[torch.Tensor], torch.Tensor],
    ) -> torch.Tensor:
        """x [1, T, hc, dim] the block's streams; `attend` the attention of this stage over its context."""
        if self.activation_checkpointing and torch.is_grad_enabled():
            return torch.utils.checkpoint.checkpoint(self._mix, x, attend, token_ids, use_reentrant=False)
        return self._mix(x, attend, token_ids)


# ------------------------------------------------------------------------------------------ outputs
@dataclass
class DraftBlocks:
    """What the stages computed for N blocks (before the sequential Markov part)."""

    hidden: torch.Tensor  # [N, B, dim] the HC head's output before the norm
    base_logits: torch.Tensor  # [N, B, vocab] fp32: head(norm(hidden)), no Markov bias yet


@dataclass
class Proposal:
    """N drafted blocks: what an engine verifies."""

    tokens: torch.Tensor  # [N, B] long: draft i predicts the token at position p + i + 1
    logits: torch.Tensor  # [N, B, vocab] fp32: the distributions the drafts were drawn from
    confidence: torch.Tensor  # [N, B] fp32 logits; sigmoid = P(draft i kept | drafts < i kept)

    @property
    def survival(self) -> torch.Tensor:
        """[N, B] P(drafts 0..i all kept) = cumulative product of sigmoid(confidence)."""
        return survival(self.confidence)


def survival(confidence: torch.Tensor) -> torch.Tensor:
    """Confidence logits [..., B] -> prefix survival probabilities [..., B] (non-increasing in i)."""
    return torch.sigmoid(confidence.float()).cumprod(-1)


def verify_length(
    confidence: torch.Tensor, threshold: float, k: int | None = None, rule: str = "survival"
) -> torch.Tensor:
    """How many drafts of each block to verify: [..., B] confidence logits -> [...] long in [0, k].

    rule "survival" (vLLM's static threshold): the drafts whose survival probability is >= threshold (a
    prefix, since the survival never increases); "per_position" (DeepSpec's evaluator): the drafts before
    the first one whose own probability sigmoid(c_i) is < threshold. threshold <= 0 verifies all k; k
    (default B) caps the count (an engine's --speculative K)."""
    B = confidence.size(-1)
    k = B if k is None else k
    if not 0 <= k <= B:
        raise ValueError(f"k must be in [0, {B}] (the draft's block size), got {k}")
    if threshold <= 0:
        return torch.full(confidence.shape[:-1], k, dtype=torch.long, device=confidence.device)
    p = torch.sigmoid(confidence.float())
    if rule == "survival":
        n = (p.cumprod(-1) >= threshold).sum(-1)
    elif rule == "per_position":
        n = (p >= threshold).long().cumprod(-1).sum(-1)
    else:
        raise ValueError(f"rule must be 'survival' or 'per_position', got {rule!r}")
    return n.clamp(max=k)


def greedy(i: int, logits: torch.Tensor) -> torch.Tensor:
    """The `choose` of a greedy draft: the argmax of slot i's logits [N, vocab]."""
    return logits.argmax(-1)


# ------------------------------------------------------------------------------------------ the draft
class DSparkDraft:
    """The draft of a `DeepSeekV4` whose `mtp` holds DSpark stages (`model.dspark`): a view over the model
    (it shares the main model's embedding and head, and owns no state). See the module docstring."""

    def __init__(self, model: nn.Module):
        self.model, self.cfg = model, model.cfg
        self.stages: list[DSparkStage] = list(model.mtp)
        self.block_size = self.cfg.dspark_block_size
        self.window = self.cfg.window_size

    # ---------------------------------------------------------------- context
    def main_x(self, taps: torch.Tensor) -> torch.Tensor:
        """taps [..., len(targets) * dim] -> main_x [..., dim]."""
        first = self.stages[0]
        return first.main_norm(first.main_proj(taps))

    def context(self, taps: torch.Tensor, positions: torch.Tensor) -> list[torch.Tensor]:
        """taps [T, len(targets) * dim] at positions [T] -> every stage's context keys [T, head_dim]."""
        mx = self.main_x(taps).unsqueeze(0)
        return [record(f"{s.stage}.context", s.attn.context(mx, positions))[0] for s in self.stages]

    @torch.no_grad()
    def write_context(self, taps: torch.Tensor, inputs: StepInputs, cache: PagedKVCache) -> None:
        """Write the context keys of the positions `inputs` names (taps [T, ...] of the step that ran them,
        `append(..., return_taps=True)`) into each stage's window rows of the paged cache. Positions written
        for tokens later rejected are written again (by the verify that replaces them) before a block reads
        them, as every cache of the engine."""
        plan = plan_step(inputs, cache.layout, compressed=False)
        for stage, kv in zip(self.stages, self.context(taps, inputs.positions)):
            pool = cache.layers[stage.layer_id]
            ops.write_rows((kv.to(pool.kv.dtype),), None, (pool.kv,), plan.window_write)

    # ---------------------------------------------------------------- the block
    def _embed(self, tokens: torch.Tensor) -> torch.Tensor:
        """The main model's embedding of tokens [1, T], expanded to the mHC copies [1, T, hc, dim]. The
        shared embedding and head enter the draft detached: training the draft never changes the main
        model (DeepSpec freezes its copies of both)."""
        e = torch.nn.functional.embedding(tokens, self.model.embed.weight.detach())
        low = autocast_dtype(e.device.type)
        if low is not None:
            e = e.to(low)
        return e.unsqueeze(2).expand(-1, -1, self.cfg.hc_mult, -1).contiguous()

    def blocks(
        self, anchors: torch.Tensor, positions: torch.Tensor, ctx: list[torch.Tensor], ctx_idx: torch.Tensor
    ) -> DraftBlocks:
        """N blocks: anchors [N] at positions [N]; ctx: each stage's context keys [M, head_dim]; ctx_idx
        [N, W] the context rows block n sees (-1: none), the same for every stage."""
        cfg, B = self.cfg, self.block_size
        N = anchors.numel()
        dev = anchors.device
        tokens = torch.full((N, B), cfg.dspark_noise_token_id, dtype=torch.long, device=dev)
        tokens[:, 0] = anchors
        pos = (positions.view(N, 1) + torch.arange(B, device=dev)).flatten()  # [N*B]
        idx = ctx_idx.repeat_interleave(B, 0)  # [N*B, W]
        flat = tokens.view(1, N * B)
        x = self._embed(flat)  # [1, N*B, hc, dim]
        for stage, kv in zip(self.stages, ctx):

            def attend(h: torch.Tensor, stage: DSparkStage = stage, kv: torch.Tensor = kv) -> torch.Tensor:
                return stage.attn.block(h, pos, kv.unsqueeze(0), idx, B)

            x = stage(x, flat, attend)
        last = self.stages[-1]
        h = hc_head(x, last.hc_head_fn, last.hc_head_scale, last.hc_head_base, cfg)  # [1, N*B, dim]
        head = self.model.head.weight  # (no gradient into the main head; at inference its kept split serves)
        head = head.detach() if torch.is_grad_enabled() else head
        base = record(f"{last.stage}.base_logits", linear_fp32(last.norm(h), head))
        return DraftBlocks(h.view(N, B, -1), base.view(N, B, -1))

    def heads(self, blocks: DraftBlocks, prev: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Markov and confidence heads with given previous tokens prev [N, B] (slot i's: the anchor, then
        the drafts or, in training, the true tokens) -> (logits [N, B, vocab] fp32, confidence [N, B])."""
        last = self.stages[-1]
        bias, emb = last.markov_head(prev)
        return blocks.base_logits + bias, last.confidence_head(blocks.hidden, emb)

    def chain(
        self, blocks: DraftBlocks, anchors: torch.Tensor, choose: Callable[[int, torch.Tensor], torch.Tensor] = greedy
    ) -> Proposal:
        """Draft the blocks' tokens slot by slot: slot i's logits are its base logits plus the Markov bias of
        the token before it, and `choose(i, logits [N, vocab]) -> tokens [N]` draws slot i's draft (the
        engine's sampler; `greedy` by default)."""
        last = self.stages[-1]
        prev, toks, logits, embs = anchors, [], [], []
        for i in range(self.block_size):
            bias, emb = last.markov_head(prev)
            li = blocks.base_logits[:, i] + bias  # [N, vocab]
            prev = choose(i, li)
            toks.append(prev)
            logits.append(li)
            embs.append(emb)
        conf = last.confidence_head(blocks.hidden, torch.stack(embs, 1))
        return Proposal(
            torch.stack(toks, 1),
            record(f"{last.stage}.logits", torch.stack(logits, 1)),
            record(f"{last.stage}.confidence", conf),
        )

    # ---------------------------------------------------------------- entry points
    @torch.no_grad()
    def propose(
        self,
        anchors: torch.Tensor,
        positions: torch.Tensor,
        wtable: torch.Tensor,
        cache: PagedKVCache,
        choose: Callable[[int, torch.Tensor], torch.Tensor] = greedy,
    ) -> Proposal:
        """The engine's draft step on the paged cache, no host synchronization: anchors [N] (each sequence's
        last sampled token), positions [N] (the anchor's position p: the sequence's context is positions
        < p, written by `write_context`), wtable [N, table_width] (each sequence's window pages)."""
        N = anchors.numel()
        dev = anchors.device
        inp = StepInputs(
            tokens=anchors,
            positions=positions - 1,
            rows=torch.arange(N, device=dev),
            seg_start=torch.arange(N, device=dev),
            start=positions - 1,
            length=positions,
            wtable=wtable,
            ctable=wtable,
            state=torch.zeros(N, dtype=torch.long, device=dev),
        )
        slots = plan_step(inp, cache.layout, compressed=False).window_idx  # [N, W] of p-W .. p-1
        W = slots.size(1)
        ctx = [cache.layers[s.layer_id].kv[slots.clamp_min(0).flatten()] for s in self.stages]  # [N*W, d]
        rows = torch.arange(N * W, device=dev).view(N, W)
        blocks = self.blocks(anchors, positions, ctx, rows.masked_fill(slots < 0, -1))
        return self.chain(blocks, anchors, choose)

    def sequence_blocks(self, taps: torch.Tensor, tokens: torch.Tensor, anchors: torch.Tensor) -> DraftBlocks:
        """Blocks over whole sequences (training, checks): taps [b, S, len(targets) * dim] of the main
        model's forward over tokens [b, S]; anchors [b, A] the anchor positions p (each block's context is
        the window of positions before p). -> DraftBlocks of the b*A blocks in row-major order."""
        b, S = tokens.shape
        dev = tokens.device
        pos = torch.arange(S, device=dev).repeat(b)  # [b*S]
        ctx = self.context(taps.reshape(b * S, -1), pos)
        q = anchors.unsqueeze(-1) - self.window + torch.arange(self.window, device=dev)  # [b, A, W]
        base = (torch.arange(b, device=dev) * S).view(b, 1, 1)
        ctx_idx = (base + q).masked_fill(q < 0, -1).flatten(0, 1)  # [b*A, W]
        flat = anchors + base.view(b, 1)
        return self.blocks(tokens.flatten()[flat.flatten()], anchors.flatten(), ctx, ctx_idx)


def draft_of(model: nn.Module) -> DSparkDraft | None:
    """The DSpark draft of a model (None when its MTP layers are not DSpark stages)."""
    return DSparkDraft(model) if model.cfg.dspark else None


__all__ = [
    "ConfidenceHead",
    "DSparkAttention",
    "DSparkDraft",
    "DSparkStage",
    "DraftBlocks",
    "MarkovHead",
    "Proposal",
    "draft_of",
    "greedy",
    "survival",
    "verify_length",
]
