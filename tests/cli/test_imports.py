"""Every dsv4 module imports on its own, and the import graph has no cycle.

Import order hides cycles: `import dsv4` loads modules in an order that happens to work. Here each module
is imported first, in a fresh interpreter state (no dsv4 module loaded), and the graph of every import
statement in the package - the deferred ones inside functions too - is checked for cycles: between the
subpackages (config and formats, ops, model, checkpoint, then train / check / bench / serve, then the
CLI) and between modules.
"""

from __future__ import annotations

import ast
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PKG = ROOT / "dsv4"

# run with the repository first on the path, so the code under test is what gets imported
_SCRIPT = r"""
import importlib, json, sys, traceback
failures = {}
for name in json.loads(sys.argv[1]):
    for loaded in [m for m in sys.modules if m == "dsv4" or m.startswith("dsv4.")]:
        del sys.modules[loaded]
    try:
        importlib.import_module(name)
    except ModuleNotFoundError as e:
        if (e.name or "").split(".")[0] == "dsv4":
            failures[name] = traceback.format_exc(limit=-3)
        # else: an optional third-party dependency this environment lacks (reported as a skip)
    except Exception:
        failures[name] = traceback.format_exc(limit=-3)
print(json.dumps(failures))
"""


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def modules() -> dict[str, Path]:
    """Every module of the package by dotted name (`python -m dsv4` runs `__main__`: left out)."""
    return {_module_name(p): p for p in sorted(PKG.rglob("*.py")) if p.name != "__main__.py"}


def import_edges() -> dict[str, set[str]]:
    """module -> the dsv4 modules it imports anywhere in its source (top level or inside functions)."""
    mods = modules()
    edges: dict[str, set[str]] = {}
    for name, path in mods.items():
        package = name if path.name == "__init__.py" else name.rpartition(".")[0]
        out: set[str] = set()
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.ImportFrom):
                if node.level:
                    base = package.split(".")[: len(package.split(".")) - node.level + 1]
                    target = ".".join(base + ([node.module] if node.module else []))
                else:
                    target = node.module or ""
                for alias in node.names:  # `from pkg import module` names a module
                    sub = f"{target}.{alias.name}"
                    out.add(sub if sub in mods else target)
            elif isinstance(node, ast.Import):
                out.update(a.name for a in node.names)
        edges[name] = {t for t in out if t in mods and t != name}
    return edges


def cycles(edges: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components with more than one node (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(edges.get(v, ())):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                found.append(sorted(comp))

    for v in sorted(edges):
        if v not in index:
            visit(v)
    return found


@pytest.mark.slow
def test_every_module_imports_on_its_own():
    names = sorted(modules())
    assert "dsv4.ops.moe_shared" in names and "dsv4.check.zoo" in names
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]))
    out = subprocess.run(
        [sys.executable, "-c", _SCRIPT, json.dumps(names)],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert out.returncode == 0, out.stderr[-2000:]
    failures = json.loads(out.stdout.strip().splitlines()[-1])
    assert not failures, "\n".join(f"{m}:\n{tb}" for m, tb in failures.items())


def _subpackage(module: str) -> str:
    return ".".join(module.split(".")[:2])


# Known cycles, to be broken (each names the piece to move below both sides); nothing else may join them.
# None left: the model arguments and the loader that `dsv4 serve` and `dsv4 bench serve` share with the
# CLI live in dsv4/loading.py, below all three.
KNOWN_MODULE_CYCLES: list[list[str]] = []
KNOWN_SUBPACKAGE_CYCLES: list[list[str]] = []


def test_no_cycle_between_subpackages():
    """config/formats -> ops -> model -> checkpoint -> train/check/bench/serve -> cli, never back up."""
    edges: dict[str, set[str]] = {}
    for m, targets in import_edges().items():
        here = _subpackage(m)
        edges.setdefault(here, set()).update(_subpackage(t) for t in targets if _subpackage(t) != here)
    edges.pop("dsv4", None)  # the package root re-exports, nothing imports it
    for targets in edges.values():
        targets.discard("dsv4")
    assert [c for c in cycles(edges) if c not in KNOWN_SUBPACKAGE_CYCLES] == []


def _registers(module: str) -> bool:
    """Whether the module calls `register(...)`: a backend adding itself to a dispatcher's registry."""
    tree = ast.parse(modules()[module].read_text())
    return any(
        isinstance(n, ast.Call) and getattr(n.func, "id", getattr(n.func, "attr", None)) == "register"
        for n in ast.walk(tree)
    )


# a backend module registering into its own package (`from .. import register`) is the registration
# pattern, not a layering cycle: the package imports its backends, which add themselves to its registry.
# Only modules that register get that exemption: a shared helper below the backends (e.g. the MoE routing
# plan) importing its package is a real cycle.
def _into_own_package(module: str, target: str) -> bool:
    return module.startswith(target + ".") and _registers(module)


def test_no_cycle_between_modules():
    edges = {m: {t for t in ts if not _into_own_package(m, t)} for m, ts in import_edges().items()}
    assert [c for c in cycles(edges) if c not in KNOWN_MODULE_CYCLES] == []


def test_only_registering_backends_import_their_package():
    """The exemption above covers backends alone: the shared MoE pieces sit below the dispatcher (the
    backends hand them the dispatched ops they need)."""
    edges = import_edges()
    assert "dsv4.ops" in edges["dsv4.ops.torch_native"] and _registers("dsv4.ops.torch_native")
    assert not _registers("dsv4.ops.moe_shared")
    assert not any(
        t == "dsv4.ops" or t.startswith("dsv4.ops.triton") or t == "dsv4.ops.torch_native"
        for t in edges["dsv4.ops.moe_shared"]
    )


def test_the_graph_sees_deferred_imports():
    """The edges include imports inside functions (the kind that hid the model <-> checkpoint cycle)."""
    edges = import_edges()
    assert "dsv4.model" in edges["dsv4.checkpoint.load"]  # inside load_pretrained
    assert "dsv4.ops.moe_shared" in edges["dsv4.ops.triton.moe"]
    assert not any(t.startswith("dsv4.checkpoint") for m, ts in edges.items() if m.startswith("dsv4.model") for t in ts)
    assert "dsv4.ops.torch_native" not in edges["dsv4.ops.triton.moe"]
    assert not any(t.startswith("dsv4.ops.triton") for t in edges["dsv4.ops.torch_native"])
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]


