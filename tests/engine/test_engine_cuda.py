"""The serving engine on a GPU: every step replayed from the CUDA graph of its bucket.

A graph replays the kernels that the same bucketed step runs eagerly, on the same shapes, so tokens and
log-probabilities must be identical bit for bit (the eager bucketed steps are themselves checked against
the ragged steps on the CPU, tests/engine/test_engine.py). Also: the steps really replay (no eager step, no
capture after the warm-up, no kernel compilation after it), and launching a step before reading the last
one (overlap) changes nothing.
"""

from __future__ import annotations

import pytest
import torch

from dsv4 import DeepSeekV4, ops
from dsv4.check.inputs import check_config
from dsv4.engine import Engine, EngineConfig, SamplingParams
from dsv4.ops.reference_plan import INDEX_OPS

pytestmark = pytest.mark.gpu

LENGTHS = (5, 40, 23, 70, 1, 17, 130, 9)
NEW = 12


@pytest.fixture(scope="module")
def model() -> DeepSeekV4:
    return DeepSeekV4.from_config(check_config("tiny"), seed=0, dtype=torch.bfloat16, device="cuda").eval()


@pytest.fixture(scope="module")
def prompts(model) -> list[list[int]]:
    g = torch.Generator().manual_seed(1)
    return [torch.randint(2, model.cfg.vocab_size, (n,), generator=g).tolist() for n in LENGTHS]


def run(model, prompts, params, warm: bool, **config):
    cfg = dict(max_seqs=8, max_batch_tokens=48, page_size=16, chunk_len=8)
    cfg.update(config)
    engine = Engine(model, EngineConfig(**cfg))
    if warm:
        engine.warmup()
    arrivals = [0, 2, 3, 0, 7, 5, 9, 1]
    outs = {i: [] for i in range(len(prompts))}
    lps = {i: [] for i in range(len(prompts))}
    pending, step = list(range(len(prompts))), 0
    while pending or engine.has_work():
        for i in [i for i in pending if arrivals[i] <= step]:
            engine.add_request(str(i), prompts[i], params[i])
            pending.remove(i)
        for out in engine.step():
            outs[int(out.request_id)].extend(out.new_tokens)
            lps[int(out.request_id)].extend((x.token, x.logprob, tuple(x.top)) for x in out.new_logprobs)
        step += 1
    return [outs[i] for i in range(len(prompts))], [lps[i] for i in range(len(prompts))], engine


@pytest.mark.parametrize("sampled,logprobs", [(False, 2), (True, 2), (True, None), (False, 0)])
def test_graphed_steps_equal_the_eager_bucketed_steps(model, prompts, sampled, logprobs):
    """Alternatives (logprobs 2) are drawn eagerly after the graph; otherwise the graph draws every row."""
    params = [
        SamplingParams(
            max_tokens=NEW, temperature=0.8 if sampled else 0, seed=7 + i, ignore_eos=True, logprobs=logprobs
        )
        for i in range(len(prompts))
    ]
    eager, eager_lp, e0 = run(model, prompts, params, warm=False, cuda_graphs=False, pad_steps=True, overlap=False)
    graphed, graphed_lp, e1 = run(model, prompts, params, warm=True)
    assert graphed == eager and graphed_lp == eager_lp
    assert e0.runner.padded_steps == e0.stats["steps"] and e0.runner.graph_steps == 0
    assert e1.runner.eager_steps == 0 and e1.runner.graph_steps == e1.stats["steps"]
    assert e1.runner.late_captures == 0
    m = e1.metrics()
    assert m["kernel_compiles_after_ready"] in (0, None)
    assert e1.manager.free_pages()[0] == e1.layout.n_window_pages - 1  # every page came back


