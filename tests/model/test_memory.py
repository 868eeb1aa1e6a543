"""Memory estimates (`dsv4.memory`, `dsv4 info`) against what the code allocates and what a CPU measures.

Exact where the estimate mirrors a data structure (the paged cache, the loaded weights); within 25% of the
measured peak of torch's CPU allocations where it models transient tensors (activations).
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from subproc import checkout_env
from test_recipes import RECIPES, model_config

from dsv4 import memory as mem
from dsv4.checkpoint import load_pretrained, model_values, save
from dsv4.checkpoint.layouts import load_config
from dsv4.cli import default_model_dir
from dsv4.config import ModelConfig
from dsv4.engine import Engine, EngineConfig
from dsv4.model import DeepSeekV4

ROOT = Path(__file__).resolve().parents[2]
SHIPPED = default_model_dir()
TOLERANCE = 0.25


def _bytes(model) -> int:
    return sum(t.numel() * t.element_size() for t in [*model.parameters(), *model.buffers()])


@pytest.fixture(scope="module")
def shipped_model():
    return load_pretrained(SHIPPED, dtype=torch.float32)


@pytest.mark.parametrize("prefix_caching", [True, False])
@pytest.mark.parametrize("seqs,context,chunk", [(1, 300, 64), (3, 1000, 512)])
def test_cache_estimate_is_what_the_engine_allocates(seqs, context, chunk, prefix_caching):
    model = DeepSeekV4.from_config(ModelConfig.preset("tiny"), dtype=torch.bfloat16)
    engine = Engine(
        model,
        EngineConfig(
            max_seqs=seqs,
            max_model_len=context,
            max_batch_tokens=chunk,
            prefix_caching=prefix_caching,
            cuda_graphs=False,
        ),
    )
    est = mem.cache_bytes(model.cfg, context, seqs, 2, max_batch_tokens=chunk, prefix_caching=prefix_caching)
    assert est.total == engine.cache.nbytes()


def test_cache_per_position_counts_entries_keys_and_tails():
    """Per position: each compressed layer's entry (head_dim / r), each CSA layer's indexer key and, with
    prefix caching, the fp32 raw rows of each page's last group (r rows of kv + score per page)."""
    cfg = ModelConfig.preset("tiny")
    P = mem.engine_cache_layout(cfg, 1, 1024).page_size
    want = want_tails = 0.0
    for r in cfg.compress_ratios:
        if not r:
            continue
        want += 2 * cfg.head_dim / r + (2 * cfg.index_head_dim / 4 if r == 4 else 0)
        if r == 4:
            want_tails += 2 * 4 * r * (2 * cfg.head_dim + 2 * cfg.index_head_dim) / P
    assert mem.cache_bytes(cfg, 4096, 1, 2, prefix_caching=False).per_token == pytest.approx(want)
    assert mem.cache_bytes(cfg, 4096, 1, 2).per_token == pytest.approx(want + want_tails)


def test_weight_estimate_is_what_loading_allocates(shipped_model, tmp_path):
    cfg = shipped_model.cfg
    assert mem.weight_bytes(cfg, torch.float32).dequantized == _bytes(shipped_model)
    # an FP8 checkpoint kept quantized: FP8 linears and experts stay one byte per weight plus block scales
    tiny = DeepSeekV4.from_config(ModelConfig.preset("tiny"), dtype=torch.float32)
    save(model_values(tiny), tiny.cfg, tmp_path / "fp8", target="fp8")
    kept = load_pretrained(tmp_path / "fp8", dtype=torch.bfloat16, keep_quantized=True)
    est = mem.weight_bytes(load_config(tmp_path / "fp8"), torch.bfloat16)
    assert est.kept_quantized == _bytes(kept)
    assert est.kept_quantized < est.dequantized
    payload = sum(p.stat().st_size for p in (tmp_path / "fp8").glob("*.safetensors"))
    assert est.stored <= payload < est.stored * 1.01 + 2**16  # payload + the JSON headers


def _within(est: float, measured: float) -> None:
    assert abs(est / measured - 1) <= TOLERANCE, f"estimate {est:,.0f} vs measured {measured:,.0f}"


@pytest.mark.parametrize("which", ["tiny", "shipped"])
def test_inference_estimate_within_25_percent_of_measured(which, shipped_model):
    model = (
        shipped_model
        if which == "shipped"
        else DeepSeekV4.from_config(ModelConfig.preset("tiny"), dtype=torch.float32).eval()
    )
    cfg = model.cfg
    for context, batch, chunk in ((512, 1, 256), (768, 2, 384)):
        got = mem.measure_inference(model, context, batch, chunk)
        cache = mem.cache_bytes(cfg, context, batch, 4, max_batch_tokens=chunk * batch, prefix_caching=False)
        assert got["cache"] == cache.total
        est = got["weights"] + cache.total + mem.activation_bytes(cfg, chunk * batch, context, 4, logits_rows=batch)
        _within(est, got["peak"])