def test_serving_does_not_reach_the_training_package():
    """Nothing `dsv4 serve` or the engine imports - directly, through another module, or inside a function -
    is in dsv4.train (the tokenizer lives in dsv4.tokenizer: a server needs it, not the trainer)."""
    edges = import_edges()
    assert "dsv4.tokenizer" in edges["dsv4.serve.startup"]  # the graph sees the deferred import
    for start in [m for m in edges if m.startswith(("dsv4.serve", "dsv4.engine"))]:
        parent: dict[str, str] = {start: start}
        todo = [start]
        while todo:
            here = todo.pop()
            for target in edges.get(here, ()):
                if target not in parent:
                    parent[target] = here
                    todo.append(target)
        for reached in [m for m in parent if m.startswith("dsv4.train")]:
            chain = [reached]
            while chain[-1] != start:
                chain.append(parent[chain[-1]])
            raise AssertionError(" <- ".join(chain))


# what a server's HTTP processes other than the first import (`dsv4.serve.api_servers._child`, `run_http`;
# dsv4.serve.cli: the pickled arguments name its command function)
HTTP_PROCESS_MODULES = (
    "dsv4.serve.cli",
    "dsv4.serve.api_servers",
    "dsv4.serve.http_process",
    "dsv4.serve.app",
    "dsv4.serve.http_guard",
    "dsv4.serve.metrics",
    "dsv4.serve.startup",
    "dsv4.serve.validate",
    "dsv4.serve.warmup",
    "dsv4.engine.engine_process",
    "dsv4.tokenizer",
)


def test_http_processes_do_not_load_torch():
    """Those modules load without torch (hundreds of MiB and a second of start-up per process); the
    engine package's names still resolve on use. (The serving test of two HTTP processes checks the
    running process's memory map.)"""
    script = (
        "import importlib, json, sys\n"
        f"for m in {HTTP_PROCESS_MODULES!r}: importlib.import_module(m)\n"
        "light = 'torch' not in sys.modules\n"
        "from dsv4.engine import SamplingParams, StepOutput\n"
        "p = SamplingParams(max_tokens=3)\n"
        "light = light and 'torch' not in sys.modules\n"
        "import dsv4.engine.offline\n"
        "from dsv4.engine import Engine, generate\n"
        "print(json.dumps([light, 'torch' in sys.modules, Engine.__module__, generate.__module__]))\n"
    )
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]))
    out = subprocess.run([sys.executable, "-c", script], cwd=ROOT, env=env, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    light, loaded, where, gen = json.loads(out.stdout.strip().splitlines()[-1])
    assert light, "an HTTP process's modules (or SamplingParams, StepOutput) loaded torch"
    # the lazy package still gives the engine, and `generate` is the function once its module is loaded
    assert loaded and where == "dsv4.engine.engine" and gen == "dsv4.engine.offline"


def test_modules_stay_readable():
    """The engine's loop fits in 400 lines (its parts live beside it), and no module passes 800."""
    lines = {name: len(path.read_text().splitlines()) for name, path in modules().items()}
    assert lines["dsv4.engine.engine"] <= 400
    assert {n: c for n, c in lines.items() if c > 800} == {}
