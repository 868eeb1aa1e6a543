"""dsv4.check: stage capture, first divergence, determinism, non-finite hooks, the bug-zoo conformance suite."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from dsv4 import ops
from dsv4.check.capture import capturing, layer_of
from dsv4.check.compare import Side, backend_choice, build_model, compare, perturbed
from dsv4.check.conformance import run_conformance
from dsv4.check.determinism import determinism, locate_nondeterminism
from dsv4.check.inputs import boundary_lengths, check_config, moe_inputs, random_tokens
from dsv4.check.metrics import TOLERANCES, diff, index_mismatch
from dsv4.check.mutants import MUTANTS, catalogue, temporary_backend
from dsv4.check.nonfinite import find_nonfinite
from dsv4.check.zoo import CHECKS
from dsv4.cli import main as dsv4_main
from dsv4.config import ModelConfig
from dsv4.errors import UserError
from dsv4.ops import reference as ref


@pytest.fixture(scope="module")
def cfg():
    return check_config("tiny")


@pytest.fixture(scope="module")
def model(cfg):
    return build_model(cfg=cfg)


@pytest.fixture(scope="module")
def tokens(cfg):
    return random_tokens(cfg, batch=1, seq=24)


def test_capture_keeps_numbers_and_order(model, tokens):
    with torch.no_grad():
        plain = model(tokens).logits
        with capturing() as cap:
            captured = model(tokens).logits
    assert torch.equal(plain, captured)
    names = list(cap.stages)
    assert names[0] == "embed" and names[-1] == "head.logits"
    assert names.index("layers.1.attn.indexer.topk") < names.index("layers.1.attn.core")
    assert "layers.2.attn.compressed_kv" in names and "layers.3.ffn.router_indices" in names
    assert layer_of("layers.3.ffn.out") == "layers.3" and layer_of("head.logits") == "head"


def test_metrics():
    a = torch.tensor([[1, 2, 3], [4, 5, -1]])
    assert index_mismatch(a, a.flip(-1)) == 0.0  # order inside a row does not matter
    assert index_mismatch(a, torch.tensor([[1, 2, 7], [4, 5, -1]])) == pytest.approx(1 / 6)
    x = torch.randn(10)
    d = diff("x", x * (1 + 1e-3), x, TOLERANCES["fp32"])
    assert not d.ok and d.rel_l2 == pytest.approx(1e-3, rel=1e-3)
    masked = torch.tensor([1.0, float("-inf")])
    assert diff("m", masked, masked.clone(), TOLERANCES["exact"]).ok
    assert not diff("m", torch.tensor([1.0, float("nan")]), masked, TOLERANCES["fp32"]).ok


def test_boundary_lengths(cfg):
    n = boundary_lengths(cfg)
    assert {3, 4, 5, 15, 16, 17} <= set(n)


def test_compare_names_the_perturbed_layer(model, tokens):
    rep = compare(Side("perturbed", perturbed(model, "layers.2.attn.wq_b.weight", 1e-2)), Side("ref", model), tokens)
    assert not rep.ok
    assert rep.first_divergence == "layers.2.attn.q"
    assert all(
        d.ok and d.rel_l2 == 0 for d in rep.stages.diffs if not d.name.startswith(("layers.2", "layers.3", "head"))
    )
    same = compare(Side("a", model), Side("b", model), tokens, TOLERANCES["exact"])
    assert same.ok and same.first_divergence is None


def test_compare_reports_the_backend_that_ran(model, tokens):
    choice, missing = backend_choice("grouped")
    assert choice == {"moe_experts": "grouped"} and "sparse_attention" in missing
    rep = compare(Side("grouped", model, backend=choice), Side("reference", model, backend="reference"), tokens)
    assert rep.implementations["grouped"]["moe_experts"] == ["grouped"]
    assert rep.implementations["reference"]["moe_experts"] == ["reference"]
    assert rep.ok, rep.render()
    with pytest.raises(UserError):
        backend_choice("no-such-backend")


def test_determinism_reference_and_planted_drift(model, tokens):
    t = tokens[:, :12]
    assert determinism(model, t, runs=2).ok
    z18 = next(m for m in MUTANTS if m.id == "Z18")
    from dsv4.check.zoo import Context

    with z18.plant(Context(model.cfg, model, t)):
        rep = determinism(model, t, runs=2)
        first = locate_nondeterminism(model, t)
    assert first is not None and first["op"] == "randperm" and first["phase"] == "forward"
    assert not rep.ok and any(d["name"].startswith(("grad:", "stage:")) for d in rep.drifting)
    assert "mutant_random_order" in rep.implementations["hc_pre"]
    assert "mutant_random_order" not in ops.backends("hc_pre")  # unregistered on exit


def test_nonfinite_names_the_planted_op(model, tokens):
    assert find_nonfinite(model, tokens[:, :12]).ok

    def bad_hc_post(f, residual, post, comb):
        y = ref.hc_post(f, residual, post, comb)
        return y * torch.where(post[..., :1, None] > 0, torch.log(post[..., :1, None] - post[..., :1, None]), 1.0)

    with temporary_backend("hc_post", "mutant_nan", bad_hc_post):
        rep = find_nonfinite(model, tokens[:, :12], backward=False)
    assert not rep.ok
    assert rep.dsv4_op == "hc_post" or rep.name.startswith("hc_post")
    assert rep.module == "layers.0"


def test_bug_zoo_list_is_the_table_in_docs(capsys):
    """`dsv4 check conformance --list` prints the table generated from MUTANTS, and docs/bugzoo.md holds
    exactly that table: the rows cannot drift from the code."""
    assert dsv4_main(["check", "conformance", "--list"]) == 0
    listed = capsys.readouterr().out.rstrip("\n")
    assert listed == catalogue()
    rows = listed.splitlines()
    assert len(rows) == 2 + len(MUTANTS) == 29 and [r.split(" | ")[0] for r in rows[2:]] == [
        f"| Z{i:02d}" for i in range(1, 28)
    ]
    doc = (Path(__file__).resolve().parents[2] / "docs" / "bugzoo.md").read_text()
    assert [line for line in doc.splitlines() if line.startswith("|")] == rows


def test_bug_zoo_doc_describes_every_entry():
    """Each entry has its section in docs/bugzoo.md (what happened, symptom, the checks by name, the
    mutant), and its catalogue row says the symptom and how the mutant is planted (or why it is pending)."""
    doc = (Path(__file__).resolve().parents[2] / "docs" / "bugzoo.md").read_text()
    sections = doc.split("\n### ")[1:]
    assert [s.split(" - ")[0] for s in sections] == [m.id for m in MUTANTS]
    for m, text in zip(MUTANTS, sections):
        assert text.startswith(f"{m.id} - {m.title}")
        for part in ("**What happened.**", "**Symptom.**", "**Caught by", "**Mutant"):
            assert part in text, (m.id, part)
        for check in m.checks:
            assert f"`{check}`" in text, (m.id, check)
        assert m.symptom and (m.mutant or m.pending), m.id
        assert (m.plant is None) == (not m.mutant), m.id  # a described mutant is one that can be planted
        assert all(c in CHECKS for c in m.checks), m.id


@pytest.mark.slow
def test_conformance_tiny_catches_every_applicable_mutant(capsys):
    det_before = torch.are_deterministic_algorithms_enabled()
    rc = dsv4_main(["check", "conformance", "--preset", "tiny", "--device", "cpu", "--json"])  # also on a GPU machine
    out = json.loads(capsys.readouterr().out)
    assert torch.are_deterministic_algorithms_enabled() == det_before  # global state restored
    assert not any(b.startswith(("mutant_", "probe")) for op in ops.ops() for b in ops.backends(op))
    assert rc == 0, out
    ids = [r["id"] for r in out["mutants"]]
    assert ids == [f"Z{i:02d}" for i in range(1, 28)]
    for r in out["mutants"]:
        assert r["status"] in ("caught", "pending")
        if r["status"] == "caught":
            assert r["check"] and r["detail"]
            assert "backends" in r["results"][r["check"]]  # what ran under the mutant
            assert not r["by_exception"], r  # caught by the check, not a crash
    assert all(v["ok"] for v in out["baseline"].values())
    assert out["device"] == "cpu" and out["model_dtype"] == "float32" and out["backend"] is None
    assert out["backends"]["poisoned-memory"] == {"moe_experts": ["grouped"]}
    assert out["backends"]["stage-compare"]["sparse_attention"] == ["reference"]  # the clean run it judged
    z18 = next(r for r in out["mutants"] if r["id"] == "Z18")
    assert z18["results"]["determinism"]["backends"]["hc_pre"] == ["mutant_random_order"]


def test_conformance_preferred_backend_bf16_model_on_cpu(capsys):
    """A bf16 check model with one backend preferred everywhere: per-check backends show it ran (in the
    model too), the mutants' planted backends replace it, a mutant none of whose checks ran is skipped."""
    inp = moe_inputs(ModelConfig.preset("tiny"), tokens=4, dtype=torch.bfloat16)
    default = ops.resolve("moe_experts", None, **inp).name
    rc = dsv4_main(
        [
            "check",
            "conformance",
            "--device",
            "cpu",
            "--dtype",
            "bf16",
            "--backend",
            "grouped",
            "--only",
            "Z01,Z05,Z09,Z18,Z24",
            "--checks",
            "swiglu-limit,poisoned-memory,determinism,static-shapes",
            "--json",
        ]
    )
    out = json.loads(capsys.readouterr().out)
    assert ops.resolve("moe_experts", None, **inp).name == default == "reference"  # preference undone
    assert rc == 0, out
    assert out["model_dtype"] == "bfloat16" and out["backend"] == "grouped"
    assert sorted(out["baseline"]) == ["determinism", "poisoned-memory", "static-shapes", "swiglu-limit"]
    assert out["backends"]["determinism"]["moe_experts"] == ["grouped"]  # inside the model
    # the routed experts on the preferred backend; the shared expert's dense projections on torch's GEMM
    assert out["backends"]["swiglu-limit"] == {
        "moe_experts": ["grouped"],
        "linear": ["reference"],
        "clamped_swiglu": ["reference"],  # the shared expert (no Triton on this CPU run)
    }
    status = {r["id"]: r for r in out["mutants"]}
    assert status["Z01"]["status"] == "skipped" and out["counts"]["skipped"] == 1
    planted = {"Z05": "mutant_no_clamp", "Z09": "mutant_unmasked", "Z24": "mutant_host_split"}
    for zid, name in planted.items():
        r = status[zid]
        assert r["status"] == "caught", r
        assert r["results"][r["check"]]["backends"]["moe_experts"] == [name]
    assert status["Z18"]["status"] == "caught"


