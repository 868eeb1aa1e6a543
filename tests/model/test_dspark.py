"""The DSpark draft of Flash-0731 (dsv4.model.dspark): what the block sees, the sequential Markov part, the
confidence and verify length, the paged path the engine calls against the whole-sequence path, loading kept
quantized, the config keys, and training that moves the draft alone.

Tolerance of the paged-vs-sequence comparison: both compute the same fp32 math and differ only in how many
rows share a reduction (the same bound as the golden comparisons, `dsv4.check.goldens.FP32_TOL`: a few
hundred ulp of the largest magnitude through a dozen reductions per stage)."""

from __future__ import annotations

import json

import pytest
import torch

from dsv4.check.capture import capture
from dsv4.check.goldens import FP32_TOL
from dsv4.checkpoint import load_pretrained, read_config, to_hf_json, write_random
from dsv4.config import ConfigError, ModelConfig
from dsv4.model import DeepSeekV4
from dsv4.model.dspark import greedy, survival, verify_length
from dsv4.train.dspark_loss import DSparkLossConfig, dspark_loss, sample_anchors

WINDOW = 16  # so that 40 tokens give blocks with empty, partial and full context windows
S = 40


def dspark_config(**kw) -> ModelConfig:
    return ModelConfig.preset("tiny").replace(window_size=WINDOW, **kw).with_draft("dspark", markov_rank=8)


@pytest.fixture(scope="module")
def model():
    return DeepSeekV4.from_config(dspark_config(), seed=1).eval()


@pytest.fixture(scope="module")
def tokens():
    return torch.randint(0, 1024, (2, S), generator=torch.Generator().manual_seed(0))


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).abs().max() / b.abs().max())


def anchor_tokens(tokens: torch.Tensor, anchors: torch.Tensor) -> torch.Tensor:
    return tokens.gather(1, anchors).flatten()


def test_a_dspark_config_builds_the_release_structure(model):
    c = model.cfg
    assert c.dspark and c.n_mtp_layers == 3 and c.dspark_block_size == 5
    assert c.dspark_target_layer_ids == (1, 2, 3) and c.compress_ratios[c.n_layers :] == (0, 0, 0)
    heads = {
        n
        for n, _ in model.named_parameters()
        if n.startswith("mtp.")
        and ".attn." not in n
        and ".ffn." not in n
        and "hc_attn" not in n
        and "hc_ffn" not in n
        and not n.endswith(("attn_norm.weight", "ffn_norm.weight"))
    }
    assert heads == {
        "mtp.0.main_proj.weight",
        "mtp.0.main_norm.weight",
        "mtp.2.norm.weight",
        "mtp.2.hc_head_fn",
        "mtp.2.hc_head_base",
        "mtp.2.hc_head_scale",
        "mtp.2.markov_head.markov_w1.weight",
        "mtp.2.markov_head.markov_w2.weight",
        "mtp.2.confidence_head.proj.weight",
    }
    assert not any("compressor" in n or "indexer" in n for n, _ in model.named_parameters() if n.startswith("mtp."))
    with pytest.raises(ValueError, match="DSpark"):
        model(torch.zeros(1, 4, dtype=torch.long), mtp=True)


def test_taps_are_the_mean_of_the_target_layers_outputs(model, tokens):
    with torch.no_grad():
        out, stages = capture(lambda: model(tokens, taps=True))
    want = torch.cat([stages[f"layers.{i}.hc_ffn_post"].mean(-2) for i in model.cfg.dspark_target_layer_ids], -1)
    assert torch.equal(out.taps, want)


def test_the_paged_draft_matches_the_whole_sequence_draft(model, tokens):
    """The engine's path - taps from `append`, `write_context`, `propose` on the paged cache - drafts what
    the whole-sequence path drafts, for anchors with no, some and a full window of context."""
    anchors = torch.tensor([[0, 9, 30], [3, 16, 39]])
    d = model.dspark
    with torch.no_grad():
        out = model(tokens, taps=True)
        ref = d.chain(d.sequence_blocks(out.taps, tokens, anchors), anchor_tokens(tokens, anchors))
        cache = model.new_cache(2, 64)
        inp = cache.step_inputs(tokens, static_start=0)
        _, taps = model.append(tokens, inp, cache.kv, return_taps=True)
        assert taps.shape == (2 * S, 3 * model.cfg.dim) and rel(taps.view(2, S, -1), out.taps) <= FP32_TOL
        d.write_context(taps, inp, cache.kv)
        for j in range(anchors.size(1)):
            p = anchors[:, j]
            got = d.propose(tokens[torch.arange(2), p], p, cache.wtable, cache.kv)
            want_logits = ref.logits.view(2, 3, 5, -1)[:, j]
            assert rel(got.logits, want_logits) <= FP32_TOL
            assert rel(got.confidence, ref.confidence.view(2, 3, 5)[:, j]) <= FP32_TOL
            assert torch.equal(got.tokens, ref.tokens.view(2, 3, 5)[:, j])


