"""`dsv4 bench int8`: INT8 W8A8 (`--quant int8`) against bf16 / fp32 / fp16 and the official W8A8, on a
CPU or a GPU: decode speed and memory, and accuracy.

- `speed`: in each of `--runs` rounds every mode runs once in a fresh process (the modes in alternating
  order): it loads the model (a checkpoint, or a preset's random weights), prefills a prompt and times
  greedy decode steps at each batch size; tokens/s is the median of the rounds (with min and max).
  Memory: the model's weights as held (parameters + buffers), the decode cache, and the process's peak
  resident memory (CPU) or torch's peak allocation (CUDA). On CUDA the steps replay from a CUDA graph (as
  `dsv4 generate --cuda-graph`), compiled and captured outside the timing.
  Modes: `fp32`, `bf16`, `fp16` (the float model, W8A16 numerics of a quantized checkpoint), `int8:DTYPE`
  (INT8 weights and activations, the other ops in DTYPE), `w8a8:DTYPE` (the official FP8 numerics).
- `accuracy`: on an FP8 + MXFP4 checkpoint (`--model`, or a preset's random weights written as one), the
  official W8A8 model decodes `--tokens` greedy tokens from each prompt; INT8 and W8A16 then run that
  sequence in one forward (teacher forced): relative L2 of their logits against W8A8's and the share of
  positions whose top-1 token is W8A8's (W8A8's own full forward against its decode is the floor of that
  measure); and INT8 and W8A16 decode greedily on their own: the share of their tokens equal to W8A8's and
  where they first differ.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

from .. import argtypes, options
from ..errors import UserError

MODES = ("fp32", "bf16", "fp16", "int8", "w8a8")


def parse_mode(mode: str, device: str) -> tuple[str, str, str]:
    """'int8:bf16' -> (label, quant_mode, dtype); a bare dtype is the float model (W8A16 numerics). A
    suffix '+BACKEND' (e.g. 'int8:bf16+triton_splitk') runs the mode with that ops backend preferred wherever
    it can run a call (`ops.prefer_backend`: a backend registered by name only, timed against the default)."""
    from .. import ops

    spec, _, backend = mode.partition("+")
    if "+" in mode and backend not in ops.backend_names():
        raise UserError(f"--modes: '{mode}': no ops backend named '{backend}' here")
    suffix = f"+{backend}" if backend else ""
    kind, _, dtype = spec.partition(":")
    if kind in ("fp32", "bf16", "fp16") and not dtype:
        return spec + suffix, "w8a16", kind
    if kind in ("int8", "w8a8") and dtype in ("", "fp32", "bf16", "fp16"):
        dtype = dtype or ("bf16" if device.startswith("cuda") else "fp32")
        return f"{kind}:{dtype}{suffix}", kind, dtype
    raise UserError(f"--modes: unknown mode '{mode}' (fp32, bf16, fp16, int8[:DTYPE], w8a8[:DTYPE], each +BACKEND)")


def preferred_backend(label: str) -> str | None:
    """The backend a mode's label prefers ('int8:bf16+triton_splitk' -> 'triton_splitk'), or None."""
    return label.partition("+")[2] or None


def _config(preset: str, layers: int | None):
    from ..config import ModelConfig

    cfg = ModelConfig.preset(preset)
    if layers is not None and layers < cfg.n_layers:
        cfg = cfg.replace(  # (the hash-routed layers are the first ones: as many as are kept)
            n_layers=layers,
            n_hash_layers=min(cfg.n_hash_layers, layers),
            compress_ratios=cfg.compress_ratios[:layers] + cfg.compress_ratios[cfg.n_layers :],
        )
    return cfg


def load(opts: dict, quant_mode: str, dtype: str, device: str):
    """The model of a run: the checkpoint `opts['model']` or the preset's random weights (seed)."""
    from .. import defaults
    from ..checkpoint import load_pretrained
    from ..model import DeepSeekV4

    dt = defaults.resolve_dtype(dtype)
    if opts.get("model"):
        return load_pretrained(opts["model"], dtype=dt, device=device, quant_mode=quant_mode, progress=False)
    cfg = _config(opts["preset"], opts.get("layers"))
    if quant_mode == "int8":
        cfg = cfg.replace(quant_mode="int8")
    # on a GPU the random weights are drawn there: a CPU draw of a flash-sized model takes minutes per run
    on_gpu = str(device).startswith("cuda")
    return DeepSeekV4.from_config(cfg, seed=opts.get("seed", 0), init_on_device=on_gpu, dtype=dt, device=device).eval()