def test_conformance_skipped_check_is_not_a_pass(monkeypatch):
    from dsv4.check import zoo

    monkeypatch.setitem(zoo.CHECKS, "fp4-known-bytes", lambda ctx: zoo.skipped("no packed FP4 here"))
    seen = []
    rep = run_conformance("tiny", ids=["Z01", "Z02"], progress=lambda *a: seen.append(a))
    total = len(rep.baseline) + 2  # progress: every check on the correct code, then every mutant, then done
    assert [d for d, _, _ in seen] == list(range(total + 1)) and {t for _, t, _ in seen} == {total}
    assert [w for _, _, w in seen][-3:] == ["mutant Z01", "mutant Z02", "done"]
    rows = {r.id: r for r in rep.rows}
    assert rows["Z01"].status == "skipped" and "no packed FP4 here" in rows["Z01"].detail
    assert rows["Z02"].status == "caught"
    assert rep.baseline["fp4-known-bytes"]["skipped"] and rep.counts() == {"skipped": 1, "caught": 1}
    assert "SKIPPED" in rep.render() and "skipped on cpu: no packed FP4 here" in rep.render()


def test_conformance_device_and_backend_errors(capsys, monkeypatch):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    base = ["check", "conformance", "--only", "Z05", "--checks", "swiglu-limit"]
    assert dsv4_main(base + ["--backend", "no-such-backend"]) == 2
    assert "no op has a backend named 'no-such-backend'" in capsys.readouterr().err
    assert dsv4_main(base + ["--checks", "no-such-check"]) == 2
    assert "unknown checks" in capsys.readouterr().err
    if "triton" in ops.backends("sparse_attention"):
        assert dsv4_main(base + ["--backend", "triton", "--device", "cpu"]) == 2
        err = capsys.readouterr().err
        assert "backend 'triton' cannot run on cpu" in err and "TRITON_INTERPRET" in err
    if not torch.cuda.is_available():
        assert dsv4_main(base + ["--device", "cuda"]) == 2
        err = capsys.readouterr().err
        assert err.startswith("error: argument --device: ") and "CUDA" in err and len(err.strip().splitlines()) == 1
    assert dsv4_main(["check", "conformance", "--only", "Z99"]) == 2
    err = capsys.readouterr().err
    assert "unknown bug-zoo ids ['Z99']" in err and len(err.strip().splitlines()) == 1