@pytest.mark.slow
@pytest.mark.parametrize(
    "which,checkpointing", [("tiny", False), ("tiny", True), ("shipped", False), ("pycode-base", True)]
)
def test_training_estimate_within_25_percent_of_measured(which, checkpointing):
    if which == "tiny":
        cfg = ModelConfig.preset("tiny")
    else:
        cfg = load_config(SHIPPED) if which == "shipped" else model_config(next(r for r in RECIPES if r.stem == which))
    # the balance loss on both ways (dsv4 train's default): with checkpointing the backward recomputes one
    # block at a time (tests/train/test_checkpointing.py), so the estimate holds with it; with 16 experts x
    # 8 layers (pycode-base) the optimizer step's batched Newton-Schulz sets the peak instead
    got = mem.measure_training(cfg, 2, 256, checkpointing, balance_alpha=1e-4)
    _within(mem.train_step_estimate(cfg, 2, 256, checkpointing), got["peak"])


def test_training_state_follows_the_optimizer():
    """Muon keeps one fp32 buffer per hidden matrix, AdamW two per other tensor: the estimate's optimizer
    bytes equal the state MuonAdamW holds after a step."""
    from dsv4.train.losses import total_loss
    from dsv4.train.optim import MuonAdamW, OptimConfig

    cfg = ModelConfig.preset("tiny")
    model = DeepSeekV4.from_config(cfg, dtype=torch.float32)
    opt = MuonAdamW(model, OptimConfig())
    tokens = torch.randint(0, cfg.vocab_size, (2, 128), generator=torch.Generator().manual_seed(0))
    total_loss(model(tokens, mtp=True, indexer_loss=True), tokens).total.backward()
    assert all(p.grad is not None for p in model.parameters())  # state is created for every parameter
    opt.step()
    state = sum(
        t.numel() * t.element_size()
        for o in (opt.muon, opt.adamw)
        for s in o.state.values()
        for k, t in s.items()
        if k in ("momentum_buffer", "exp_avg", "exp_avg_sq")
    )
    est = mem.train_state_bytes(cfg)
    assert est.weights == est.grads == _bytes_params(model)
    assert est.optimizer == state


def _bytes_params(model) -> int:
    return sum(p.numel() * p.element_size() for p in model.parameters())


