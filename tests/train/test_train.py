"""dsv4.train: losses by hand, indexer-only gradient, bias balancing, Muon's parameter set, tokenizer and
data determinism, exact resume, corrupt-checkpoint refusal, CLI/config file. A micro V4 (every
feature: window-only, CSA + indexer, HCA, hash layer, MTP) keeps each test well under a few seconds."""

from __future__ import annotations

import json
import math
import os
import re
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from bounds import U32
from subproc import checkout_env

from dsv4.config import ModelConfig
from dsv4.errors import UserError
from dsv4.model import DeepSeekV4
from dsv4.tokenizer import Tokenizer
from dsv4.train import balance, checkpoint, data, losses, optim
from dsv4.train.trainer import TrainConfig, Trainer

MICRO = dict(
    vocab_size=300,
    dim=32,
    n_layers=3,
    n_mtp_layers=1,
    n_hash_layers=1,
    n_heads=2,
    head_dim=80,
    rope_head_dim=16,
    q_lora_rank=16,
    o_groups=1,
    o_lora_rank=16,
    window_size=8,
    compress_ratios=(0, 4, 8, 0),
    index_n_heads=2,
    index_head_dim=32,
    index_topk=2,
    n_routed_experts=4,
    n_shared_experts=1,
    n_activated_experts=2,
    moe_inter_dim=32,
    max_seq_len=256,
)


def micro_cfg(**kw) -> ModelConfig:
    return ModelConfig.preset("tiny").replace(**{**MICRO, **kw})


def micro_model(seed: int = 0, **kw) -> DeepSeekV4:
    return DeepSeekV4.from_config(micro_cfg(**kw), seed=seed, dtype=torch.float32).train()


# ------------------------------------------------------------------------------------------ losses
def test_next_token_and_mtp_losses_by_hand():
    torch.manual_seed(1)
    b, s, v = 2, 6, 5
    tokens = torch.randint(0, v, (b, s))
    logits = torch.randn(b, s, v)
    want = 0.0
    for i in range(b):
        for t in range(s - 1):
            want += -torch.log_softmax(logits[i, t], -1)[tokens[i, t + 1]]
    assert losses.next_token_loss(logits, tokens).item() == pytest.approx(float(want) / (b * (s - 1)), rel=1e-6)

    # depth k logits [b, s-1-k, V]: position t predicts tokens[t + k + 2]
    mtp = [torch.randn(b, s - 1 - k, v) for k in range(2)]
    per_depth = []
    for k, lg in enumerate(mtp):
        tot, n = 0.0, 0
        for i in range(b):
            for t in range(s - k - 2):
                tot += -torch.log_softmax(lg[i, t], -1)[tokens[i, t + k + 2]]
                n += 1
        per_depth.append(float(tot) / n)
    assert losses.mtp_loss(mtp, tokens).item() == pytest.approx(sum(per_depth) / 2, rel=1e-6)


def test_losses_take_whole_logits_as_the_sliced_definition_does():
    """The losses read their logits whole, the positions without a target ignored: the same loss and the
    same gradient as cross-entropy over the slice of positions that have one, a zero gradient at the
    others, and a window too short for a depth adds nothing. The losses compute in fp32 (as training
    does): the two ways add the same fp32 terms in another order, so they agree to the sum's rounding,
    about (rows + vocabulary) ulps at most."""
    torch.manual_seed(2)
    b, s, v = 3, 7, 11
    tokens = torch.randint(0, v, (b, s))
    logits = torch.randn(b, s, v, requires_grad=True)
    mtp = [torch.randn(b, s - 1 - k, v, requires_grad=True) for k in range(2)]
    got = losses.next_token_loss(logits, tokens) + losses.mtp_loss(mtp, tokens)
    g_got = torch.autograd.grad(got, [logits, *mtp])

    def sliced(lg, shift):
        n = s - shift
        return F.cross_entropy(lg[:, :n].reshape(-1, v), tokens[:, shift:].reshape(-1))

    want = sliced(logits, 1) + (sliced(mtp[0], 2) + sliced(mtp[1], 3)) / 2
    g_want = torch.autograd.grad(want, [logits, *mtp])
    tol = (b * s + v) * 2.0**-24
    assert got.item() == pytest.approx(want.item(), rel=tol)
    for a, w in zip(g_got, g_want):
        torch.testing.assert_close(a, w, rtol=tol, atol=tol * w.abs().max().item())
    assert not g_got[0][:, -1].any() and not g_got[1][:, -1].any()  # no target: no gradient
    short = torch.randint(0, v, (b, 2))
    assert losses.mtp_loss([torch.randn(b, 1, v)], short) is None


def test_total_loss_weights_parts():
    class Out:
        logits = torch.zeros(1, 4, 3)
        mtp_logits = [torch.zeros(1, 3, 3)]
        indexer_loss = torch.tensor(0.5)
        balance_loss = torch.tensor(0.25)

    parts = losses.total_loss(Out(), torch.tensor([[0, 1, 2, 0]]), mtp_weight=0.1, indexer_weight=2.0)
    ln3 = math.log(3)
    assert parts.total.item() == pytest.approx(ln3 + 0.1 * ln3 + 2 * 0.5 + 0.25, rel=1e-6)


def test_balance_loss_by_hand():
    m = micro_model()
    moe = m.layers[1].ffn
    torch.manual_seed(2)
    b, t, e, k = 2, 5, moe.n_experts, moe.topk
    scores = torch.rand(b * t, e) + 0.1
    indices = torch.stack([torch.randperm(e)[:k] for _ in range(b * t)])
    got = moe._balance_loss(scores, indices, b, 0.01).item()
    want = 0.0
    for i in range(b):
        rows = range(i * t, (i + 1) * t)
        for j in range(e):
            f = e / (k * t) * sum(int((indices[r] == j).any()) for r in rows)
            p = sum(float(scores[r, j] / scores[r].sum()) for r in rows) / t
            want += f * p
    assert got == pytest.approx(0.01 * want / b, rel=1e-5)


@pytest.mark.parametrize("n", [4, 100])
def test_indexer_loss_by_hand(n):
    """KL(target || indexer) over the selected entries, target = main attention's probabilities summed over
    heads and renormalized; invalid (-1) slots excluded; rows without a valid slot ignored. Both ways the
    model computes the target's logits: 4 entries (h * n <= k * d: every entry's product, then the selected
    columns) and 100 (the selected keys gathered first)."""
    m = micro_model()
    attn = m.layers[1].attn
    torch.manual_seed(3)
    b, s, h, d = 1, 3, 2, 80
    assert (h * n <= 2 * d) == (n == 4)  # (k = 2 slots below)
    q = torch.randn(b, s, h, d)
    kv_all = torch.randn(b, s + n, d)
    comp_idx = torch.tensor([[[-1, -1], [s + 0, -1], [s + 2, s + 1]]])  # [b, s, k], into kv_all
    lse = torch.randn(b, s, h).abs() + 2.0
    scores = torch.randn(b, s, n)
    got = attn._indexer_loss(q, kv_all, comp_idx, lse, scores, s).item()
    total, rows = 0.0, 0
    for t in range(s):
        sel = [j for j in comp_idx[0, t].tolist() if j >= 0]
        if not sel:
            continue
        p = torch.tensor(
            [
                sum(math.exp(float(q[0, t, hh] @ kv_all[0, j]) * attn.scale - float(lse[0, t, hh])) for hh in range(h))
                for j in sel
            ]
        )
        target = p / p.sum()
        log_q = torch.log_softmax(torch.tensor([float(scores[0, t, j - s]) for j in sel]), -1)
        total += float((target * (target.log() - log_q)).sum())
        rows += 1
    assert got == pytest.approx(total / rows, rel=1e-4)


