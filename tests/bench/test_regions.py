"""`dsv4.bench.regions`: kernels counted in the region whose window they start in, and the model's regions
annotated for the profiler without changing what the model computes."""

from __future__ import annotations

import random

import pytest
import torch

from dsv4.bench.regions import attribute, region_table, synced_regions
from dsv4.config import ModelConfig
from dsv4.engine import Engine, EngineConfig, SamplingParams
from dsv4.model import DeepSeekV4


def test_attribute_counts_each_kernel_in_the_window_it_starts_in():
    spans = [("append", 10.0, 20.0), ("draft", 30.0, 40.0), ("append", 50.0, 60.0)]
    # (start, duration in us): inside, on a window's end, between windows, on a start, a later window, after all
    kernels = [(12.0, 2.0), (20.0, 1.0), (25.0, 3.0), (30.0, 4.0), (55.0, 1.0), (70.0, 5.0)]
    want = {
        "append": {"kernels": 1.5, "ms": 0.002},
        "draft": {"kernels": 0.5, "ms": 0.002},
        "rest": {"kernels": 1.0, "ms": 0.004},
        "total": {"kernels": 3.0, "ms": 0.008},
    }
    assert attribute(spans, kernels, steps=2) == want
    shuffled = spans[:]
    random.Random(0).shuffle(shuffled)
    assert attribute(shuffled, kernels[::-1], steps=2) == want  # order of neither input matters
    assert attribute([], kernels, steps=1)["rest"] == {"kernels": 6.0, "ms": 0.016}
    with pytest.raises(ValueError, match="steps must be >= 1"):
        attribute(spans, kernels, steps=0)


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


def test_synced_regions_annotate_the_forward_and_the_draft_and_change_no_token():
    """A speculative engine's steps under `region_table` on the CPU: the forward and the MTP passes appear as
    regions (no device kernels to count there), the engine's tokens equal an unwrapped engine's, and the
    model's methods are its class's again afterwards."""
    model = DeepSeekV4.from_config(ModelConfig.preset("tiny"), seed=0).eval()
    plain = _drain(_engine(model))
    wrapped = _engine(model)
    seen: list[list] = []

    def step():
        outs = wrapped.step()
        seen.append(outs)
        return outs

    table = region_table(step, 3, model)
    assert set(table) == {"append", "draft", "rest", "total"}, table
    assert all(v == {"kernels": 0.0, "ms": 0.0} for v in table.values())  # a CPU model: no device kernels
    assert "append" not in vars(model) and "draft" not in vars(model)
    assert len(seen) == 4  # one untimed step, then three
    got = _drain(wrapped, lambda: [o for outs in seen for o in outs])
    assert plain and sum(map(len, plain.values())) == 24 and got == plain
    with synced_regions(model):
        assert "append" in vars(model)
        with torch.profiler.profile() as prof:
            _engine(model).step()
    assert any(e.name == "dsv4.region.append" for e in prof.events())
