import pytest
import torch

from dsv4 import DeepSeekV4, ModelConfig
from dsv4.check.teacher_forcing import teacher_forcing
from dsv4.engine import generate


@pytest.fixture(scope="module")
def tiny() -> DeepSeekV4:
    return DeepSeekV4.from_config("tiny", seed=0).eval()


# batch 3: the README's `dsv4 check teacher-forcing` command (tests/cli/test_readme_commands.py)
@pytest.mark.slow
@pytest.mark.parametrize("batch", [1])
def test_teacher_forcing_crosses_window_and_compression_groups(tiny, batch):
    # 300 tokens: past the 128 window, 75 ratio-4 groups, two complete ratio-128 groups
    tokens = torch.randint(0, tiny.cfg.vocab_size, (batch, 300), generator=torch.Generator().manual_seed(batch))
    rep = teacher_forcing(tiny, tokens, prefill=7)
    assert rep.ok, rep
    assert rep.max_rel_error < 1e-4 and len(rep.per_position) == 300


def test_teacher_forcing_with_long_prefill(tiny):
    tokens = torch.randint(0, tiny.cfg.vocab_size, (2, 270))
    rep = teacher_forcing(tiny, tokens, prefill=258)  # prefill ends inside open groups of both ratios
    assert rep.ok, rep


def test_teacher_forcing_names_a_planted_cache_bug(tiny, monkeypatch):
    # docs/bugzoo.md Z11-style: the decode steps rope a new compressed entry at its raw token position
    # instead of its compressed index (the full path and the prefill stay correct)
    comp = tiny.layers[1].attn.compressor
    in_step = [False]
    append, finish = comp.append, comp.finish

    def bad_append(x, *args, **kw):
        in_step[0] = x.size(1) == 1  # one token: a decode step of batch 1
        try:
            append(x, *args, **kw)
        finally:
            in_step[0] = False

    monkeypatch.setattr(comp, "append", bad_append)
    monkeypatch.setattr(
        comp, "finish", lambda pooled, ids, dtype: finish(pooled, ids * 4 if in_step[0] else ids, dtype)
    )
    tokens = torch.randint(0, tiny.cfg.vocab_size, (1, 40))
    rep = teacher_forcing(tiny, tokens, prefill=7)
    assert not rep.ok
    assert rep.first_position == 7  # group 1 (tokens 4..7) completes in decode
    assert rep.first_stage.startswith("layers.1.attn")


def test_every_trainable_parameter_gets_a_gradient_and_tid2eid_none():
    model = DeepSeekV4.from_config("tiny", seed=1).train()
    tokens = torch.randint(0, model.cfg.vocab_size, (2, 140))
    out = model(tokens, mtp=True, indexer_loss=True, balance_alpha=1e-3)
    loss = torch.nn.functional.cross_entropy(out.logits[:, :-1].flatten(0, 1), tokens[:, 1:].flatten())
    loss = loss + out.mtp_logits[0][:, :-1].logsumexp(-1).mean() + out.indexer_loss + out.balance_loss
    loss.backward()
    missing = [n for n, p in model.named_parameters() if p.grad is None or not p.grad.abs().sum() > 0]
    assert missing == []
    tables = [n for n, _ in model.named_buffers() if n.endswith("tid2eid")]
    assert tables and all(not n.endswith("tid2eid") for n, _ in model.named_parameters())
    assert all(not b.requires_grad for b in model.buffers())


def test_indexer_loss_reaches_only_the_indexer():
    model = DeepSeekV4.from_config("tiny", seed=2).train()
    out = model(torch.randint(0, model.cfg.vocab_size, (1, 64)), indexer_loss=True)
    out.indexer_loss.backward()
    with_grad = {n for n, p in model.named_parameters() if p.grad is not None and p.grad.abs().sum() > 0}
    assert with_grad and all(".indexer." in n for n in with_grad)