def test_indexer_loss_gradient_reaches_only_the_indexer():
    m = micro_model()
    tokens = torch.randint(0, 300, (2, 24))
    out = m(tokens, indexer_loss=True)
    assert out.indexer_loss is not None and out.indexer_loss.item() > 0
    out.indexer_loss.backward()
    touched = {n for n, p in m.named_parameters() if p.grad is not None and p.grad.abs().sum() > 0}
    assert touched, "the indexer loss produced no gradient at all"
    assert all(".indexer." in n for n in touched), sorted(n for n in touched if ".indexer." not in n)
    assert any(n.endswith("indexer.wq_b.weight") for n in touched)
    assert any("indexer.compressor" in n for n in touched)


# ------------------------------------------------------------------------------------------ balancing
def test_bias_update_rule_and_convergence():
    m = micro_model()
    moe = m.layers[1].ffn
    moe.set_load(torch.tensor([10, 0, 3, 7]))
    balance.update_bias(m, gamma=0.5)
    assert moe.gate.bias.tolist() == [-0.5, 0.5, 0.5, -0.5]  # mean 5: overloaded down, under up
    assert m.layers[0].ffn.gate.bias is None  # hash layer: nothing to update

    # a router heavily skewed towards expert 0: repeated updates must even out the load
    gate = moe.gate
    with torch.no_grad():
        gate.bias.zero_()
        gate.weight.zero_()
        gate.weight[0] = 0.5
        gate.weight[1] = 0.3
    x = torch.randn(256, 32).abs()

    def spread() -> float:
        _, idx, _ = gate(x, torch.zeros(256, dtype=torch.long))
        load = torch.bincount(idx.flatten(), minlength=4).float()
        return float(load.max() - load.min())

    before = spread()
    for _ in range(200):
        _, idx, _ = gate(x, torch.zeros(256, dtype=torch.long))
        moe.set_load(torch.bincount(idx.flatten(), minlength=4))
        balance.update_bias(m, gamma=0.01)
    assert before >= 200 and spread() < 0.25 * before


# ------------------------------------------------------------------------------------------ optimizers
def test_muon_gets_exactly_the_hidden_matrices():
    m = micro_model()
    opt = optim.MuonAdamW(m, optim.OptimConfig())
    muon, adamw = set(opt.muon_names), set(opt.adamw_names)
    names = dict(m.named_parameters())
    assert muon | adamw == set(names) and not muon & adamw
    for n in muon:
        leaf = n.rsplit(".", 1)[-1]
        assert names[n].dim() >= 2 and not n.startswith(("embed", "head")) and not leaf.startswith("hc_")
        assert leaf != "ape"
    for must in (
        "layers.1.attn.wq_a.weight",
        "layers.1.attn.wo_b.weight",
        "layers.1.ffn.experts.w1",
        "layers.1.attn.indexer.wq_b.weight",
        "layers.1.attn.compressor.wkv.weight",
        "layers.0.ffn.shared_experts.w2.weight",
        "mtp.0.e_proj.weight",
        "layers.2.ffn.gate.weight",
    ):
        assert must in muon, must
    for must in (
        "embed.weight",
        "head.weight",
        "norm.weight",
        "layers.1.attn.attn_sink",
        "layers.0.hc_attn_fn",
        "layers.1.attn.compressor.ape",
        "hc_head_base",
        "layers.0.attn.q_norm.weight",
    ):
        assert must in adamw, must
    assert isinstance(opt.muon, torch.optim.Muon)
    g = opt.muon.param_groups[0]
    assert tuple(g["ns_coefficients"]) == (3.4445, -4.7750, 2.0315) and g["ns_steps"] == 5
    assert all(p.dim() == 2 for p in opt.muon.param_groups[0]["params"])


def test_stacked_experts_orthogonalized_per_expert():
    """Muon on the stacked [E, out, in] experts (one batched step) == torch's Muon on each expert as a
    separate matrix, over several steps (momentum), and after the state went through a checkpoint. The two
    Newton-Schulz chains round their bf16 products in other orders (on a CPU ours multiplies as fp32): each
    output is within the chain bound of fp64 (tests/train/test_optim.py), so two of them within twice it,
    and a step moves the weights apart by at most lr' times that (decay shrinks the earlier differences)."""
    from test_optim import _chain_bound

    m = micro_model()
    w = m.layers[1].ffn.experts.w1
    lr, wd, mom = 0.02, 0.1, 0.95
    opt = optim.MuonAdamW(m, optim.OptimConfig(lr=lr, weight_decay=wd))
    ref = [torch.nn.Parameter(w.detach()[e].clone()) for e in range(w.size(0))]
    ref_opt = torch.optim.Muon(ref, lr=lr, weight_decay=wd, momentum=mom, adjust_lr_fn="match_rms_adamw")
    lr_adj = optim.adjust_lr(lr, "match_rms_adamw", *w.shape[1:])
    # the same optimizer on the experts as separate 2-D weights: the same arithmetic, exactly
    holder = torch.nn.Module()
    holder.experts = torch.nn.ParameterList([torch.nn.Parameter(w.detach()[e].clone()) for e in range(w.size(0))])
    holder.norm = torch.nn.Parameter(torch.ones(3))  # (an AdamW parameter: the optimizer wants both kinds)
    holder.norm.grad = torch.zeros(3)
    sep_opt = optim.MuonAdamW(holder, optim.OptimConfig(lr=lr, weight_decay=wd))
    views = next(vs for p, vs in opt._stacked if p is w)
    torch.manual_seed(4)
    apart = torch.zeros(w.size(0), dtype=torch.float64)  # the bound on ||w_e - ref_e||_F so far
    for step in range(3):
        grad = torch.randn_like(w)
        for p in m.parameters():
            p.grad = torch.zeros_like(p)
        w.grad = grad.clone()
        for e, r in enumerate(ref):
            r.grad = grad[e].clone()
            holder.experts[e].grad = grad[e].clone()
        before = w.detach().clone()
        opt.step()
        ref_opt.step()
        sep_opt.step()
        assert not torch.equal(before, w.detach())
        assert all(torch.equal(w.detach()[e], x.detach()) for e, x in enumerate(holder.experts))
        update = torch.stack([grad[e].lerp(ref_opt.state[r]["momentum_buffer"], mom) for e, r in enumerate(ref)])
        ulp = 8 * U32 * before.abs().norm(dim=(-2, -1)).double()  # the fp32 decay and update of the weight
        apart = apart * (1 - lr * wd) + lr_adj * 2 * _chain_bound(update) + ulp
        for e, r in enumerate(ref):
            assert (w.detach()[e] - r.detach()).norm() <= apart[e], (step, e)
        if step == 1:  # momentum restored as separate tensors, as a resume does
            opt.load_state_dict(opt.state_dict())
            for v in views:
                opt.muon.state[v]["momentum_buffer"] = opt.muon.state[v]["momentum_buffer"].clone()
    bufs = [opt.muon.state[v]["momentum_buffer"] for v in views]
    for e, r in enumerate(ref):
        torch.testing.assert_close(bufs[e], ref_opt.state[r]["momentum_buffer"], rtol=1e-6, atol=1e-7)


