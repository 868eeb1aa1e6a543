"""Greedy speculative decoding with a DSpark draft, outside the serving engine: how many drafts the main
model accepts, and proof that the tokens are plain greedy decoding's.

One sequence on a `BatchCache`, in the engine's order of calls (`dsv4.model.dspark`): the prompt through
`append(..., return_taps=True)` and `write_context`; then per step the draft `propose`s a block after the
last token, `verify_length` keeps the drafts whose survival is at least `threshold` (at most k), and one
`append` of [last token, drafts] verifies them; the longest prefix of drafts equal to the main model's
argmax is kept plus the argmax after it, the verify's taps become context, and the cache advances by the
tokens kept (the positions past them are written again before anything reads them).

    python3 -m dsv4.bench.dspark_accept --model DIR [--prompt-ids 1,2,3] [--max-new-tokens 64] [--k 5] [--threshold 0]

prints the tokens per verify step, the share of verified drafts accepted, and whether the output equals
plain greedy decoding (`dsv4.engine.generate`, deterministic: float64 accumulation on both sides, so that
no near-tie flips)."""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from ..model.dspark import greedy, verify_length
from ..ops.precision import exact_accumulation


@dataclass
class SpecResult:
    tokens: list[int]  # the generated tokens (after the prompt)
    steps: int = 0  # verify steps (one append each)
    verified: int = 0  # drafts verified
    accepted: int = 0  # drafts accepted
    lengths: list[int] = field(default_factory=list)  # verify length per step

    def summary(self) -> dict:
        return {
            "tokens": len(self.tokens),
            "verify_steps": self.steps,
            "tokens_per_step": round(len(self.tokens) / max(1, self.steps), 3),
            "drafts_verified": self.verified,
            "drafts_accepted": self.accepted,
            "acceptance": round(self.accepted / self.verified, 3) if self.verified else None,
            "mean_verify_length": round(sum(self.lengths) / max(1, len(self.lengths)), 3),
        }


@torch.no_grad()
def speculative_greedy(
    model,
    prompt: list[int],
    max_new_tokens: int,
    k: int | None = None,
    threshold: float = 0.0,
    plant: Callable[[int, torch.Tensor], torch.Tensor] | None = None,
) -> SpecResult:
    """Greedy decoding of `max_new_tokens` after `prompt` with the model's DSpark draft (see the module
    docstring); k (default: the block size) caps the drafts verified per step. `plant(p, drafts [1, B])`
    (tests) may replace the drafts of the block anchored at position p."""
    draft = model.dspark
    if draft is None:
        raise ValueError("this model has no DSpark draft")
    dev = model.embed.weight.device
    cache = model.new_cache(1, len(prompt) + max_new_tokens + draft.block_size + 1)
    ids = torch.tensor([prompt], device=dev)
    inputs = cache.step_inputs(ids, static_start=0)
    logits, taps = model.append(ids, inputs, cache.kv, return_taps=True)
    draft.write_context(taps, inputs, cache.kv)
    cache.advance(len(prompt))
    x = int(logits[-1].argmax())
    out = SpecResult([x])
    while len(out.tokens) < max_new_tokens:
        p = cache.pos  # x's position
        prop = draft.propose(
            torch.tensor([x], device=dev), torch.tensor([p], device=dev), cache.wtable, cache.kv, greedy
        )
        n = int(verify_length(prop.confidence, threshold, k)[0])
        drafts = prop.tokens if plant is None else plant(p, prop.tokens)
        block = torch.cat([torch.tensor([[x]], device=dev), drafts[:, :n]], 1)  # [1, n + 1]
        inputs = cache.step_inputs(block)
        logits, taps = model.append(block, inputs, cache.kv, return_taps=True)
        target = logits.argmax(-1)  # [n + 1]
        a = int((block[0, 1:] == target[:n]).long().cumprod(0).sum())
        draft.write_context(taps, inputs, cache.kv)
        cache.advance(a + 1)
        out.tokens += block[0, 1 : a + 1].tolist() + [int(target[a])]
        out.steps, out.verified, out.accepted = out.steps + 1, out.verified + n, out.accepted + a
        out.lengths.append(n)
        x = out.tokens[-1]
    out.tokens = out.tokens[:max_new_tokens]
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python3 -m dsv4.bench.dspark_accept", description=__doc__.split("\n\n")[0])
    p.add_argument("--model", required=True, help="a checkpoint whose draft is DSpark")
    p.add_argument("--prompt-ids", default="0", help="comma-separated prompt token ids")
    p.add_argument("--max-new-tokens", type=int, default=64)
    p.add_argument("--k", type=int, default=None, help="drafts verified per step at most (default: the block)")
    p.add_argument("--threshold", type=float, default=0.0, help="survival threshold of the verify length")
    p.add_argument("--device", default="cpu")
    a = p.parse_args(argv)
    from ..checkpoint import load_pretrained
    from ..engine import generate

    model = load_pretrained(a.model, device=a.device).eval()
    if not model.cfg.dspark:
        print(f"error: {a.model}: the model's draft is not DSpark", file=sys.stderr)
        return 2
    prompt = [int(t) for t in a.prompt_ids.split(",")]
    with exact_accumulation():
        spec = speculative_greedy(model, prompt, a.max_new_tokens, a.k, a.threshold)
        plain = generate(model, [prompt], max_new_tokens=a.max_new_tokens, stop_at_eos=False, deterministic=True)[0]
    print(json.dumps({**spec.summary(), "equals_plain_greedy": spec.tokens == list(plain)}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
