"""dsv4 bench on a CPU: argument parsing, the printed tables and rates, and the refusals of the GPU-only
benchmarks (one `error:` line naming the reason, exit status 2)."""

from __future__ import annotations

import json

import pytest
import torch

from dsv4.bench import e2e, graph_check, kernel_profile, kernels, moe_plan, report
from dsv4.bench import ops as bench_ops
from dsv4.cli import build_parser, main
from dsv4.config import ModelConfig
from dsv4.errors import UserError

LIMITS = {"matmul_tflops": 800.0, "copy_gbs": 4000.0}


@pytest.fixture
def no_cuda(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)


# ------------------------------------------------------------------------------ parsing
def test_bench_subcommands_parse_their_options():
    parse = build_parser().parse_args
    a = parse(["bench", "ops", "--quant-shapes", "4096x1024", "2048X7168", "--only", "moe,quant", "--jsonl"])
    assert a.func is bench_ops.run_ops_bench and a.quant_shapes == [(4096, 1024), (2048, 7168)]
    assert a.only == "moe,quant" and a.jsonl and not a.json and a.moe_routed == [8192, 32768]
    a = parse(["bench", "kernels", "--seq", "128", "--topk", "64", "--sweep", "--json"])
    assert a.func is kernels.run_kernel_bench and (a.seq, a.topk, a.heads) == (128, 64, 64) and a.sweep and a.json
    for bench in ("prefill", "decode", "train"):
        a = parse(["bench", bench, "--preset", "tiny", "--device", "cpu", "--allow-cpu"])
        assert a.func is e2e.run_e2e_bench and a.bench == bench and a.dtype == "bf16" and a.batch is None
    assert parse(["bench", "decode"]).steps == 32 and not parse(["bench", "train"]).optimizer
    a = parse(["bench", "train", "--optimizer-only", "--profile"])
    assert a.optimizer_only and a.profile and not a.optimizer and not parse(["bench", "train"]).optimizer_only


def test_bench_train_times_the_model_a_recipe_trains(tmp_path):
    """`--train-config` builds what `dsv4 train` would from the recipe: its preset with its [model]
    overrides; a recipe that continues a checkpoint is refused by name."""
    from dsv4.train.settings import TrainConfig, model_config_of

    recipe = "dsv4/train/recipes/pycode-base.toml"
    a = build_parser().parse_args(["bench", "train", "--train-config", recipe])
    cfg = e2e._bench_config(a)
    assert cfg == model_config_of(TrainConfig.from_file(recipe))
    assert (cfg.dim, cfg.n_layers, cfg.n_routed_experts) == (384, 8, 16) and cfg != ModelConfig.preset("tiny")
    assert e2e._bench_config(build_parser().parse_args(["bench", "train", "--preset", "small"])) == "small"
    cont = tmp_path / "cont.toml"
    cont.write_text('init_from = "somewhere"\n')
    with pytest.raises(UserError, match="continues a checkpoint"):
        e2e._bench_config(build_parser().parse_args(["bench", "train", "--train-config", str(cont)]))


@pytest.mark.parametrize(
    "argv",
    [
        ["bench", "ops", "--quant-shapes", "4096"],
        ["bench", "ops", "--hc-tokens", "many"],
        ["bench", "prefill", "--dtype", "fp8"],
        ["bench", "kernels", "--nope"],
        ["bench", "train", "--optimizer", "--optimizer-only"],
        ["bench", "prefill", "--optimizer-only"],
    ],
)
def test_bad_bench_options_exit_2(argv, capsys):
    with pytest.raises(SystemExit) as e:
        build_parser().parse_args(argv)
    assert e.value.code == 2 and "error:" in capsys.readouterr().err


# ------------------------------------------------------------------------------ refusals
@pytest.mark.parametrize("bench", ["kernels", "ops", "prefill", "decode", "train", "w8a8"])
def test_gpu_benches_refuse_a_cpu_with_the_reason(bench, no_cuda, capsys):
    assert main(["bench", bench]) == 2
    out = capsys.readouterr()
    assert out.out == ""
    assert out.err.startswith(f"error: dsv4 bench {bench} needs a CUDA device and this process has none; ")
    assert len(out.err.strip().splitlines()) == 1


def test_autocast_options_without_the_full_step_are_refused(capsys):
    """Without --optimizer bench train times a bf16 model (no autocast): --head-precision bf16 and
    --per-use-casts would change nothing, so they are refused in one line before any model is built."""
    cpu = ["--preset", "tiny", "--device", "cpu", "--allow-cpu"]
    for flags in (["--head-precision", "bf16"], ["--per-use-casts"]):
        assert main(["bench", "train", *cpu, *flags]) == 2
        err = capsys.readouterr().err
        assert err.startswith(f"error: {flags[0]}") and "add --optimizer" in err and len(err.splitlines()) == 1