def test_schedules_and_orthogonalization_metric():
    f = [optim.lr_factor(s, 100, 10, "cosine", 0.1) for s in range(1, 101)]
    assert f[0] == pytest.approx(0.1) and f[9] == 1.0 and f[-1] == pytest.approx(0.1) and f[50] < f[20]
    w = [optim.lr_factor(s, 100, 10, "wsd", 0.0, 0.2) for s in range(1, 101)]
    assert w[50] == 1.0 and w[79] == 1.0 and w[-1] == pytest.approx(0.0) and w[89] < 1.0
    g = torch.randn(16, 8)
    err = optim.orthogonalization_error(g)
    assert 0.0 < err < 0.5  # the quintic NS stops short of exact orthogonality
    q, _ = torch.linalg.qr(torch.randn(16, 8))
    assert optim.orthogonalization_error(q) < err


# ------------------------------------------------------------------------------------------ tokenizer, data
def _corpus(tmp_path: Path, n: int = 40) -> Path:
    root = tmp_path / "corpus"
    if root.exists():
        return root
    root.mkdir()
    for i in range(n):
        body = "".join(f"def f{i}_{j}(x, y={j}):\n    return x * {i} + y  # step {j}\n\n" for j in range(30))
        (root / f"mod_{i:03d}.py").write_text(f'"""Module {i}: ünïcode ok."""\nimport os\n\n' + body)
    return root


def test_tokenizer_round_trip_and_save(tmp_path):
    root = _corpus(tmp_path, 6)
    tok = Tokenizer.train((p.read_text() for p in sorted(root.iterdir())), vocab_size=300)
    assert (tok.bos_id, tok.eos_id, tok.vocab_size) == (0, 1, 300)
    text = "def g(x):\n    return x  # ü €\n"
    ids = tok.encode(text, bos=True, eos=True)
    assert ids[0] == 0 and ids[-1] == 1 and tok.decode(ids) == text
    assert "".join(tok.decode_stream(ids)) == text
    texts = [text, "", "x = 1\n", *(p.read_text() for p in sorted(root.iterdir()))]
    assert tok.encode_batch(texts) == [tok.encode(t) for t in texts]  # the batch path: the same ids
    tok.save(tmp_path / "tk")
    tok2 = Tokenizer.from_file(tmp_path / "tk")
    assert tok2.encode(text) == tok.encode(text) and tok2.bos_id == 0 and tok2.eos_id == 1


def test_packing_split_and_loader_resume(tmp_path):
    root = _corpus(tmp_path, 30)
    docs = data.find_documents([root])
    tok = Tokenizer.train((p.read_text() for _, p in docs[:5]), vocab_size=300)
    train, held = data.tokenize_corpus(tok, docs, held_out_pct=10.0)
    held_names = [n for n, _ in docs if data.is_held_out(n, 10.0)]
    assert held_names and len(held_names) < len(docs)
    assert int((train == tok.bos_id).sum()) == len(docs) - len(held_names)  # one BOS per document
    assert train[0] == tok.bos_id and int((held == tok.eos_id).sum()) == len(held_names)

    a = data.PackedLoader(train, 16, 4, seed=3)
    first = [a.next_batch() for _ in range(3)]
    st = a.state_dict()
    rest = [a.next_batch() for _ in range(3)]
    b = data.PackedLoader(train, 16, 4, seed=3)
    b.load_state_dict(st)
    assert all(torch.equal(x, y) for x, y in zip(rest, [b.next_batch() for _ in range(3)]))
    c = data.PackedLoader(train, 16, 4, seed=3)
    assert torch.equal(c.next_batch(), first[0])
    # two ranks see the two halves of the same global batch
    r0, r1 = (data.PackedLoader(train, 16, 4, seed=3, rank=r, world=2) for r in (0, 1))
    assert torch.equal(torch.cat([r0.next_batch(), r1.next_batch()]), first[0])
    # each window is a contiguous slice of the stream
    w = first[0][0].numpy()
    starts = [i for i in range(0, len(train) - 16 + 1, 16) if np.array_equal(train[i : i + 16], w)]
    assert starts


# ------------------------------------------------------------------------------------------ trainer
def _train_cfg(tmp_path: Path, **kw) -> TrainConfig:
    base = dict(
        preset="tiny",
        model={k: list(v) if isinstance(v, tuple) else v for k, v in MICRO.items()},
        data=[str(_corpus(tmp_path))],
        seq_len=32,
        batch_size=2,
        steps=4,
        warmup=1,
        lr=5e-3,
        eval_every=2,
        eval_windows=2,
        diag_every=1,
        out=str(tmp_path / "run"),
        progress=False,
        deterministic=True,
        sample_prompt="",
        held_out_pct=10.0,
    )
    base.update(kw)
    return TrainConfig(**base)


def test_resume_reproduces_uninterrupted_run(tmp_path):
    full = Trainer(_train_cfg(tmp_path, save_every=2), log=lambda *_: None)
    full.fit()
    straight = [r["loss"] for r in full.history if "loss" in r]
    final = {k: v.clone() for k, v in full.model.state_dict().items()}
    ckpt = Path(full.out) / "checkpoints" / "step_00000002"
    assert ckpt.exists()
    resumed = Trainer(
        _train_cfg(tmp_path, save_every=-1, out=str(tmp_path / "run2"), resume=str(ckpt)), log=lambda *_: None
    )
    assert resumed.step == 2
    # Muon momenta and AdamW moments come back exactly, by parameter name
    from safetensors.torch import load_file

    saved = load_file(str(ckpt / "optimizer.safetensors"))
    restored = checkpoint.optimizer_tensors(resumed.opt, resumed.model)
    assert saved.keys() == restored.keys() and all(torch.equal(restored[k], saved[k]) for k in saved)
    assert saved["muon/layers.1.ffn.experts.w1/momentum_buffer"].abs().sum() > 0
    assert float(saved["adamw/embed.weight/step"]) == 2
    resumed.fit()
    again = [r["loss"] for r in resumed.history if "loss" in r]
    assert again == straight  # steps 1-2 from the checkpoint's history, 3-4 recomputed
    for k, v in resumed.model.state_dict().items():
        assert torch.equal(v, final[k]), k
    rows = [json.loads(line) for line in (Path(full.out) / "metrics.jsonl").read_text().splitlines()]
    step_rows = [r for r in rows if "grad_norm" in r]
    for key in (
        "lm",
        "mtp",
        "indexer",
        "balance",
        "grad_norm",
        "lr",
        "tokens_per_s",
        "peak_mem_gib",
        "expert_load_max_min",
        "mhc_violation",
        "muon_ortho_err",
        "nonfinite",
    ):
        assert key in step_rows[0], key
    assert step_rows[0]["nonfinite"] == 0 and 0 <= step_rows[0]["mhc_violation"] < 1e-2
    assert rows[0]["event"] == "start" and rows[0]["param_dtypes"] == {"float32": rows[0]["params"]}


