"""`dsv4.bench.regions`: kernels counted in the region whose window they start in, and the model's blocks
annotated for the profiler (by forward hooks, removed after) without changing what the model computes."""

from __future__ import annotations

import random
from types import SimpleNamespace

import pytest
import torch

from dsv4.bench.regions import TOP_NAME, attribute, region_table, split_events, synced_regions
from dsv4.config import ModelConfig
from dsv4.engine import Engine, EngineConfig, SamplingParams
from dsv4.model import DeepSeekV4


def test_attribute_counts_each_kernel_in_the_window_it_starts_in():
    spans = [("layers", 10.0, 20.0), ("mtp", 30.0, 40.0), ("layers", 50.0, 60.0)]
    # (start, duration in us): inside, on a window's end, between windows, on a start, a later window, after all
    kernels = [(12.0, 2.0), (20.0, 1.0), (25.0, 3.0), (30.0, 4.0), (55.0, 1.0), (70.0, 5.0)]
    want = {
        "layers": {"kernels": 1.5, "ms": 0.002, "top": []},
        "mtp": {"kernels": 0.5, "ms": 0.002, "top": []},
        "rest": {"kernels": 1.0, "ms": 0.004, "top": []},
        "total": {"kernels": 3.0, "ms": 0.008, "top": []},
    }
    assert attribute(spans, kernels, steps=2) == want
    shuffled = spans[:]
    random.Random(0).shuffle(shuffled)
    assert attribute(shuffled, kernels[::-1], steps=2) == want  # order of neither input matters
    assert attribute([], kernels, steps=1)["rest"] == {"kernels": 6.0, "ms": 0.016, "top": []}
    with pytest.raises(ValueError, match="steps must be >= 1"):
        attribute(spans, kernels, steps=0)


def test_attribute_names_each_regions_largest_kernels():
    """Named kernels: per region the `top` with the most device time per step, with their calls per step,
    ties broken by name, names cut to TOP_NAME characters; "total" ranks them over every region."""
    spans = [("layers", 0.0, 100.0)]
    long = "void cutlass::Kernel2<" + "x" * 200 + ">"
    kernels = [
        (1.0, 4.0, "gemm"),
        (2.0, 4.0, "gemm"),
        (3.0, 2.0, "norm"),
        (4.0, 2.0, "add"),
        (5.0, 1.0, long),
        (150.0, 6.0, "accept"),
        (160.0, 1.0, "draw"),
    ]
    table = attribute(spans, kernels, steps=2, top=3)
    assert table["layers"]["top"] == [["gemm", 0.004, 1.0], ["add", 0.001, 0.5], ["norm", 0.001, 0.5]]
    assert table["rest"]["top"] == [["accept", 0.003, 0.5], ["draw", 0.0005, 0.5]]
    assert table["total"]["top"] == [["gemm", 0.004, 1.0], ["accept", 0.003, 0.5], ["add", 0.001, 0.5]]
    cut = attribute(spans, [(1.0, 1.0, long)], steps=1)["layers"]["top"]
    assert cut == [[long[:TOP_NAME], 0.001, 1.0]] and len(cut[0][0]) == TOP_NAME
    assert table["layers"]["kernels"] == 2.5 and table["layers"]["ms"] == 0.0065


def test_split_events_keeps_host_windows_and_device_events():
    """The profiler's events as a CUDA run gives them: a region's annotation on the host is a window, its
    device-side copy is neither a window nor a kernel; kernels and copies on the device are device events;
    other host events are ignored."""

    def event(name, device, start, end):
        return SimpleNamespace(name=name, device_type=device, time_range=SimpleNamespace(start=start, end=end))

    events = [
        event("dsv4.region.layers", "DeviceType.CPU", 10.0, 20.0),
        event("dsv4.region.layers", "DeviceType.CUDA", 11.0, 19.0),
        event("aten::mm", "DeviceType.CPU", 12.0, 13.0),
        event("gemm_kernel", "DeviceType.CUDA", 12.5, 14.0),
        event("Memcpy HtoD", "DeviceType.CUDA", 21.0, 21.5),
    ]
    spans, kernels = split_events(events)
    assert spans == [("layers", 10.0, 20.0)]
    assert kernels == [(12.5, 1.5, "gemm_kernel"), (21.0, 0.5, "Memcpy HtoD")]
    assert attribute(spans, kernels, 1)["layers"] == {
        "kernels": 1.0,
        "ms": 0.0015,
        "top": [["gemm_kernel", 0.0015, 1.0]],
    }


def _engine(model: DeepSeekV4) -> Engine:
    engine = Engine(model, EngineConfig(max_seqs=2, speculative=2, pad_steps=True, cuda_graphs=False))
    for i in range(2):
        engine.add_request(str(i), [5 + i + j for j in range(9)], SamplingParams(max_tokens=12, temperature=0))
    return engine


def _drain(engine: Engine, step=None) -> dict[str, list[int]]:
    """Run the engine to its end (first through `step` when given, once): every request's tokens."""
    tokens: dict[str, list[int]] = {}
    outs = step() if step is not None else []
    while True:
        for o in outs:
            tokens.setdefault(o.request_id, []).extend(o.new_tokens)
        if not engine.has_work():
            return tokens
        outs = engine.step()


def test_synced_regions_annotate_the_blocks_and_the_mtp_block_and_change_no_token():
    """A speculative engine's steps under `region_table` on the CPU: the main model's blocks and the MTP
    block's passes appear as regions (no device kernels to count there), the engine's tokens equal an
    unhooked engine's, and no hook is left on the model afterwards."""
    model = DeepSeekV4.from_config(ModelConfig.preset("tiny"), seed=0).eval()
    plain = _drain(_engine(model))
    wrapped = _engine(model)
    seen: list[list] = []

    def step():
        outs = wrapped.step()
        seen.append(outs)
        return outs

    table = region_table(step, 3, model)
    assert set(table) == {"layers", "mtp", "rest", "total"}, table
    assert all(v == {"kernels": 0.0, "ms": 0.0, "top": []} for v in table.values())  # a CPU model: no device kernels
    hooked = [model.layers[0], model.layers[-1], *model.mtp]
    assert not any(m._forward_pre_hooks or m._forward_hooks for m in hooked)
    assert len(seen) == 4  # one untimed step, then three
    got = _drain(wrapped, lambda: [o for outs in seen for o in outs])
    assert plain and sum(map(len, plain.values())) == 24 and got == plain
    with synced_regions(model):
        assert model.layers[0]._forward_pre_hooks and model.mtp[0]._forward_hooks
        with torch.profiler.profile() as prof:
            engine = _engine(model)
            engine.step()
            engine.step()  # (the first step is the prompts': the MTP block catches up on them too)
    names = {e.name for e in prof.events()}
    assert {"dsv4.region.layers", "dsv4.region.mtp"} <= names, names
