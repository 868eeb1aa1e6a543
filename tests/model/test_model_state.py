"""The model's modules are set by the model alone.

Code outside dsv4/model never assigns an attribute of a model module: options come in at build time, through
a method or pass defined in dsv4/model (`DeepSeekV4.set_options`, `dsv4.model.quant.set_quant_mode` /
`mark_stored`, `MoE.set_load`, `Experts.narrow`), or by swapping a whole module (`model.set_submodule`, as
the checkpoint loader places kept-quantized modules and expert parallelism its parallel experts); what a
forward computes for the caller (the auxiliary losses) comes back in its output.

The scan reads the source of every module of dsv4 outside dsv4/model (`ast`, nothing imported) and reports
each assignment `R.X = ...` (also augmented, annotated, in tuples, and `setattr(R, "X", ...)`) where
- X is an attribute name the model's modules define: `self.X = ...` in a method or `X = ...` in the body of
  an `nn.Module` subclass in dsv4/model, or a buffer / parameter registered under that name - except the
  few names in GENERIC, which unrelated objects carry as well; or
- R is itself a model module: `model` / `....model`, `get_submodule(...)`, or an attribute chain ending in
  a submodule name of a model module (`layer.attn`, `moe.experts`, `model.layers[0].ffn`); then any X
  counts, names the model never defined included (`layer.attn.want_indexer_loss = True`).
An object setting its own attributes (`self.X = ...`) is not counted: classes outside dsv4/model are not
model modules (the parallel experts set their own exchange settings as they are built).
"""

from __future__ import annotations

import ast
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from dsv4.config import ModelConfig
from dsv4.model import DeepSeekV4
from dsv4.model.moe import MoE
from dsv4.model.quant import mark_stored

ROOT = Path(__file__).resolve().parents[2]
MODEL = ROOT / "dsv4" / "model"

# Names the model's modules define that other objects carry too, each for a reason that has nothing to do
# with the model: an autograd Function's ctx stores its `scale`, `eps` and `ratio` for the backward (the
# Triton kernels), a probe records the `stage` it is in (dsv4/check/determinism.py); `weight`, `bias` and
# `training` are nn.Module / tensor names any torch object may have. The receiver rule still catches these
# on a model module (`layer.ffn.gate.bias = ...`).
GENERIC = frozenset({"scale", "eps", "ratio", "stage", "weight", "bias", "training"})

# torch.nn classes a model module may derive from or hold as a submodule
_TORCH_MODULES = frozenset({"Module", "Linear", "Embedding", "ModuleList", "ModuleDict", "Sequential"})


def _names(t: ast.expr) -> Iterator[ast.expr]:
    if isinstance(t, (ast.Tuple, ast.List)):
        for e in t.elts:
            yield from _names(e)
    elif isinstance(t, ast.Starred):
        yield from _names(t.value)
    else:
        yield t


def _base_name(b: ast.expr) -> str | None:
    return b.attr if isinstance(b, ast.Attribute) else b.id if isinstance(b, ast.Name) else None


def _model_classes() -> dict[str, ast.ClassDef]:
    """Every class of dsv4/model that is an nn.Module (through torch bases or other model classes)."""
    classes: dict[str, ast.ClassDef] = {}
    for f in sorted(MODEL.glob("*.py")):
        for node in ast.walk(ast.parse(f.read_text())):
            if isinstance(node, ast.ClassDef):
                classes[node.name] = node

    def is_module(name: str, seen: frozenset[str] = frozenset()) -> bool:
        if name not in classes:
            return name in _TORCH_MODULES
        return any(
            is_module(b, seen | {name}) for b in map(_base_name, classes[name].bases) if b is not None and b not in seen
        )

    return {n: c for n, c in classes.items() if is_module(n)}