def _nbytes(tensors) -> int:
    return sum(t.numel() * t.element_size() for t in tensors)


def _rss_mib() -> float:
    """Resident memory now (Linux /proc), else the peak so far."""
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    except OSError:
        pass
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


# ----------------------------------------------------------------------------- one mode, in its own process
@torch.no_grad()
def speed_child(opts: dict) -> dict:
    """Load one mode and time `steps` greedy decode steps at every batch size, once (a fresh process)."""
    from .. import ops

    with ops.prefer_backend(preferred_backend(opts["label"])):
        return _time_mode(opts)


def _time_mode(opts: dict) -> dict:
    from .. import ops

    if opts.get("threads"):
        torch.set_num_threads(opts["threads"])
    device = torch.device(opts["device"])
    torch.manual_seed(0)
    model = load(opts, opts["quant_mode"], opts["dtype"], opts["device"])
    weights = _nbytes(list(model.parameters()) + list(model.buffers()))
    out = {
        "mode": opts["label"],
        "weights_mib": round(weights / 2**20, 2),
        "rss_after_load_mib": round(_rss_mib(), 1),
        "batches": [],
    }
    for b in opts["batch"]:
        g = torch.Generator().manual_seed(b)
        prompt = torch.randint(2, model.cfg.vocab_size, (b, opts["prompt"]), generator=g).to(device)
        cache = model.new_cache(b, opts["prompt"] + opts["steps"] + 8)
        nxt = model.prefill(prompt, cache)[:, -1].argmax(-1, keepdim=True)

        def step(t: torch.Tensor, cache=cache) -> torch.Tensor:
            return model.decode_step(t, cache)

        for _ in range(2):  # warm-up (autotune, first-call costs)
            nxt = step(nxt)[:, -1].argmax(-1, keepdim=True)
        if device.type == "cuda" and opts["cuda_graph"]:
            from .graphs import GraphedDecoder

            step = GraphedDecoder(model, cache).step
            for _ in range(2):  # each of its two graphs' first replay (its upload) outside the timing
                nxt = step(nxt)[:, -1].argmax(-1, keepdim=True)
        ops.reset_calls()
        if device.type == "cuda":
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        for _ in range(opts["steps"]):
            nxt = step(nxt)[:, -1].argmax(-1, keepdim=True)
        if device.type == "cuda":
            torch.cuda.synchronize()
        row = {
            "batch": b,
            "tokens_per_s": b * opts["steps"] / (time.perf_counter() - t0),
            "cache_mib": round(_nbytes(cache.tensors()) / 2**20, 2),
            "backends": sorted({f"{op}={be}" for op, be in ops.calls() if op.startswith(("int8", "fp8", "act"))}),
        }
        if device.type == "cuda":
            row["cuda_peak_mib"] = round(torch.cuda.max_memory_allocated(device) / 2**20, 1)
        out["batches"].append(row)
    out["peak_rss_mib"] = round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024, 1)
    return out