def _official_names(cfg: ModelConfig) -> set[str]:
    """The official inference parameter names (inference/model.py), experts listed one by one."""
    names = {"embed.weight", "norm.weight", "head.weight", "hc_head_fn", "hc_head_base", "hc_head_scale"}

    def block(p: str, layer: int) -> None:
        for n in (
            "attn_norm.weight",
            "ffn_norm.weight",
            "hc_attn_fn",
            "hc_ffn_fn",
            "hc_attn_base",
            "hc_ffn_base",
            "hc_attn_scale",
            "hc_ffn_scale",
            "attn.attn_sink",
            "attn.wq_a.weight",
            "attn.q_norm.weight",
            "attn.wq_b.weight",
            "attn.wkv.weight",
            "attn.kv_norm.weight",
            "attn.wo_a.weight",
            "attn.wo_b.weight",
            "ffn.gate.weight",
        ):
            names.add(f"{p}.{n}")
        ratio = cfg.compress_ratios[layer]
        comp = ("ape", "wkv.weight", "wgate.weight", "norm.weight")
        if ratio:
            names.update(f"{p}.attn.compressor.{n}" for n in comp)
        if ratio == 4:
            names.update(f"{p}.attn.indexer.{n}" for n in ("wq_b.weight", "weights_proj.weight"))
            names.update(f"{p}.attn.indexer.compressor.{n}" for n in comp)
        names.add(f"{p}.ffn.gate.tid2eid" if layer < cfg.n_hash_layers else f"{p}.ffn.gate.bias")
        for e in range(cfg.n_routed_experts):
            names.update(f"{p}.ffn.experts.{e}.{w}.weight" for w in ("w1", "w2", "w3"))
        names.update(f"{p}.ffn.shared_experts.{w}.weight" for w in ("w1", "w2", "w3"))

    for i in range(cfg.n_layers):
        block(f"layers.{i}", i)
    for k in range(cfg.n_mtp_layers):
        block(f"mtp.{k}", cfg.n_layers + k)
        names.update(
            f"mtp.{k}.{n}"
            for n in (
                "e_proj.weight",
                "h_proj.weight",
                "enorm.weight",
                "hnorm.weight",
                "norm.weight",
                "hc_head_fn",
                "hc_head_base",
                "hc_head_scale",
            )
        )
    return names


def test_parameter_names_map_one_to_one_onto_official_names(tiny):
    ours = set(tiny.state_dict())
    official = _official_names(tiny.cfg)
    # stacked experts: layers.i.ffn.experts.w1 [E, ...] <-> layers.i.ffn.experts.{e}.w1.weight
    expanded = set()
    for name in ours:
        head, _, leaf = name.rpartition(".")
        if head.endswith("ffn.experts") and leaf in ("w1", "w2", "w3"):
            expanded.update(f"{head}.{e}.{leaf}.weight" for e in range(tiny.cfg.n_routed_experts))
        else:
            expanded.add(name)
    assert expanded == official


def test_generate_greedy_sampling_and_eos(tiny):
    prompt = [[0, 5, 9, 200], [0, 7]]
    a = generate(tiny, prompt, max_new_tokens=6, stop_at_eos=False)
    b = generate(tiny, prompt, max_new_tokens=6, stop_at_eos=False)
    assert a == b and [len(x) for x in a] == [6, 6]
    # greedy continuation equals argmax of the full forward
    seq = prompt[0] + a[0]
    logits = tiny(torch.tensor([seq])).logits[0]
    assert logits[len(prompt[0]) - 1 : -1].argmax(-1).tolist() == a[0]
    s1 = generate(tiny, prompt, max_new_tokens=6, temperature=1.0, top_p=0.9, top_k=50, seed=3, stop_at_eos=False)
    s2 = generate(tiny, prompt, max_new_tokens=6, temperature=1.0, top_p=0.9, top_k=50, seed=3, stop_at_eos=False)
    assert s1 == s2
    eos = a[0][2]
    stopped = generate(tiny, prompt[:1], max_new_tokens=6, eos_token_id=eos)
    assert stopped[0] == a[0][: a[0].index(eos) + 1]


def test_bad_inputs_are_refused(tiny):
    with pytest.raises(ValueError, match="token ids"):
        tiny(torch.tensor([[0, 5000]]))
    with pytest.raises(ValueError, match="integer tensor"):
        tiny(torch.zeros(1, 3))
    cache = tiny.new_cache(1, max_len=8)
    with pytest.raises(ValueError, match="max_len"):
        tiny.prefill(torch.zeros(1, 9, dtype=torch.long), cache)
    with pytest.raises(ValueError, match="empty prompt"):
        generate(tiny, [[]])