@pytest.mark.parametrize("sampled", [False, True])
def test_graphs_captured_between_steps_change_nothing(model, prompts, sampled):
    """Without the start-up capture each bucket's graph is captured when a step first needs it, between
    two steps: its empty warm-up steps draw into the buffer that holds the last step's tokens, which the
    next step feeds to its decode rows (overlap). Those tokens must survive: the same tokens as eager."""
    params = [
        SamplingParams(max_tokens=NEW, temperature=0.8 if sampled else 0, seed=7 + i, ignore_eos=True)
        for i in range(len(prompts))
    ]
    eager, _, _ = run(model, prompts, params, warm=False, cuda_graphs=False, pad_steps=True, overlap=False)
    late, _, engine = run(model, prompts, params, warm=False)
    assert engine.runner.late_captures > 1 and engine.runner.eager_steps == 0
    assert late == eager


@pytest.mark.parametrize("sampled", [False, True])
def test_deterministic_mode_batching_does_not_change_tokens(model, prompts, sampled):
    """`--deterministic` on the GPU, every step from its bucket's graph (README: "Batching does not change
    results"): each request alone gives the tokens and log-probabilities it gets in a busy batch with
    arrivals at other steps, bit for bit. The Triton kernels run here, not the reference ops: each must
    compute a row the same way whatever else is in the step (hc_pre's K split, for one, is fixed under
    exact accumulation for this)."""
    params = [
        SamplingParams(max_tokens=NEW, temperature=0.8 if sampled else 0, seed=7 + i, ignore_eos=True, logprobs=0)
        for i in range(len(prompts))
    ]
    with ops.which_ran() as ran:
        busy, busy_lp, engine = run(model, prompts, params, warm=False, deterministic=True)
    assert engine.runner.eager_steps == 0
    # the projections took the fixed-plan GEMM (captured into the graphs), not float64 products
    assert "triton" in ran["linear"] and "triton" in ran["linear_fp32"]
    assert ran["pool_groups"] == ["triton"]  # the compressors' paged pooling, in place of gathered copies
    assert ran["write_rows"] == ["triton"]  # the caches' row writes
    # the router, the step's plan and each layer's attention rows: one launch each (exact accumulation: the
    # router's float64 form)
    assert all(ran[op] == ["triton"] for op in ("route", *INDEX_OPS))
    for i, p in enumerate(prompts):
        alone, alone_lp, _ = run(model, [p], [params[i]], warm=False, deterministic=True, max_seqs=1)
        assert alone[0] == busy[i], f"request {i}: alone {alone[0]}, in the batch {busy[i]}"
        assert alone_lp[0] == busy_lp[i], f"request {i}: log-probabilities differ"


def test_speculative_steps_replay_graphs_captured_at_warm_up(model, prompts):
    """`--speculative`: prompt chunks in the buckets' graphs (with the MTP block's catch-up), and greedy rows,
    sampled rows and rows that want their log-probabilities in the fixed-shape step's graphs, all captured
    by `warmup`: no eager step, no capture and no kernel compilation after it; the tokens of the same steps
    run eagerly (deterministic mode: a row computes the same way at any batch). The graphs took their
    sampled acceptance from the fused kernel (its per-row settings are strided columns of the step's
    integers: a kernel that refused them would leave the reference in the graph, unseen), and the carry
    that feeds the next step, left and read in one launch each, likewise."""
    temps = (0.8, 0, 1.3, 0, 1.0, 0.5, 0, 0.9)
    params = [
        SamplingParams(max_tokens=NEW, temperature=t, seed=7 + i, ignore_eos=True, logprobs=0 if i % 2 else None)
        for i, t in enumerate(temps)
    ]
    spec = dict(speculative=2, deterministic=True)
    eager, _, e0 = run(model, prompts, params, warm=False, cuda_graphs=False, pad_steps=True, **spec)
    warm = Engine(model, EngineConfig(max_seqs=8, max_batch_tokens=48, page_size=16, chunk_len=8, **spec))
    n_graphs = warm.warmup() - len(warm.runner.graphs)
    assert n_graphs == len(warm.spec.graphs) == 4 * 2  # batches 1, 2, 4, 8; greedy and sampled
    captured = warm.graph_backends  # the sampled variant's acceptance: the fused kernel
    assert captured["ran"]["speculative_accept"] == ["triton"] and "speculative_accept" not in captured["refused"]
    for op in ("write_carry", "read_carry", "token_logprobs", "spec_advance"):  # the carry; log p; the draft's integers
        assert captured["ran"][op] == ["triton"] and op not in captured["refused"]
    graphed, graphed_lp, e1 = run(model, prompts, params, warm=True, **spec)
    assert len(e1.spec.graphs) == n_graphs and e1.runner.late_captures == 0  # no capture after the warm-up
    assert e1.runner.eager_steps == 0 and e1.runner.graph_steps > 0
    assert e1.metrics()["kernel_compiles_after_ready"] == 0
    assert graphed == eager
    assert all((lp == []) == (params[i].logprobs is None) for i, lp in enumerate(graphed_lp))
    assert e0.spec_stats["fixed_steps"] > 0 and e1.spec_stats["fixed_steps"] == e0.spec_stats["fixed_steps"]