def test_optimizer_only_refuses_a_cpu_and_a_cuda_graph(no_cuda, capsys):
    assert main(["bench", "train", "--optimizer-only"]) == 2
    assert capsys.readouterr().err.startswith("error: dsv4 bench train needs a CUDA device")
    assert main(["bench", "train", "--optimizer-only", "--cuda-graph", "--device", "cpu", "--allow-cpu"]) == 2
    err = capsys.readouterr().err
    assert (
        err.startswith("error: --optimizer-only --cuda-graph replays the update from a CUDA graph; this run is on cpu")
        and len(err.splitlines()) == 1
    )


def test_optimizer_only_times_both_paths_on_a_micro_model():
    """bench_optimizer on a micro model on the CPU: both paths step every weight, report ms per step and
    the Muon and AdamW implementations (batched Muon and fused AdamW on this CPU for the fast path, torch's
    per-matrix Muon and default AdamW for the old one), and leave no gradients behind."""
    import argparse

    from test_train import micro_model

    m = micro_model()
    args = argparse.Namespace(reps=1, profile=False)
    rows = []
    for path in ("fast", "old"):
        before = {n: p.detach().clone() for n, p in m.named_parameters()}
        rows.append(e2e.bench_optimizer(m, args, torch.device("cpu"), path))
        assert all(not torch.equal(p, before[n]) for n, p in m.named_parameters() if p.dim() >= 2), path
        assert all(p.grad is None for p in m.parameters())
    assert [r["path"] for r in rows] == ["fast", "old"] and all(r["ms_per_step"] > 0 for r in rows)
    assert [r["adamw"] for r in rows] == ["fused", "default"] and rows[0]["muon_matrices"] > 0
    assert [r["muon"] for r in rows] == ["batched", "per-matrix"] and not any(r["cuda_graph"] for r in rows)
    # the Newton-Schulz products of a step: torch's FLOP counter over one orthogonalization of each Muon matrix
    # (a CPU has no known bf16 peak: no floor)
    from torch.utils.flop_counter import FlopCounterMode

    from dsv4.train.muon_batched import NS_COEFFICIENTS, NS_STEPS, batched_newton_schulz
    from dsv4.train.optim import MuonAdamW, OptimConfig

    with FlopCounterMode(display=False) as fc:
        for v in MuonAdamW(m, OptimConfig()).muon_params:
            batched_newton_schulz(v.detach().unsqueeze(0), NS_COEFFICIENTS, NS_STEPS, 1e-7)
    assert all(r["newton_schulz_flops"] == fc.get_total_flops() > 0 for r in rows)
    assert all(r["newton_schulz_ms_at_peak"] is None for r in rows)
    lines = e2e.render(_result(rows, preset="micro", dtype="fp32", speedup=1.5)).splitlines()
    assert lines[1].startswith("train    fast") and "ms/optimizer step" in lines[1] and "'adamw': 'fused'" in lines[1]
    assert lines[-1] == "speed-up fast / old: 1.5x" and not any("backends" in ln for ln in lines)
    # a profiled row lists its largest kernels under it, and not in the row's own line
    rows[0]["top_kernels"] = [["nvjet_sm90_bmm", 12.5, 30.0], ["foreach_lerp", 0.25, 4.0]]
    lines = e2e.render(_result(rows, preset="micro", dtype="fp32", speedup=1.5)).splitlines()
    assert lines[2:4] == ["    12.500 ms    30.0x  nvjet_sm90_bmm", "     0.250 ms     4.0x  foreach_lerp"]
    assert "top_kernels" not in lines[1] and lines[4].startswith("train    old")


def test_e2e_bench_refuses_another_device_without_allow_cpu(capsys):
    assert main(["bench", "prefill", "--device", "cpu"]) == 2
    assert "pass --device cpu --allow-cpu for a smoke run" in capsys.readouterr().err


@pytest.mark.parametrize(
    "entry, argv, name",
    [
        (graph_check.main, [], "graph_check"),
        (kernel_profile.main, ["train"], "kernel_profile"),
        (moe_plan.main, [], "moe_plan"),
    ],
)
def test_module_entry_points_refuse_a_cpu_with_the_reason(entry, argv, name, no_cuda, capsys):
    assert entry(argv) == 2
    out = capsys.readouterr()
    assert out.out == "" and out.err.startswith(f"error: python3 -m dsv4.bench.{name} needs a CUDA device")


def test_require_cuda_names_the_bench_and_the_reason(no_cuda):
    with pytest.raises(UserError, match=r"^x needs a CUDA device and this process has none; because$"):
        report.require_cuda("x", "because")
    with pytest.raises(UserError, match=r"^x needs a CUDA device and this process has none$"):
        report.require_cuda("x")


# ------------------------------------------------------------------------------ rates and tables
def test_rates_against_the_measured_limits():
    r = report.rates(2.0, LIMITS, flops=2e12, nbytes=4e9)  # 2e12 FLOP in 2 ms, 4 GB in 2 ms
    assert r == {"tflops": 1000.0, "of_matmul": 1.25, "gbs": 2000.0, "of_copy": 0.5}
    assert report.rates(1.0, LIMITS) == {}
    assert report.rate_columns(r) == " 1000.0 TFLOP/s (125% of matmul)     2000 GB/s (50% of copy)"
    assert report.rate_columns({}) == ""