def test_a_run_in_stages_ends_with_the_uninterrupted_runs_weights(tmp_path, monkeypatch):
    """--stop-after-s: each invocation stops at a step boundary with a checkpoint, --resume continues the same
    schedule; only the last stage exports, and its loss picture shows every stage's steps. Here every stage
    stops after its first step."""
    from dsv4.train import metrics, trainer

    plotted: list[list[dict]] = []
    monkeypatch.setattr(metrics, "plot_losses", lambda rows, path: plotted.append(list(rows)))
    monkeypatch.setattr(trainer, "HISTORY_KEPT", 1)  # a checkpoint carries fewer rows than the run logged
    quiet = dict(eval_every=0, diag_every=0)
    full = Trainer(_train_cfg(tmp_path, **quiet), log=lambda *_: None)
    full.fit()
    final = {k: v.clone() for k, v in full.model.state_dict().items()}
    out, export = tmp_path / "staged", tmp_path / "export"
    summaries = []
    for _ in range(6):
        cfg = _train_cfg(tmp_path, **quiet, out=str(out), resume="auto", stop_after_s=1e-9, export=str(export))
        t = Trainer(cfg, log=lambda *_: None)
        summaries.append(t.fit())
        if "stopped" not in summaries[-1]:
            break
        assert not export.exists()
    assert [s["steps"] for s in summaries] == [1, 2, 3, 4] and "stopped" not in summaries[-1]
    assert summaries[0]["stopped"].endswith("at step 1 of 4: --resume continues")
    assert (export / "config.json").exists()
    for k, v in t.model.state_dict().items():
        assert torch.equal(v, final[k]), k
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows if "grad_norm" in r] == [1, 2, 3, 4]
    assert sum(r.get("event") == "stage" for r in rows) == 3
    # two plots: the uninterrupted run's and the last stage's, each over steps 1-4 (the last stage's own
    # process ran step 4 alone)
    assert [[r["step"] for r in p if "lm" in r] for p in plotted] == [[1, 2, 3, 4]] * 2
    with pytest.raises(UserError, match="not with --save-every -1"):
        Trainer(_train_cfg(tmp_path, stop_after_s=60, save_every=-1), log=lambda *_: None)
    with pytest.raises(UserError, match="give the run's --steps"):
        Trainer(_train_cfg(tmp_path, stop_after_s=60, time_budget_s=600), log=lambda *_: None)


def test_corrupt_checkpoint_is_refused(tmp_path):
    t = Trainer(_train_cfg(tmp_path, steps=1, eval_every=0, diag_every=0), log=lambda *_: None)
    t.fit()
    ckpt = checkpoint.resolve(Path(t.out) / "checkpoints")
    checkpoint.load(ckpt)  # intact: loads
    f = ckpt / "model.safetensors"
    raw = bytearray(f.read_bytes())
    raw[-3] ^= 0xFF
    f.write_bytes(bytes(raw))
    with pytest.raises(checkpoint.CorruptCheckpoint, match="SHA-256"):
        checkpoint.load(ckpt)
    (ckpt / "manifest.json").unlink()
    with pytest.raises(checkpoint.CorruptCheckpoint, match="incomplete"):
        Trainer(_train_cfg(tmp_path, resume=str(ckpt)), log=lambda *_: None)


def test_training_reduces_held_out_loss_and_qat_switches(tmp_path):
    cfg = _train_cfg(
        tmp_path,
        steps=12,
        eval_every=12,
        lr=1e-2,
        diag_every=0,
        deterministic=False,
        fp4_experts=True,
        activation_checkpointing=True,
        save_every=-1,
    )
    t = Trainer(cfg, log=lambda *_: None)
    first = t.evaluate()
    summary = t.fit()
    assert summary["final_eval_loss"] < first - 0.3
    assert t.mcfg.fp8_kv_sim and t.mcfg.fp4_indexer_sim
    assert all(r["nonfinite"] == 0 for r in t.history if "nonfinite" in r)


def _saved_tensors_and_grads(m: DeepSeekV4, tokens: torch.Tensor) -> tuple[int, float, dict[str, torch.Tensor]]:
    """(tensors the forward saves for backward, loss, gradients) of one training step of `m`."""
    saved = 0

    def pack(t: torch.Tensor) -> torch.Tensor:
        nonlocal saved
        saved += 1
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = m(tokens, mtp=True, indexer_loss=True, balance_alpha=1e-3)
        loss = losses.total_loss(out, tokens).total
    loss.backward()
    return saved, loss.item(), {n: p.grad.clone() for n, p in m.named_parameters() if p.grad is not None}


def test_activation_checkpointing_option_keeps_loss_and_gradients_and_saves_less():
    """`set_options(activation_checkpointing=True)`: every block recomputes in backward, so the forward
    saves fewer tensors, while the loss and every gradient stay those of the plain model."""
    tokens = torch.randint(0, 300, (2, 24), generator=torch.Generator().manual_seed(0))
    plain = _saved_tensors_and_grads(micro_model(), tokens)
    m = micro_model().set_options(activation_checkpointing=True)
    assert all(b.activation_checkpointing for b in [*m.layers, *m.mtp])
    ckpt = _saved_tensors_and_grads(m, tokens)
    assert ckpt[0] < plain[0] / 2
    assert ckpt[1] == pytest.approx(plain[1], rel=1e-6)
    assert ckpt[2].keys() == plain[2].keys()
    for n in plain[2]:
        torch.testing.assert_close(ckpt[2][n], plain[2][n], rtol=1e-5, atol=1e-7, msg=n)
    with torch.no_grad():  # nothing to recompute for: the plain forward
        torch.testing.assert_close(m(tokens).logits, micro_model()(tokens).logits)


def _routed_experts_and_inputs() -> tuple[DeepSeekV4, torch.nn.Module, tuple[torch.Tensor, ...]]:
    """A micro model, its layer-1 routed experts and inputs for them: x [10, dim], weights, indices [10, 2]."""
    m = micro_model()
    ex = m.layers[1].ffn.experts
    g = torch.Generator().manual_seed(1)
    x = torch.randn(10, ex.w1.size(-1), generator=g)
    weights = torch.rand(10, 2, generator=g)
    indices = torch.stack([torch.randperm(4, generator=g)[:2] for _ in range(10)])
    return m, ex, (x, weights, indices)


def test_fp4_fake_quant_option_computes_with_fp4_weights_and_passes_gradients():
    """`set_options(fp4_fake_quant=True)`: the routed experts compute with their weights' FP4 round trip
    (not the weights themselves), and gradients reach the full-precision weights."""
    from dsv4 import ops

    m, ex, (x, weights, indices) = _routed_experts_and_inputs()
    q = ops.fp4_round_trip
    with torch.no_grad():
        exact = ops.moe_experts(x, weights, indices, ex.w1, ex.w2, ex.w3, ex.swiglu_limit, ex.offset)
        rounded = ops.moe_experts(
            x, weights, indices, q(ex.w1, 32), q(ex.w2, 32), q(ex.w3, 32), ex.swiglu_limit, ex.offset
        )
        assert not torch.allclose(exact, rounded)
        torch.testing.assert_close(ex(x, weights, indices), exact)
        m.set_options(fp4_fake_quant=True)
        assert all(e.fp4_fake_quant for e in m.modules() if type(e).__name__ == "Experts")
        torch.testing.assert_close(ex(x, weights, indices), rounded)
    tokens = torch.randint(0, 300, (2, 24))
    m(tokens).logits.logsumexp(-1).mean().backward()
    assert ex.w1.grad is not None and ex.w1.grad.abs().sum() > 0


