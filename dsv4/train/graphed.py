"""Forward + loss + backward replayed from one CUDA graph (fixed batch shape).

A training step of a small model launches thousands of kernels from Python (norms, RoPE, mHC, routing,
the losses and every one of their backward kernels); on a GPU that host work, not the kernels, sets the
step time. The model's forward and backward never synchronize with the host, so at a fixed batch shape
they can be captured once and replayed:

    step = GraphedBackward(model, loss_fn, batch)        # loss_fn(batch) -> {"loss": scalar, ...}
    out = step.run(new_batch)                            # writes every parameter's .grad in place
    optimizer.step()                                     # eager, as before

`run` copies the batch into the graph's input buffers and replays; the outputs (the loss and whatever else
loss_fn returns) are the graph's buffers, overwritten by the next replay. The gradients are *set*, not
accumulated (the capture starts from `.grad = None`), and re-attached after each replay, so an optimizer
that sets them to None between steps keeps working. Under autocast the capture runs with autocast's weight
cache off, as CUDA graphs require.

With `accumulate=True` (gradient accumulation over micro-batches) the gradients are buffers allocated
before the capture, which the captured backward adds into in place: `run(batch, zero=True)` clears them
first (the step's first micro-batch), `run(batch, zero=False)` adds the next micro-batch's gradients;
`loss_scale` (e.g. 1/N for N micro-batches) weights the loss that backward starts from, not the outputs.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from ..ops.cuda_graphs import capturing


class GraphedBackward:
    def __init__(
        self,
        model: torch.nn.Module,
        loss_fn: Callable[[torch.Tensor], dict[str, torch.Tensor]],
        example: torch.Tensor,
        autocast_dtype: torch.dtype | None = None,
        warmup: int = 2,
        accumulate: bool = False,
        loss_scale: float = 1.0,
    ):
        dev = example.device
        if accumulate and warmup < 1:
            raise ValueError("accumulate=True needs a warm-up step: it tells which parameters the loss reaches")
        if dev.type != "cuda":
            raise ValueError(f"CUDA graphs need CUDA tensors, this batch is on {dev}")
        self.model, self.loss_fn, self.autocast_dtype = model, loss_fn, autocast_dtype
        self.loss_scale = loss_scale
        self.batch = example.clone()
        self.params = [p for p in model.parameters() if p.requires_grad]
        side = torch.cuda.Stream(dev)
        side.wait_stream(torch.cuda.current_stream(dev))
        with torch.cuda.stream(side):  # compile / autotune kernels outside the graph
            for _ in range(warmup):
                self._forward_backward()
        torch.cuda.current_stream(dev).wait_stream(side)
        self.accumulate = accumulate
        reached = [p.grad is not None for p in self.params]  # by the warm-up's backward
        for p, r in zip(self.params, reached):  # accumulating: buffers the captured backward adds into
            p.grad = torch.zeros_like(p) if accumulate and r else None  # (AccumulateGrad's in-place add)
        self.graph = torch.cuda.CUDAGraph()
        with capturing(self.graph):
            self.outputs = self._forward_backward()
        self.grads = [p.grad for p in self.params]  # None where the loss does not reach
        if accumulate:
            self._zero()

    def _zero(self) -> None:
        torch._foreach_zero_([g for g in self.grads if g is not None])

    def _forward_backward(self) -> dict[str, torch.Tensor]:
        if self.autocast_dtype is None:
            out = self.loss_fn(self.batch)
        else:
            with torch.autocast("cuda", dtype=self.autocast_dtype, cache_enabled=False):
                out = self.loss_fn(self.batch)
        loss = out["loss"]
        (loss if self.loss_scale == 1.0 else loss * self.loss_scale).backward()
        return out

    def run(self, batch: torch.Tensor, zero: bool = True) -> dict[str, torch.Tensor]:
        """Replays forward + backward on `batch` (same shape and dtype as the example); -> loss_fn's outputs.
        Accumulating, `zero=False` adds this batch's gradients to the buffers instead of replacing them."""
        if not zero and not self.accumulate:
            raise ValueError("this graph sets the gradients; capture it with accumulate=True to add to them")
        if batch.shape != self.batch.shape or batch.dtype != self.batch.dtype:
            raise ValueError(
                f"this graph was captured for a {self.batch.dtype} batch of shape "
                f"{list(self.batch.shape)}, got {batch.dtype} {list(batch.shape)}"
            )
        self.batch.copy_(batch)
        if self.accumulate and zero:
            self._zero()
        self.graph.replay()
        for p, g in zip(self.params, self.grads):
            p.grad = g
        return self.outputs


class GraphedUpdate:
    """A parameter update (e.g. clipping + `MuonAdamW.step` + the router-bias update) captured once as a
    CUDA graph at construction, replayed by each call.

    `fn` takes no arguments and must read only tensors that stay where they are between calls: the gradients
    of `GraphedBackward` (the same buffers every replay), the optimizer's state and device learning rates,
    and any input the caller copies into a buffer of its own before calling. Run `fn` eagerly once before
    (the optimizer builds its state and the batched Muon plan on its first step; capture records kernels
    without running them). Skipping a step is not calling this."""

    def __init__(self, fn: Callable[[], object]):
        self.fn = fn
        self.graph = torch.cuda.CUDAGraph()
        with capturing(self.graph):
            fn()

    def __call__(self) -> None:
        self.graph.replay()


class ReplayAfterFirst:
    """Runs fn eagerly at the first call, captures it (`GraphedUpdate`) at the second and replays it from then
    on: the first step builds the optimizer's state, which the graph then updates in place."""

    def __init__(self, fn: Callable[[], object]):
        self.fn = fn
        self.graph: GraphedUpdate | None = None
        self.calls = 0

    def __call__(self) -> None:
        self.calls += 1
        if self.calls == 1:
            self.fn()
            return
        if self.graph is None:
            self.graph = GraphedUpdate(self.fn)
        self.graph()