def _result(rows: list[dict], **extra) -> dict:
    return {
        "device": "Test GPU",
        "torch": "2.x",
        "triton": "3.y",
        "date": "2026-01-01",
        "limits": LIMITS,
        "rows": rows,
        "seconds": 1.0,
        **extra,
    }


def test_kernels_table():
    row = {
        "kernel": "sparse_attention fwd",
        "shape": "b=1 s=4096",
        "ms": 1.5,
        **report.rates(1.5, LIMITS, 6e11),
        "ref_ms": 15.0,
        "speedup": 10.0,
        "rel_err": 1e-3,
    }
    text = kernels.render(_result([row, {"diag": "k", "regs": 96}], sweeps=[{"cfg": 1}]))
    lines = text.splitlines()
    assert lines[0] == "Test GPU  torch 2.x  triton 3.y  2026-01-01"
    assert lines[1] == "measured: bf16 matmul 800 TFLOP/s, copy 4000 GB/s"
    assert lines[2] == "sweep {'cfg': 1}"
    assert lines[3].startswith("sparse_attention fwd") and "    1.500 ms" in lines[3]
    assert "400.0 TFLOP/s (50% of matmul)" in lines[3] and lines[3].endswith("x10.0 vs reference")
    assert lines[4].strip() == "{'rel_err': 0.001}"
    assert lines[5] == "{'diag': 'k', 'regs': 96}"


def test_ops_table():
    rows = [
        {
            "op": "moe_experts",
            "backend": "triton",
            "shape": "T*k=8192",
            "ms": 2.0,
            **report.rates(2.0, LIMITS, nbytes=4e9),
            "of_same_shape_mm": 0.8,
            "rel": 2e-3,
        },
        {"op": "fp8_linear", "backend": "triton", "shape": "4096x4096", "skipped": "no sm90"},
        {"parity": "hc_pre", "case": "x", "same_frac": 1.0},
    ]
    lines = bench_ops.render(_result(rows)).splitlines()
    assert lines[2].startswith("moe_experts            triton     T*k=8192")
    assert "2000 GB/s (50% of copy)  80% of same-shape mm  {'rel': 0.002}" in lines[2]
    assert lines[3].endswith("skipped: no sm90")
    assert json.loads(lines[4].removeprefix("parity ")) == rows[2]


def test_e2e_table():
    rows = [
        {
            "bench": "prefill",
            "path": "fast",
            "tokens_per_s": 1234.5,
            "s": 0.5,
            "mfu": 0.4,
            "backends": {"rms_norm": ["triton"]},
        },
        {"bench": "prefill", "path": "reference", "tokens_per_s": 123.4, "s": 5.0, "backends": {}},
    ]
    lines = e2e.render(_result(rows, preset="small", dtype="bf16", speedup=10.0)).splitlines()
    assert lines[0] == "Test GPU  torch 2.x  2026-01-01  preset small bf16"
    assert lines[1] == "prefill  fast             1234.5 tokens/s  (0.5000 s)  {'mfu': 0.4}"
    assert lines[2].startswith("prefill  reference         123.4 tokens/s")
    assert lines[3] == "fast path backends: {'rms_norm': ['triton']}"
    assert lines[4] == "speed-up fast / reference: 10.0x"


def test_e2e_table_prints_the_spread_of_the_timed_runs():
    """A row timed several times prints its median with the slowest and fastest run's rate (the same tokens
    over each run's seconds), an optimizer row its fastest and slowest ms."""
    row = {
        "bench": "train",
        "path": "fast",
        "tokens_per_s": 2000.0,
        "s": 0.5,
        "s_reps": [0.4, 0.5, 0.8],
        "backends": {},
    }
    lines = e2e.render(_result([row], preset="small", dtype="bf16")).splitlines()
    assert lines[1] == "train    fast             2000.0 tokens/s (1250.0-2500.0)  (0.5000 s)"
    opt = {"bench": "train", "path": "fast", "step": "optimizer", "ms_per_step": 29.689, "s_reps": [0.02958, 0.0297]}
    lines = e2e.render(_result([opt], preset="small", dtype="fp32")).splitlines()
    assert lines[1] == "train    fast             29.689 ms/optimizer step (29.580-29.700)"


def test_emit_prints_a_table_json_or_nothing(capsys):
    result = {"rows": [1]}
    assert report.emit(result, lambda r: "TABLE", as_json=False, as_jsonl=False) == 0
    assert report.emit(result, lambda r: "TABLE", as_json=True, as_jsonl=False) == 0
    assert report.emit(result, lambda r: "TABLE", as_json=False, as_jsonl=True) == 0
    assert capsys.readouterr().out.splitlines() == ["TABLE", '{"rows": [1]}']


def test_stream_prints_each_row_as_it_comes(capsys):
    rows = report.Stream()
    rows.append({"a": 1})
    assert capsys.readouterr().out == '{"a": 1}\n' and rows == [{"a": 1}]