def test_bf16_model_runs_and_keeps_fp32_islands():
    model = DeepSeekV4.from_config("tiny", dtype=torch.bfloat16)
    assert model.layers[1].attn.compressor.wkv.weight.dtype == torch.float32
    assert model.head.weight.dtype == torch.float32 and model.embed.weight.dtype == torch.bfloat16
    out = model(torch.randint(0, 1024, (1, 40)))
    assert out.logits.dtype == torch.float32 and torch.isfinite(out.logits).all()


def test_mixed_precision_feeds_fused_ops_bf16_operands_and_keeps_fp32_gradients():
    # Under autocast with fp32 master weights the fused kernels (mHC, grouped MoE) require bf16 operands;
    # if the model handed them fp32 they would refuse and the reference would run instead. A spy backend
    # records the dtypes each op receives.
    from dsv4 import ops
    from dsv4.ops import reference

    seen: dict[str, set] = {"hc_pre": set(), "hc_post": set(), "moe_experts": set()}
    operands = {"hc_pre": (0,), "hc_post": (0, 1), "moe_experts": (0, 3, 4, 5)}  # x; f, residual; x, w1-3

    def spy(op):
        def fn(*args, **kw):
            seen[op].update(str(args[i].dtype) for i in operands[op])
            return getattr(reference, op)(*args, **kw)

        return fn

    for op in seen:
        ops.register(op, "spy", spy(op), priority=100)
    try:
        model = DeepSeekV4.from_config("tiny", seed=0).train()
        tokens = torch.randint(0, model.cfg.vocab_size, (1, 24), generator=torch.Generator().manual_seed(0))
        with torch.autocast("cpu", dtype=torch.bfloat16):
            out = model(tokens)
        out.logits.float().logsumexp(-1).mean().backward()
    finally:
        for op in seen:
            ops.unregister(op, "spy")
    assert seen["hc_pre"] == {"torch.bfloat16"} and seen["hc_post"] == {"torch.bfloat16"}
    assert seen["moe_experts"] == {"torch.bfloat16"}, seen
    w1 = model.layers[1].ffn.experts.w1
    assert w1.dtype == torch.float32 and w1.grad is not None and w1.grad.dtype == torch.float32
    assert bool(torch.isfinite(w1.grad).all()) and float(w1.grad.abs().sum()) > 0


def test_random_init_once_and_on_the_device():
    """`from_config` draws the weights once, the same as building the model and re-initializing it at the
    seed (the CPU generator: the same weights on every device); `init_on_device` draws them from a generator
    on the model's device: the same for the same seed, each linear N(0, 1/in) (its sample std within 6
    standard errors, sqrt(1 / (2n)) relative, of 1/sqrt(in)) and every hash-routed token given distinct
    experts."""
    cfg = ModelConfig.preset("tiny")
    built = DeepSeekV4(cfg)
    built.reset_parameters(3)
    once = DeepSeekV4.from_config(cfg, seed=3)
    for (name, a), b in zip(built.state_dict().items(), once.state_dict().values(), strict=True):
        assert torch.equal(a, b), name
    dev = [DeepSeekV4.from_config(cfg, seed=3, init_on_device=True) for _ in range(2)]
    for (name, a), b in zip(dev[0].state_dict().items(), dev[1].state_dict().values(), strict=True):
        assert torch.equal(a, b), name
    w = dev[0].layers[0].attn.wq_a.weight
    n = w.numel()
    assert abs(w.std().item() * w.size(1) ** 0.5 - 1) < 6 * (1 / (2 * n)) ** 0.5
    table = dev[0].layers[0].ffn.gate.tid2eid
    assert table.shape == (cfg.vocab_size, cfg.n_activated_experts)
    assert int(table.min()) >= 0 and int(table.max()) < cfg.n_routed_experts
    assert all(len(set(row)) == cfg.n_activated_experts for row in table.tolist())