def _child(opts: dict) -> dict:
    env = dict(
        os.environ,
        PYTHONPATH=os.pathsep.join([str(Path(__file__).resolve().parents[2]), os.environ.get("PYTHONPATH", "")]),
    )
    if opts.get("threads"):
        env["OMP_NUM_THREADS"] = str(opts["threads"])
    proc = subprocess.run(
        [sys.executable, "-m", "dsv4.bench.int8", "--child", json.dumps(opts)], capture_output=True, text=True, env=env
    )
    if proc.returncode != 0:
        # the child's own last lines: a compiler's error ends with its source excerpt, not its message
        tail = "\n  ".join(proc.stderr.strip().splitlines()[-20:])
        raise RuntimeError(f"mode {opts['label']} failed (exit {proc.returncode}):\n  {tail}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def run_speed(args: argparse.Namespace) -> list[dict]:
    """`--runs` rounds; in each, every mode runs once in a fresh process, the modes in alternating order, so
    that a change of the machine's load during the run reaches every mode alike. Per mode and batch size:
    the median tokens/s of the rounds, with min and max."""
    modes = [parse_mode(m, args.device) for m in args.modes]
    runs: dict[str, list[dict]] = {label: [] for label, _, _ in modes}
    for r in range(args.runs):
        for label, quant_mode, dtype in modes if r % 2 == 0 else modes[::-1]:
            # a fresh process loads (and on a GPU compiles and captures) every time: say what runs
            print(f"bench int8: round {r + 1}/{args.runs}, {label} ...", file=sys.stderr, flush=True)
            t0 = time.perf_counter()
            runs[label].append(
                _child(
                    {
                        "model": args.model,
                        "preset": args.preset,
                        "layers": args.layers,
                        "seed": args.seed,
                        "device": args.device,
                        "label": label,
                        "quant_mode": quant_mode,
                        "dtype": dtype,
                        "batch": args.batch,
                        "prompt": args.prompt,
                        "steps": args.steps,
                        "threads": args.threads,
                        "cuda_graph": args.cuda_graph,
                    }
                )
            )
            rates = ", ".join(f"batch {b['batch']} {b['tokens_per_s']:.1f}" for b in runs[label][-1]["batches"])
            took = time.perf_counter() - t0
            print(f"bench int8:   {label}: {rates} tok/s ({took:.0f} s)", file=sys.stderr, flush=True)
    rows = []
    for got in runs.values():
        row = {k: got[0][k] for k in ("mode", "weights_mib", "rss_after_load_mib")}
        row["peak_rss_mib"] = max(g["peak_rss_mib"] for g in got)
        row["batches"] = []
        for i, b in enumerate(got[0]["batches"]):
            rates = sorted(g["batches"][i]["tokens_per_s"] for g in got)
            row["batches"].append(
                {
                    **b,
                    "tokens_per_s": round(statistics.median(rates), 2),
                    "min": round(rates[0], 2),
                    "max": round(rates[-1], 2),
                    "runs": len(rates),
                }
            )
        rows.append(row)
    return rows


# ----------------------------------------------------------------------------- accuracy
def _greedy(model, prompt: list[int], n: int) -> list[int]:
    dev = model.embed.weight.device
    cache = model.new_cache(1, len(prompt) + n + 1)
    logits = model.prefill(torch.tensor([prompt], device=dev), cache)
    out = []
    for _ in range(n):
        nxt = logits[:, -1].argmax(-1, keepdim=True)
        out.append(int(nxt))
        logits = model.decode_step(nxt, cache)
    return out


def _prompts(model_dir: str | None, vocab: int, n: int, length: int = 32) -> list[list[int]]:
    """The first tokens of held-out documents (a checkpoint with a tokenizer), else random tokens."""
    if model_dir and (Path(model_dir) / "tokenizer.json").is_file():
        from ..eval.heldout import held_out_documents
        from ..tokenizer import Tokenizer
        from ..train.data import find_documents, read_text

        tok = Tokenizer.from_file(Path(model_dir))
        docs = held_out_documents(find_documents(None), 2.0)[:n]
        return [([tok.bos_id] + tok.encode(read_text(path)))[:length] for _, path in docs]
    g = torch.Generator().manual_seed(1)
    return [[0] + torch.randint(2, vocab, (length - 1,), generator=g).tolist() for _ in range(n)]


@torch.no_grad()
def run_accuracy(args: argparse.Namespace) -> dict:
    from ..checkpoint import load_pretrained, model_values, save
    from ..model.quant import quantized_modules

    print("bench int8: accuracy: loading the W8A8, INT8 and W8A16 models ...", file=sys.stderr, flush=True)
    with tempfile.TemporaryDirectory() as tmp:
        ckpt = args.model
        if ckpt is None:  # random weights as an FP8 + MXFP4 release checkpoint
            src = load({"preset": args.preset, "layers": args.layers, "seed": args.seed}, "w8a16", "fp32", "cpu")
            ckpt = str(save(model_values(src), src.cfg, Path(tmp) / "ckpt", "fp8", expert_dtype="fp4"))
            del src
        dev = args.device
        models = {
            m: load_pretrained(ckpt, dtype=torch.float32, device=dev, quant_mode=m, progress=False)
            for m in ("w8a8", "int8", "w8a16")
        }
    ref = models["w8a8"]
    stored = sorted(set(quantized_modules(ref).values()))
    result = {
        "checkpoint": args.model
        or f"{args.preset} random weights (seed {args.seed}, {ref.cfg.n_layers} layers) as FP8 + MXFP4",
        "stored_formats": stored,
        "tokens": args.max_new_tokens,
        "prompts": [],
        "device": dev,
    }
    for prompt in _prompts(args.model, ref.cfg.vocab_size, args.prompts):
        want = _greedy(ref, prompt, args.max_new_tokens)
        seq = torch.tensor([prompt + want], device=dev)
        lo = len(prompt) - 1
        logits = {m: mod(seq).logits[0, lo:-1].double() for m, mod in models.items()}  # [tokens, vocab]
        target = torch.tensor(want, device=dev)
        row = {"prompt_tokens": len(prompt)}
        for m in ("int8", "w8a16", "w8a8"):
            row[m] = {
                "logits_rel_l2": round(float((logits[m] - logits["w8a8"]).norm() / logits["w8a8"].norm()), 5),
                "top1_agree": round(float((logits[m].argmax(-1) == target).double().mean()), 4),
            }
        for m in ("int8", "w8a16"):  # each decoding on its own
            same = [a == b for a, b in zip(_greedy(models[m], prompt, args.max_new_tokens), want)]
            row[m]["greedy_same"] = round(sum(same) / len(same), 4)
            row[m]["first_difference"] = same.index(False) if False in same else None
        result["prompts"].append(row)
    for m in ("int8", "w8a16", "w8a8"):
        for k in ("logits_rel_l2", "top1_agree", "greedy_same"):
            if k in result["prompts"][0][m]:
                result[f"{m}_{k}"] = round(statistics.mean(p[m][k] for p in result["prompts"]), 5)
    return result


# ----------------------------------------------------------------------------- entry points
def render(result: dict) -> str:
    lines = [
        f"dsv4 bench int8 on {result['device']} ({result['machine']}, {result['threads']} threads), torch "
        f"{result['torch']}, {result['date']}: {result['model']}"
    ]
    if result.get("load_average"):
        lines.append(
            f"  machine load average (1, 5, 15 min) at start {result['load_average']}, at the end "
            f"{result.get('load_average_end')}"
        )
    for r in result.get("speed", []):
        for b in r["batches"]:
            mem = f"cuda peak {b['cuda_peak_mib']} MiB" if "cuda_peak_mib" in b else f"peak RSS {r['peak_rss_mib']} MiB"
            lines.append(
                f"  decode {r['mode']:<10} batch {b['batch']:>3}: {b['tokens_per_s']:>9.2f} tok/s "
                f"(min {b['min']}, max {b['max']})  weights {r['weights_mib']} MiB, cache {b['cache_mib']} "
                f"MiB, {mem}"
            )
    acc = result.get("accuracy")
    if acc:
        lines.append(
            f"  accuracy vs the official W8A8 on {acc['checkpoint']} ({acc['tokens']} greedy tokens x "
            f"{len(acc['prompts'])} prompts):"
        )
        for m in ("int8", "w8a16"):
            lines.append(
                f"    {m:<6} logits rel L2 {acc[f'{m}_logits_rel_l2']:.4f}, top-1 = W8A8's at "
                f"{acc[f'{m}_top1_agree']:.1%} of positions (teacher forced); decoding on its own "
                f"{acc[f'{m}_greedy_same']:.1%} of its tokens are W8A8's, the first difference at "
                f"{[p[m]['first_difference'] for p in acc['prompts']]}"
            )
        lines.append(
            f"    w8a8   its own full forward's top-1 = its decode's at {acc['w8a8_top1_agree']:.1%} of "
            "positions (the rounding of batched vs single-token matmuls: the floor of this measure)"
        )
    return "\n".join(lines)


def run_int8_bench(args: argparse.Namespace) -> int:
    from ..defaults import resolve_device

    args.device = str(resolve_device(args.device))
    parts = set(args.only.split(",")) if args.only else {"speed", "accuracy"}
    if parts - {"speed", "accuracy"}:
        raise UserError(f"--only: speed and/or accuracy, got {args.only}")
    if args.model is None and args.preset is None:
        raise UserError("give --model DIR (a checkpoint) or --preset NAME (random weights)")
    args.modes = (
        args.modes.split(",")
        if args.modes
        else (
            ["bf16", "int8:bf16", "fp16", "int8:fp16"] if args.device.startswith("cuda") else ["fp32", "bf16", "int8"]
        )
    )
    for m in args.modes:
        parse_mode(m, args.device)
    import platform

    result = {
        "device": args.device,
        "machine": f"{platform.machine()}, {os.cpu_count()} CPUs"
        if args.device == "cpu"
        else torch.cuda.get_device_name(),
        "torch": torch.__version__,
        "date": time.strftime("%Y-%m-%d"),
        "model": args.model
        or f"{args.preset} (random weights, seed {args.seed}" + (f", {args.layers} layers)" if args.layers else ")"),
        "threads": args.threads or torch.get_num_threads(),
        "load_average": [round(x, 2) for x in os.getloadavg()] if hasattr(os, "getloadavg") else None,
    }
    if args.threads:
        torch.set_num_threads(args.threads)
    if "speed" in parts:
        result["speed"] = run_speed(args)
    if "accuracy" in parts:
        result["accuracy"] = run_accuracy(args)
    if hasattr(os, "getloadavg"):
        result["load_average_end"] = [round(x, 2) for x in os.getloadavg()]
    if args.out:
        from .w8a8 import _write_atomic

        _write_atomic(Path(args.out), json.dumps(result, indent=1))
    print(json.dumps(result) if args.json else render(result))
    return 0


def add_bench_parsers(subparsers) -> argparse.ArgumentParser:
    """Adds `int8` to the `dsv4 bench` subcommands."""
    p = subparsers.add_parser(
        "int8",
        help="INT8 W8A8 vs bf16 / fp32 / fp16 and the official W8A8: decode speed, memory, accuracy (CPU or GPU)",
    )
    g = p.add_mutually_exclusive_group()
    options.add(g, "model", note="an FP8 / MXFP4 or float checkpoint")
    options.add(g, "preset", note="e.g. small")
    p.add_argument(
        "--layers",
        type=argtypes.positive_int,
        default=None,
        help="with --preset: keep only the first N layers (a smaller model of the same shapes)",
    )
    options.add(p, "seed", default=0, note="of a preset's random weights and the prompts")
    options.add(p, "device", default="cpu", note="this benchmark's default is the CPU")
    p.add_argument("--only", default="", help="speed and/or accuracy (default both)")
    p.add_argument(
        "--modes",
        default="",
        help="comma list of fp32, bf16, fp16, int8[:DTYPE], w8a8[:DTYPE], each optionally +BACKEND, an ops "
        "backend preferred where it can run (e.g. int8:bf16+triton_splitk) (default fp32,bf16,int8 on a "
        "CPU; bf16,int8:bf16,fp16,int8:fp16 on CUDA)",
    )
    p.add_argument("--batch", type=argtypes.positive_int, nargs="+", default=[1, 16], help="decode batch sizes")
    p.add_argument("--prompt", type=argtypes.positive_int, default=32, help="prompt tokens before decoding")
    p.add_argument("--steps", type=argtypes.positive_int, default=16, help="decode steps per run")
    p.add_argument(
        "--runs",
        type=argtypes.int_in(3),
        default=3,
        help="rounds: every mode runs once per round in a fresh process (the median is reported; >= 3)",
    )
    options.add(p, "threads", note="of each run")
    options.add(p, "cuda_graph")
    options.add(p, "max_new_tokens", default=256, note="greedy tokens per accuracy prompt")
    p.add_argument("--prompts", type=argtypes.positive_int, default=2, help="accuracy prompts")
    p.add_argument("--out", type=argtypes.path, help="write the JSON result to this file (atomically)")
    options.add(p, "json")
    p.set_defaults(func=run_int8_bench)
    return p


def _child_main(argv: list[str]) -> int:
    torch.set_grad_enabled(False)
    print(json.dumps(speed_child(json.loads(argv[1]))))
    return 0


if __name__ == "__main__":
    if len(sys.argv) == 3 and sys.argv[1] == "--child":
        sys.exit(_child_main(sys.argv[1:]))
    sys.exit(2)