def test_e2e_smoke_run_on_cpu(capsys):
    """`--device cpu --allow-cpu`: both paths run the tiny model and the table follows."""
    assert (
        main(
            [
                "bench",
                "prefill",
                "--preset",
                "tiny",
                "--device",
                "cpu",
                "--allow-cpu",
                "--dtype",
                "fp32",
                "--seq",
                "16",
                "--reps",
                "1",
                "--json",
            ]
        )
        == 0
    )
    out = json.loads(capsys.readouterr().out)
    assert out["device"] == "cpu" and [r["path"] for r in out["rows"]] == ["fast", "reference"]
    assert all(r["tokens_per_s"] > 0 for r in out["rows"]) and out["speedup"] > 0
    assert out["rows"][1]["backends"] and set(b for bs in out["rows"][1]["backends"].values() for b in bs) == {
        "reference"
    }


def test_decode_bench_times_a_checkpoint_kept_quantized_against_its_dequantized_weights(tmp_path, capsys):
    """`bench decode --model DIR --keep-quantized --batch 1 2`: both models at both batches, the FP8/FP4 kernels
    on the quantized one only, and a speed-up per batch that is the ratio of the rows it names."""
    ckpt = str(tmp_path / "q")
    assert main(["init", ckpt, "--preset", "tiny", "--to", "fp8", "--expert-dtype", "fp4"]) == 0
    capsys.readouterr()
    assert (
        main(
            [
                "bench",
                "decode",
                "--model",
                ckpt,
                "--keep-quantized",
                "--device",
                "cpu",
                "--allow-cpu",
                "--dtype",
                "fp32",
                "--batch",
                "1",
                "2",
                "--prompt",
                "4",
                "--steps",
                "1",
                "--reps",
                "1",
                "--json",
            ]
        )
        == 0
    )
    out = json.loads(capsys.readouterr().out)
    assert [(r["variant"], r["batch"]) for r in out["rows"]] == [
        ("quantized", 1),
        ("quantized", 2),
        ("fp32", 1),
        ("fp32", 2),
    ]
    quant, plain = out["rows"][0]["backends"], out["rows"][2]["backends"]
    assert "fp8_gemm" in quant and "quantized_moe_experts" in quant
    assert "fp8_gemm" not in plain and "quantized_moe_experts" not in plain and "moe_experts" in plain
    rate = {(r["variant"], r["batch"]): r["tokens_per_s"] for r in out["rows"]}
    for b in (1, 2):
        # the ratio of the printed rates, rounded to 2 decimals: within half a unit of the last place
        assert out["speedup_by_batch"][str(b)] == pytest.approx(
            rate["quantized", b] / rate["fp32", b], abs=0.005 + 1e-9
        )


def test_decode_bench_refuses_keep_quantized_without_quantized_weights(tmp_path, capsys):
    assert main(["bench", "decode", "--keep-quantized", "--device", "cpu", "--allow-cpu"]) == 2
    assert capsys.readouterr().err.startswith("error: --keep-quantized times a checkpoint's FP8/FP4 weights")
    plain = str(tmp_path / "plain")
    assert main(["init", plain, "--preset", "tiny"]) == 0
    capsys.readouterr()
    assert (
        main(
            [
                "bench",
                "decode",
                "--model",
                plain,
                "--keep-quantized",
                "--device",
                "cpu",
                "--allow-cpu",
                "--dtype",
                "fp32",
                "--prompt",
                "4",
                "--steps",
                "1",
                "--reps",
                "1",
            ]
        )
        == 2
    )
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "stores no FP8 or FP4 weights" in err[0]


# ------------------------------------------------------------------------------ bench serve and bench w8a8
def test_serve_bench_parses_and_passes_its_engine_settings_to_the_server():
    from dsv4.bench import serve as bench_serve

    a = build_parser().parse_args(
        [
            "bench",
            "serve",
            "--preset",
            "tiny",
            "--clients",
            "4",
            "--spread",
            "0.5",
            "--no-prefix-caching",
            "--max-model-len",
            "512",
            "--json",
        ]
    )
    assert a.func is bench_serve.run_serve_bench and (a.clients, a.spread, a.json) == ([4], 0.5, True)
    assert build_parser().parse_args(["bench", "serve", "--clients", "4", "64"]).clients == [4, 64]
    argv = bench_serve._server_argv(a)
    assert argv[1:8] == ["-m", "dsv4", "serve", "--host", "127.0.0.1", "--port", "0"]
    assert argv[argv.index("--preset") + 1] == "tiny" and argv[argv.index("--max-model-len") + 1] == "512"
    assert "--no-prefix-caching" in argv
    assert "--speculative" not in argv and "--deterministic" not in argv  # 0 / unset: left to the server


@pytest.mark.parametrize(
    "argv",
    [
        ["bench", "serve", "--spread", "1"],
        ["bench", "serve", "--clients", "0"],
        ["bench", "w8a8", "--tokens", "-3"],
        ["bench", "w8a8", "--preset", "huge"],
    ],
)
def test_bad_serve_and_w8a8_bench_options_exit_2(argv, capsys):
    with pytest.raises(SystemExit) as e:
        build_parser().parse_args(argv)
    assert e.value.code == 2 and "error:" in capsys.readouterr().err