def _interpreter_defect() -> str | None:
    if importlib.util.find_spec("triton") is None:
        return "triton not installed"
    from dsv4.ops.triton._common import interpreter_defect

    return interpreter_defect()


@pytest.mark.slow
@pytest.mark.skipif(bool(_interpreter_defect()), reason=str(_interpreter_defect()))
def test_conformance_triton_backends_on_the_interpreter():
    """The op-level checks with the Triton backends (CPU interpreter, a fresh process so the kernels are
    built for it): the report shows Triton ran on the clean code, and every mutant is still caught."""
    root = Path(__file__).resolve().parents[2]
    # the CPU interpreter on a process that sees no GPU, whatever the machine has: with CUDA visible the
    # kernels are built for the GPU and the CPU inputs of --device cpu would not reach the interpreter
    env = dict(
        os.environ,
        TRITON_INTERPRET="1",
        OMP_NUM_THREADS="1",
        CUDA_VISIBLE_DEVICES="",
        PYTHONPATH=os.pathsep.join([str(root), os.environ.get("PYTHONPATH", "")]),
    )
    cmd = [
        sys.executable,
        "-m",
        "dsv4",
        "check",
        "conformance",
        "--device",
        "cpu",
        "--backend",
        "triton",
        "--only",
        "Z05,Z09,Z12,Z14,Z15,Z19",
        "--checks",
        "swiglu-limit,poisoned-memory,indexer-padding,attention-backward-random,lse-contract",
        "--json",
    ]
    p = subprocess.run(cmd, env=env, cwd=root, capture_output=True, text=True, timeout=600)
    assert p.returncode == 0, p.stdout[-2000:] + p.stderr[-2000:]
    out = json.loads(p.stdout)
    assert out["op_dtypes"]["moe_experts"] == "bfloat16" and out["op_dtypes"]["sparse_attention"] == "float32"
    ran = out["backends"]
    assert ran["attention-backward-random"] == {"sparse_attention": ["triton"]}
    assert "(float32, bfloat16)" in out["baseline"]["attention-backward-random"]["detail"]  # the model's dtype too
    assert ran["lse-contract"] == {"sparse_attention": ["triton"]}
    assert ran["indexer-padding"] == {"indexer_topk": ["triton"]}
    assert "triton" in ran["swiglu-limit"]["moe_experts"] and "triton" in ran["poisoned-memory"]["moe_experts"]
    assert all(v["ok"] for v in out["baseline"].values())
    for r in out["mutants"]:
        assert r["status"] == "caught" and not r["by_exception"], r
        assert all(b.startswith("mutant_") for bes in r["results"][r["check"]]["backends"].values() for b in bes)


