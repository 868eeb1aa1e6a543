"""GPU time and kernels of one graphed decode step, bf16 against INT8 (`quant_mode="int8"`): the top kernels
by time at each batch (a diagnostic; `dsv4 bench int8` gives the rates). CUDA only.

    python3 scripts/profile_int8_decode.py                                  # small, batch 1 and 16
    python3 scripts/profile_int8_decode.py --preset flash --layers 2 --batch 1 --top 20
    python3 scripts/profile_int8_decode.py --preset flash --layers 2 --batch 1 --modes int8,bf16   # INT8 first
"""

from __future__ import annotations

import argparse
import gc
import sys
from functools import partial
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # this checkout's dsv4, also when not installed

from dsv4.argtypes import int_in, preset  # noqa: E402
from dsv4.bench.device_profile import kernel_table  # noqa: E402
from dsv4.bench.graphs import GraphedDecoder  # noqa: E402
from dsv4.bench.int8 import load  # noqa: E402

QUANT = {"bf16": "w8a16", "int8": "int8"}  # mode -> the model's quant_mode (bf16: the float model)


def _modes(value: str) -> list[str]:
    modes = [m.strip() for m in value.split(",") if m.strip()]
    if not modes or any(m not in QUANT for m in modes) or len(set(modes)) != len(modes):
        raise argparse.ArgumentTypeError(f"a comma list of distinct modes from {', '.join(QUANT)}, got {value!r}")
    return modes


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=" ".join(__doc__.split("\n\n")[0].split()))
    p.add_argument(
        "--preset", type=preset, default="small", help="a built-in architecture with random weights (default: small)"
    )
    p.add_argument("--layers", type=int_in(1), default=None, help="keep only the first N layers")
    p.add_argument("--batch", type=int_in(1), nargs="+", default=[1, 16], help="decode batch sizes")
    p.add_argument("--top", type=int_in(1), default=12, help="kernels listed per profile (default: 12)")
    p.add_argument(
        "--modes",
        type=_modes,
        default=["bf16", "int8"],
        help="the modes, profiled in this order in one process (default: bf16,int8)",
    )
    args = p.parse_args(argv)
    if not torch.cuda.is_available():
        raise SystemExit("profile_int8_decode: needs a CUDA GPU")
    for name in args.modes:
        quant = QUANT[name]
        model = load({"preset": args.preset, "layers": args.layers}, quant, "bf16", "cuda")
        for batch in args.batch:
            cache = model.new_cache(batch, 64)
            prompt = torch.randint(2, 1000, (batch, 32), device="cuda")
            with torch.no_grad():
                nxt = model.prefill(prompt, cache)[:, -1].argmax(-1, keepdim=True)
                busy, n, rows = kernel_table(partial(GraphedDecoder(model, cache).step, nxt), 3)
            print(f"{name} batch {batch}: GPU busy {busy:.3f} ms per step, {n:.0f} kernels", flush=True)
            for kname, ms, k in rows[: args.top]:
                print(f"   {ms:7.3f} ms {k:6.1f}x {kname[:100]}", flush=True)
            del cache
        del model
        gc.collect()
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