def test_a_block_sees_the_window_before_its_anchor_and_nothing_else(model, tokens):
    d, p, W = model.dspark, 30, WINDOW
    anchors = torch.tensor([[p], [p]])
    with torch.no_grad():
        taps = model(tokens, taps=True).taps
        base = d.sequence_blocks(taps, tokens, anchors).base_logits

        def moved(pos: int) -> bool:
            t = taps.clone()
            t[:, pos] += 1.0
            return not torch.equal(d.sequence_blocks(t, tokens, anchors).base_logits, base)

        assert moved(p - 1) and moved(p - W)  # the window: p - W ... p - 1
        assert not moved(p) and not moved(p + 3) and not moved(p - W - 1)


def test_a_block_is_not_causal_inside(model, tokens):
    """Every slot attends every key of its block: the noise tokens after slot 0 change slot 0's output."""
    d = model.dspark
    anchors = torch.tensor([[20], [20]])
    with torch.no_grad():
        taps = model(tokens, taps=True).taps
        base = d.sequence_blocks(taps, tokens, anchors).base_logits
        d.cfg = d.cfg.replace(dspark_noise_token_id=8)
        other = d.sequence_blocks(taps, tokens, anchors).base_logits
    assert not torch.equal(other[:, 0], base[:, 0])


def test_the_chain_is_the_heads_on_its_own_drafts(model, tokens):
    """Slot i's logits are its base logits plus the Markov bias of the token before it (the anchor, then
    the drafts), and greedy drafts are their argmax; the confidence reads the same Markov embeddings."""
    d = model.dspark
    anchors = torch.tensor([[5, 25], [12, 33]])
    with torch.no_grad():
        blocks = d.sequence_blocks(model(tokens, taps=True).taps, tokens, anchors)
        a = anchor_tokens(tokens, anchors)
        prop = d.chain(blocks, a, greedy)
        prev = torch.cat([a.unsqueeze(1), prop.tokens[:, :-1]], 1)
        logits, conf = d.heads(blocks, prev)
        last = d.stages[-1].markov_head
        bias = last.markov_w1.weight[prev].double() @ last.markov_w2.weight.double().T
    assert torch.equal(prop.logits, logits) and torch.equal(prop.confidence, conf)
    assert torch.equal(prop.tokens, prop.logits.argmax(-1))
    assert rel(logits.double() - blocks.base_logits.double(), bias) <= FP32_TOL


def test_verify_length_rules():
    c = torch.tensor([[2.0, 1.0, 0.0, 3.0, -1.0], [-3.0, 2.0, 2.0, 2.0, 2.0]])
    p = torch.sigmoid(c)
    surv = survival(c)
    assert torch.allclose(surv, p.cumprod(-1)) and (surv[:, 1:] <= surv[:, :-1]).all()
    for tau in (0.05, 0.3, 0.5, 0.7, 0.9):
        n = verify_length(c, tau)
        assert torch.equal(n, (surv >= tau).sum(-1))  # a prefix: survival never increases
        assert torch.equal(verify_length(c, tau, rule="per_position"), (p >= tau).long().cumprod(-1).sum(-1))
        assert (n <= verify_length(c, tau, rule="per_position")).all()  # a product is below each factor
    assert verify_length(c, 0.5).tolist() == [2, 0] and verify_length(c, 0.5, rule="per_position").tolist() == [4, 0]
    assert verify_length(c, 0.0, k=3).tolist() == [3, 3] and verify_length(c, 0.1, k=1).tolist() == [1, 0]
    with pytest.raises(ValueError, match="block size"):
        verify_length(c, 0.5, k=6)
    with pytest.raises(ValueError, match="rule"):
        verify_length(c, 0.5, rule="inverted")