def test_serve_bench_load_processes_follow_the_clients_and_leave_the_server_cores():
    from dsv4.bench.serve import default_load_procs

    assert [default_load_procs(c, 16) for c in (1, 4, 8, 9, 64, 256)] == [1, 1, 1, 2, 8, 8]
    assert default_load_procs(64, 2) == 1 and default_load_procs(64, 1) == 1 and default_load_procs(64, 6) == 3


def test_serve_bench_splits_the_time_to_first_token_from_the_server_histograms():
    from dsv4.bench.serve import ttft_parts

    # 100 sequences: 98 queued under 1 ms, one under 5 ms, one under 10 ms; the runs' differences of counters
    sm = {"ttft_queue_count": 100.0, "ttft_queue_sum": 0.2, "ttft_queue_bucket.+Inf": 100.0}
    sm |= {"ttft_queue_bucket.0.001": 98.0, "ttft_queue_bucket.0.005": 99.0, "ttft_queue_bucket.0.01": 100.0}
    parts = ttft_parts(sm)
    assert list(parts) == ["queue"]  # (no prefill or transport counted: not reported)
    assert parts["queue"] == {"mean_s": 0.002, "p99_at_most_s": 0.005, "count": 100.0}
    sm["ttft_queue_bucket.0.005"] = 98.0  # the 99th percentile in the last finite bucket
    assert ttft_parts(sm)["queue"]["p99_at_most_s"] == 0.01


def test_serve_bench_code_prompts_are_windows_of_held_out_sources():
    """`--prompts code`: every prompt is a window of a held-out standard library file's tokens (what the
    shipped model has not trained on), of the drawn length; the same seed draws the same work."""
    from dsv4 import defaults
    from dsv4.bench import serve as bench_serve
    from dsv4.tokenizer import Tokenizer
    from dsv4.train.data import find_documents, is_held_out

    tok = Tokenizer.from_file(defaults.shipped_model_dir())
    pool = bench_serve.code_pool(tok, max_docs=8)
    held = [n for n, _ in find_documents(None) if is_held_out(n, 2.0)]
    assert 0 < len(pool) <= 8 and len(held) >= len(pool)
    assert all(p[0] == tok.bos_id for p in pool)
    a = build_parser().parse_args(["bench", "serve", "--prompts", "code", "--prompt-len", "40", "--spread", "0.5"])
    work = bench_serve._work(tok.vocab_size, 12, a, 7, pool)
    assert work == bench_serve._work(tok.vocab_size, 12, a, 7, pool)
    for prompt, n in work:
        assert 20 <= len(prompt) <= 60 and n >= 1  # (the drawn length: these documents are longer)
        assert any(doc[i : i + len(prompt)] == prompt for doc in pool for i in range(len(doc)))
    with pytest.raises(UserError, match="tokenizer"):
        bench_serve.code_pool(None)


def test_serve_bench_refuses_bad_settings_before_loading_a_model():
    from dsv4.bench import serve as bench_serve

    for name, value, msg in (
        ("max_num_seqs", 2, "--max-num-seqs must be at least the largest --clients"),
        ("output_len", 0, "--output-len must be"),
        ("spread", 1.5, "--spread must be in"),
    ):
        a = build_parser().parse_args(["bench", "serve", "--preset", "tiny", "--clients", "4"])
        setattr(a, name, value)
        with pytest.raises(UserError, match=msg):
            bench_serve.run_serve_bench(a)


