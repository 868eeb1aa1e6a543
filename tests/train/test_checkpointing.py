"""Activation checkpointing with the training losses on (balance loss, indexer loss, MTP).

The auxiliary losses leave each block through its output (`Block.forward(..., with_losses=True)`), not
through module attributes: a recomputation in backward writes nothing onto the modules, so nothing outside
the backward keeps a recomputed block's tensors alive. Checked here on the `tiny` preset on CPU:

- the backward recomputes the blocks one at a time, last first, each once, and when a block's
  recomputation starts no tensor of an earlier recomputation is alive any more (tracked by storage weak
  references to the MoE input each recomputation produces, a tensor its router saves for backward); none
  is alive after the backward;
- the gradients with checkpointing equal those without, bit for bit (the recomputation runs the same
  deterministic CPU kernels on the same inputs, and the backward graph is the same).
"""

from __future__ import annotations

import torch
from torch.multiprocessing.reductions import StorageWeakRef

from dsv4.config import ModelConfig
from dsv4.model import DeepSeekV4
from dsv4.train.losses import total_loss

CFG = ModelConfig.preset("tiny")


def _step(checkpointing: bool, probe: bool = False) -> tuple[dict[str, torch.Tensor], list, list]:
    """One forward (MTP, indexer and balance losses on) and backward -> (gradients by name, recomputation
    order, for each recomputation the earlier recomputations' MoE inputs still alive when it started;
    appended last: those alive after the backward)."""
    model = DeepSeekV4.from_config(CFG, seed=0, dtype=torch.float32).train()
    model.set_options(activation_checkpointing=checkpointing)
    tokens = torch.randint(0, CFG.vocab_size, (2, 160), generator=torch.Generator().manual_seed(0))
    in_backward = False
    order: list[int] = []
    refs: dict[int, StorageWeakRef] = {}
    alive: list[list[int]] = []

    def recomputed(i: int):
        def hook(module, args):
            if in_backward:  # the block's recomputation reaches its MoE
                order.append(i)
                alive.append(sorted(j for j, r in refs.items() if not r.expired()))
                refs[i] = StorageWeakRef(args[0].untyped_storage())

        return hook

    handles = (
        [layer.ffn.register_forward_pre_hook(recomputed(i)) for i, layer in enumerate(model.layers)] if probe else []
    )
    out = model(tokens, mtp=True, indexer_loss=True, balance_alpha=1e-2)
    assert out.balance_loss is not None and out.indexer_loss is not None
    loss = total_loss(out, tokens).total
    in_backward = True
    loss.backward()
    alive.append(sorted(j for j, r in refs.items() if not r.expired()))
    for h in handles:
        h.remove()
    return {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}, order, alive


def test_backward_recomputes_one_block_at_a_time_with_the_balance_loss_on():
    _, order, alive = _step(True, probe=True)
    assert order == list(range(CFG.n_layers))[::-1]  # each block once, the last first
    assert alive == [[]] * (CFG.n_layers + 1), alive  # no earlier recomputation alive; none after


def test_checkpointing_leaves_the_gradients_unchanged():
    plain, order, _ = _step(False, probe=True)
    assert order == []  # nothing recomputed without checkpointing
    ckpt, _, _ = _step(True)
    assert plain.keys() == ckpt.keys() and len(plain) > 0
    for n in plain:
        assert torch.equal(plain[n], ckpt[n]), n
