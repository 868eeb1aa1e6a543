"""`dsv4 bench prefill|decode|train`: end-to-end tokens/s of the model, fast backends vs the torch reference.

Both paths run the same randomly initialised model in the same process: "reference" inside
`dsv4.ops.use_backend("reference")` (every op its plain-torch definition), "fast" with the default backend
of each op on the device (the ops that ran are listed from `dsv4.ops.calls()`, so a silent fallback shows).

- prefill: `model.prefill(tokens [b, s], cache)`; tokens/s = b*s / time. On CUDA the fast path replays
  it from a CUDA graph (`GraphedPrefill`, a fresh cache restored inside the graph); `--no-cuda-graph`
  launches it eagerly.
- decode: after an untimed prompt, `model.decode_step` one token at a time; tokens/s = b*steps / time.
  On CUDA the fast path replays the step from a CUDA graph (`GraphedDecoder`; `--no-cuda-graph`: eager).
  `--profile` adds, per step: CUDA kernels launched, GPU-busy time, and host syncs (the decode path's
  limits: a launch-bound step is short on GPU time and long on the host).
- train: forward + cross-entropy + backward on [b, s] tokens; with --optimizer the full training step of
  `dsv4 train` (fp32 master weights, bf16 autocast, all losses, clipping, Muon + AdamW, bias update).
  `--cuda-graph` replays forward + losses + backward from one graph (`GraphedBackward`) and, with
  --optimizer, the update (clipping, Muon + AdamW, router bias) from a second one captured at the second
  step (`ReplayAfterFirst`), as `dsv4 train --cuda-graph` does. `--grad-accum N`: N micro-batches of [b, s]
  a step, their gradients summed (the graph adds into its gradient buffers), one update. tokens/s =
  N*b*s / time; MFU from the config's active FLOPs per token (`dsv4.train.metrics`).
  `--optimizer-only` times the optimizer part of that step alone, on random gradients and expert loads:
  gradient norm and clipping, the non-finite check, Muon + AdamW and the router-bias update, as
  `Trainer.train_step` runs them ("fast": `OptimConfig(fast=True)`, one device read; with --cuda-graph
  the update replayed from a CUDA graph after the norm's read) against the previous step ("old":
  `fast=False`, torch's per-matrix Muon, torch's default AdamW, a host read per gradient); ms per step,
  and which Muon / AdamW implementation ran.

The reference path always runs eagerly. For graphed paths, the backends listed are those recorded while
the graph was captured (a replay runs the captured kernels and records nothing).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import time
import warnings

import torch
import torch.nn.functional as F

from .. import argtypes, ops, options
from ..config import ModelConfig
from ..errors import UserError
from .device_profile import kernel_table
from .report import add_output_args, emit, require_cuda


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _timed_reps(fn, device: torch.device, reps: int, setup=None) -> list[float]:
    """Wall seconds of each of reps calls of fn(state), sorted (setup() builds a fresh state, untimed)."""
    times = []
    for _ in range(reps):
        state = setup() if setup is not None else None
        _sync(device)
        t0 = time.perf_counter()
        fn(state)
        _sync(device)
        times.append(time.perf_counter() - t0)
    return sorted(times)


def _path(name: str):
    return ops.use_backend("reference") if name == "reference" else contextlib.nullcontext()


def _backends_used() -> dict[str, list[str]]:
    used: dict[str, list[str]] = {}
    for (op, be), _n in sorted(ops.calls().items()):
        used.setdefault(op, []).append(be)
    return used


def _count_syncs(fn) -> int:
    """Host<->device synchronisations fn() triggers (CUDA sync debug mode)."""
    if not torch.cuda.is_available():
        return -1
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        try:
            fn()
        finally:
            torch.cuda.set_sync_debug_mode(0)
    return sum("synchroniz" in str(w.message).lower() for w in caught)


def _profile_step(fn, steps: int, top: int = 15) -> dict:
    """Per call: CUDA kernels launched, their summed GPU time (ms), and the `top` kernels by GPU time as
    [name, ms per call, launches per call] (where the time goes)."""
    busy, n, rows = kernel_table(fn, steps)
    return {
        "kernels_per_step": round(n, 1),
        "gpu_busy_ms_per_step": round(busy, 3),
        "top_kernels": [[name[:100], round(ms, 4), round(k, 1)] for name, ms, k in rows[:top]],
    }


def build_model(preset: str | ModelConfig, device: torch.device, dtype: torch.dtype, seed: int = 0):
    from ..model import DeepSeekV4

    cfg = preset if isinstance(preset, ModelConfig) else ModelConfig.preset(preset)
    torch.manual_seed(seed)
    return DeepSeekV4(cfg, dtype=dtype, device=device)


def _tokens(cfg: ModelConfig, b: int, s: int, device: torch.device, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(2, cfg.vocab_size, (b, s), generator=g).to(device)


# ----------------------------------------------------------------------------- the three benchmarks
def _graphed(args, device: torch.device, path: str) -> bool:
    return path != "reference" and device.type == "cuda" and getattr(args, "cuda_graph", True)


def bench_prefill(model, args, device, path: str) -> dict:
    tokens = _tokens(model.cfg, args.batch, args.seq, device)
    max_len = args.seq + 8
    graphed = _graphed(args, device, path)
    with _path(path), torch.no_grad():
        if graphed:
            from .graphs import GraphedPrefill

            ops.reset_calls()
            prefill = GraphedPrefill(model, args.batch, args.seq, max_len)  # warm-up + capture
            used = _backends_used()  # what the graph replays
            reps = _timed_reps(lambda _: prefill.run(tokens), device, args.reps)
        else:

            def run(cache):
                model.prefill(tokens, cache)

            run(model.new_cache(args.batch, max_len))  # warm-up (compiles, autotunes)
            ops.reset_calls()
            reps = _timed_reps(run, device, args.reps, setup=lambda: model.new_cache(args.batch, max_len))
            used = _backends_used()
    sec = reps[len(reps) // 2]
    return {
        "bench": "prefill",
        "path": path,
        "batch": args.batch,
        "seq": args.seq,
        "s": round(sec, 4),
        "tokens_per_s": round(args.batch * args.seq / sec, 1),
        "s_reps": [round(t, 5) for t in reps],
        "cuda_graph": graphed,
        "backends": used,
    }


def bench_decode(model, args, device, path: str) -> dict:
    prompt = _tokens(model.cfg, args.batch, args.prompt, device)
    max_len = args.prompt + args.steps * (args.reps + 2) + 8
    with _path(path), torch.no_grad():
        cache = model.new_cache(args.batch, max_len)
        logits = model.prefill(prompt, cache)
        nxt = logits[:, -1].argmax(-1, keepdim=True)
        model.decode_step(nxt, cache)  # warm-up
        state = {"nxt": nxt}
        graphed = _graphed(args, device, path)
        ops.reset_calls()
        if graphed:
            from .graphs import GraphedDecoder

            step = GraphedDecoder(model, cache).step
            used = _backends_used()  # what the graph replays
        else:

            def step(tokens):
                return model.decode_step(tokens, cache)

        def run(_):
            for _ in range(args.steps):
                state["nxt"] = step(state["nxt"])[:, -1].argmax(-1, keepdim=True)

        reps = _timed_reps(run, device, args.reps)
        sec = reps[len(reps) // 2]
        if not graphed:
            used = _backends_used()
        row = {
            "bench": "decode",
            "path": path,
            "batch": args.batch,
            "prompt": args.prompt,
            "steps": args.steps,
            "s": round(sec, 4),
            "tokens_per_s": round(args.batch * args.steps / sec, 2),
            "ms_per_step": round(sec / args.steps * 1e3, 3),
            "s_reps": [round(t, 5) for t in reps],
            "cuda_graph": graphed,
            "backends": used,
        }
        if args.profile and device.type == "cuda":

            def one():
                state["nxt"] = step(state["nxt"])[:, -1].argmax(-1, keepdim=True)

            row.update(_profile_step(one, 3))
            row["host_syncs_per_step"] = _count_syncs(one)
    return row


def bench_train(model, args, device, path: str) -> dict:
    """Forward + cross-entropy + backward on a bf16 model, or with --optimizer the whole step of
    `dsv4 train`: fp32 master weights under bf16 autocast, every loss the config has (MTP, indexer KL),
    gradient clipping, the Muon + AdamW step and the router bias update."""
    from ..train import balance
    from ..train.casts import StepCasts
    from ..train.losses import total_loss
    from ..train.metrics import peak_tflops, train_flops_per_token
    from ..train.optim import MuonAdamW, OptimConfig

    cfg = model.cfg
    n_micro = getattr(args, "grad_accum", None) or 1
    batches = [_tokens(cfg, args.batch, args.seq, device, seed=i) for i in range(n_micro)]  # a step's micro-batches
    tokens = batches[0]
    model.train()
    head = getattr(args, "head_precision", None) or "fp32"
    model.set_options(
        activation_checkpointing=bool(getattr(args, "activation_checkpointing", False)), head_precision=head
    )
    full = bool(getattr(args, "optimizer", False))
    mtp = full and cfg.n_mtp_layers > 0 and not cfg.dspark
    opt = MuonAdamW(model, OptimConfig(lr=1e-4)) if full else None
    autocast = torch.autocast(device_type=device.type, dtype=torch.bfloat16) if full else contextlib.nullcontext()
    per_use = getattr(args, "per_use_casts", False)
    casts = StepCasts.attach(model, device, head) if full and not per_use else None  # (as `dsv4 train`)
    if casts is None:
        model.set_options(expert_casts=False)  # (cast at each use)

    def loss_fn(batch: torch.Tensor) -> dict[str, torch.Tensor]:
        if full:
            return {"loss": total_loss(model(batch, mtp=mtp, indexer_loss=True), batch).total}
        logits = model(batch).logits[:, :-1].float()
        return {"loss": F.cross_entropy(logits.reshape(-1, logits.size(-1)), batch[:, 1:].reshape(-1))}

    def update() -> None:
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        balance.update_bias(model, 1e-3)
        if casts is not None:
            casts.refresh()

    def optimizer_step() -> None:
        if opt is not None:
            update()
            opt.zero_grad()
        else:
            model.zero_grad(set_to_none=True)

    def eager_step(_):
        for batch in batches:
            with autocast:
                loss = loss_fn(batch)["loss"]
            (loss if n_micro == 1 else loss / n_micro).backward()
        optimizer_step()

    graphed = path != "reference" and device.type == "cuda" and bool(getattr(args, "cuda_graph", False))
    try:
        with _path(path):
            if graphed:
                from ..train.graphed import GraphedBackward

                ops.reset_calls()
                graph = GraphedBackward(
                    model,
                    loss_fn,
                    tokens,
                    torch.bfloat16 if full else None,
                    accumulate=n_micro > 1,
                    loss_scale=1.0 / n_micro,
                )
                used = _backends_used()  # what the graph replays

                if opt is not None:  # the update replayed too, from the second call on
                    from ..train.graphed import ReplayAfterFirst

                    replay = ReplayAfterFirst(update)

                def step(_):
                    for i, batch in enumerate(batches):
                        graph.run(batch, zero=i == 0)
                    if opt is not None:
                        replay()
                        opt.zero_grad()

                step(None)  # eager update (optimizer state), then the capture
                step(None)
            else:
                step = eager_step
                step(None)  # warm-up
                ops.reset_calls()
            reps = _timed_reps(step, device, args.reps)
            sec = reps[len(reps) // 2]
            if not graphed:
                used = _backends_used()
            profiled = _profile_step(lambda: step(None), 3) if args.profile and device.type == "cuda" else {}
    finally:
        model.eval()
        model.set_options(activation_checkpointing=False, head_precision="fp32", expert_casts=False)
        if casts is not None:
            casts.close()
    tok_s = n_micro * args.batch * args.seq / sec
    row = {
        "bench": "train",
        "path": path,
        "step": "full" if full else "fwd+bwd",
        "batch": args.batch,
        "seq": args.seq,
        "grad_accum": n_micro,
        "head_precision": head if full else "fp32",  # (an option of autocast: --optimizer)
        "s": round(sec, 4),
        "tokens_per_s": round(tok_s, 1),
        "cuda_graph": graphed,
        "s_reps": [round(t, 5) for t in reps],
        "activation_checkpointing": bool(getattr(args, "activation_checkpointing", False)),
        "weight_casts": ("per step" if casts is not None else "per use") if full else None,
        "backends": used,
    }
    if opt is not None:
        row["optimizer"] = opt.implementation | {"graphed": graphed}
    row.update(profiled)
    peak = peak_tflops(device, getattr(args, "peak_tflops", None))
    flops = train_flops_per_token(cfg, args.seq, mtp=mtp)
    row["model_tflops"] = round(flops * tok_s / 1e12, 2)
    if peak:
        row["mfu"] = round(flops * tok_s / 1e12 / peak, 4)
        row["peak_tflops"] = peak
    return row


def _old_clip(model, max_norm: float) -> tuple[int, float]:
    """The clipping of the previous training step: a non-finite count read per gradient, torch's clipping,
    the norm read back."""
    grads = [p.grad for p in model.parameters() if p.grad is not None]
    nonfinite = int(sum(int((~torch.isfinite(g)).sum()) for g in grads))
    return nonfinite, float(torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm))


def _fast_clip(model, max_norm: float) -> tuple[int, float]:
    """The clipping of `Trainer.train_step`: device norm and coefficient, one read of the norm."""
    from ..train import clipping

    params = list(model.parameters())
    total = clipping.total_norm([p.grad for p in params if p.grad is not None], params[0].device)
    gnorm = float(total.to("cpu", copy=True))
    clipping.clip_(params, max_norm, total)
    return (0 if gnorm == gnorm and abs(gnorm) != float("inf") else -1), gnorm


def bench_optimizer(model, args, device, path: str) -> dict:
    """The optimizer part of a training step alone (clipping, Muon + AdamW, router-bias update) on fixed
    random gradients and expert loads: path "fast" is `OptimConfig(fast=True)` with the trainer's clipping,
    "old" the previous step (`fast=False`, a host read per gradient)."""
    from ..train import balance
    from ..train.optim import MuonAdamW, OptimConfig

    fast = path == "fast"
    gen = torch.Generator().manual_seed(0)
    for p in model.parameters():
        p.grad = (torch.randn(p.shape, generator=gen) * 1e-2).to(device)
    for m in model.modules():
        if hasattr(m, "gate") and hasattr(m, "load") and hasattr(m, "n_experts"):
            m.set_load(torch.randint(0, 1000, (m.n_experts,), generator=gen).to(device))
    opt = MuonAdamW(model, OptimConfig(lr=1e-4, fast=fast))
    clip = _fast_clip if fast else _old_clip
    graphed = fast and device.type == "cuda" and bool(getattr(args, "cuda_graph", False))

    def step(_=None) -> None:
        nonfinite, _norm = clip(model, 1.0)
        if nonfinite == 0:
            opt.step()
            balance.update_bias(model, 1e-3)

    step()  # warm-up: state, kernels
    if graphed:  # as `dsv4 train --cuda-graph` runs it: the norm read, then the captured update
        from ..train import clipping
        from ..train.graphed import GraphedUpdate

        params = list(model.parameters())
        total = clipping.total_norm([p.grad for p in params], device)

        def update() -> None:
            clipping.clip_(params, 1.0, total)
            opt.step()
            balance.update_bias(model, 1e-3)

        captured = GraphedUpdate(update)

        def step(_=None) -> None:  # noqa: F811  (the graphed step replaces the eager one)
            total.copy_(clipping.total_norm([p.grad for p in params], device))
            norm = float(total.to("cpu", copy=True))
            if norm == norm and abs(norm) != float("inf"):
                captured()

    reps = _timed_reps(step, device, args.reps)
    sec = reps[len(reps) // 2]
    n_muon = len(opt.muon_params)
    impl = opt.implementation
    from ..train import metrics
    from ..train.muon_batched import newton_schulz_flops

    # the Newton-Schulz products alone, and the time they take at the device's bf16 peak: a floor of the step
    ns = newton_schulz_flops([tuple(p.shape[-2:]) for p in opt.muon_params])
    peak = metrics.peak_tflops(device, None)
    row = {
        "bench": "train",
        "path": path,
        "step": "optimizer",
        "s": round(sec, 5),
        "s_reps": [round(t, 5) for t in reps],
        "ms_per_step": round(sec * 1e3, 3),
        "muon_matrices": n_muon,
        "newton_schulz_flops": ns,
        "newton_schulz_ms_at_peak": round(ns / (peak * 1e12) * 1e3, 3) if peak else None,
        "adamw_tensors": len(opt.adamw_names),
        "muon": impl["muon"],
        "adamw": impl["adamw"],
        "cuda_graph": graphed,
        "backends": {},
    }
    if args.profile and device.type == "cuda":
        row.update(_profile_step(step, 3))
        row["host_syncs_per_step"] = _count_syncs(step)
    for p in model.parameters():
        p.grad = None
    return row


def _bench_config(args: argparse.Namespace) -> str | ModelConfig:
    """--preset, or with `bench train --train-config FILE` the model that recipe trains (its preset or
    config.json with its [model] overrides, as `dsv4 train` builds it)."""
    recipe = getattr(args, "train_config", None)
    if not recipe:
        return args.preset
    from ..train.settings import TrainConfig, model_config_of

    c = TrainConfig.from_file(recipe)
    if c.init_from:
        raise UserError(f"--train-config {recipe}: continues a checkpoint (init_from); time its preset instead")
    return model_config_of(c)


_BENCHES = {"prefill": bench_prefill, "decode": bench_decode, "train": bench_train}
_DEFAULTS = {"prefill": {"batch": 1, "seq": 4096}, "decode": {"batch": 1, "seq": 0}, "train": {"batch": 2, "seq": 2048}}


def run_e2e_bench(args: argparse.Namespace) -> int:
    """Entry point of `dsv4 bench prefill|decode|train`."""
    explicit = args.device not in (None, "auto")
    device = torch.device(args.device if explicit else ("cuda" if torch.cuda.is_available() else "cpu"))
    if device.type != "cuda" and not args.allow_cpu:
        if explicit:  # asked for explicitly: refused also where a GPU is present
            raise UserError(
                f"dsv4 bench {args.bench} measures a CUDA device, not {device.type}; "
                "pass --device cpu --allow-cpu for a smoke run (not a benchmark)"
            )
        require_cuda(f"dsv4 bench {args.bench}", "pass --device cpu --allow-cpu for a smoke run (not a benchmark)")
    dtype = {"bf16": torch.bfloat16, "fp32": torch.float32}[args.dtype]
    for key, val in _DEFAULTS[args.bench].items():
        if getattr(args, key) is None:
            setattr(args, key, val)
    t0 = time.time()
    only = args.bench == "train" and getattr(args, "optimizer_only", False)
    if only and args.cuda_graph and device.type != "cuda":
        raise UserError(
            f"--optimizer-only --cuda-graph replays the update from a CUDA graph; this run is on "
            f"{device.type}: leave out --cuda-graph"
        )
    if args.bench == "train" and not (args.optimizer or only):
        autocast_only = [
            f
            for f, on in (
                ("--head-precision bf16", getattr(args, "head_precision", "fp32") != "fp32"),
                ("--per-use-casts", getattr(args, "per_use_casts", False)),
            )
            if on
        ]
        if autocast_only:
            raise UserError(
                f"{' and '.join(autocast_only)} act{'s' if len(autocast_only) == 1 else ''} on the full step's "
                "bf16 autocast: add --optimizer (without it "
                "bench train times forward + backward of a bf16 model)"
            )
    if args.bench == "train" and (args.optimizer or only):
        dtype = torch.float32  # fp32 master weights, bf16 autocast
    if only:
        args.dtype = "fp32"  # the weights it steps (no forward runs)
    if args.bench == "decode":
        return _run_decode(args, device, dtype, t0)
    model = build_model(_bench_config(args), device, dtype)
    model.eval()
    paths = ["fast", "old" if only else "reference"] if not args.no_reference else ["fast"]
    rows = []
    for path in paths:
        row = (bench_optimizer if only else _BENCHES[args.bench])(model, args, device, path)
        rows.append(row)
        if args.jsonl:
            print(json.dumps(row), flush=True)
    result = {
        "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
        "torch": torch.__version__,
        "date": time.strftime("%Y-%m-%d"),
        "preset": getattr(args, "train_config", None) or args.preset,
        "dtype": args.dtype,
        "rows": rows,
        "seconds": round(time.time() - t0, 1),
    }
    if len(rows) == 2:
        result["speedup"] = (
            round(rows[1]["s"] / rows[0]["s"], 2)
            if only
            else round(rows[0]["tokens_per_s"] / rows[1]["tokens_per_s"], 2)
        )
    if args.jsonl:
        print(json.dumps({"speedup": result.get("speedup")}))
    return emit(result, render, args.json, args.jsonl)


def _load_checkpoint(path: str, device: torch.device, dtype: torch.dtype, keep_quantized: bool):
    from ..checkpoint import load_pretrained
    from ..checkpoint.quantized import QuantExperts, QuantLinear

    model = load_pretrained(path, dtype=dtype, device=device, keep_quantized=keep_quantized, progress=False)
    model.eval()
    kept = sum(isinstance(m, (QuantLinear, QuantExperts)) for m in model.modules())
    if keep_quantized and not kept:
        raise UserError(
            f"{path} stores no FP8 or FP4 weights, so --keep-quantized would time the bf16 model "
            "twice; make one with `dsv4 init DIR --preset small --to fp8 --expert-dtype fp4`"
        )
    return model


def _decode_variants(args, device: torch.device, dtype: torch.dtype) -> list[tuple[str, str, object]]:
    """(label, ops path, model factory) of each timed variant, first the one the speed-up is of."""
    if args.keep_quantized and not args.model:
        raise UserError(
            "--keep-quantized times a checkpoint's FP8/FP4 weights: give it with --model DIR "
            "(e.g. from `dsv4 init DIR --preset small --to fp8 --expert-dtype fp4`)"
        )
    if args.model and args.keep_quantized:  # the same weights kept quantized, then dequantized
        return [
            ("quantized", "fast", lambda: _load_checkpoint(args.model, device, dtype, True)),
            (args.dtype, "fast", lambda: _load_checkpoint(args.model, device, dtype, False)),
        ]

    def make():
        if args.model:
            return _load_checkpoint(args.model, device, dtype, False)
        m = build_model(args.preset, device, dtype)
        m.eval()
        return m

    return [("fast", "fast", make)] + ([] if args.no_reference else [("reference", "reference", make)])


def _run_decode(args, device: torch.device, dtype: torch.dtype, t0: float) -> int:
    """`dsv4 bench decode`: every variant at every --batch (each model built once, then freed)."""
    import gc

    batches = list(args.batch) if isinstance(args.batch, (list, tuple)) else [args.batch]
    rows: list[dict] = []
    model = None
    prefer = getattr(args, "prefer_backend", None)
    if prefer and prefer not in ops.backend_names():
        raise UserError(f"--prefer-backend {prefer}: no op has it (registered: {', '.join(ops.backend_names())})")
    for i, (label, path, make) in enumerate(_decode_variants(args, device, dtype)):
        if model is None or args.keep_quantized:
            model = None
            gc.collect()
            model = make()
        chosen = prefer if i == 0 else None  # the variant the speed-up is of
        for b in batches:
            with ops.prefer_backend(chosen):
                row = bench_decode(model, argparse.Namespace(**{**vars(args), "batch": b}), device, path)
            row["variant"] = label + (f"+{chosen}" if chosen else "")
            rows.append(row)
            if args.jsonl:
                print(json.dumps(row), flush=True)
    labels = list(dict.fromkeys(r["variant"] for r in rows))
    result = {
        "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
        "torch": torch.__version__,
        "date": time.strftime("%Y-%m-%d"),
        "preset": args.model or args.preset,
        "dtype": args.dtype,
        "rows": rows,
        "seconds": round(time.time() - t0, 1),
    }
    if len(labels) == 2:
        by = {(r["variant"], r["batch"]): r for r in rows}
        result["speedup_of"] = f"{labels[0]} / {labels[1]}"
        result["speedup_by_batch"] = {
            b: round(by[labels[0], b]["tokens_per_s"] / by[labels[1], b]["tokens_per_s"], 2) for b in batches
        }
        if len(batches) == 1:
            result["speedup"] = result["speedup_by_batch"][batches[0]]
    if args.jsonl:
        print(json.dumps({"speedup": result.get("speedup_by_batch")}))
    return emit(result, render, args.json, args.jsonl)


def render(result: dict) -> str:
    """The printed table of a run: header, tokens/s per path (with the profile numbers a row has), the
    fast path's backends and the speed-up."""
    rows = result["rows"]
    lines = [
        f"{result['device']}  torch {result['torch']}  {result['date']}  preset {result['preset']} {result['dtype']}"
    ]
    optimizer = bool(rows) and rows[0].get("step") == "optimizer"
    for r in rows:
        keys = (
            "kernels_per_step",
            "gpu_busy_ms_per_step",
            "host_syncs_per_step",
            "grad_accum",
            "model_tflops",
            "mfu",
            "muon",
            "adamw",
            "cuda_graph",
            "muon_matrices",
            "newton_schulz_flops",
            "newton_schulz_ms_at_peak",
            "optimizer",
        )
        extra = {k: r[k] for k in keys if k in r}
        reps = r.get("s_reps") or []
        if optimizer:
            rate = f"{r['ms_per_step']:12.3f} ms/optimizer step"
            spread = f" ({1e3 * min(reps):.3f}-{1e3 * max(reps):.3f})" if len(reps) > 1 else ""
        else:
            rate = f"{r['tokens_per_s']:12.1f} tokens/s"
            # the same tokens over the slowest and the fastest timed run
            per_s = r["tokens_per_s"] * r["s"]
            spread = f" ({per_s / max(reps):.1f}-{per_s / min(reps):.1f})" if len(reps) > 1 else ""
            spread += f"  ({r['s']:.4f} s)"
        rate += spread
        name = r.get("variant", r["path"])
        batch = f" batch {r['batch']:<4d}" if "variant" in r else ""
        lines.append(f"{r['bench']:8s} {name:10s}{batch} {rate}{'  ' + str(extra) if extra else ''}")
        lines += [f"  {ms:8.3f} ms {k:7.1f}x  {kname}" for kname, ms, k in r.get("top_kernels", [])]
    if "speedup_by_batch" in result:  # two models: what each ran
        for label in dict.fromkeys(r["variant"] for r in rows):
            lines.append(f"{label} backends: {next(r['backends'] for r in rows if r['variant'] == label)}")
    elif not optimizer:
        lines.append(f"fast path backends: {rows[0]['backends']}")
    if "speedup_by_batch" in result:
        per = ", ".join(f"batch {b}: {x}x" for b, x in result["speedup_by_batch"].items())
        lines.append(f"speed-up {result['speedup_of']}: {per}")
    elif "speedup" in result:
        lines.append(f"speed-up fast / {'old' if optimizer else 'reference'}: {result['speedup']}x")
    return "\n".join(lines)


