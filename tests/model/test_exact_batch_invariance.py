"""Under exact accumulation (`--deterministic`), a token's numbers do not depend on how many tokens share a
step: the model's logits for rows of one token (decode) and of three (a speculative verify), at batches 1 to
4, and the final mHC reduce on its own. CPU, the reference ops: fp32 elementwise kernels there take a
vectorized path and a scalar tail whose last bits differ, so where a reference computes a transcendental
(sigmoid, exp) in fp32 a token's value would follow its place in the batch."""

from __future__ import annotations

import pytest
import torch

from dsv4 import ops
from dsv4.check.inputs import check_config
from dsv4.model.transformer import DeepSeekV4
from dsv4.ops.precision import exact_accumulation


@pytest.fixture(scope="module")
def model() -> DeepSeekV4:
    return DeepSeekV4.from_config(check_config("tiny"), seed=0).eval()


@pytest.mark.parametrize("width", [1, 3])
def test_a_rows_logits_do_not_depend_on_the_batch(model, width):
    g = torch.Generator().manual_seed(1)
    toks = torch.randint(2, model.cfg.vocab_size, (4, 21 + 6 * width), generator=g)
    first = {}
    with torch.no_grad(), exact_accumulation(True), ops.use_backend("reference"):
        for b in (1, 2, 3, 4):
            cache = model.new_cache(b, max_len=toks.size(1))
            model.prefill(toks[:b, :21], cache, last_only=False)
            rows = []
            for t in range(21, toks.size(1), width):  # (steps that cross compression groups of 4)
                x = toks[:b, t : t + width]
                logits = model.append(x, cache.step_inputs(x), cache.kv)
                rows.append(logits.view(b, width, -1)[0])
                cache.advance(width)
            first[b] = torch.stack(rows)
    for b in (2, 3, 4):
        assert torch.equal(first[b], first[1]), b


def test_the_final_mhc_reduce_is_per_token(model):
    x = torch.randn(1, 9, model.cfg.hc_mult, model.cfg.dim, generator=torch.Generator().manual_seed(2))
    args = (model.hc_head_fn, model.hc_head_scale, model.hc_head_base, 1e-6, 1e-6)
    with exact_accumulation(True):
        whole = ops.hc_head(x, *args, backend="reference")
        for n in (1, 2, 3, 5):
            assert torch.equal(ops.hc_head(x[:, :n], *args, backend="reference"), whole[:, :n]), n