def test_gpu_counts():
    cfg = ModelConfig.preset("flash")
    st = mem.train_state_bytes(cfg)
    total = st.weights + st.grads + st.optimizer
    usable = 141 * mem.GB * mem.USABLE_FRACTION

    def need(w: int, acts: int) -> float:  # a rank's share, the larger of activations and Newton-Schulz
        return total / w + st.copies(w) + max(acts, mem.muon_step_bytes(cfg, False, w)) + st.largest_block

    for acts in (10 * mem.GB, 0):
        n = mem.training_gpus(cfg, st, acts, 141 * mem.GB)
        assert n is not None and cfg.n_routed_experts % n == 0
        assert need(n, acts) <= usable  # fits at n
        assert all(need(w, acts) > usable for w in range(1, n) if cfg.n_routed_experts % w == 0)
    # the expert stacks' share of the Newton-Schulz set shrinks with the expert-parallel ranks, the rest not
    ns = [mem.muon_step_bytes(cfg, False, w) for w in (1, 2, 8)]
    assert ns[0] > ns[1] > ns[2] > 0 and ns[0] > 10 * mem.GB  # flash's 256-expert stacks: more than 10 GB
    assert mem.training_gpus(cfg, st, 200 * mem.GB, 141 * mem.GB) is None  # activations alone overflow
    # a GPU that holds one rank's state and activations but not the Newton-Schulz set on top: not one rank
    small = ModelConfig.preset("small")
    sst = mem.train_state_bytes(small)
    one = sst.weights + sst.grads + sst.optimizer + sst.copies(1)
    gpu = int((one + mem.muon_step_bytes(small, False) // 2) / mem.USABLE_FRACTION)
    assert mem.training_gpus(small, sst, 0, gpu) > 1
    assert mem.inference_gpus(int(usable), 141 * mem.GB) == 1 and mem.inference_gpus(int(usable) + 1, 141 * mem.GB) == 2
    assert mem.parse_size("141GB") == 141 * 10**9 and mem.parse_size("80GiB") == 80 * 2**30
    assert mem.parse_size("1.5G") == 1_500_000_000 and mem.parse_size("4096") == 4096


def _cli(*args: str) -> subprocess.CompletedProcess:
    env = checkout_env(CUDA_VISIBLE_DEVICES="")
    return subprocess.run(
        [sys.executable, "-m", "dsv4", "info", *args], capture_output=True, text=True, env=env, timeout=300
    )


@pytest.mark.slow
def test_info_reports_memory_and_refuses_bad_sizes(capsys):
    r = _cli("--preset", "flash", "--context", "65536", "--gpu-memory", "141GB", "--json")
    assert r.returncode == 0, r.stderr
    m = json.loads(r.stdout)["memory"]
    cfg = ModelConfig.preset("flash")
    assert m["cache"]["total"] == mem.cache_bytes(cfg, 65536, 1, 2).total
    assert m["weights"]["kept_quantized"] < m["weights"]["dequantized"]
    assert m["inference_gpus_quantized"] >= 1 and m["train_gpus_ckpt"] is not None
    from dsv4.cli import main

    assert main(["info", "--preset", "tiny"]) == 0
    text = capsys.readouterr().out
    for want in ("weights:", "KV cache:", "prefill chunk", "inference on a GPU", "training GPUs of 141 GB"):
        assert want in text, text
    for bad, why in (
        (("--gpu-memory", "lots"), "--gpu-memory: not a size"),
        (("--gpu-memory", "1e400GB"), "--gpu-memory: not a size"),
        (("--gpu-memory", "infGB"), "--gpu-memory: not a size"),
        (("--gpu-memory", "80"), "give a unit"),
        (("--context", "0"), "--context"),
    ):
        assert main(["info", "--preset", "tiny", *bad]) == 2
        out, err = capsys.readouterr()
        assert err.startswith("error: ") and why in err and len(err.strip().splitlines()) == 1 and not out, err


@pytest.mark.slow
def test_info_measure_sets_the_cpu_peak_beside_the_estimate(capsys):
    from dsv4.cli import main

    assert (
        main(
            [
                "info",
                "--preset",
                "tiny",
                "--measure",
                "--context",
                "300",
                "--chunk",
                "128",
                "--train-batch",
                "1",
                "--train-seq-len",
                "128",
                "--json",
            ]
        )
        == 0
    )
    rows = json.loads(capsys.readouterr().out)["measured"]
    assert [r["what"].split(" ")[0] for r in rows] == ["serving", "one", "one"]
    for r in rows:
        _within(r["estimated"], r["measured"])


def test_the_kept_splits_estimate_is_what_a_serving_model_keeps():
    """`WeightBytes.splits` (the bf16 parts a GPU engine keeps of the fp32 projections' and the mHC mix
    weights) equals what `ops.keep_splits` keeps once a forward has run every fp32 projection through the
    bf16x3 backend (as CUDA does from 2 rows): the head, the compressors and the indexers' compressors, plus
    the mix weights' parts."""
    from dsv4 import ops
    from dsv4.check.inputs import check_config
    from dsv4.ops import torch_native

    model = DeepSeekV4.from_config(check_config("tiny"), seed=0, dtype=torch.bfloat16).eval()
    ops.keep_splits(model)
    tokens = torch.randint(0, model.cfg.vocab_size, (1, 70), generator=torch.Generator().manual_seed(0))
    with torch.no_grad(), ops.prefer_backend("bf16x3"), ops.which_ran() as ran:
        model(tokens)
    assert "bf16x3" in ran["linear_fp32"]  # (the router's bf16 weight takes the reference)
    kept = [torch_native._KEPT[p] for p in model.parameters() if p in torch_native._KEPT]
    nbytes = sum(k[1].numel() * k[1].element_size() for k in kept if k is not None)
    # the mHC mix weights' parts, which the CPU's reference mHC does not make (their formula is held to the
    # parts the kernels keep in tests/ops/test_triton_moe_mhc.py)
    fns = [p for n, p in model.named_parameters() if n.endswith("_fn")]
    hc = sum(mem.hc_fn_split_bytes(*p.shape, model.cfg.hc_mult) for p in fns)
    assert len(fns) == 2 * (model.cfg.n_layers + model.cfg.n_mtp_layers) + 1 + model.cfg.n_mtp_layers
    assert nbytes + hc == mem.weight_bytes(model.cfg).splits and nbytes > 0 and hc > 0
    assert mem.weight_bytes(model.cfg, torch.float32).splits == 0  # (fp32 activations: no bf16x3)