def test_eager_experts_option_keeps_the_experts_out_of_compiled_graphs():
    """`set_options(eager_experts_under_compile=True)` (what `--compile` sets): tracing a block breaks the
    graph at the routed experts instead of tracing into them, and the output is unchanged."""
    import torch._dynamo

    m, ex, (x, weights, indices) = _routed_experts_and_inputs()
    with torch.no_grad():
        want = ex(x, weights, indices)
        torch._dynamo.reset()
        traced = torch._dynamo.explain(ex)(x, weights, indices)
        m.set_options(eager_experts_under_compile=True)
        torch._dynamo.reset()
        eager = torch._dynamo.explain(ex)(x, weights, indices)
        torch.testing.assert_close(ex(x, weights, indices), want)
    assert traced.graph_count >= 1 and eager.graph_count == 0


def test_init_from_with_qat_switches_builds_model_and_config_in_agreement(tmp_path):
    """`--init-from` plus the QAT switches (and model overrides): the switches are applied to the config
    before the model is built, so the trainer's config, the model's and every module's agree (the loaded
    model once kept the checkpoint's switches in the modules that copy them at construction)."""
    import dataclasses

    from dsv4.checkpoint import model_values, save
    from dsv4.model.attention import Compressor, Indexer

    src = micro_model()
    ckpt = save(model_values(src), src.cfg, tmp_path / "src", "bf16")
    assert src.cfg.fp8_kv_sim and src.cfg.fp4_indexer_sim
    t = Trainer(
        _train_cfg(
            tmp_path,
            init_from=str(ckpt),
            fp8_kv_sim=False,
            fp4_indexer_sim=False,
            fp4_experts=True,
            steps=1,
            save_every=-1,
        ),
        log=lambda *_: None,
    )
    assert not t.mcfg.fp8_kv_sim and not t.mcfg.fp4_indexer_sim and t.mcfg.quant_mode == "w8a16"
    assert t.model.cfg == t.mcfg
    held = [m.cfg for m in t.model.modules() if isinstance(getattr(m, "cfg", None), ModelConfig)]
    assert len(held) > 1 and all(c == t.mcfg for c in held)
    copied = [m for m in t.model.modules() if isinstance(m, (Compressor, Indexer))]  # flags read at build
    assert copied and all(not m.fp4_sim and not getattr(m, "fp8_sim", False) for m in copied)
    with pytest.raises(dataclasses.FrozenInstanceError):
        t.model.cfg.fp8_kv_sim = True  # type: ignore[misc]
    t.fit()


def test_cli_and_config_file(tmp_path):
    import argparse

    from dsv4.train.cli import add_train_parser, config_from_args

    toml = tmp_path / "run.toml"
    toml.write_text("steps = 7\nlr = 0.001\n[model]\ndim = 64\nn_layers = 2\n")
    parser = argparse.ArgumentParser()
    add_train_parser(parser.add_subparsers(dest="cmd"))
    args = parser.parse_args(
        ["train", "--config", str(toml), "--steps", "9", "--set", "n_layers=3", "--deterministic", "--no-fp8-kv-sim"]
    )
    cfg = config_from_args(args)
    assert cfg.steps == 9 and cfg.lr == 0.001 and cfg.deterministic and cfg.fp8_kv_sim is False
    assert cfg.model == {"dim": 64, "n_layers": 3}
    assert args.func.__name__ == "run_train"
    # a setting the file makes is kept unless the command line gives it: no option's default overrides it
    toml.write_text('steps = 7\ndevice = "cuda"\n')
    assert config_from_args(parser.parse_args(["train", "--train-config", str(toml)])).device == "cuda"
    assert (
        config_from_args(parser.parse_args(["train", "--train-config", str(toml), "--device", "cpu"])).device == "cpu"
    )
    assert config_from_args(parser.parse_args(["train"])).device == "auto"
    from dsv4.errors import UserError

    with pytest.raises(UserError, match="unknown training setting"):
        TrainConfig.from_dict({"stepz": 3})


@pytest.mark.parametrize(
    "setting, says",
    [
        ("steps = -5", "steps: must be an integer >= 1"),
        ("steps = 1.5", "steps: must be an integer >= 1"),
        ("steps = true", "steps: must be a single value"),
        ('lr = "0.1"', "lr: must be a number, not the string"),
        ("lr = -1.0", "lr: must be a finite number > 0"),
        ("batch_size = 0", "batch_size: must be an integer >= 1"),
        ("seq_len = 1", "seq_len: must be an integer >= 2"),
        ('schedule = "linear"', "schedule: must be one of cosine, wsd, constant"),
        ("compile = 1", "compile: must be true or false"),
        ('data = "x.py"', "data: must be a list of strings"),
    ],
)
def test_a_settings_file_value_the_flag_would_refuse_is_refused(tmp_path, setting, says):
    """The values of --train-config go through the checks of the flags of the same names: one line naming
    the file and the key, before any data or model is built (they trained 0 steps for -5, 2 for 1.5)."""
    from dsv4.errors import UserError
    from dsv4.train.cli import checked_values

    toml = tmp_path / "run.toml"
    toml.write_text(setting + "\n")
    with pytest.raises(UserError, match=f"^{re.escape(str(toml))}: {re.escape(says)}"):
        TrainConfig.from_file(toml, check=checked_values)
    # a saved run's settings (every field, defaults such as time_budget_s = 0.0 = off included) pass
    saved = tmp_path / "settings.json"
    saved.write_text(json.dumps(TrainConfig().to_dict()))
    assert TrainConfig.from_file(saved, check=checked_values) == TrainConfig()


def test_an_unknown_model_setting_is_named_in_one_line(tmp_path):
    from dsv4.train.settings import model_config_of

    with pytest.raises(UserError, match=r"^unknown model setting\(s\) \['foo'\] in --set / \[model\]"):
        model_config_of(TrainConfig(model={"foo": 1, "dim": 64}))


def test_train_flops_counts_active_experts_only():
    from dsv4.train import metrics
    from dsv4.train.metrics import train_flops_per_token

    c = micro_cfg()
    more = c.replace(n_routed_experts=16)
    wider = c.replace(n_activated_experts=3)
    assert train_flops_per_token(more, 64) == pytest.approx(
        train_flops_per_token(c, 64) + 3 * 2 * 12 * c.dim * (c.n_layers + 1)
    )
    assert train_flops_per_token(wider, 64) > train_flops_per_token(c, 64)
    # the matmul part agrees with `dsv4 info`'s forward FLOPs (which also counts norm/mHC vectors)
    from dsv4.info import model_info

    small = ModelConfig.preset("small")
    matmul = (
        3
        * 2
        * (sum(metrics._block_matmul_params(small, i) for i in range(small.n_layers)) + small.dim * small.vocab_size)
    )
    assert matmul == pytest.approx(3 * model_info(small).flops_per_token, rel=0.01)


