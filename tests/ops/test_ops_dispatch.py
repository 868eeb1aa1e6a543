"""The public seams of `dsv4.ops` dispatch: which backends exist and why one refuses, which ran, which is
asked for, and a preferred backend - what `dsv4 check` and the benches use instead of the registry."""

import pytest
import torch

from dsv4 import ops
from dsv4.ops import reference as ref


def _twice(x: torch.Tensor) -> torch.Tensor:
    return ref.hadamard(x) * 2


def _only_3d(x: torch.Tensor) -> str | None:
    return None if x.dim() == 3 else f"wants a 3-D x, got {x.dim()}-D"


@pytest.fixture
def fake():
    """A backend 'fake' of hadamard that runs on 3-D inputs only (twice the reference), low priority."""
    ops.register("hadamard", "fake", _twice, can_run=_only_3d, priority=-5)
    yield "fake"
    ops.unregister("hadamard", "fake")


def test_refusal_names_the_reason_an_explicit_request_raises(fake):
    x2, x3 = torch.randn(2, 8), torch.randn(1, 2, 8)
    assert ops.refusal("hadamard", "fake", x3) is None
    assert ops.refusal("hadamard", "fake", x2) == "wants a 3-D x, got 2-D"
    with pytest.raises(ops.BackendUnavailable, match="wants a 3-D x, got 2-D"):
        ops.hadamard(x2, backend="fake")
    assert "no backend 'nope'" in ops.refusal("hadamard", "nope", x3)
    with pytest.raises(KeyError):
        ops.refusal("no_such_op", "reference")


def test_refusal_in_deterministic_mode():
    ops.register("hadamard", "racy", _twice, deterministic=False)
    try:
        assert ops.refusal("hadamard", "racy", torch.randn(2, 8)) is None
        ops.set_deterministic(True)
        assert "not deterministic" in ops.refusal("hadamard", "racy", torch.randn(2, 8))
    finally:
        ops.set_deterministic(False)
        ops.unregister("hadamard", "racy")


def test_which_ran_collects_the_calls_of_the_block(fake):
    x3 = torch.randn(1, 2, 8)
    ops.hadamard(x3)  # before the block: not counted
    with ops.which_ran() as ran:
        ops.hadamard(x3, backend="fake")
        ops.hadamard(x3)
        ops.rms_norm(x3, None, 1e-6)
        assert ran == {}  # filled when the block ends
    assert ran == {"hadamard": ["fake", "reference"], "rms_norm": ["reference"]}
    with ops.which_ran() as none:
        pass
    assert none == {}


def test_which_refused_names_the_faster_backends_passed_over_and_why(fake):
    """A backend that outranks the reference but refuses the inputs is listed with its reason when the default
    choice passes it over; not when it runs, not when it is merely not preferred for the inputs, and not a
    refusing backend that ranks below what ran (the low-priority 'fake')."""
    x2, x3 = torch.randn(2, 8), torch.randn(1, 2, 8)
    ops.register("hadamard", "picky", _twice, can_run=_only_3d, priority=20)
    ops.register("hadamard", "shy", _twice, priority=30, prefer=lambda x: False)
    try:
        with ops.which_ran() as ran, ops.which_refused() as refused:
            ops.hadamard(x2)
        assert ran == {"hadamard": ["reference"]} and list(refused) == ["hadamard"]
        assert refused["hadamard"].pop("picky") == "wants a 3-D x, got 2-D"
        assert set(refused["hadamard"]) <= {"triton"}  # (on a CPU, triton's hadamard refuses CPU tensors too)
        with ops.which_ran() as ran, ops.which_refused() as refused:
            ops.hadamard(x3)
            ops.hadamard(x2, backend="reference")  # an explicit request passes nothing over
        assert ran == {"hadamard": ["picky", "reference"]} and refused == {}
        with ops.which_refused() as outer:  # nested blocks, both empty when the inner one ends
            with ops.which_refused() as inner:
                pass
            ops.hadamard(x2)
        assert inner == {} and outer["hadamard"]["picky"] == "wants a 3-D x, got 2-D"
        with ops.which_refused() as after:
            pass
        ops.hadamard(x2)  # outside every block: nothing recorded anywhere
        assert after == {} and inner == {} and "hadamard" in outer
    finally:
        ops.unregister("hadamard", "picky")
        ops.unregister("hadamard", "shy")


def test_requested_and_inherited_choices():
    assert ops.requested("hadamard") is None
    with ops.use_backend("reference"):
        assert ops.requested("hadamard") == ops.requested("rms_norm") == "reference"
        with ops.use_backend({"hadamard": "fake"}):  # replaces the enclosing choice
            assert ops.requested("hadamard") == "fake" and ops.requested("rms_norm") is None
        with ops.use_backend({"hadamard": "fake"}, inherit=True):  # keeps it for the other ops
            assert ops.requested("hadamard") == "fake" and ops.requested("rms_norm") == "reference"
        assert ops.requested("hadamard") == "reference"
    assert ops.requested("hadamard") is None


def test_prefer_backend_wins_the_default_where_it_can_run(fake):
    x2, x3 = torch.randn(2, 8), torch.randn(1, 2, 8)
    assert ops.resolve("hadamard", None, x3).name == "reference"  # priority -5: never the default
    with ops.prefer_backend("fake"):
        assert ops.resolve("hadamard", None, x3).name == "fake"
        assert torch.equal(ops.hadamard(x3), 2 * ref.hadamard(x3)) and ops.last_backend("hadamard") == "fake"
        assert ops.resolve("hadamard", None, x2).name == "reference"  # refused: the usual default runs
        assert ops.resolve("rms_norm", None, x3, None, 1e-6).name != "fake"  # ops without it: unchanged
        with ops.use_backend("reference"):  # an explicit choice still wins
            assert ops.resolve("hadamard", None, x3).name == "reference"
    assert ops.resolve("hadamard", None, x3).name == "reference"
    with ops.prefer_backend(None):
        assert ops.resolve("hadamard", None, x3).name == "reference"


def test_prefer_backend_leaves_the_registry_as_it_was(fake):
    before = {op: ops.backends(op) for op in ops.ops()}
    with ops.prefer_backend("fake"):
        pass
    assert {op: ops.backends(op) for op in ops.ops()} == before
    assert ops.resolve("hadamard", None, torch.randn(1, 2, 8)).name == "reference"


def test_every_reference_lives_in_reference_py():
    """The contract: each op's reference backend is the function of the same name in dsv4.ops.reference."""
    assert {"fp8_linear", "fp4_linear", "moe_experts"} <= set(ops.ops())
    for op in ops.ops():
        assert ops.resolve(op, "reference").fn is getattr(ref, op), op
        assert getattr(ops, op).__doc__ == getattr(ref, op).__doc__


def test_exact_accumulation_and_backend_choice_are_both_per_thread():
    """A thread in exact (float64) mode or with a backend chosen does not change what another thread
    computes: both settings belong to the thread that set them."""
    import threading

    from dsv4.ops.precision import acc_dtype, exact_accumulation

    seen: dict[str, object] = {}
    inside, done = threading.Event(), threading.Event()

    def other() -> None:
        inside.wait()
        seen["dtype"], seen["requested"] = acc_dtype(), ops.requested("hadamard")
        done.set()

    t = threading.Thread(target=other)
    t.start()
    with exact_accumulation(True), ops.use_backend({"hadamard": "reference"}):
        assert acc_dtype() == torch.float64
        inside.set()
        done.wait(30)
    t.join(30)
    assert seen == {"dtype": torch.float32, "requested": None}
    assert acc_dtype() == torch.float32