def model_attributes() -> tuple[frozenset[str], frozenset[str]]:
    """(attribute names the model's modules define, the names among them that hold submodules)."""
    classes = _model_classes()
    # what builds a submodule: a module class, or a class attribute naming one (`attention_cls = Attention`)
    module_calls = set(classes) | _TORCH_MODULES
    for cls in classes.values():
        for st in cls.body:
            if isinstance(st, ast.AnnAssign) and isinstance(st.target, ast.Name):
                targets, value = [st.target], st.value
            elif isinstance(st, ast.Assign):
                targets, value = [t for t in st.targets if isinstance(t, ast.Name)], st.value
            else:
                continue
            if isinstance(value, ast.Name) and value.id in classes:
                module_calls.update(t.id for t in targets)
    names: set[str] = set()
    submodules: set[str] = set()
    for cls in classes.values():
        for st in cls.body:
            if isinstance(st, (ast.Assign, ast.AnnAssign)):
                for t in st.targets if isinstance(st, ast.Assign) else [st.target]:
                    names.update(e.id for e in _names(t) if isinstance(e, ast.Name))
        for node in ast.walk(cls):
            if isinstance(node, (ast.Assign, ast.AnnAssign)):
                targets = node.targets if isinstance(node, ast.Assign) else [node.target]
                values = node.value.elts if isinstance(node.value, ast.Tuple) else [node.value]
                for t in targets:
                    elts = list(_names(t))
                    for i, e in enumerate(elts):
                        if isinstance(e, ast.Attribute) and isinstance(e.value, ast.Name) and e.value.id == "self":
                            names.add(e.attr)
                            v = values[i] if len(values) == len(elts) else None
                            if isinstance(v, ast.IfExp):
                                v = v.body
                            if isinstance(v, ast.Call) and _base_name(v.func) in module_calls:
                                submodules.add(e.attr)
            if (
                isinstance(node, ast.Call)
                and _base_name(node.func) in ("register_buffer", "register_parameter")
                and node.args
                and isinstance(node.args[0], ast.Constant)
            ):
                names.add(node.args[0].value)
    return frozenset(names), frozenset(submodules)


NAMES, SUBMODULES = model_attributes()


def _module_expr(e: ast.expr, held: set[str]) -> bool:
    """Whether expression e is a model module: a name holding one, `....model`, a submodule attribute
    (`layer.attn`), an item of one (`model.layers[0]`), or `get_submodule(...)`."""
    if isinstance(e, ast.Subscript):
        return _module_expr(e.value, held)
    if isinstance(e, ast.Name):
        return e.id in held
    if isinstance(e, ast.Attribute):
        return e.attr == "model" or e.attr in SUBMODULES
    if isinstance(e, ast.Call):
        return _base_name(e.func) == "get_submodule"
    if isinstance(e, ast.IfExp):
        return _module_expr(e.body, held) or _module_expr(e.orelse, held)
    return False


def _yields_modules(e: ast.expr, held: set[str]) -> bool:
    """Whether iterating e gives model modules: a module list (`model.layers`), `m.modules()` /
    `m.children()` of a model module (`named_...`: as the second of each pair), a comprehension of modules,
    or any of these through `list`, `reversed`, `enumerate` (the second of each pair again)."""
    if isinstance(e, ast.Call) and isinstance(e.func, ast.Attribute) and e.func.attr in _ITERATORS:
        return _module_expr(e.func.value, held)
    if isinstance(e, ast.Call) and _base_name(e.func) in ("list", "tuple", "reversed", "enumerate") and e.args:
        return _yields_modules(e.args[0], held)
    if isinstance(e, (ast.ListComp, ast.GeneratorExp)):
        return _module_expr(e.elt, held)
    return _module_expr(e, held)


_ITERATORS = ("modules", "children", "named_modules", "named_children")


def _bound(target: ast.expr) -> Iterator[str]:
    """The name a for-loop target binds to the module (`m`, or `m` of `name, m`)."""
    if isinstance(target, ast.Name):
        yield target.id
    elif isinstance(target, ast.Tuple) and len(target.elts) == 2 and isinstance(target.elts[1], ast.Name):
        yield target.elts[1].id


def module_names(tree: ast.AST) -> set[str]:
    """Names that hold a model module somewhere in the file (flow- and scope-insensitive, to a fixpoint):
    `model`, names assigned a model module (`ex = moe.experts`) and loop variables over modules
    (`for layer in model.layers`, `for name, m in model.named_modules()`, comprehensions alike)."""
    held = {"model"}
    while True:
        before = len(held)
        for node in ast.walk(tree):
            if isinstance(node, ast.Assign) and _module_expr(node.value, held):
                held.update(t.id for t in node.targets if isinstance(t, ast.Name))
            elif isinstance(node, (ast.For, ast.comprehension)) and _yields_modules(node.iter, held):
                held.update(_bound(node.target))
        if len(held) == before:
            return held