@pytest.mark.slow
def test_two_process_run_matches_one_process(tmp_path):
    """`torchrun --nproc_per_node 2` (gloo, FSDP2 + expert parallelism through dsv4.train.distributed) trains
    on the same global batches: the first loss agrees to fp32 rounding, later ones closely (Muon/AdamW
    normalize tiny gradients, which magnifies summation-order differences)."""
    import subprocess
    import sys

    cfg = _train_cfg(
        tmp_path,
        steps=2,
        eval_every=0,
        diag_every=1,
        save_every=-1,
        batch_size=4,
        deterministic=False,
        threads=1,
        device="cpu",
    )  # gloo, also on a GPU machine
    single = Trainer(cfg, log=lambda *_: None)
    single.fit()
    one = [r for r in single.history if "loss" in r]
    cfg_file = tmp_path / "cfg.json"
    cfg_file.write_text(json.dumps(cfg.to_dict() | {"out": str(tmp_path / "run2")}))
    env = checkout_env(OMP_NUM_THREADS="1")
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--standalone",
            "--nproc_per_node",
            "2",
            "-m",
            "dsv4.train.cli",
            "train",
            "--config",
            str(cfg_file),
        ],
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = [json.loads(line) for line in (tmp_path / "run2" / "metrics.jsonl").read_text().splitlines()]
    assert rows[0]["world"] == 2 and rows[0]["params"] == sum(p.numel() for p in single.model.parameters())
    two = [r for r in rows if "loss" in r]
    assert len(two) == len(one) == 2
    assert two[0]["loss"] == pytest.approx(one[0]["loss"], rel=1e-5)
    assert two[0]["grad_norm"] == pytest.approx(one[0]["grad_norm"], rel=1e-4)
    assert two[1]["loss"] == pytest.approx(one[1]["loss"], rel=5e-3)
    assert two[0]["mhc_violation"] == pytest.approx(one[0]["mhc_violation"], rel=1e-3, abs=1e-6)


def test_ops_dispatch_does_not_recompile_under_torch_compile():
    """The dispatcher's call counters stay out of compiled graphs: tracing them guarded on their values and
    recompiled every block at every call."""
    import torch._dynamo

    from dsv4 import ops

    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()  # the counters outlive reset(): count this test only
    f = torch.compile(lambda h, r, p, c: ops.hc_post(h, r, p, c), backend="eager")
    b, s, hc, d = 1, 3, 4, 8
    args = (torch.randn(b, s, d), torch.randn(b, s, hc, d), torch.rand(b, s, hc), torch.rand(b, s, hc, hc))
    for _ in range(3):
        torch.testing.assert_close(f(*args), ops.reference.hc_post(*args))
    graphs = torch._dynamo.utils.counters["stats"]["unique_graphs"]
    torch._dynamo.reset()
    assert graphs == 1


# aot_eager always (dynamo + AOTAutograd trace the block's forward and backward); the real inductor on the
# whole training step (a C++ build of forward and backward that takes minutes on 2 CPU cores) when
# DSV4_TEST_COMPILE=1. The inductor forward below runs by default wherever a C++ compiler is found.
_COMPILERS = ["aot_eager"] + (["inductor"] if os.environ.get("DSV4_TEST_COMPILE") == "1" else [])


def cpp_compiler() -> str | None:
    """The C++ compiler inductor would build CPU kernels with, or None when there is none."""
    try:
        from torch._inductor import cpp_builder

        return shutil.which(cpp_builder.get_cpp_compiler())
    except Exception:  # noqa: BLE001  (torch internals vary)
        import torch._inductor.config as inductor_config

        names = [os.environ.get("CXX")] + [c for c in inductor_config.cpp.cxx if c]
        return next((shutil.which(c) for c in names if c and shutil.which(c)), None)


@pytest.mark.skipif(
    cpp_compiler() is None,
    reason="no C++ compiler found: inductor cannot build CPU kernels (install g++ to run the real --compile path)",
)
@pytest.mark.slow
def test_inductor_compiled_block_forward_matches_eager():
    """The real inductor through `compile_blocks` (the `--compile` path): generated C++ kernels, built and
    run on a one-block window-only model, give the eager logits to fp32 reassociation error (inductor fuses
    and reorders fp32 reductions: a few ulp per op, ~1e-5 of the logits' scale after a block)."""
    import torch._dynamo

    from dsv4.train.compiled import compile_blocks

    kw = dict(n_layers=1, n_mtp_layers=0, n_hash_layers=0, compress_ratios=(0,))
    tokens = torch.randint(0, 300, (2, 16), generator=torch.Generator().manual_seed(9))
    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()
    eager, compiled = micro_model(**kw), micro_model(**kw)
    compile_blocks(compiled, torch.device("cpu"), backend="inductor")
    with torch.no_grad():
        want, got = eager(tokens).logits, compiled(tokens).logits
    frames = torch._dynamo.utils.counters["stats"]["unique_graphs"]
    torch._dynamo.reset()
    assert frames > 0
    assert (got - want).abs().max() <= 1e-4 * want.abs().max()


@pytest.mark.slow
@pytest.mark.parametrize("backend", _COMPILERS)
def test_compiled_training_step_matches_eager(backend):
    """`--compile` on a one-block model with every block feature but MTP (CSA + Lightning Indexer, mHC,
    MoE): the loss equals the eager one to fp32 rounding and the gradients are finite and close (inductor
    reorders fp32 reductions)."""
    import torch._dynamo

    from dsv4.train.compiled import compile_blocks

    kw = dict(n_layers=1, n_mtp_layers=0, n_hash_layers=0, compress_ratios=(4,))
    tokens = torch.randint(0, 300, (2, 16), generator=torch.Generator().manual_seed(9))
    results = []
    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()  # frames compiled by earlier tests must not count here
    for compiled in (False, True):
        m = micro_model(**kw)
        if compiled:
            compile_blocks(m, torch.device("cpu"), backend=backend)
        out = m(tokens, indexer_loss=True, balance_alpha=1e-3)
        loss = losses.total_loss(out, tokens).total
        loss.backward()
        grads = {n: p.grad.clone() for n, p in m.named_parameters() if p.grad is not None}
        results.append((float(loss.detach()), grads))
    frames = torch._dynamo.utils.counters["stats"]["unique_graphs"]
    torch._dynamo.reset()
    (eager_loss, eager), (comp_loss, comp) = results
    assert frames > 0  # the block was compiled, not run eagerly
    assert comp_loss == pytest.approx(eager_loss, rel=1e-5)
    assert comp.keys() == eager.keys()
    for n, g in comp.items():
        assert torch.isfinite(g).all(), n
        torch.testing.assert_close(g, eager[n], rtol=1e-3, atol=1e-5, msg=n)