def test_dspark_config_keys_and_their_checks():
    cfg = dspark_config()
    raw = to_hf_json(cfg)
    assert {k: raw[k] for k in raw if k.startswith("dspark_")} == cfg.dspark_json()
    assert read_config(raw) == cfg
    # Flash-0731's config.json: num_nextn_predict_layers 1, one window-only entry per stage after the layers
    raw = {**raw, "num_nextn_predict_layers": 1, "compress_ratios": list(cfg.compress_ratios)}
    assert read_config(raw).n_mtp_layers == 3
    assert ModelConfig.from_dict(cfg.to_inference_json()) == cfg.replace(name="custom")
    with pytest.raises(ConfigError, match="dspark_noise_token_id"):
        cfg.replace(dspark_noise_token_id=1024)
    with pytest.raises(ConfigError, match="dspark_target_layer_ids"):
        cfg.replace(dspark_target_layer_ids=(2, 1))
    assert not cfg.with_draft("mtp").dspark and cfg.with_draft("mtp").n_mtp_layers == 1
    assert cfg.with_draft("none").n_mtp_layers == 0 and not ModelConfig.preset("tiny").dspark_json()
    flash = ModelConfig.preset("flash").with_draft("dspark")  # Flash-0731's own numbers
    assert (flash.dspark_target_layer_ids, flash.dspark_noise_token_id, flash.dspark_markov_rank) == (
        (40, 41, 42),
        128799,
        256,
    )


def test_a_random_fp8_dspark_checkpoint_loads_kept_quantized(tmp_path, tokens):
    src = write_random(tmp_path / "ds", dspark_config(), target="fp8", expert_dtype="fp4")
    assert json.loads((src / "config.json").read_text())["dspark_block_size"] == 5
    anchors = torch.tensor([[7, 30], [20, 39]])
    out = {}
    for keep in (False, True):
        m = load_pretrained(src, keep_quantized=keep)
        assert m.cfg.dspark and type(m.mtp[0].main_proj).__name__ == ("QuantLinear" if keep else "Linear")
        with torch.no_grad():
            blocks = m.dspark.sequence_blocks(m(tokens, taps=True).taps, tokens, anchors)
            out[keep] = m.dspark.chain(blocks, anchor_tokens(tokens, anchors))
    assert rel(out[True].logits, out[False].logits) <= FP32_TOL
    assert torch.equal(out[True].tokens, out[False].tokens)


def test_the_draft_loss_trains_the_draft_and_never_the_main_model(tokens):
    model = DeepSeekV4.from_config(dspark_config(), seed=2).train()
    cfg = DSparkLossConfig(anchors=6)
    anchors = sample_anchors(2, S, cfg.anchors, torch.Generator().manual_seed(0), tokens.device)
    assert anchors.shape == (2, 6) and (anchors[:, 1:] > anchors[:, :-1]).all() and anchors.max() <= S - 2
    draft = [p for n, p in model.named_parameters() if n.startswith("mtp.")]
    opt = torch.optim.Adam(draft, lr=3e-3)
    losses = []
    for _ in range(8):
        out = model(tokens, taps=True)
        d = dspark_loss(model, tokens, out.taps, out.logits, anchors, cfg)
        opt.zero_grad()
        d.total.backward()
        assert all(p.grad is None for n, p in model.named_parameters() if not n.startswith("mtp."))
        opt.step()
        losses.append(float(d.total))
        assert 1.0 <= float(d.tau) <= 1 + model.cfg.dspark_block_size
    assert losses[-1] < losses[0], losses


@pytest.mark.parametrize("threshold", [0.0, 0.5])
def test_greedy_speculative_decoding_with_the_draft_is_plain_greedy(model, threshold):
    """The draft's own blocks, with verify lengths from the confidence (threshold 0.5) or whole (0), and
    blocks planted to hold the true continuation up to every depth then a wrong token: the tokens are plain
    greedy decoding's (both in float64 accumulation, so no near-tie flips)."""
    from dsv4.bench.dspark_accept import speculative_greedy
    from dsv4.engine import generate
    from dsv4.ops.precision import exact_accumulation

    prompt, n, B = [5, 17, 300, 9, 44, 2, 71], 24, model.cfg.dspark_block_size
    with exact_accumulation():
        plain = generate(model, [prompt], max_new_tokens=n + B, stop_at_eos=False, deterministic=True)[0]
        own = speculative_greedy(model, prompt, n, threshold=threshold)
        depth = iter(range(10**6))

        def plant(p: int, drafts: torch.Tensor) -> torch.Tensor:
            good = next(depth) % (B + 1)  # the first `good` drafts are right, then one wrong
            truth = torch.tensor([plain[p - len(prompt) + 1 : p - len(prompt) + 1 + B]])
            return torch.where(torch.arange(B) < good, truth, (truth + 1) % model.cfg.vocab_size)

        planted = speculative_greedy(model, prompt, n, threshold=threshold, plant=plant)
    assert own.tokens == plain[:n] and planted.tokens == plain[:n]
    assert (threshold == 0) == all(v == B for v in own.lengths + planted.lengths)
    if threshold == 0:  # every depth accepted once: fewer verify steps than tokens
        assert planted.accepted > 0 and planted.verified > planted.accepted and planted.steps < n