def _flagged(receiver: ast.expr, attr: str | None, held: set[str]) -> bool:
    if isinstance(receiver, ast.Name) and receiver.id == "self":
        return False
    return (attr is not None and attr in NAMES and attr not in GENERIC) or _module_expr(receiver, held)


def offenders(source: str, where: str = "<source>") -> list[str]:
    """'where:line: statement' for every assignment in `source` that sets an attribute of a model module."""
    tree = ast.parse(source)
    held = module_names(tree)
    found = []
    for node in ast.walk(tree):
        hits: list[tuple[ast.expr, str | None]] = []
        if isinstance(node, ast.Assign):
            hits = [(e.value, e.attr) for t in node.targets for e in _names(t) if isinstance(e, ast.Attribute)]
        elif isinstance(node, (ast.AugAssign, ast.AnnAssign)) and isinstance(node.target, ast.Attribute):
            hits = [(node.target.value, node.target.attr)]
        elif isinstance(node, ast.Call) and _base_name(node.func) in ("setattr", "__setattr__") and len(node.args) >= 2:
            name = node.args[1]
            hits = [(node.args[0], name.value if isinstance(name, ast.Constant) else None)]
        if any(_flagged(r, a, held) for r, a in hits):
            found.append(f"{where}:{node.lineno}: {ast.unparse(node).splitlines()[0][:100]}")
    return found


def _outside_model() -> Iterator[Path]:
    for f in sorted((ROOT / "dsv4").rglob("*.py")):
        if MODEL not in f.parents:
            yield f


# ------------------------------------------------------------------------------------------ tests
def test_the_names_come_from_the_model_source():
    """The scan's names are read from dsv4/model: options, measured state and submodules of its modules,
    also those declared at class level or registered as buffers."""
    for name in (
        "act_format",
        "stored_format",
        "fp4_fake_quant",
        "activation_checkpointing",
        "load",
        "offset",
        "checkpoint_plan",
        "tid2eid",
        "swiglu_limit",
    ):
        assert name in NAMES, name
    assert {"attn", "ffn", "experts", "gate", "shared_experts", "layers", "mtp", "indexer"} <= SUBMODULES
    assert not {"load", "offset", "act_format", "tid2eid"} & SUBMODULES  # tensors and plain values
    # the per-call flags and results of the training forward are arguments and outputs now
    assert not {"want_indexer_loss", "indexer_loss", "balance_loss", "balance_alpha", "routed_override"} & NAMES


def test_no_code_outside_the_model_sets_a_model_module():
    found = [o for f in _outside_model() for o in offenders(f.read_text(), str(f.relative_to(ROOT)))]
    assert found == [], "\n".join(found)


def test_the_scan_catches_a_module_attribute_set_from_outside():
    """Each of these set a model module's attribute (several are what the code did before); each is found."""
    planted = [
        "layer.attn.want_indexer_loss = True",  # a name the model does not define
        "for moe in model.modules():\n    moe.routed_override = ExpertParallel(moe.experts)",
        "for name, m in model.named_modules():\n    m.act_format = act",
        "m.act_format = act",
        "model.get_submodule(path).stored_format = 'fp8'",
        "model.checkpoint_plan = {}",
        "self.model.serving_layout = layout",
        "ex.offset = lo",
        "mod.load = out['load.0']",
        "model.layers[0].ffn.experts = other",
        "a, layer.ffn.balance_alpha = 1, 0.5",
        "m.load += 1",
        "setattr(layer.ffn, 'routed_override', f)",
        "ex = layer.ffn.experts\nsetattr(ex, name, nn.Parameter(w))",  # a name known only at run time
        "for blk in [b for b in self.model.layers]:\n    blk.note = 1",
        "for i, layer in enumerate(model.layers):\n    layer.note = i",
        "(model.get_submodule(parent) if parent else model).note = 1",
    ]
    for source in planted:
        assert len(offenders(source)) == 1, source


def test_the_scan_catches_a_line_planted_in_real_code():
    """A mutation of a real file outside dsv4/model: one planted line, reported at its line number."""
    path = ROOT / "dsv4" / "train" / "trainer.py"
    source = path.read_text()
    assert offenders(source) == []
    planted = source + "\n\ndef _planted(layer):\n    layer.attn.want_indexer_loss = True\n"
    line = planted.count("\n")
    assert offenders(planted, "trainer.py") == [f"trainer.py:{line}: layer.attn.want_indexer_loss = True"]


