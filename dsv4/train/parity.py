"""Parity of the distributed training path against a single-process replica: `parity_check` (training
steps under FSDP2 + expert parallelism, the gradients and weights of every step compared),
`inference_check` (the expert-parallel inference modes), and the self-test command

    python -m dsv4.train.parity --selftest [--nproc 2] [--preset tiny] [--device cpu|cuda] [--deterministic]

which runs under torchrun or spawns its own gloo processes and judges the differences against the
arithmetic's tolerance (tight runs) or the spread of repeated single-process runs.
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import socket
import sys
from collections.abc import Callable

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from .distributed import (
    full_grads,
    full_state_dict,
    grad_norm,
    is_distributed,
    is_expert_param,
    moe_layers,
    setup_distributed,
    shard_experts,
    shard_model,
    teardown_distributed,
)


# ----------------------------------------------------------------------------- parity check
def _loss(out, tokens: torch.Tensor, mtp_weight: float = 0.3) -> torch.Tensor:
    """Next-token CE (+ weighted MTP CE + indexer loss + balance loss) - a self-contained check loss."""
    v = out.logits.size(-1)
    loss = F.cross_entropy(out.logits[:, :-1].reshape(-1, v), tokens[:, 1:].reshape(-1))
    if out.mtp_logits:
        m = out.mtp_logits[0]  # predicts t+2
        loss = loss + mtp_weight * F.cross_entropy(m[:, :-1].reshape(-1, v), tokens[:, 2:].reshape(-1))
    for extra in (out.indexer_loss, out.balance_loss):
        if extra is not None:
            loss = loss + extra
    return loss


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    """Norm-wise relative difference ||a - b|| / ||b|| (0 when both are zero)."""
    a, b = a.detach().float(), b.detach().float()
    diff = torch.linalg.vector_norm(a - b)
    return 0.0 if float(diff) == 0 else float(diff / torch.linalg.vector_norm(b).clamp_min(1e-30))


def _max_rel(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> tuple[float, str]:
    if a.keys() != b.keys():
        raise AssertionError(f"parameter sets differ: {sorted(a.keys() ^ b.keys())[:5]}")
    worst = max(((_rel(a[k], b[k]), k) for k in a), default=(0.0, ""))
    return worst


def parity_check(
    preset: str = "tiny",
    steps: int = 3,
    batch: int = 4,
    seq: int = 32,
    lr: float = 1e-3,
    optimizer: str = "adamw",
    seed: int = 0,
    device: torch.device | None = None,
    prepare: Callable[[nn.Module], None] | None = None,
    ep: bool = True,
    qat: bool = True,
    spread: bool = False,
) -> dict:
    """Train a single-process replica and the FSDP2 + expert-parallel model side by side on every rank.

    qat=False switches the FP8 / FP4 round trips off: they turn a rounding-sized difference (the order of
    a sum changes with the batch split) into a whole quantization step, which can flip an indexer top-k
    pick, after which the two runs differ by that discrete decision, not by rounding.

    Both start from the same seeded weights (`prepare(model)` may edit both before sharding; ep=False
    leaves the experts to FSDP like every other weight); the replica
    sees the whole global batch [batch, seq], each rank its slice. Reports per-step losses (the parallel
    one averaged over ranks), per-step worst norm-wise relative gradient difference over all parameters,
    the forward (logits) difference at step 0, the final parameter difference, the global grad norms of
    the last step and the expert range [lo, hi) this rank holds in every MoE layer.

    Differences are fp32 rounding from the changed summation order (batch split, reduce-scatter); AdamW
    magnifies them in parameters whose gradient is nearly zero, SGD does not.

    spread=True also trains a second single-process replica on the same global batch cut into the ranks'
    slices (micro-batches, gradients accumulated): the same arithmetic as the first replica up to the
    order of its sums, the kernels chosen for the smaller shapes and, on a GPU, the order of atomic
    additions. Its differences from the first replica ("spread_rel" per step, "param_spread") measure how
    far one device's run wanders by rounding alone - the yardstick for runs whose kernels are not
    deterministic.
    """
    from ..config import ModelConfig
    from ..model.transformer import DeepSeekV4

    device = device or torch.device("cpu")
    cfg = ModelConfig.preset(preset)
    if not qat:
        cfg = cfg.replace(fp8_kv_sim=False, fp4_indexer_sim=False)
    rank, world = (dist.get_rank(), dist.get_world_size()) if is_distributed() else (0, 1)
    if batch % world:
        raise ValueError(f"global batch {batch} must split evenly over {world} ranks")
    gen = torch.Generator().manual_seed(seed + 1)
    data = torch.randint(0, cfg.vocab_size, (steps, batch, seq), generator=gen).to(device)
    per = batch // world

    # one seeded init, copied: the init draws every weight on the host, which at `small` costs more than
    # the whole check on a GPU
    ref = DeepSeekV4.from_config(cfg, seed=seed).to(device)
    par = copy.deepcopy(ref)
    alt = copy.deepcopy(ref) if spread else None
    if prepare is not None:
        prepare(ref), prepare(par)
        if alt is not None:
            prepare(alt)
    par = shard_model(par, ep=ep)
    ranges = [(int(m.experts.offset), int(m.experts.offset + m.experts.w1.size(0))) for m in moe_layers(par)]

    def make_opt(model: nn.Module) -> torch.optim.Optimizer:
        # expert (plain) and FSDP (DTensor) parameters in separate groups: foreach kernels need one kind
        ps = list(model.parameters())
        groups = [[p for p in ps if is_expert_param(p)], [p for p in ps if not is_expert_param(p)]]
        groups = [g for g in groups if g]
        if optimizer == "sgd":
            return torch.optim.SGD([{"params": g} for g in groups], lr=lr)
        return torch.optim.AdamW([{"params": g} for g in groups], lr=lr, weight_decay=0.01)

    opt_ref, opt_par = make_opt(ref), make_opt(par)
    opt_alt = make_opt(alt) if alt is not None else None
    kw = {"mtp": True, "indexer_loss": True, "balance_alpha": 1e-3}
    report: dict = {
        "rank": rank,
        "world": world,
        "expert_ranges": ranges,
        "loss_ref": [],
        "loss_par": [],
        "grad_rel": [],
        "grad_worst": [],
        "spread_rel": [],
        "spread_worst": [],
    }
    for step in range(steps):
        tokens = data[step]
        local = tokens[rank * per : (rank + 1) * per]
        ref.train(), par.train()
        out_ref = ref(tokens, **kw)
        out_par = par(local, **kw)
        if step == 0:
            report["forward_rel"] = _rel(out_par.logits, out_ref.logits[rank * per : (rank + 1) * per])
        loss_ref, loss_par = _loss(out_ref, tokens), _loss(out_par, local)
        loss_ref.backward()
        loss_par.backward()
        glob = loss_par.detach().clone()
        if world > 1:
            dist.all_reduce(glob)
            glob /= world
        report["loss_ref"].append(float(loss_ref.detach()))
        report["loss_par"].append(float(glob))
        ref_grads = {n: p.grad for n, p in ref.named_parameters() if p.grad is not None}
        rel, name = _max_rel(full_grads(par), ref_grads)
        report["grad_rel"].append(rel)
        report["grad_worst"].append(name)
        if alt is not None:
            alt.train()
            loss_alt = 0.0
            for r in range(world):  # the ranks' slices, one after the other
                part = tokens[r * per : (r + 1) * per]
                mb = _loss(alt(part, **kw), part) / world
                mb.backward()
                loss_alt += float(mb.detach())
            report["loss_spread"] = max(
                report.get("loss_spread", 0.0), abs(loss_alt - report["loss_ref"][-1]) / abs(report["loss_ref"][-1])
            )
            rel, name = _max_rel({n: p.grad for n, p in alt.named_parameters() if p.grad is not None}, ref_grads)
            report["spread_rel"].append(rel)
            report["spread_worst"].append(name)
            opt_alt.step()
            opt_alt.zero_grad(set_to_none=True)
        report["grad_norm_ref"] = float(
            torch.nn.utils.get_total_norm([p.grad for p in ref.parameters() if p.grad is not None])
        )
        report["grad_norm_par"] = float(grad_norm(par))
        opt_ref.step(), opt_par.step()
        opt_ref.zero_grad(set_to_none=True), opt_par.zero_grad(set_to_none=True)
    report["param_rel"] = _max_rel(full_state_dict(par), {k: v for k, v in ref.state_dict().items()})[0]
    if alt is not None:
        report["param_spread"] = _max_rel(dict(alt.state_dict()), dict(ref.state_dict()))[0]
    report["loss_rel"] = max(abs(a - b) / abs(a) for a, b in zip(report["loss_par"], report["loss_ref"]))
    return report


def inference_check(
    preset: str = "tiny",
    seed: int = 0,
    prompt_len: int = 24,
    new_tokens: int = 4,
    modes: tuple[str, ...] = ("all_reduce", "all_to_all"),
    device: torch.device | None = None,
) -> dict:
    """Logits of a fixed prompt set from expert-split models vs a full replica (full forward, prefill and
    every greedy decode step) and `generate`'s greedy continuations. Every rank holds the same prompts.
    Returns {mode: {"forward_rel", "decode_rel", "greedy_equal", "expert_ranges"}}."""
    from ..config import ModelConfig
    from ..engine import generate
    from ..model.transformer import DeepSeekV4

    device = device or torch.device("cpu")
    cfg = ModelConfig.preset(preset)
    gen = torch.Generator().manual_seed(seed + 2)
    prompts = torch.randint(0, cfg.vocab_size, (2, prompt_len), generator=gen).to(device)

    @torch.no_grad()
    def run(model: nn.Module) -> tuple[torch.Tensor, list[torch.Tensor], list[list[int]]]:
        full = model(prompts).logits  # [b, s, V]
        cache = model.new_cache(prompts.size(0), max_len=prompt_len + new_tokens)
        steps = [model.prefill(prompts, cache)]  # [b, 1, V] each
        for _ in range(new_tokens - 1):
            steps.append(model.decode_step(steps[-1][:, -1].argmax(-1, keepdim=True), cache))
        # eager decode: the all-to-all exchange reads its split sizes on the host, so it cannot be captured
        # in a CUDA graph
        greedy = generate(model, prompts.tolist(), max_new_tokens=new_tokens, stop_at_eos=False)
        return full, steps, greedy

    base = DeepSeekV4.from_config(cfg, seed=seed).to(device).eval()
    f_ref, s_ref, g_ref = run(base)
    report: dict = {}
    for mode in modes:
        par = copy.deepcopy(base)
        if is_distributed():
            shard_experts(par, dist.new_group(list(range(dist.get_world_size()))), mode=mode)
        f_par, s_par, g_par = run(par)
        report[mode] = {
            "forward_rel": _rel(f_par, f_ref),
            "decode_rel": max(_rel(a, b) for a, b in zip(s_par, s_ref)),
            "greedy_equal": g_par == g_ref,
            "expert_ranges": [
                (int(m.experts.offset), int(m.experts.offset + m.experts.w1.size(0))) for m in moe_layers(par)
            ],
        }
    return report


# ----------------------------------------------------------------------------- command line
def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


SPREAD_FACTOR = 10.0
"""Selftest mode "spread" (a GPU's default kernels, or the QAT round trips on): the parallel run may differ
from the single-process replica by up to this many times the single-device spread (see
`parity_check(spread=True)`). Both are rounding walks of the same size per step; the parallel one adds the
reduce-scatter's and the expert exchange's summation orders, and the worst of thousands of parameters is
taken on each side. A real fault (a missing reduction, a rank-local parameter, a mis-scaled gradient)
moves gradients by tens of percent, far above this bound whenever the spread is small; the selftest prints
the spread so a large one is seen."""


def _deterministic_mode() -> None:
    """Bit-identical repeats on a GPU: cuBLAS's fixed workspace, torch's deterministic algorithms (the
    expert exchange's index_add then sorts instead of using atomics) and the ops backends' deterministic
    variants (the sparse-attention backward's two-pass reduction instead of fp32 atomics)."""
    from .. import ops

    os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
    ops.set_deterministic(True)
    torch.use_deterministic_algorithms(True)


def _selftest(args: argparse.Namespace) -> dict:
    rank, world, dev = setup_distributed(device=args.device)
    say = (lambda m: print(f"selftest: {m}", file=sys.stderr, flush=True)) if rank == 0 else (lambda m: None)
    say(f"{world} processes on {dev.type}, preset {args.preset}, training parity")
    if args.deterministic:
        _deterministic_mode()
    qat = args.qat == "on"
    torch.manual_seed(0)
    try:
        train = parity_check(
            args.preset,
            steps=args.steps,
            batch=args.batch,
            seq=args.seq,
            lr=args.lr,
            optimizer=args.optimizer,
            device=dev,
            qat=qat,
            spread=True,
        )
        say("inference parity")
        infer = inference_check(args.preset, device=dev)
    finally:
        teardown_distributed()
    exact = (dev.type == "cpu" or args.deterministic) and not qat
    mode = "tight" if exact else "spread"
    return {
        "mode": mode,
        "device": dev.type,
        "deterministic": bool(args.deterministic),
        "qat": qat,
        "train": train,
        "inference": infer,
    }


def _allowed(res: dict, tol: float) -> dict:
    """The differences the selftest accepts. Mode "tight" (deterministic kernels - the CPU, or a GPU with
    --deterministic - and no QAT round trips): `tol` for first-step gradients, losses, logits and final
    parameters, 100 x tol for later gradients (near-zero gradients carry rounding noise). Mode "spread"
    (a GPU's default kernels, with atomics, or the QAT round trips, which turn rounding into whole
    quantization steps): gradients and final parameters may also differ by SPREAD_FACTOR x the
    single-device spread measured in the same run."""
    train = res["train"]
    grads = [tol if i == 0 else 100 * tol for i in range(len(train["grad_rel"]))]
    params = loss = tol
    if res.get("mode") == "spread":
        worst = 0.0
        for i, s in enumerate(train["spread_rel"]):
            worst = max(worst, s)
            grads[i] = max(grads[i], SPREAD_FACTOR * worst)
        params = max(params, SPREAD_FACTOR * train.get("param_spread", 0.0))
        loss = max(loss, SPREAD_FACTOR * train.get("loss_spread", 0.0))
    return {"grad_rel": grads, "param_rel": params, "loss_rel": loss}


def _selftest_ok(res: dict, tol: float) -> bool:
    train, rank = res["train"], res["train"]["rank"]
    infer = list(res["inference"].values())
    ranges = train["expert_ranges"] + [r for m in infer for r in m["expert_ranges"]]
    n_local = ranges[0][1] - ranges[0][0]
    ranges_ok = all(tuple(r) == (rank * n_local, (rank + 1) * n_local) for r in ranges)  # docs/bugzoo.md Z08
    allowed = _allowed(res, tol)
    res["allowed"] = allowed
    train_ok = (
        all(g < a for g, a in zip(train["grad_rel"], allowed["grad_rel"]))
        and train["param_rel"] < allowed["param_rel"]
        and max(train["loss_rel"], train["forward_rel"]) < allowed["loss_rel"]
    )
    infer_ok = all(max(m["forward_rel"], m["decode_rel"]) < tol and m["greedy_equal"] for m in infer)
    return ranges_ok and train_ok and infer_ok


def _summary(res: dict, ok: bool) -> str:
    """One line for a log: mode, worst differences, the spread and what was allowed."""
    t, a = res["train"], res.get("allowed", {})
    fmt = lambda xs: "[" + ", ".join(f"{x:.2e}" for x in xs) + "]"  # noqa: E731
    return (
        f"selftest {'ok' if ok else 'FAILED'} mode={res.get('mode')} device={res.get('device')} "
        f"deterministic={res.get('deterministic')} qat={res.get('qat')} "
        f"loss_rel={t['loss_rel']:.2e} forward_rel={t['forward_rel']:.2e} grad_rel={fmt(t['grad_rel'])} "
        f"allowed={fmt(a.get('grad_rel', []))} spread={fmt(t.get('spread_rel', []))} "
        f"param_rel={t['param_rel']:.2e} param_spread={t.get('param_spread', 0.0):.2e} "
        f"worst={t['grad_worst']}"
    )


def _spawned(rank: int, world: int, port: int, args: argparse.Namespace, out_dir: str) -> None:
    os.environ.update(
        RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port)
    )
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // world))
    res = _selftest(args)
    with open(os.path.join(out_dir, f"rank{rank}.json"), "w") as f:
        json.dump(res, f)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        prog="python -m dsv4.train.distributed",
        description="FSDP2 + expert-parallel parity self-test against a "
        "single-process replica. Under torchrun it uses the launched "
        "ranks; otherwise it spawns --nproc gloo processes on the CPU.",
    )
    p.add_argument("--selftest", action="store_true", required=True)
    p.add_argument("--preset", default="tiny")
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--batch", type=int, default=4, help="global batch (sequences)")
    p.add_argument("--seq", type=int, default=32)
    p.add_argument("--optimizer", choices=("sgd", "adamw"), default="sgd")
    p.add_argument("--lr", type=float, default=0.1)
    p.add_argument("--nproc", type=int, default=2, help="processes to spawn when not under torchrun")
    p.add_argument("--device", default=None, help="cpu or cuda (default: cuda when available)")
    p.add_argument(
        "--deterministic",
        action="store_true",
        help="deterministic kernels (no atomics): judged by --tol alone; without it a GPU run "
        "is judged against the single-device spread as well",
    )
    p.add_argument(
        "--qat",
        choices=("on", "off"),
        default="off",
        help="FP8 / FP4 round trips in the parity run (default off: they turn a rounding-sized "
        "difference into a whole quantization step; 'on' is judged against the spread)",
    )
    p.add_argument(
        "--tol",
        type=float,
        default=1e-4,
        help="max relative difference allowed in losses, logits and final parameters (and "
        "first-step gradients; later steps get 100x: near-zero gradients carry rounding "
        "noise)",
    )
    args = p.parse_args(argv)

    if "WORLD_SIZE" in os.environ:
        results = [_selftest(args)]
    else:
        import tempfile

        import torch.multiprocessing as mp

        args.device = "cpu"
        with tempfile.TemporaryDirectory() as tmp:
            mp.spawn(_spawned, args=(args.nproc, _free_port(), args, tmp), nprocs=args.nproc)
            results = []
            for r in range(args.nproc):
                with open(os.path.join(tmp, f"rank{r}.json")) as f:
                    results.append(json.load(f))
    ok = all(_selftest_ok(r, args.tol) for r in results)
    if int(os.environ.get("RANK", "0")) == 0:
        print(json.dumps({"ok": ok, "ranks": results}, indent=1))
        print(_summary(results[0], ok))
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