def add_bench_parsers(subparsers) -> None:
    """Adds `prefill`, `decode` and `train` to the `dsv4 bench` subcommands (func=run_e2e_bench)."""
    helps = {
        "prefill": "prompt tokens/s (model.prefill), fast backends vs the torch reference",
        "decode": "generated tokens/s (model.decode_step), fast backends vs the torch reference",
        "train": "training tokens/s and MFU (forward+backward; --optimizer: the full step), fast backends "
        "vs the torch reference",
    }
    for name, text in helps.items():
        p = subparsers.add_parser(name, help=text, description=text[0].upper() + text[1:] + ".")
        options.add(p, "preset", default="small")
        options.add(p, "dtype", default="bf16", choices=("bf16", "fp32"), help="weights and activations")
        if name == "decode":
            p.add_argument(
                "--batch",
                type=argtypes.positive_int,
                nargs="+",
                default=None,
                help="sequences; several values time each (default: 1)",
            )
            options.add(p, "model", note="time this checkpoint instead of a --preset with random weights")
            p.add_argument(
                "--keep-quantized",
                action="store_true",
                help="with --model: time its FP8/FP4 weights kept quantized against the same weights "
                "dequantized to --dtype (the speed-up per batch)",
            )
            p.add_argument(
                "--prefer-backend",
                default=None,
                help="run the first variant (the quantized one with --keep-quantized) with this ops backend "
                "preferred wherever it can run a call, e.g. triton_splitk (default: none)",
            )
        else:
            p.add_argument("--batch", type=argtypes.positive_int, default=None, help="sequences (default: by bench)")
        options.add(p, "seq_len", dest="seq", type=argtypes.positive_int, note="prefill, train; none = by bench")
        p.add_argument("--prompt", type=argtypes.positive_int, default=64, help="decode: untimed prompt length")
        p.add_argument("--steps", type=argtypes.positive_int, default=32, help="decode: timed steps per rep")
        p.add_argument("--reps", type=argtypes.positive_int, default=3, help="timed repetitions (median, min, max)")
        p.add_argument(
            "--profile",
            action="store_true",
            help="decode, train: kernels and GPU ms per step, by kernel (decode, --optimizer-only: also host syncs)",
        )
        if name != "train":
            options.add(p, "cuda_graph", note=f"here the {'step' if name == 'decode' else 'prefill'}")
        p.add_argument("--no-reference", action="store_true", help="skip the torch reference path")
        if name == "train":
            options.add(
                p,
                "cuda_graph",
                default=False,
                note="replay forward + losses + backward from one CUDA graph and (with --optimizer) the "
                "update (clipping, Muon + AdamW, router bias) from another: what `dsv4 train "
                "--cuda-graph` runs; with --optimizer-only the update alone, replayed",
            )
            which = p.add_mutually_exclusive_group()
            which.add_argument(
                "--optimizer",
                action="store_true",
                help="time the whole training step as `dsv4 train` runs it: fp32 master weights, "
                "bf16 autocast, all losses, clipping, Muon + AdamW step, router bias update",
            )
            which.add_argument(
                "--optimizer-only",
                action="store_true",
                help="time the optimizer part of the step alone (clipping, Muon + AdamW, router "
                "bias) on random gradients, fast vs old path, ms per step (--profile: "
                "kernels and host syncs per step)",
            )
            p.add_argument(
                "--activation-checkpointing",
                action="store_true",
                help="recompute each block's forward in backward (the MFU counts the model's FLOPs, "
                "not the recomputation): how `medium` fits one H200",
            )
            p.add_argument(
                "--head-precision",
                choices=("fp32", "bf16"),
                default="fp32",
                help="the vocabulary heads' products under autocast (--optimizer), as `dsv4 train "
                "--head-precision`: fp32 (default) or bf16 (one product per term, fp32 sums)",
            )
            p.add_argument(
                "--per-use-casts",
                action="store_true",
                help="with --optimizer: cast the routed experts' fp32 weights to bf16 and split the fp32 "
                "head at every use instead of once per optimizer step as `dsv4 train` does in one "
                "process (an A/B)",
            )
            p.add_argument(
                "--grad-accum",
                type=argtypes.positive_int,
                default=1,
                metavar="N",
                help="micro-batches per step: forward + backward on N batches of --batch sequences, gradients "
                "summed, then (with --optimizer) one update, as `dsv4 train --grad-accum N`; tokens/s and "
                "MFU count all N (default 1)",
            )
            p.add_argument(
                "--peak-tflops", type=argtypes.positive_float, help="device bf16 peak for MFU (default: known GPUs)"
            )
            p.add_argument(
                "--train-config",
                type=argtypes.path,
                default=None,
                help="time the model a training recipe trains (its preset and [model] overrides, e.g. "
                "dsv4/train/recipes/pycode-base.toml) instead of --preset (default: none)",
            )
        options.add(p, "device")
        options.add(p, "threads")
        p.add_argument("--allow-cpu", action="store_true", help="run on CPU (smoke test, not a benchmark)")
        add_output_args(p)
        p.set_defaults(func=run_e2e_bench, bench=name)