def test_defaults_depend_on_preset_and_device():
    from dsv4.train.trainer import QUICK_CPU_DEFAULTS, STANDARD_DEFAULTS

    assert QUICK_CPU_DEFAULTS.keys() == STANDARD_DEFAULTS.keys()
    unset = TrainConfig()
    assert all(getattr(unset, k) is None for k in STANDARD_DEFAULTS)
    quick = unset.resolved("cpu")  # `dsv4 train` on a CPU: tiny, quick
    assert {k: getattr(quick, k) for k in QUICK_CPU_DEFAULTS} == QUICK_CPU_DEFAULTS
    for cfg in (
        unset.resolved("cuda"),
        TrainConfig(preset="small").resolved("cpu"),
        TrainConfig(model_config="config.json").resolved("cpu"),
    ):
        assert {k: getattr(cfg, k) for k in STANDARD_DEFAULTS} == STANDARD_DEFAULTS
    mine = TrainConfig(steps=7, seq_len=64).resolved("cpu")  # given settings are kept
    assert (mine.steps, mine.seq_len, mine.batch_size) == (7, 64, QUICK_CPU_DEFAULTS["batch_size"])
    assert (
        QUICK_CPU_DEFAULTS["steps"] * QUICK_CPU_DEFAULTS["batch_size"] * QUICK_CPU_DEFAULTS["seq_len"]
        < STANDARD_DEFAULTS["steps"] * STANDARD_DEFAULTS["batch_size"] * STANDARD_DEFAULTS["seq_len"]
    )


def test_compile_without_a_cxx_compiler_is_refused(monkeypatch):
    import shutil

    from dsv4.errors import UserError
    from dsv4.train.compiled import compile_blocks

    monkeypatch.delenv("CXX", raising=False)
    monkeypatch.setattr(shutil, "which", lambda name: None)
    with pytest.raises(UserError, match="C\\+\\+ compiler"):
        compile_blocks(micro_model(), torch.device("cpu"))


def test_cuda_graph_training_is_refused_where_it_cannot_run(tmp_path, capsys):
    """`--cuda-graph` on a CPU fails at once with the reason (before tokenizing or building anything), and
    the graph wrappers refuse CPU tensors by name."""
    from dsv4.bench.graphs import GraphedPrefill
    from dsv4.cli import main
    from dsv4.train.graphed import GraphedBackward

    rc = main(
        [
            "train",
            "--preset",
            "tiny",
            "--device",
            "cpu",
            "--cuda-graph",
            "--out",
            str(tmp_path / "run"),
            "--no-progress",
        ]
    )
    assert rc == 2
    assert "--cuda-graph: it needs a CUDA device" in capsys.readouterr().err
    assert not (tmp_path / "run" / "tokenizer").exists()
    model = micro_model()
    with pytest.raises(ValueError, match="CUDA graphs need"):
        GraphedBackward(model, lambda x: {"loss": model(x).logits.sum()}, torch.zeros(1, 4, dtype=torch.long))
    with pytest.raises(ValueError, match="CUDA graphs need"):
        GraphedPrefill(model, 1, 4)


def test_resume_keeps_one_metrics_row_per_step_and_its_pointer_inside_the_run(tmp_path):
    """A run killed after logging steps it had not checkpointed replays them on resume: their old rows go
    (one row per step), a torn last line goes, and the `latest` pointer cannot lead outside the run."""
    import shutil

    run = tmp_path / "run"
    Trainer(_train_cfg(tmp_path, save_every=2, eval_every=0), log=lambda *_: None).fit()
    ckpts = run / "checkpoints"
    # as if killed after logging steps 3-4 but before their checkpoint: latest still names step 2
    (ckpts / "latest").write_text("step_00000002")
    with open(run / "metrics.jsonl", "a") as f:
        f.write('{"step": 5, "loss": 1.')  # a torn write
    logged = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()[:-1]]
    assert [r["step"] for r in logged if "step" in r] == [1, 2, 3, 4]
    resumed = Trainer(_train_cfg(tmp_path, save_every=-1, eval_every=0, resume="auto"), log=lambda *_: None)
    assert resumed.step == 2
    resumed.fit()
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows if "step" in r] == [1, 2, 3, 4]
    assert [r.get("event") for r in rows if "event" in r] == ["start", "start", "end"]

    # the pointer names a real, intact checkpoint, but outside the run: refused before it is opened
    elsewhere = tmp_path / "elsewhere"
    shutil.copytree(ckpts / "step_00000002", elsewhere / "step_00000002")
    for pointer in ("../../elsewhere/step_00000002", str(elsewhere / "step_00000002"), "", "."):
        (ckpts / "latest").write_text(pointer)
        with pytest.raises(checkpoint.CorruptCheckpoint, match="not a checkpoint inside"):
            Trainer(_train_cfg(tmp_path, save_every=-1, resume="auto"), log=lambda *_: None)
    (ckpts / "step_00000002").rename(ckpts / "moved")
    (ckpts / "step_00000002").symlink_to(elsewhere / "step_00000002")  # inside by name, outside by link
    (ckpts / "latest").write_text("step_00000002")
    with pytest.raises(checkpoint.CorruptCheckpoint, match="not a checkpoint inside"):
        Trainer(_train_cfg(tmp_path, save_every=-1, resume="auto"), log=lambda *_: None)


@pytest.mark.parametrize("frozen", [False, True])
def test_training_a_dspark_draft_with_or_without_the_main_model(tmp_path, frozen):
    """--draft dspark: the draft's loss and tau are logged; with --freeze-main only the draft (and its
    routers' bias) moves, without it the main model trains on its own losses as well."""
    t = Trainer(
        _train_cfg(
            tmp_path,
            draft="dspark",
            freeze_main=frozen,
            dspark_anchors=4,
            steps=2,
            eval_every=0,
            diag_every=0,
            save_every=-1,
        ),
        log=lambda *_: None,
    )
    assert t.model.cfg.dspark and t.model.cfg.n_mtp_layers == 3
    before = {k: v.clone() for k, v in t.model.state_dict().items()}
    t.fit()
    rows = [r for r in t.history if "loss" in r]
    assert len(rows) == 2 and all(r["dspark"] > 0 and 1 <= r["dspark_tau"] <= 6 and "lm" in r for r in rows)
    moved = {k for k, v in t.model.state_dict().items() if not torch.equal(v, before[k])}
    assert any(k.startswith("mtp.") for k in moved)
    assert any(not k.startswith("mtp.") for k in moved) != frozen, sorted(moved)[:5]
    if frozen:
        assert all(r["loss"] == r["dspark"] for r in rows)


# ------------------------------------------------------------------------------ gradient accumulation
def _micro_grads(t: Trainer, batch: torch.Tensor) -> dict[str, torch.Tensor]:
    """One micro-batch's own gradients (eager forward + backward of its unweighted loss, from zero)."""
    t.model.zero_grad(set_to_none=True)
    with t._backend(), t._autocast():
        t._losses(batch).total.backward()
    return {n: p.grad.clone() for n, p in t.model.named_parameters() if p.grad is not None}


