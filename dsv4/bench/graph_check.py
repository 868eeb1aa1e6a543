"""CUDA-graph replays vs eager execution of the same model (CUDA only).

- prefill: `GraphedPrefill` logits vs `model.prefill` on a fresh cache (and two replays bit-identical);
- decode: greedy tokens of `GraphedDecoder`, continuing from the graphed prefill's cache, vs eager
  `decode_step` continuing from the eager cache;
- training: `GraphedBackward` (fp32 master weights, bf16 autocast, every loss) vs eager forward + backward
  over several steps with Muon + AdamW, clipping and the router-bias update in between: per-step loss and
  the largest relative gradient difference, beside a second eager copy that measures the kernels' own
  run-to-run nondeterminism. A stale weight inside a captured graph (e.g. a cached copy of a parameter
  made at capture time) shows up here from the second step on.

    python3 -m dsv4.bench.graph_check [--presets tiny small] [--steps 3]

Exit status 1 when a check fails (tolerances: prefill logits and per-step losses within bf16 rounding of the
eager values, decode tokens identical).
"""

from __future__ import annotations

import argparse
import json
import os

import torch

from .. import ops
from ..config import ModelConfig
from ..errors import UserError
from ..model import DeepSeekV4
from ..train import balance
from ..train.graphed import GraphedBackward
from ..train.losses import total_loss
from ..train.optim import MuonAdamW, OptimConfig
from .graphs import GraphedDecoder, GraphedPrefill
from .report import refused, require_cuda


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.float(), b.float()
    return float((a - b).abs().max() / b.abs().max().clamp_min(1e-30))


@torch.no_grad()
def check_inference(cfg: ModelConfig, dev: torch.device, seq: int = 256, new: int = 16) -> dict:
    torch.manual_seed(0)
    model = DeepSeekV4(cfg, dtype=torch.bfloat16, device=dev).eval()
    tokens = torch.randint(2, cfg.vocab_size, (2, seq), device=dev)
    cache = model.new_cache(2, seq + new + 8)
    eager = model.prefill(tokens, cache, last_only=False).clone()
    graphed = GraphedPrefill(model, 2, seq, seq + new + 8, last_only=False)
    first = graphed.run(tokens).clone()
    second = graphed.run(tokens).clone()
    nxt_e = nxt_g = eager[:, -1].argmax(-1, keepdim=True)
    decoder = GraphedDecoder(model, graphed.cache)
    out_e, out_g = [], []
    for _ in range(new):
        nxt_e = model.decode_step(nxt_e, cache)[:, -1].argmax(-1, keepdim=True)
        nxt_g = decoder.step(nxt_g)[:, -1].argmax(-1, keepdim=True)
        out_e.append(nxt_e)
        out_g.append(nxt_g)
    same_tokens = bool(torch.equal(torch.cat(out_e, 1), torch.cat(out_g, 1)))
    err = _rel(first, eager)
    return {
        "prefill_rel_err": err,
        "prefill_replays_identical": bool(torch.equal(first, second)),
        "decode_tokens_identical": same_tokens,
        "ok": err <= 2e-2 and bool(torch.equal(first, second)) and same_tokens,
    }


def check_training(cfg: ModelConfig, dev: torch.device, steps: int = 3, batch: int = 2, seq: int = 512) -> dict:
    """Three copies of one model: two trained eagerly, one through the graph, in deterministic mode.

    eager vs eager measures what the run-to-run nondeterminism of the kernels leaves (Muon turns tiny
    gradient differences of near-zero gradients into visible update differences); graph vs eager must
    stay within it (a stale captured weight shows as a loss gap from the second step on)."""
    torch.manual_seed(0)
    models = [DeepSeekV4(cfg, dtype=torch.float32, device=dev).train() for _ in range(3)]
    for m in models[1:]:
        m.load_state_dict(models[0].state_dict())
    eager, eager2, graphed = models
    optims = [MuonAdamW(m, OptimConfig(lr=1e-3)) for m in models]
    mtp = cfg.n_mtp_layers > 0 and not cfg.dspark  # (a DSpark draft trains through model.dspark)
    gen = torch.Generator().manual_seed(1)
    batches = [torch.randint(2, cfg.vocab_size, (batch, seq), generator=gen).to(dev) for _ in range(steps)]

    def loss_fn(x: torch.Tensor) -> dict[str, torch.Tensor]:
        return {"loss": total_loss(graphed(x, mtp=mtp, indexer_loss=True), x).total}

    def eager_loss(m: DeepSeekV4, x: torch.Tensor) -> float:
        with torch.autocast("cuda", dtype=torch.bfloat16):
            loss = total_loss(m(x, mtp=mtp, indexer_loss=True), x).total
        loss.backward()
        return float(loss.detach())

    def grad_gap(a: DeepSeekV4, b: DeepSeekV4) -> float:
        return max(
            _rel(pb.grad, pa.grad)
            for pa, pb in zip(a.parameters(), b.parameters())
            if pa.grad is not None and pa.grad.abs().max() > 0
        )

    step = GraphedBackward(graphed, loss_fn, batches[0], torch.bfloat16)
    rows = []
    for x in batches:
        le, le2 = eager_loss(eager, x), eager_loss(eager2, x)
        lg = float(step.run(x)["loss"])
        rows.append(
            {
                "loss_eager": le,
                "loss_eager2": le2,
                "loss_graph": lg,
                "grad_gap_eager2": grad_gap(eager, eager2),
                "grad_gap_graph": grad_gap(eager, graphed),
            }
        )
        for m, opt in zip(models, optims):
            torch.nn.utils.clip_grad_norm_(m.parameters(), 1.0)
            opt.step()
            balance.update_bias(m, 1e-3)
            opt.zero_grad()
    noise = max(abs(r["loss_eager2"] - r["loss_eager"]) for r in rows)
    ok = all(abs(r["loss_graph"] - r["loss_eager"]) <= 4 * noise + 1e-5 * abs(r["loss_eager"]) for r in rows)
    return {"steps": rows, "ok": ok}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--presets", nargs="+", default=["tiny", "small"])
    p.add_argument("--steps", type=int, default=3)
    args = p.parse_args(argv)
    os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")  # before cuBLAS starts: fixed GEMM order
    try:
        dev = require_cuda("python3 -m dsv4.bench.graph_check", "it compares CUDA-graph replays with eager runs")
    except UserError as e:
        return refused(e)
    ops.set_deterministic(True)  # bit-repeatable backends where they offer it
    ok = True
    for preset in args.presets:
        cfg = ModelConfig.preset(preset)
        for name, fn in (("inference", check_inference), ("training", check_training)):
            res = fn(cfg, dev) if name == "inference" else fn(cfg, dev, steps=args.steps)
            ok &= res["ok"]
            print(json.dumps({"preset": preset, "check": name, **res}), flush=True)
            torch.cuda.empty_cache()
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
