"""The routed experts' bf16 copies kept for an optimizer step (`dsv4.train.casts.StepCasts`): the same
losses and gradients as casting at every forward, bit for bit; no cast of an expert weight inside a
forward or backward; fresh after every update and after any in-place write of a weight."""

from __future__ import annotations

import copy
import math

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from dsv4.config import ModelConfig
from dsv4.model import DeepSeekV4
from dsv4.train.casts import StepCasts
from dsv4.train.losses import total_loss
from dsv4.train.trainer import Trainer

DEV = torch.device("cpu")  # (autocast bf16 on the CPU: the same casts as on a GPU)


def _model() -> DeepSeekV4:
    return DeepSeekV4.from_config(ModelConfig.preset("tiny"), seed=0, dtype=torch.float32, device=DEV).train()


def _step(m: DeepSeekV4, micro: list[torch.Tensor]) -> tuple[list[torch.Tensor], dict[str, torch.Tensor]]:
    """Every micro-batch's loss (bf16 autocast, every loss term) and the summed gradients."""
    losses = []
    for tok in micro:
        with torch.autocast(DEV.type, dtype=torch.bfloat16):
            loss = total_loss(m(tok, mtp=True, indexer_loss=True), tok).total
        (loss / len(micro)).backward()
        losses.append(loss.detach())
    grads = {n: p.grad.clone() for n, p in m.named_parameters() if p.grad is not None}
    m.zero_grad(set_to_none=True)
    return losses, grads


class _ExpertCastCount(TorchDispatchMode):
    """Counts fp32 -> bf16 conversions of tensors shaped like a routed expert weight."""

    def __init__(self, shapes: set[tuple[int, ...]]):
        super().__init__()
        self.shapes, self.n = shapes, 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if func in (torch.ops.aten._to_copy.default, torch.ops.aten.copy_.default):
            src = args[1] if func is torch.ops.aten.copy_.default else args[0]
            dst = args[0] if func is torch.ops.aten.copy_.default else out
            if tuple(src.shape) in self.shapes and src.dtype == torch.float32 and dst.dtype == torch.bfloat16:
                self.n += 1
        return out


@pytest.mark.parametrize("checkpointing", [False, True])
def test_kept_copies_give_the_cast_at_each_use_bit_for_bit(checkpointing):
    """Two optimizer-like steps of two micro-batches each, with and without the kept copies; between them
    every weight is written in place (as an optimizer does), then `refresh()` as the trainer's update calls it."""
    m0 = _model().set_options(activation_checkpointing=checkpointing)
    m1 = copy.deepcopy(m0)
    casts = StepCasts(m1)
    m1.set_options(expert_casts=casts)
    assert len(casts) == 3 * sum(1 for n, _ in m1.named_modules() if n.endswith(".experts"))
    g = torch.Generator().manual_seed(1)
    vocab = m0.cfg.vocab_size
    for _ in range(2):
        micro = [torch.randint(0, vocab, (2, 32), generator=g) for _ in range(2)]
        (l0, g0), (l1, g1) = _step(m0, micro), _step(m1, micro)
        assert all(torch.equal(a, b) for a, b in zip(l0, l1))
        assert g0.keys() == g1.keys() and any(".experts.w" in k for k in g0)
        assert all(torch.equal(g0[k], g1[k]) for k in g0), [k for k in g0 if not torch.equal(g0[k], g1[k])]
        with torch.no_grad():
            for m in (m0, m1):
                for i, p in enumerate(m.parameters()):
                    p.mul_(1.0 - 0.01 * (i % 7))
        casts.refresh()


def test_no_expert_weight_is_cast_inside_a_step():
    """With the copies kept, the forward, the recomputation of checkpointing and the backward of two
    micro-batches cast no expert weight (without them: at least one cast per weight per forward)."""
    m = _model().set_options(activation_checkpointing=True)
    shapes = {tuple(p.shape) for n, p in m.named_parameters() if ".experts.w" in n}
    tok = [torch.randint(0, m.cfg.vocab_size, (2, 32), generator=torch.Generator().manual_seed(2))] * 2
    with _ExpertCastCount(shapes) as uncached:
        _step(m, tok)
    n_weights = sum(1 for n, _ in m.named_parameters() if ".experts.w" in n)
    assert uncached.n >= 2 * n_weights  # (the test can fail: the count sees the casts)
    m.set_options(expert_casts=StepCasts(m))
    with _ExpertCastCount(shapes) as cached:
        _step(m, tok)
    assert cached.n == 0


def test_a_weight_written_in_place_is_cast_again_before_use():
    """Outside a CUDA graph capture `get` compares the weight's version counter with its copy's: a write
    without `refresh()` (a checkpoint load, a manual edit) is seen; `get` declines other dtypes and weights."""
    m = _model()
    casts = StepCasts(m)
    w = next(p for n, p in m.named_parameters() if n.endswith(".experts.w1"))
    assert torch.equal(casts.get(w, torch.bfloat16), w.detach().bfloat16())
    with torch.no_grad():
        w.add_(1.0)
    assert torch.equal(casts.get(w, torch.bfloat16), w.detach().bfloat16())
    m.load_state_dict({k: v * 2 for k, v in m.state_dict().items()})
    assert torch.equal(casts.get(w, torch.bfloat16), w.detach().bfloat16())
    assert casts.get(w, torch.float16) is None and casts.get(m.embed.weight, torch.bfloat16) is None