def test_the_step_clock_times_every_launched_step_in_order(model, prompts):
    """`Runner.clock` (what `bench engine` reads the device's busy and idle time from): one (start, end,
    shape) per launched step, each span positive, each step starting at or after the last one's end (one
    stream); `device_time` sums them per step and splits them by step shape without losing a step."""
    from dsv4.bench.engine import device_time

    engine = Engine(model, EngineConfig(max_seqs=8, max_batch_tokens=48, page_size=16, chunk_len=8))
    engine.warmup()
    engine.runner.clock = []
    before = engine.runner.graph_steps + engine.runner.eager_steps
    for i, p in enumerate(prompts):
        engine.add_request(str(i), p, SamplingParams(max_tokens=NEW, temperature=0, ignore_eos=True))
    while engine.has_work():
        engine.step()
    clock = engine.runner.clock
    torch.cuda.synchronize()
    assert len(clock) == engine.runner.graph_steps + engine.runner.eager_steps - before > 0
    assert all(start.elapsed_time(end) > 0 for start, end, _ in clock)
    assert all(end.elapsed_time(nxt) >= 0 for (_, end, _), (nxt, _, _) in zip(clock, clock[1:], strict=False))
    t = device_time(clock)
    assert t["busy"] * len(clock) == pytest.approx(sum(a.elapsed_time(b) for a, b, _ in clock))
    assert t["idle"] >= 0
    steps = engine.runner.bucket_steps
    shapes = {f"{d}+{c}" for d, c in steps} | ({"ragged"} if engine.runner.eager_steps else set())
    assert set(t["by_shape"]) <= shapes and sum(map(len, t["by_shape"].values())) == len(clock)


def test_a_step_that_cannot_be_captured_says_why(model, prompts):
    """Every op forced to its reference: MoE dispatch reads a data-dependent shape (`torch.where`), which a
    CUDA graph cannot hold. The capture's failure names the cause and the way out instead of CUDA's bare
    'operation not permitted when stream is capturing'; the same engine without graphs runs."""
    from dsv4.ops.cuda_graphs import GraphCaptureError

    params = SamplingParams(max_tokens=2, temperature=0, ignore_eos=True)
    with ops.use_backend("reference"):
        with pytest.raises(GraphCaptureError, match="--no-cuda-graph"):
            run(model, prompts[:2], [params] * 2, warm=True)
        out, _, _ = run(model, prompts[:2], [params] * 2, warm=False, cuda_graphs=False)
    assert [len(o) for o in out] == [2, 2]
    # the process loses nothing: random ops run (the failed capture left the generators in capture mode,
    # and every later draw in the process raised), and a new graphed engine samples
    seed = torch.cuda.initial_seed()
    assert torch.randn(4, device="cuda").isfinite().all() and torch.cuda.initial_seed() == seed
    sampled = SamplingParams(max_tokens=3, temperature=1.0, seed=5, ignore_eos=True)
    out, _, _ = run(model, prompts[:2], [sampled] * 2, warm=True)
    assert [len(o) for o in out] == [3, 3]