def test_serve_bench_percentiles_and_printed_report(capsys):
    from dsv4.bench import serve as bench_serve

    assert bench_serve._pct([], 50) is None
    values = [float(i) for i in range(101)]
    assert bench_serve._pct(values, 50) == 50.0 and bench_serve._pct(values, 99) == 99.0
    assert bench_serve._pct([3.0, 1.0, 2.0], 0) == 1.0

    def spread(*v):
        return {"median": sorted(v)[len(v) // 2], "min": min(v), "max": max(v)}

    result = {
        "device": "cpu",
        "torch": "2",
        "date": "d",
        "model": "tiny",
        "dtype": "fp32",
        "commit": "abc",
        "prompt_len": 8,
        "output_len": 4,
        "spread": 0.25,
        "repeats": 3,
    }
    r = {
        "clients": 2,
        "requests": 4,
        "tokens_per_s": spread(12.0, 12.5, 13.0),
        "errors": 1,
        "ttft_p50_s": spread(0.009, 0.01, 0.011),
        "ttft_p99_s": None,
        "ttft_idle_s": 0.005,
        "ttft_p99_over_idle": None,
        "ttft_p99_after_opening_s": spread(0.02, 0.03, 0.04),
        "ttft_p99_after_opening_over_idle": 6.0,
        "itl_p50_s": spread(0.002, 0.002, 0.003),
        "itl_p99_s": spread(0.004, 0.004, 0.004),
        "itl_p99_over_p50": 2.0,
        "raw_decode_tokens_per_s": spread(20.0, 25.0, 30.0),
        "fraction_of_raw_decode": 0.5,
        "server_metrics": {"engine_phase_seconds.schedule": 1.0, "engine_phase_seconds.forward": 3.0},
        "first_errors": ["TimeoutError: late"],
    }
    bench_serve._print(result, r)
    out = capsys.readouterr().out.splitlines()
    assert out[0] == "cpu  torch 2  d  tiny  fp32  commit abc"
    assert "2 streaming clients, 4 requests per run, prompt ~8, output ~4 (+-25%); median (min-max) of 3 runs" in out[1]
    assert "12.5 (12.0-13.0) output tokens/s  (1 errors)" in out[2]
    assert "p50 10.0 ms (9.0-11.0)  p99 -  (idle 5.0 ms)" in out[3]
    assert "after the opening wave (each client's first request): p99 30.0 ms (20.0-40.0) (6.0x idle)" in out[4]
    assert "(p99 2.0x p50)" in out[5]
    assert "25.0 (20.0-30.0) tokens/s at batch 2: the server reaches 50% of it" in out[6]
    assert out[-2] == "  engine process time: schedule 25%, forward 75% of 4.0 s"
    assert out[-1] == "  error: TimeoutError: late"


def test_w8a8_summary_takes_each_shapes_best_backend_and_the_worst_shape():
    from dsv4.bench import w8a8

    rows = [
        {"part": "gemm", "shape": "a", "backend": "x", "x_bf16": 1.2},
        {"part": "gemm", "shape": "a", "backend": "y", "x_bf16": 1.6},
        {"part": "gemm", "shape": "b", "backend": "x", "x_bf16": 1.5},
        {"part": "gemm", "shape": "b", "backend": "y", "skipped": "no"},
        {"part": "decode", "shape": "c", "backend": "x", "of_copy": 0.5},
    ]
    s = w8a8.summarize(rows)
    assert s["gemm"] == {
        "goal": w8a8.GOALS["gemm"],
        "metric": "x_bf16",
        "worst_best_backend": 1.5,
        "min": 1.2,
        "max": 1.6,
        "met": 1.5 >= w8a8.GOALS["gemm"],
    }
    assert s["decode"]["worst_best_backend"] == 0.5 and s["decode"]["met"] is (0.5 >= w8a8.GOALS["decode"])
    assert "experts" not in s
    shapes = w8a8.flash_linears(ModelConfig.preset("flash"))
    assert shapes["wq_a"] == (1024, 4096) and "wo_a" not in shapes  # wo_a runs in bf16 officially


@pytest.mark.slow
def test_gpu_train_bench_script_runs_its_commands_on_the_cpu(tmp_path):
    """scripts/gpu_train_bench.sh --device cpu --preset tiny: the same three `dsv4 bench train` commands as on
    a GPU (full step, optimizer only, full step with checkpointing) at tiny shapes, one timed step each;
    prints the commit, the date and one line per figure with its median, min and max."""
    import os
    import subprocess
    from pathlib import Path

    root = Path(__file__).resolve().parents[2]
    env = {**os.environ, "REPS": "1", "OUT": str(tmp_path)}
    res = subprocess.run(
        ["bash", str(root / "scripts" / "gpu_train_bench.sh"), "--device", "cpu", "--preset", "tiny"],
        capture_output=True,
        text=True,
        timeout=600,
        env=env,
    )
    assert res.returncode == 0, res.stderr[-2000:]
    lines = res.stdout.splitlines()
    assert lines[0].startswith("commit: ") and lines[1].startswith("date: 20")
    full, opt, mfu = lines[-3:]
    assert full.startswith("full step, tiny 1 x 64: ") and "(min " in full and "'muon': 'batched'" in full
    assert opt.startswith("optimizer only, tiny: ") and "muon batched, adamw fused" in opt and "% of the full" in opt
    assert mfu.startswith("full step, tiny 2 x 1 x 64 (micro-batches), activation checkpointing: ")
    assert "tokens/s" in mfu
    rows = [json.loads(ln) for ln in (tmp_path / "mfu.jsonl").read_text().splitlines() if '"path"' in ln]
    assert rows[0]["activation_checkpointing"] is True and len(rows[0]["s_reps"]) == 1
    res = subprocess.run(
        ["bash", str(root / "scripts" / "gpu_train_bench.sh"), "--bogus"],
        capture_output=True,
        text=True,
        timeout=60,
        env=env,
    )
    assert res.returncode == 2 and res.stderr.startswith("error: unknown argument --bogus")


# ------------------------------------------------------------------------------ bench engine
def test_engine_bench_accounts_for_every_step_it_times(tmp_path, capsys):
    """`bench engine` on tiny: every timed output token past a request's first is one decode row of some
    timed step (the first comes from the prompt's step), the bucket shares of the timed steps sum to one,
    and the rows per step are printed."""
    from dsv4.bench.engine import _work

    out = tmp_path / "engine.json"
    args = ["--preset", "tiny", "--device", "cpu", "--clients", "2", "--requests", "5", "--prompt-len", "9"]
    args += ["--output-len", "4", "--repeats", "2", "--no-raw", "--seed", "3", "--out", str(out)]
    assert main(["bench", "engine", *args]) == 0
    text = capsys.readouterr().out
    row = json.loads(out.read_text())["runs"]["2"]
    mix = row["step_mix"]
    work = _work(ModelConfig.preset("tiny").vocab_size, 5, 9, 4, 0.25, 3)
    per_run = sum(n - 1 for _, n in work)  # decode rows of one run
    assert per_run > 0
    assert mix["decode_rows_per_step"] * mix["steps"] == pytest.approx(2 * per_run)
    assert 0 < mix["chunk_tokens_per_step"] * mix["steps"] <= 2 * sum(len(p) for p, _ in work)
    assert sum(mix["bucket_share"].values()) == pytest.approx(1.0)
    assert mix["bucket_share"] == {"ragged": 1.0}  # a CPU engine runs unpadded steps
    assert row["device_ms_per_step"] is None and "device ms per step" not in text  # (CUDA events only)
    assert f"per step: {mix['decode_rows_per_step']:.1f} decode rows" in text
    from dsv4.bench.load import closed_loop_ceiling

    assert row["closed_loop_ceiling"] == closed_loop_ceiling([n for _, n in work], 2)
    assert f"at most {row['closed_loop_ceiling']:.0%} of raw decode" in text


def test_decode_bench_prefers_a_backend_for_the_variant_it_times(tmp_path, capsys):
    """`--prefer-backend NAME` runs the first variant (the quantized one) with NAME preferred where it can
    run and says so in its label; the comparison variant runs as before; an unknown name is refused."""
    ckpt = str(tmp_path / "q")
    assert main(["init", ckpt, "--preset", "tiny", "--to", "fp8", "--expert-dtype", "fp4"]) == 0
    capsys.readouterr()
    argv = ["bench", "decode", "--model", ckpt, "--keep-quantized", "--device", "cpu", "--allow-cpu", "--dtype"]
    argv += ["fp32", "--batch", "1", "--prompt", "4", "--steps", "1", "--reps", "1", "--json"]
    assert main([*argv, "--prefer-backend", "triton_splitk"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert [r["variant"] for r in out["rows"]] == ["quantized+triton_splitk", "fp32"]
    assert out["speedup_of"] == "quantized+triton_splitk / fp32" and "fp8_gemm" in out["rows"][0]["backends"]
    assert main([*argv, "--prefer-backend", "nonesuch"]) == 2
    assert "--prefer-backend nonesuch: no op has it" in capsys.readouterr().err


def test_kernel_difference_lists_every_changed_name_largest_change_first():
    """Names only in one table count from zero; unchanged names are left out; the total is the sum of the
    listed changes."""
    from dsv4.bench.engine import kernel_difference

    before = [("gemm_a", 1.0, 10.0), ("same", 0.5, 4.0), ("gone", 0.5, 1.0)]
    after = [("gemm_a", 1.25, 10.0), ("same", 0.5, 4.0), ("radix_sort", 0.125, 8.0)]
    lines = kernel_difference(before, after, "b minus a")  # (binary fractions: exact sums)
    assert lines[0] == "b minus a: -0.125 ms over 3 kernel names that changed"
    names = [line.split()[-1] for line in lines[1:]]
    assert names == ["gone", "gemm_a", "radix_sort"]
    assert "-1.0x" in lines[1] and "+0.0x" in lines[2] and "+8.0x" in lines[3]


def test_speculative_bench_script_greedy_equals_plain_and_sampled_is_not_compared():
    """scripts/bench_speculative.py on the CPU with the shipped model, two prompts at once: greedy MTP
    decoding gives plain decoding's tokens (`same_tokens` true) and counts its drafts; with --temperature 1
    the tokens are sampled, so they are not compared (`same_tokens` null); a bad temperature, an unknown
    op of --backend and --regions without CUDA are refused."""
    import os
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parents[2]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(root), os.environ.get("PYTHONPATH", "")])}
    base = [sys.executable, str(root / "scripts" / "bench_speculative.py"), "--tokens", "6", "--k", "2"]
    base += ["--repeats", "1", "--batch", "2"]
    for temperature, same in (("0", True), ("1", None)):
        res = subprocess.run(
            [*base, "--temperature", temperature], capture_output=True, text=True, timeout=300, env=env
        )
        assert res.returncode == 0, res.stderr[-2000:]
        result = json.loads(res.stdout.splitlines()[-1])
        assert result["temperature"] == float(temperature) and result["batch"] == 2
        mtp = result["settings"]["mtp k=2"]
        assert mtp["same_tokens"] is same and result["settings"]["plain"]["same_tokens"] is same
        assert mtp["verify_lengths"] and 0 <= mtp["acceptance"] <= 1
        assert mtp["batch_fill"] is None or 0 < mtp["batch_fill"] <= 1  # (None: no fixed-shape step ran)
    res = subprocess.run([*base, "--temperature", "-1"], capture_output=True, text=True, timeout=120, env=env)
    assert res.returncode == 2 and "--temperature must be in [0, 100], got -1.0" in res.stderr
    res = subprocess.run([*base, "--backend", "no_such_op=x"], capture_output=True, text=True, timeout=120, env=env)
    assert res.returncode == 2 and "--backend takes OP=NAME" in res.stderr
    res = subprocess.run([*base, "--regions"], capture_output=True, text=True, timeout=120, env=env)
    assert res.returncode == 2 and "--regions times kernels by region: it needs --device cuda" in res.stderr


def test_every_python_script_finds_this_checkouts_dsv4_without_an_install(tmp_path):
    """`python3 scripts/X.py` from any directory, with no PYTHONPATH and no installed dsv4 (as on a machine
    that received only the checkout): every script that imports dsv4 puts its checkout first on the path
    before it does; one is run so (`-E -s`: no PYTHONPATH, no user site; this suite's dsv4 comes from
    PYTHONPATH)."""
    import ast
    import subprocess
    import sys
    from pathlib import Path

    scripts = sorted((Path(__file__).resolve().parents[2] / "scripts").glob("*.py"))
    assert len(scripts) >= 10
    for script in scripts:
        body = ast.parse(script.read_text(encoding="utf-8")).body
        first = next(
            (
                n.lineno
                for n in body
                if (isinstance(n, ast.ImportFrom) and (n.module or "").split(".")[0] == "dsv4")
                or (isinstance(n, ast.Import) and any(a.name.split(".")[0] == "dsv4" for a in n.names))
            ),
            None,
        )
        if first is None:
            continue
        inserts = [
            n.lineno
            for n in body
            if isinstance(n, ast.Expr) and "sys.path.insert(0" in ast.unparse(n) and "parents[1]" in ast.unparse(n)
        ]
        assert inserts and min(inserts) < first, script.name
    spec = next(s for s in scripts if s.name == "bench_speculative.py")
    res = subprocess.run(
        [sys.executable, "-E", "-s", str(spec), "--help"], cwd=tmp_path, capture_output=True, text=True, timeout=300
    )
    assert res.returncode == 0 and "--temperature" in res.stdout, res.stderr[-500:]


def test_engine_host_script_times_the_host_phases_with_no_model_work():
    """scripts/bench_engine_host.py on the CPU, tiny preset: the engine with its model's work removed still
    runs every request to its length (tokens per run = the requests' output lengths) and reports each host
    phase per step as median (min-max); bad arguments are one error line."""
    import os
    import re
    import subprocess
    import sys
    from pathlib import Path

    from dsv4.bench.engine import _work
    from dsv4.config import ModelConfig

    root = Path(__file__).resolve().parents[2]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(root), os.environ.get("PYTHONPATH", "")])}
    base = [sys.executable, str(root / "scripts" / "bench_engine_host.py"), "--preset", "tiny"]
    args = ["--clients", "3", "--repeats", "2", "--prompt-len", "20", "--output-len", "6"]
    res = subprocess.run([*base, *args], capture_output=True, text=True, timeout=300, env=env)
    assert res.returncode == 0, res.stderr[-2000:]
    line = res.stdout.splitlines()[-1]
    want = sum(n for _, n in _work(ModelConfig.preset("tiny").vocab_size, 12, 20, 6, 0.25, 0))
    assert line.startswith(f"3 clients, 12 requests ({want} tokens in "), line
    for phase in ("schedule", "launch", "post", "total"):
        med, lo, hi = map(float, re.search(rf"{phase} ([0-9.]+) \(([0-9.]+)-([0-9.]+)\)", line).groups())
        assert 0 <= lo <= med <= hi, line
    bad = subprocess.run([*base, "--repeats", "0"], capture_output=True, text=True, timeout=120, env=env)
    assert bad.returncode == 2 and "must be at least 1" in bad.stderr


def test_device_gaps_split_idle_time_by_length_and_merge_overlaps():
    from dsv4.bench.device_profile import device_gaps

    # us: [0, 10] and [5, 12] overlap (no gap), 2 us to [14, 20], 30 us to [50, 60], 1 us to [61, 70]
    iv = [(50.0, 60.0), (0.0, 10.0), (14.0, 20.0), (5.0, 12.0), (61.0, 70.0)]
    g = device_gaps(iv, calls=2, short_us=5.0)
    assert g == {"span": 70 / 2 / 1e3, "short": 3 / 2 / 1e3, "long": 30 / 2 / 1e3, "long_gaps": 0.5}
    # busy + idle = the span, whatever the threshold
    for t in (0.5, 1.5, 2.5, 40.0):
        g = device_gaps(iv, calls=1, short_us=t)
        assert g["short"] + g["long"] == 33 / 1e3
    assert device_gaps([], calls=3) == {"span": 0.0, "short": 0.0, "long": 0.0, "long_gaps": 0.0}