def test_the_trainer_keeps_copies_under_bf16_and_refreshes_them_after_every_update(tmp_path):
    """`dsv4 train --precision bf16` in one process holds the copies and, after each update, they are the
    bf16 casts of the updated weights; in fp32 there are none."""
    from test_train import _train_cfg

    t = Trainer(_train_cfg(tmp_path, precision="bf16", steps=2, eval_every=0, diag_every=0), log=lambda *_: None)
    assert t.casts is not None and len(t.casts) > 0
    t.fit()
    experts = [p for n, p in t.model.named_parameters() if ".experts.w" in n]
    assert all(torch.equal(t.casts._copies[p][0], p.detach().bfloat16()) for p in experts)
    fp32 = Trainer(_train_cfg(tmp_path, precision="fp32", steps=1, out=str(tmp_path / "b")), log=lambda *_: None)
    assert fp32.casts is None
    # FP4 fake quantization computes from the fp32 weights with its own rounding: no bf16 copies of them
    fp4 = Trainer(
        _train_cfg(tmp_path, precision="bf16", fp4_experts=True, out=str(tmp_path / "c")), log=lambda *_: None
    )
    assert fp4.casts is not None and not any(
        ".experts.w" in n for n, p in fp4.model.named_parameters() if p in fp4.casts._copies
    )


@pytest.mark.gpu  # graph capture
def test_graphed_training_refreshes_the_copies_in_its_update_graph(tmp_path, monkeypatch):
    """Under --cuda-graph the forward and backward replay reads the copies and the update graph replays
    their making (no version counter moves in a replay): after three steps of two micro-batches the experts'
    copies are the casts of the updated weights and the head's split their split; the first step (before
    any update) gives the loss of the same run casting at each use. (Not deterministic mode: it would set
    torch's global flags in a test process that has used cuBLAS already.)"""
    from test_train import _train_cfg

    import dsv4.train.trainer as trainer_module
    from dsv4.ops import torch_native

    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA device")
    kw = dict(precision="bf16", device="cuda", cuda_graph=True, grad_accum=2, steps=3, eval_every=0, diag_every=0)
    kw |= dict(deterministic=False, save_every=-1)
    kept = Trainer(_train_cfg(tmp_path, **kw), log=lambda *_: None)
    assert kept.casts is not None and [id(w) for w in kept.casts.split] == [id(kept.model.head.weight)]
    kept.fit()
    experts = [p for n, p in kept.model.named_parameters() if ".experts.w" in n]
    assert experts and all(torch.equal(kept.casts._copies[p][0], p.detach().bfloat16()) for p in experts)
    head = kept.model.head.weight
    assert torch.equal(torch_native._STEP[head][0], torch.cat(torch_native.bf16_parts(head.detach()), dim=1))
    monkeypatch.setattr(trainer_module.StepCasts, "attach", classmethod(lambda *_, **__: None))  # cast at each use
    each = Trainer(_train_cfg(tmp_path, **kw, out=str(tmp_path / "each")), log=lambda *_: None)
    assert each.casts is None
    each.fit()
    losses = [[r["loss"] for r in t.history if "loss" in r] for t in (kept, each)]
    assert len(losses[0]) == len(losses[1]) == 3 and losses[0][0] == losses[1][0]
    assert all(math.isfinite(v) for v in losses[0] + losses[1])


def test_the_kept_head_split_gives_the_per_call_split_bit_for_bit(monkeypatch):
    """With the head's bf16x3 split kept for the step (`head_split=True`), its calls, forward and backward,
    split the weight no more; losses and gradients equal the per-call split's, across in-place writes and
    `refresh()`; `close()` stops keeping it."""
    import dsv4.ops as ops
    from dsv4.ops import torch_native

    splits = []
    for name in ("split_bf16x3", "bf16_parts"):
        real = getattr(torch_native, name)

        def counted(t, _real=real):
            splits.append(tuple(t.shape))
            return _real(t)

        monkeypatch.setattr(torch_native, name, counted)
    m0 = _model()
    m1 = copy.deepcopy(m0)
    casts = StepCasts(m1, head_split=True)
    m1.set_options(expert_casts=casts)
    head = tuple(m1.head.weight.shape)
    g = torch.Generator().manual_seed(3)
    with ops.use_backend({"linear_fp32": "bf16x3"}):
        for _ in range(2):
            micro = [torch.randint(0, m0.cfg.vocab_size, (2, 32), generator=g) for _ in range(2)]
            splits.clear()
            with ops.which_ran() as ran:
                l0, g0 = _step(m0, micro)
            assert "bf16x3" in ran["linear_fp32"] and head in splits  # (per call: the head split each time)
            splits.clear()
            l1, g1 = _step(m1, micro)
            assert head not in splits
            assert all(torch.equal(a, b) for a, b in zip(l0, l1))
            assert all(torch.equal(g0[k], g1[k]) for k in g0) and g0.keys() == g1.keys()
            with torch.no_grad():
                for m in (m0, m1):
                    m.head.weight.mul_(0.97)
            casts.refresh()  # (read below without a call first: `refresh` itself made the split again)
            kept = torch_native._STEP[m1.head.weight][0]
            assert torch.equal(kept, torch.cat(torch_native.bf16_parts(m1.head.weight.detach()), dim=1))
        casts.close()
        splits.clear()
        _step(m1, micro)
        assert head in splits
