"""The paged step's plan ops (`plan_window`, `plan_groups`, `plan_keep`, `plan_entries`; backend "triton")
against their plain-torch references: integers from integers, so every output must be equal - values,
dtypes and shapes - on any inputs, not only on the ones an engine builds. The fuzz draws positions below
zero (the window's keys before a sequence's start, padding), tables with missing pages (-1), lists of
tokens with repeats, and page sizes, ratios and windows of every kind the layouts use."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton", reason="triton is not installed: no triton backend to test")

from triton_interp import DEV, interpret_unless_cuda, poison_allocator  # noqa: E402

import dsv4.ops as ops  # noqa: E402
from dsv4.config import ModelConfig  # noqa: E402
from dsv4.model.paged import BatchCache, plan_step, uniform_inputs  # noqa: E402
from dsv4.ops import reference as ref  # noqa: E402
from dsv4.ops.reference_plan import INDEX_OPS, PLAN_OPS  # noqa: E402
from dsv4.ops.triton import plan as plan_module  # noqa: E402


@pytest.fixture(autouse=True)
def _interpret(monkeypatch):
    interpret_unless_cuda(monkeypatch)
    poison_allocator(monkeypatch, plan_module)
    ops.reset_calls()
    yield


def same(got, want, name: str = "") -> None:
    if isinstance(want, (tuple, list)):
        assert isinstance(got, (tuple, list)) and len(got) == len(want), name
        for i, (a, b) in enumerate(zip(got, want, strict=True)):
            same(a, b, f"{name}[{i}]")
        return
    if want is None:
        assert got is None, name
        return
    assert got.dtype == want.dtype and got.shape == want.shape, (name, got.dtype, want.dtype, got.shape, want.shape)
    assert torch.equal(got, want), f"{name}: {int((got != want).sum())} of {want.numel()} differ"


def fuzz(seed: int, T: int = 40, B: int = 5, width: int = 9, max_pos: int = 3000) -> dict:
    g = torch.Generator().manual_seed(seed)

    def ints(lo: int, hi: int, *shape: int) -> torch.Tensor:
        return torch.randint(lo, hi, shape, generator=g).to(DEV)

    return {
        "pos": ints(-150, max_pos, T),
        "rows": ints(0, B, T),
        "wt": ints(-1, 60, B, width),
        "ct": ints(-1, 60, B, width),
        "start": ints(-3, max_pos, B),
        "seg": ints(0, T, B),
        "state": ints(0, 9, B),
        "length": ints(-3, max_pos, B),
        "list": ints(0, T, T // 2 + 1),
        "flags": ints(0, 2, T) == 1,
    }


@pytest.mark.parametrize("seed", range(3))
@pytest.mark.parametrize("page_size,window", [(256, 128), (128, 128), (16, 8), (64, 7)])
def test_window(seed, page_size, window):
    f = fuzz(seed)
    args = (f["pos"], f["rows"], f["wt"], page_size, window)
    same(ops.plan_window(*args, backend="triton"), ref.plan_window(*args))
    # a strided view of the positions, a table with one column
    args = (f["pos"][::2], f["rows"][::2], f["wt"][:, :1], page_size, window)
    same(ops.plan_window(*args, backend="triton"), ref.plan_window(*args))


@pytest.mark.parametrize("seed", range(3))
@pytest.mark.parametrize("ratio,coff,page_size", [(4, 2, 256), (128, 1, 256), (4, 1, 16), (8, 2, 64)])
@pytest.mark.parametrize("listed", [False, True])
def test_groups_and_keep(seed, ratio, coff, page_size, listed):
    f = fuzz(seed)
    lst = f["list"] if listed else None
    ring_len = coff * ratio + 16
    args = (lst, f["pos"], f["rows"], f["start"], f["seg"], f["state"], f["ct"], f["flags"], ratio, page_size)
    same(ops.plan_groups(*args, ring_len, coff, backend="triton"), ref.plan_groups(*args, ring_len, coff), "groups")
    for tails in (False, True):
        args = (lst, f["pos"], f["rows"], f["length"], f["state"], f["ct"], f["flags"], ratio, page_size, ring_len)
        same(ops.plan_keep(*args, tails, backend="triton"), ref.plan_keep(*args, tails), f"keep tails={tails}")


@pytest.mark.parametrize("seed", range(2))
@pytest.mark.parametrize("ratio,page_size,n_max", [(4, 256, 750), (128, 256, 23), (4, 16, 0), (128, 128, 5000)])
def test_entries(seed, ratio, page_size, n_max):
    f = fuzz(seed)
    for rows, pos in ((f["rows"], f["pos"]), (f["rows"][:3], None), (f["rows"][1::3], f["pos"][1::3])):
        args = (rows, f["ct"], ratio, page_size, n_max, pos)
        same(ops.plan_entries(*args, backend="triton"), ref.plan_entries(*args))


def test_empty_lists():
    f = fuzz(0)
    none = f["list"][:0]
    g = ops.plan_groups(none, f["pos"], f["rows"], f["start"], f["seg"], f["state"], f["ct"], f["flags"], 4, 256, 24, 2)
    same(
        g,
        ref.plan_groups(
            none, f["pos"], f["rows"], f["start"], f["seg"], f["state"], f["ct"], f["flags"], 4, 256, 24, 2
        ),
    )
    args = (none, f["pos"], f["rows"], f["length"], f["state"], f["ct"], f["flags"], 4, 256, 24, True)
    same(ops.plan_keep(*args, backend="triton"), ref.plan_keep(*args))
    assert ops.last_backend("plan_keep") == "triton"


def plans_equal(a, b) -> None:
    same(a.window_write, b.window_write, "window_write")
    same(a.window_idx, b.window_idx, "window_idx")
    assert a.ratios.keys() == b.ratios.keys()
    for r, pa in a.ratios.items():
        pb = b.ratios[r]
        for name in ("group_pos", "group_j", "group_new", "group_ring", "entry_write", "group_live", "keep_tok"):
            same(getattr(pa, name), getattr(pb, name), f"{r}.{name}")
        for name in ("ring_write", "tail_write", "visible"):
            same(getattr(pa, name), getattr(pb, name), f"{r}.{name}")
        same(pa.cand, pb.cand, f"{r}.cand")
        same(pa.index_cells, pb.index_cells, f"{r}.index_cells")


@pytest.mark.parametrize("page_tails", [False, True])
def test_a_models_whole_plan_prefill_decode_and_verify(page_tails):
    """plan_step on the kernels gives the reference's plan for a prompt, a decode step and a verify step of
    a real layout (V4's ratios 4 and 128, padding rows with no pages), and reports the kernels ran."""
    cfg = ModelConfig.preset("tiny")
    cache = BatchCache(cfg, 3, 300, DEV, torch.float32, page_size=128)
    layout = cache.layout
    if page_tails:
        from dataclasses import replace

        layout = replace(layout, page_tails=True)
    wt, ct = cache.wtable.clone(), cache.ctable.clone()
    wt[2], ct[2] = -1, -1  # a padding row
    g = torch.Generator().manual_seed(0)
    for s, start, static in ((37, 0, 0), (1, 130, None), (3, 255, None)):
        tokens = torch.randint(0, cfg.vocab_size, (3, s), generator=g).to(DEV)
        inp = uniform_inputs(
            tokens, torch.full((3,), start, device=DEV), wt, ct, cache.state, layout, static_start=static
        )
        with ops.use_backend("reference"):
            want = plan_step(inp, layout)
        with ops.use_backend({op: "triton" for op in PLAN_OPS}, inherit=True), ops.which_ran() as ran:
            got = plan_step(inp, layout)
        assert all(ran[op] == ["triton"] for op in PLAN_OPS)
        plans_equal(got, want)
        same(plan_step(inp, layout, compressed=False).window_idx, want.window_idx)


def test_refusals_name_their_reason():
    f = fuzz(0)
    assert ops.refusal("plan_window", "triton", f["pos"], f["rows"], f["wt"], 256, 128) is None
    assert "positions" in ops.refusal("plan_window", "triton", f["pos"].int(), f["rows"], f["wt"], 256, 128)
    assert "wtable" in ops.refusal("plan_window", "triton", f["pos"], f["rows"], f["wt"][0], 256, 128)
    args = (None, f["pos"], f["rows"], f["start"], f["seg"], f["state"], f["ct"])
    assert "multiple" in ops.refusal("plan_groups", "triton", *args, f["flags"], 3, 256, 22, 1)
    assert "has_page" in ops.refusal("plan_groups", "triton", *args, f["flags"].long(), 4, 256, 24, 2)
    assert "n_max" in ops.refusal("plan_entries", "triton", f["rows"], f["ct"], 4, 256, -1, None)
    with pytest.raises(ops.BackendUnavailable, match="positions"):
        ops.plan_window(f["pos"].float(), f["rows"], f["wt"], 256, 128, backend="triton")


@pytest.mark.parametrize("mode", ["ragged", "padded", "speculative"])
def test_every_plan_an_engine_makes_is_the_references(monkeypatch, mode):
    """The serving engine's own step inputs - prompt chunks beside decode rows, bucketed steps with padding
    rows, prefix-cache hits, speculative verify steps and the MTP block's window-only plans: each plan is
    made on the references and on the kernels, and the two must be equal (the kernels' plan is the one
    the step then uses: the engine finishes every request)."""
    from dsv4 import DeepSeekV4
    from dsv4.check.inputs import check_config
    from dsv4.engine import Engine, EngineConfig, SamplingParams
    from dsv4.model import transformer

    model = DeepSeekV4.from_config(check_config("tiny"), seed=0).eval().to(DEV)
    real, made = transformer.plan_step, []

    def both(inp, layout, compressed=True):
        with ops.use_backend(dict.fromkeys(PLAN_OPS, "reference"), inherit=True):
            want = real(inp, layout, compressed)
        with ops.use_backend(dict.fromkeys(PLAN_OPS, "triton"), inherit=True):
            got = real(inp, layout, compressed)
        plans_equal(got, want)
        made.append((inp.positions.numel(), compressed))
        return got

    monkeypatch.setattr(transformer, "plan_step", both)
    config = EngineConfig(max_seqs=4, max_batch_tokens=24, page_size=16, cuda_graphs=False, pad_steps=mode != "ragged")
    if mode == "speculative":
        config.speculative = 2
    engine = Engine(model, config)
    g = torch.Generator().manual_seed(1)
    shared = torch.randint(2, model.cfg.vocab_size, (33,), generator=g).tolist()
    prompts = [shared + torch.randint(2, model.cfg.vocab_size, (n,), generator=g).tolist() for n in (3, 20, 9, 40)]
    params = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True)
    done: set[str] = set()
    with ops.use_backend("reference"):  # every other op (on the interpreter the kernels would run it all)
        for step in range(200):
            if step < len(prompts) * 3 and step % 3 == 0:  # arrivals while others decode (a prefix-cache hit)
                engine.add_request(str(step // 3), prompts[step // 3], params)
            done |= {out.request_id for out in engine.step() if out.finished}
            if len(done) == len(prompts):
                break
    assert len(done) == len(prompts)
    assert {n for n, _ in made} > {1} and any(n > 1 for n, c in made if c)  # decode-sized and chunked steps
    if mode == "speculative":
        assert any(not c for _, c in made)  # the MTP block's window-only plans


@pytest.mark.parametrize("seed", range(3))
@pytest.mark.parametrize("b,s,k,n,width", [(4, 1, 8, 30, 8), (1, 9, 5, 12, 7), (3, 4, 1, 3, 1), (2, 3, 16, 40, 20)])
def test_select_rows(seed, b, s, k, n, width):
    g = torch.Generator().manual_seed(seed)
    T = b * s + 2
    sel = torch.randint(-1, n, (b, s, k), generator=g)
    sel[0, 0, -1] = -1  # at least one empty choice
    cand = torch.randint(0, 500, (b, n), generator=g)
    dst = torch.randperm(T, generator=g)[: b * s]
    dst[-1] = T  # a padding cell: the spare row
    sel, cand, dst = sel.to(DEV), cand.to(DEV), dst.to(DEV)
    base = torch.full((T + 1, width), -7, dtype=torch.long, device=DEV)
    got = ops.select_rows(base.clone(), sel, cand, dst, backend="triton")
    want = ref.select_rows(base.clone(), sel, cand, dst)
    same(got[:T], want[:T])  # (the spare row T: unspecified)


@pytest.mark.parametrize("T,w,n,offset", [(5, 16, 7, 100), (3, 128, 1200, 4096), (1, 8, 0, 0), (4, 1, 3, 9)])
def test_attend_rows(T, w, n, offset):
    g = torch.Generator().manual_seed(T + w + n)
    window = torch.randint(-1, 300, (T, w), generator=g).to(DEV)
    slots = torch.randint(-1, 300, (T, n), generator=g).to(DEV)
    same(ops.attend_rows(window, slots, offset, backend="triton"), ref.attend_rows(window, slots, offset))
    wide = torch.randint(-1, 300, (T, n + 3), generator=g).to(DEV)[:, :n]  # strided rows
    same(ops.attend_rows(window, wide, offset, backend="triton"), ref.attend_rows(window, wide, offset))


@pytest.mark.parametrize("mode", ["ragged", "speculative"])
def test_an_engine_on_the_index_kernels_gives_the_same_tokens(mode):
    """The serving engine with the plan, the indexer's row selection and the attention rows on the kernels
    (every other op on its reference) computes exactly what it computes on the references: the same tokens
    and log-probabilities, bit for bit (the indices are integers; everything else runs the same code)."""
    from dsv4 import DeepSeekV4
    from dsv4.check.inputs import check_config
    from dsv4.engine import Engine, EngineConfig, SamplingParams

    model = DeepSeekV4.from_config(check_config("tiny"), seed=0).eval().to(DEV)
    g = torch.Generator().manual_seed(2)
    prompts = [torch.randint(2, model.cfg.vocab_size, (n,), generator=g).tolist() for n in (5, 40, 23, 17)]
    params = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True, logprobs=2)
    kernels = dict.fromkeys(INDEX_OPS, "triton")
    results = []
    for choice in ({}, kernels):
        engine = Engine(
            model,
            EngineConfig(
                max_seqs=4,
                max_batch_tokens=16,
                page_size=16,
                speculative=2 * (mode != "ragged"),
                cuda_graphs=False,  # every other op on its reference: reference MoE dispatch is not capturable
            ),
        )
        out: dict[str, list] = {}
        with ops.use_backend("reference"), ops.use_backend(choice, inherit=True), ops.which_ran() as ran:
            for i, p in enumerate(prompts):
                engine.add_request(str(i), p, params)
            while engine.has_work():
                for o in engine.step():
                    out.setdefault(o.request_id, []).extend(
                        (t, lp.logprob, lp.top) for t, lp in zip(o.new_tokens, o.new_logprobs)
                    )
        assert all(ran[op] == [choice.get(op, "reference")] for op in kernels)
        results.append(out)
    assert results[0] == results[1] and len(results[0]) == len(prompts)
