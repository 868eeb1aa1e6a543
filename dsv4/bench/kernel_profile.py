"""Per-kernel GPU time of one end-to-end call, replayed from its CUDA graph (CUDA only).

    python3 -m dsv4.bench.kernel_profile train   [--preset small --batch 2 --seq 2048] [--top 28]
    python3 -m dsv4.bench.kernel_profile prefill [--preset small --batch 1 --seq 4096]
    python3 -m dsv4.bench.kernel_profile decode  [--preset small --batch 1]

train: forward + cross-entropy + backward of a bf16 model (`GraphedBackward`, what `dsv4 bench train
--cuda-graph` times); prefill: `GraphedPrefill`; decode: `GraphedDecoder` after a 64-token prompt. Prints
the GPU-busy time and kernel count per call, then the kernels that take the most GPU time (summed over
launches of the same kernel name). A graphed call has no host launch cost, so this is where its time goes.
"""

from __future__ import annotations

import argparse
from collections.abc import Callable

import torch
import torch.nn.functional as F

from ..errors import UserError
from .device_profile import kernel_table
from .e2e import build_model
from .report import refused, require_cuda


def _graphed_call(bench: str, args: argparse.Namespace, device: torch.device) -> Callable[[], object]:
    model = build_model(args.preset, device, torch.bfloat16)
    vocab = model.cfg.vocab_size
    tokens = torch.randint(2, vocab, (args.batch, args.seq), device=device)
    if bench == "train":
        from ..train.graphed import GraphedBackward

        model.train()

        def loss_fn(batch: torch.Tensor) -> dict[str, torch.Tensor]:
            logits = model(batch).logits[:, :-1].float()
            return {"loss": F.cross_entropy(logits.reshape(-1, vocab), batch[:, 1:].reshape(-1))}

        graph = GraphedBackward(model, loss_fn, tokens)
        return lambda: graph.run(tokens)
    model.eval()
    from .graphs import GraphedDecoder, GraphedPrefill

    with torch.no_grad():
        if bench == "prefill":
            graph = GraphedPrefill(model, args.batch, args.seq, args.seq + 8)
            return lambda: graph.run(tokens)
        cache = model.new_cache(args.batch, 64 + 64)
        nxt = model.prefill(tokens[:, :64], cache)[:, -1:].argmax(-1)
        decoder = GraphedDecoder(model, cache)
        return lambda: decoder.step(nxt)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("bench", choices=("train", "prefill", "decode"))
    p.add_argument("--preset", default="small")
    p.add_argument("--batch", type=int, default=None, help="default: 2 (train), 1 (prefill, decode)")
    p.add_argument("--seq", type=int, default=None, help="default: 2048 (train), 4096 (prefill), 64 (decode)")
    p.add_argument("--top", type=int, default=28, help="kernels listed")
    args = p.parse_args(argv)
    try:
        device = require_cuda("python3 -m dsv4.bench.kernel_profile", "it profiles CUDA kernels")
    except UserError as e:
        return refused(e)
    args.batch = args.batch or (2 if args.bench == "train" else 1)
    args.seq = args.seq or {"train": 2048, "prefill": 4096, "decode": 64}[args.bench]
    torch.manual_seed(0)
    fn = _graphed_call(args.bench, args, device)
    calls = 3 if args.bench != "decode" else 1  # decode: one step per call, the cache advances
    busy, n, rows = kernel_table(fn, calls)
    print(
        f"{args.bench} {args.preset} b={args.batch} s={args.seq} (CUDA graph): GPU busy {busy:.2f} ms per call, "
        f"{n:.0f} kernels per call"
    )
    for name, ms, launches in rows[: args.top]:
        print(f"  {ms:8.3f} ms  {launches:6.1f}x  {name[:100]}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