def test_conformance_reports_an_escaped_mutant(monkeypatch):
    z07 = next(m for m in MUTANTS if m.id == "Z07")
    monkeypatch.setattr(z07, "checks", ["swiglu-limit"])  # a check that cannot see route_scale
    rep = run_conformance("tiny", ids=["Z07"])
    assert not rep.ok and rep.rows[0].status == "escaped"


def test_cli_compare_plant_and_user_errors(capsys):
    rc = dsv4_main(["check", "compare", "--plant", "Z07", "--seq-len", "16", "--batch", "1", "--json"])
    out = json.loads(capsys.readouterr().out)
    assert rc == 1 and out["first_divergence"] == "layers.0.ffn.router_weights"
    assert dsv4_main(["check", "compare", "--seq-len", "16"]) == 2  # no mode: one-line user error
    assert "exactly one of" in capsys.readouterr().err
    assert dsv4_main(["check", "compare", "--plant", "Z99"]) == 2  # no such mutant
    assert "Z99" in capsys.readouterr().err


@pytest.mark.skipif(
    importlib.util.find_spec("transformers") is None,
    reason="transformers not installed (optional): pip install 'transformers>=5.5'",
)
def test_external_hf_agrees_within_fp32(cfg):
    from dsv4.check import hf

    try:
        hf._require_transformers()
    except UserError as e:
        pytest.skip(str(e))
    m = build_model(cfg=cfg.replace(fp8_kv_sim=False, fp4_indexer_sim=False))
    toks = random_tokens(m.cfg, batch=1, seq=24)
    rep = compare(Side("transformers", external=hf.runner(m)), Side("dsv4", m), toks)
    assert rep.ok, rep.render()
    assert rep.logits.rel_l2 < 1e-5
    assert len(rep.stages.diffs) > 20  # per-layer stages were compared
    with pytest.raises(UserError, match="simulates no FP8"):
        hf.runner(build_model(cfg=cfg))