def test_unrelated_objects_are_left_alone():
    """Attribute names that unrelated objects share with model modules, or their own attributes, pass."""
    for source in (
        "ctx.scale, ctx.mode = scale, mode",
        "trace.stage = 'after'",
        "p.grad = g",
        "args.device = 'cpu'",
        "self.load = 3",
        "self.offset = 0",
        "out.indexer_loss = loss",
        "seq.pages = []",
        "model.layers[0].attn.wq_a.weight.data = w",
        "setattr(t, _EP_ATTR, True)",
        "for p in model.parameters():\n    p.note = 1",
        "for name, p in model.named_parameters():\n    p.x = 1",
    ):
        assert offenders(source) == [], source


# ------------------------------------------------------------------------------------------ at run time
def test_a_training_forward_leaves_the_modules_as_they_were():
    """With every loss on, a training forward changes no module attribute but the measured expert load:
    the losses come back in the output, summed over the layers."""
    model = DeepSeekV4.from_config(ModelConfig.preset("tiny"), seed=0).train()
    tokens = torch.randint(0, model.cfg.vocab_size, (2, 40), generator=torch.Generator().manual_seed(0))
    missing = object()
    before = {n: dict(vars(m)) for n, m in model.named_modules()}
    out = model(tokens, mtp=True, indexer_loss=True, balance_alpha=1e-3)
    assert out.indexer_loss is not None and out.balance_loss is not None and out.balance_loss > 0
    for n, m in model.named_modules():
        now = vars(m)
        changed = {k for k in set(now) | set(before[n]) if now.get(k, missing) is not before[n].get(k, missing)}
        assert changed == ({"load"} if isinstance(m, MoE) else set()), (n, changed)  # MTP blocks' too
    assert all(a is layer.ffn.load for a, layer in zip(out.expert_load, model.layers, strict=True))


def test_the_expert_load_is_counted_where_it_is_read():
    """The load ([E] token counts of the routed choices) is measured in training mode or with autograd on
    (the bias update and the trainer read it); an inference forward (eval, no_grad: every engine step)
    measures none, so a stale count cannot be mistaken for its own."""
    model = DeepSeekV4.from_config(ModelConfig.preset("tiny"), seed=0)
    tokens = torch.randint(0, model.cfg.vocab_size, (2, 12), generator=torch.Generator().manual_seed(1))
    k, t = model.cfg.n_activated_experts, tokens.numel()
    for train, grad in ((True, False), (False, True), (False, False)):
        model.train(train)
        with torch.set_grad_enabled(grad):
            out = model(tokens)
        for load, layer in zip(out.expert_load, model.layers, strict=True):
            assert load is layer.ffn.load
            if train or grad:
                assert load.dtype == torch.long and int(load.sum()) == k * t and bool((load >= 0).all())
            else:
                assert load is None


def test_what_has_nowhere_to_go_is_refused_in_one_line():
    model = DeepSeekV4.from_config(ModelConfig.preset("tiny"), seed=0).train()
    layer = model.layers[1]
    assert layer.attn.indexer is not None  # tiny: layer 1 is a CSA layer
    x = torch.randn(1, 8, model.cfg.dim)
    tok = torch.zeros(1, 8, dtype=torch.long)
    with pytest.raises(ValueError, match="needs a losses dict"):
        layer.attn(x, torch.arange(8), indexer_loss=True)
    with pytest.raises(ValueError, match="needs a losses dict"):
        layer.ffn(x, tok, balance_alpha=0.1)
    with pytest.raises(ValueError, match="need with_losses=True"):
        layer(x.unsqueeze(2).expand(-1, -1, model.cfg.hc_mult, -1), torch.arange(8), tok, indexer_loss=True)
    with pytest.raises(ValueError, match="has 8 entries"):
        layer.ffn.set_load(torch.zeros(3, dtype=torch.long))
    with pytest.raises(ValueError, match="no module 'layers.9.attn'"):
        mark_stored(model, {"layers.9.attn": "fp8"})
    with pytest.raises(ValueError, match="stored format must be one of"):
        mark_stored(model, {"layers.0.attn.wq_a": "int4"})