def test_grad_accum_adds_the_micro_batches_gradients_bit_for_bit(tmp_path):
    """--grad-accum 2: the update sees (g1 + g2) / 2 of the two micro-batches' own backward passes,
    exactly: each backward starts from the loss halved, and halving is exact in binary floating point
    and commutes with every rounding after it, so the sum of the halves is the halved sum."""
    t = Trainer(_train_cfg(tmp_path, grad_accum=2, eval_every=0, diag_every=0, device="cpu"), log=lambda *_: None)
    b1, b2 = t.loader.next_batch(), t.loader.next_batch()
    g1, g2 = _micro_grads(t, b1), _micro_grads(t, b2)
    t.model.zero_grad(set_to_none=True)
    seen: dict[str, torch.Tensor] = {}

    def update(max_norm, gnorm):  # what the optimizer would step with (before clipping)
        seen.update({n: p.grad.clone() for n, p in t.model.named_parameters() if p.grad is not None})

    t._update = update
    t.train_step([b1, b2])
    assert seen.keys() == g1.keys() and len(g1) > 50
    for n in g1:
        assert torch.equal(seen[n], (g1[n] + g2[n]) * 0.5), n
    assert not torch.equal(g1[n], g2[n])  # two different batches (the test can tell them apart)


def test_grad_accum_reports_the_mean_loss_and_moves_the_bias_by_the_step_s_tokens(tmp_path):
    """A step of two micro-batches logs the mean of their losses (the same float32 arithmetic) and moves
    each router's bias by the sign rule on the sum of their loads, not on the last micro-batch's; the
    loader hands out grad_accum batches a step and the step counts all their tokens."""
    t = Trainer(_train_cfg(tmp_path, grad_accum=2, eval_every=0, diag_every=0, device="cpu"), log=lambda *_: None)
    b1, b2 = t.loader.next_batch(), t.loader.next_batch()
    routers = balance.routers(t.model)
    assert routers
    losses, loads = [], []
    for b in (b1, b2):
        with torch.no_grad(), t._backend(), t._autocast():
            losses.append(t._losses(b).total.detach().float())
        loads.append([m.load.clone() for m in routers])
    before = [m.gate.bias.detach().clone() for m in routers]
    row = t.train_step([b1, b2])
    assert row["loss"] == float((losses[0] + losses[1]) / 2)
    gamma = t.cfg.bias_gamma
    moved_by_last_alone = 0
    for m, b0, l1, l2 in zip(routers, before, *loads):
        total = (l1 + l2).float()
        want = b0 + (gamma * torch.sign(total.mean() - total)).to(b0.dtype)
        assert torch.equal(m.gate.bias, want)
        last = b0 + (gamma * torch.sign(l2.float().mean() - l2.float())).to(b0.dtype)
        moved_by_last_alone += int(not torch.equal(last, want))
    assert moved_by_last_alone > 0  # the sum and the last micro-batch's load disagree somewhere
    assert t.describe()["tokens_per_step"] == 2 * t.cfg.batch_size * t.cfg.seq_len

    (tmp_path / "b").mkdir()
    fresh = Trainer(
        _train_cfg(tmp_path / "b", grad_accum=3, steps=2, eval_every=0, diag_every=0, device="cpu"), log=lambda *_: None
    )
    fresh.fit()
    assert fresh.loader.state.epoch == 0
    assert fresh.loader.state.index == 2 * 3 * fresh.cfg.batch_size
    rows = [r for r in fresh.history if "tokens_per_s" in r]
    assert rows
    for r in rows:  # tokens/s over the step's time: all three micro-batches' tokens
        tps, dt = r["tokens_per_s"], r["step_time_s"]  # logged rounded to 0.1 tokens/s and 0.1 ms
        assert abs(tps * dt - 3 * 2 * 32) <= 0.05 * dt + tps * 0.5e-4 + 1e-5  # (+ the product of the two errors)


@pytest.mark.parametrize("bad", [0, -1, 1.5, True, "2"])
def test_grad_accum_must_be_a_whole_number_of_micro_batches(tmp_path, bad):
    with pytest.raises(UserError, match="grad_accum must be a whole number"):
        Trainer(_train_cfg(tmp_path, grad_accum=bad), log=lambda *_: None)


@pytest.mark.gpu  # graph capture
def test_graphed_accumulation_adds_replays_into_its_gradient_buffers():
    """GraphedBackward(accumulate=True): run(b, zero=True) replaces the buffers with b's gradients (the loss
    scaled by loss_scale), run(b, zero=False) adds to them: replay 1 then 2 gives exactly g1 + g2 of the
    same graph's single replays (one float add per element, as autograd's in-place accumulation does), and
    a graph that sets its gradients refuses to add. The model is an MLP under bf16 autocast (cuBLAS GEMMs
    and elementwise kernels, which repeat their bits at every replay; the V4 model's sparse-attention
    backward adds with atomics outside deterministic mode)."""
    from dsv4.train.graphed import GraphedBackward

    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA device")
    torch.manual_seed(0)
    mlp = torch.nn.Sequential(
        torch.nn.Linear(64, 256), torch.nn.GELU(), torch.nn.Linear(256, 256), torch.nn.GELU(), torch.nn.Linear(256, 8)
    )
    model = torch.nn.ModuleDict({"mlp": mlp, "unused": torch.nn.Linear(4, 4)}).cuda()  # one the loss never reaches
    gen = torch.Generator().manual_seed(1)
    b1, b2 = (torch.randn(512, 64, generator=gen).cuda() for _ in range(2))

    def loss_fn(batch):
        return {"loss": mlp(batch).float().square().mean()}

    graph = GraphedBackward(model, loss_fn, b1, torch.bfloat16, accumulate=True, loss_scale=0.5)

    def grads():
        return [p.grad.clone() for p in graph.params if p.grad is not None]

    graph.run(b1)
    one = grads()
    graph.run(b2)
    two = grads()
    graph.run(b1)
    assert all(torch.equal(a, b) for a, b in zip(one, grads()))  # zero=True cleared the sum
    graph.run(b2, zero=False)
    both = grads()
    assert len(both) == len(one) == 6  # the unused layer keeps no gradient (None, as without accumulation)
    assert model["unused"].weight.grad is None and model["unused"].bias.grad is None
    assert all(torch.equal(s, a + b) for s, a, b in zip(both, one, two))
    assert all(not torch.equal(a, b) for a, b in zip(one, two))
    unscaled = GraphedBackward(model, loss_fn, b1, torch.bfloat16, accumulate=True)  # the same kernels
    unscaled.run(b1)
    full = [p.grad for p in unscaled.params if p.grad is not None]
    assert all(torch.equal(f, 2 * g) for f, g in zip(full, one))  # halving is exact
    setting = GraphedBackward(model, loss_fn, b1, torch.bfloat16)
    with pytest.raises(ValueError, match="accumulate=True"):
        setting.run(b2, zero=False)


def test_head_precision_bf16_trains_the_heads_on_bf16_products_and_needs_bf16_compute(tmp_path):
    from dsv4 import ops

    with pytest.raises(UserError, match="needs --precision bf16"):
        Trainer(_train_cfg(tmp_path, head_precision="bf16", device="cpu"), log=lambda *_: None)
    with pytest.raises(UserError, match="--head-precision must be one of"):
        Trainer(_train_cfg(tmp_path, head_precision="int8"), log=lambda *_: None)
    t = Trainer(
        _train_cfg(
            tmp_path, head_precision="bf16", precision="bf16", steps=2, eval_every=0, diag_every=0, device="cpu"
        ),
        log=lambda *_: None,
    )
    with ops.which_ran() as ran:
        t.fit()
    assert ran["linear_bf16_fp32"] == ["reference"]  # (the CPU's backend)
    assert all(math.isfinite(r["loss"]) for r in t.history if "loss" in r)