def test_external_module_callable(tmp_path, monkeypatch, model, tokens):
    from dsv4.check.compare import load_external

    (tmp_path / "my_port.py").write_text(
        "import torch\n"
        "def build(model):\n"
        "    def run(tokens):\n"
        "        with torch.no_grad():\n"
        "            return model(tokens).logits * 1.01\n"  # a port with a 1% logit scale bug
        "    return run\n"
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    rep = compare(Side("my_port", external=load_external("my_port:build", model)), Side("dsv4", model), tokens)
    assert not rep.ok and rep.first_divergence == "head.logits"
    assert rep.logits.rel_l2 == pytest.approx(0.01, rel=1e-3)
    for bad in ("no_colon", "no_such_module_xyz:f", "my_port:missing"):
        with pytest.raises(UserError):
            load_external(bad, model)


def _gate_clamped_below(gate: torch.Tensor, up: torch.Tensor, limit: float) -> torch.Tensor:
    """The SwiGLU with the gate clamped from below too (the bug the formula check is for)."""
    gate, up = gate.float(), up.float()
    return torch.nn.functional.silu(gate.clamp(-limit, limit)) * up.clamp(-limit, limit)


def test_swiglu_formula_check_per_element_and_catches_a_lower_gate_clamp(cfg, monkeypatch):
    """`swiglu-formula` passes on the correct code with every backend that runs here, reports the ones
    that cannot, and fails when only the grouped path clamps the gate from below (a change of ~4.5e-4 *
    up on the elements whose gate is < -limit, invisible in a relative L2 of the whole output)."""
    from dsv4.check import zoo
    from dsv4.ops import torch_native

    ctx = zoo.Context.build(cfg, batch=1, seq=8)
    res = CHECKS["swiglu-formula"](ctx)
    assert res.ok, res.detail
    assert res.error <= 2.0**-20  # the fp32 bound the check states
    assert "grouped (float32)" in res.detail and "reference (float32)" in res.detail
    assert f"layers.{cfg.n_layers - 1}.shared" in res.detail
    # the probe reaches both sides of both clamps
    grid = torch.tensor(zoo.SWIGLU_GRID) * cfg.swiglu_limit
    assert grid.min() < -cfg.swiglu_limit and grid.max() > cfg.swiglu_limit
    monkeypatch.setattr(torch_native, "clamped_swiglu", _gate_clamped_below)
    bad = CHECKS["swiglu-formula"](ctx)
    assert not bad.ok and "grouped" in bad.detail, bad.detail
    # the relative-L2 check on inputs past the limit does not see this bug: the reason for the new one
    assert CHECKS["swiglu-limit"](ctx).ok


def test_swiglu_formula_check_catches_the_shared_expert_without_a_lower_up_clamp(cfg, monkeypatch):
    """The shared expert is checked through the model's own module: a reference SwiGLU whose up projection
    is clamped from above only is caught there (and in the reference backend)."""
    from dsv4.check import zoo

    def up_clamped_above_only(x, project, swiglu_limit, weight):
        gate, up = project(x, 1).float().clamp(max=swiglu_limit), project(x, 3).float().clamp(max=swiglu_limit)
        h = torch.nn.functional.silu(gate) * up
        return project((h if weight is None else h * weight).to(x.dtype), 2)

    ctx = zoo.Context.build(cfg, batch=1, seq=8)
    monkeypatch.setattr(ref, "swiglu_ffn", up_clamped_above_only)
    bad = CHECKS["swiglu-formula"](ctx)
    assert not bad.ok and ("reference" in bad.detail or "shared" in bad.detail), bad.detail
    assert bad.error > 0.5  # the up value -4L read as -4L, not -L


@pytest.mark.skipif(bool(_interpreter_defect()), reason=str(_interpreter_defect()))
def test_swiglu_formula_runs_the_triton_experts_on_the_interpreter():
    """Where the Triton MoE kernel can run (here: the CPU interpreter, in a fresh process that sees no GPU),
    `swiglu-formula` runs it too, in bf16, within the bf16 bound the check derives."""
    root = Path(__file__).resolve().parents[2]
    env = dict(
        os.environ,
        TRITON_INTERPRET="1",
        OMP_NUM_THREADS="1",
        CUDA_VISIBLE_DEVICES="",
        PYTHONPATH=os.pathsep.join([str(root), os.environ.get("PYTHONPATH", "")]),
    )
    code = (
        "from dsv4.check.zoo import CHECKS, Context; from dsv4.check.inputs import check_config; "
        "r = CHECKS['swiglu-formula'](Context.build(check_config('tiny'), batch=1, seq=8)); "
        "print(r.ok, r.error); print(r.detail)"
    )
    p = subprocess.run([sys.executable, "-c", code], env=env, cwd=root, capture_output=True, text=True, timeout=600)
    assert p.returncode == 0, p.stderr[-2000:]
    ok, err = p.stdout.splitlines()[0].split()
    assert ok == "True" and float(err) <= 2.0**-8 + 2.0**-16, p.stdout
    assert "triton (bfloat16)" in p.stdout and "grouped" in p.stdout
