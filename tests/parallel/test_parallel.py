"""Serving across processes (`dsv4.parallel`) on 2 real gloo processes (CPU) against one process.

One module-scoped launch runs every scenario in two processes; each process also builds the single-process
model it is compared with (the same threads, the same kernels), and the tests below judge the reports.

Bounds. Under exact accumulation (what a deterministic engine runs) the expert-parallel model must give the
single-process numbers bit for bit: attention and everything dense run on every rank exactly as in one
process; each expert sees the same rows (replicated attention) or rows whose results do not depend on the
batch (exact accumulation rounds each row once, whatever the batch); each token's slots are combined in the
single-process order (`dsv4.parallel.expert.ordered_sum`), and the one exchange that adds across ranks adds
exact zeros. Outside exact mode with replicated attention the experts compute the same rows with the same
kernels and only the order of the k-term sum per token changes: |got - want| <= 2 gamma(k) sum_j |term_j|.
"""

from __future__ import annotations

import json
import os
import time
from datetime import timedelta
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from bounds import gamma
from spawn import launch, run_workers

from dsv4 import parallel as P
from dsv4.checkpoint import load_pretrained
from dsv4.checkpoint.initialize import init_checkpoint
from dsv4.config import ModelConfig
from dsv4.loading import default_model_dir
from dsv4.ops.precision import exact_accumulation

pytestmark = pytest.mark.slow  # several processes, each with a model

WORLD = 2
TIMEOUT_S = 420  # a mismatched collective would hang: the launcher fails the test instead
SHIPPED = default_model_dir()


# ----------------------------------------------------------------------------- helpers run in the workers
def _copy(model):
    import copy

    return copy.deepcopy(model)


def _paged_run(model, prompts: torch.Tensor, chunks: tuple[int, ...], decode: int) -> list[torch.Tensor]:
    """Prefill chunks, then greedy decode steps, through `append` on a paged cache -> every step's logits."""
    b = prompts.size(0)
    cache = model.new_cache(b, max_len=sum(chunks) + decode + 1)
    out, pos = [], 0
    with torch.no_grad():
        for c in chunks:
            tok = prompts[:, pos : pos + c]
            out.append(model.append(tok, cache.step_inputs(tok, static_start=pos), cache.kv))
            cache.advance(c)
            pos += c
        nxt = out[-1].view(b, chunks[-1], -1)[:, -1].argmax(-1, keepdim=True)
        for _ in range(decode):
            logits = model.decode_step(nxt, cache)
            out.append(logits.flatten(0, 1))
            nxt = logits[:, -1].argmax(-1, keepdim=True)
    return out


def _equal(a: list[torch.Tensor], b: list[torch.Tensor]) -> bool:
    return len(a) == len(b) and all(torch.equal(x, y) for x, y in zip(a, b))


def _tiny(seed: int):
    """tiny with 4 of its 8 experts per token: with 2 a token's sum a + b is the same in any order, with
    3 or more the order of the additions shows."""
    from dsv4.model import DeepSeekV4

    return DeepSeekV4.from_config(ModelConfig.preset("tiny").replace(n_activated_experts=K), seed=seed).eval()


K = 4


def _moe_checks(rank: int) -> dict:
    """Every MoE layer of tiny: the expert-parallel routed output vs the unsharded experts, per element."""
    full = _tiny(0)
    rep = P.parallelize_for_serving(_copy(full), attention="replicated")
    dp = P.parallelize_for_serving(_copy(full), attention="data_parallel")
    unordered = P.parallelize_for_serving(_copy(full), attention="replicated", ordered=False)
    res = {"exact_equal": [], "fast_ratio": [], "dp_exact_equal": [], "unordered_equal": [], "layers": 0}
    for i, (mf, mr, md, mu) in enumerate(zip(*(P.moe_layers(m) for m in (full, rep, dp, unordered)))):
        gen = torch.Generator().manual_seed(i)
        t, d = 37, full.cfg.dim
        x = torch.randn(t, d, generator=gen)  # same on both ranks
        tok = torch.randint(0, full.cfg.vocab_size, (t,), generator=gen)
        with torch.no_grad():
            w, idx, _ = mf.gate(x, tok)
            with exact_accumulation():
                want = mf.experts(x, w, idx)
                got = mr.experts(x, w, idx)
                res["unordered_equal"].append(torch.equal(mu.experts(x, w, idx), want))
            res["exact_equal"].append(torch.equal(got, want))
            want_f = mf.experts(x, w, idx)
            got_f = mr.experts(x, w, idx)
            k = idx.size(1)
            terms = mf.experts(x.repeat_interleave(k, 0), w.reshape(-1, 1), idx.reshape(-1, 1)).view(t, k, d)
            bound = 2 * gamma(k) * terms.abs().sum(1)
            res["fast_ratio"].append(float(((got_f - want_f).abs() / bound.clamp_min(1e-30)).max()))
            # data-parallel attention: every rank its own tokens, of its own count
            g2 = torch.Generator().manual_seed(100 * i + rank)
            t2 = 5 + 6 * rank
            x2 = torch.randn(t2, d, generator=g2)
            tok2 = torch.randint(0, full.cfg.vocab_size, (t2,), generator=g2)
            w2, idx2, _ = mf.gate(x2, tok2)
            with exact_accumulation():
                res["dp_exact_equal"].append(torch.equal(md.experts(x2, w2, idx2), mf.experts(x2, w2, idx2)))
        res["layers"] += 1
    res["ranges"] = [list(P.held(m.experts)) for m in P.moe_layers(rep)]
    # the pass swapped each layer's experts for their parallel form: same names, the model's options reach it
    res["names_kept"] = list(rep.state_dict()) == list(full.state_dict())
    res["swapped"] = sorted({type(m.experts).__name__ for m in P.moe_layers(rep)})
    rep.set_options(fp4_fake_quant=True)
    res["options_reach"] = all(m.experts.fp4_fake_quant for m in P.moe_layers(rep))
    return res


def _append_replicated(model_full, prompts, chunks, decode, **kw) -> dict:
    par = P.parallelize_for_serving(_copy(model_full), attention="replicated", **kw)
    with exact_accumulation():
        want = _paged_run(model_full, prompts, chunks, decode)
        got = _paged_run(par, prompts, chunks, decode)
    return {"equal": _equal(got, want), "steps": len(got)}


def _data_parallel(rank: int) -> dict:
    """Rank 0 runs one sequence of 150 tokens (chunks of 100 and 50), rank 1 two of 60 and sits one step
    out (an idle step); each rank's logits vs the full model running the same sequences alone."""
    full = _tiny(1)
    par = P.parallelize_for_serving(_copy(full), attention="data_parallel")
    gen = torch.Generator().manual_seed(7 + rank)
    b, chunks = ((1, (100, 50)), (2, (60,)))[rank]
    prompts = torch.randint(0, full.cfg.vocab_size, (b, sum(chunks)), generator=gen)
    with exact_accumulation():
        want = _paged_run(full, prompts, chunks, decode=3)
        cache = par.new_cache(b, max_len=sum(chunks) + 4)
        got, pos = [], 0
        with torch.no_grad():
            # five steps on both ranks: rank 1 sits the second one out
            steps = [("chunk", c) for c in chunks] + [("idle", 0)] * (2 - len(chunks)) + [("decode", 1)] * 3
            nxt = None
            for kind, c in steps:
                if kind == "idle":
                    tok, inp = P.idle_inputs(cache.layout, "cpu")
                    par.append(tok, inp, cache.kv)
                elif kind == "chunk":
                    tok = prompts[:, pos : pos + c]
                    got.append(par.append(tok, cache.step_inputs(tok, static_start=pos), cache.kv))
                    cache.advance(c)
                    pos += c
                    nxt = got[-1].view(b, c, -1)[:, -1].argmax(-1, keepdim=True)
                else:
                    logits = par.decode_step(nxt, cache)
                    got.append(logits.flatten(0, 1))
                    nxt = logits[:, -1].argmax(-1, keepdim=True)
    return {"equal": _equal(got, want), "steps": len(steps)}


class _ReadLog:
    """The stored tensors a load reads (`reader.read_tensor`, the one place payload bytes are read)."""

    def __init__(self):
        from dsv4.checkpoint import reader

        self.reader, self.names = reader, []
        self.live = reader.read_tensor

    def __enter__(self):
        def read(info, handle=None):
            self.names.append(info.name)
            return self.live(info, handle)

        self.reader.read_tensor = read
        return self

    def __exit__(self, *exc):
        self.reader.read_tensor = self.live


def _shipped(rank: int) -> dict:
    from dsv4.checkpoint.names import canonical, expert_index
    from dsv4.checkpoint.reader import plan
    from dsv4.engine import Engine, EngineConfig, SamplingParams

    full = load_pretrained(SHIPPED)
    with _ReadLog() as log:
        par = load_pretrained(SHIPPED, rank=rank, world_size=WORLD)
    n = par.cfg.n_routed_experts
    lo, hi = rank * n // WORLD, (rank + 1) * n // WORLD
    whole = plan(SHIPPED)
    stored = [name for h in whole.headers.values() for name in h]
    owned = sorted(
        pc.info.name
        for e in whole.entries.values()
        for pc in e.weight + e.scale
        if (j := expert_index(e.name)) is None or lo <= j < hi
    )
    res = {
        "read_equal_owned": sorted(log.names) == owned,
        "read": len(log.names),
        "stored": len(stored),
        "foreign_read": [
            s for s in log.names if (j := expert_index(canonical(s).name)) is not None and not lo <= j < hi
        ],
        "plan_read": par.checkpoint_plan["read"]["tensors"],
        "experts": par.checkpoint_plan["experts"],
        "n_experts": n,
    }
    P.parallelize_for_serving(par, attention="replicated")
    gen = torch.Generator().manual_seed(3)
    prompts = torch.randint(0, full.cfg.vocab_size, (2, 140), generator=gen)
    with exact_accumulation():
        res["append_equal"] = _equal(_paged_run(par, prompts, (96, 44), 4), _paged_run(full, prompts, (96, 44), 4))

    def serve(model) -> dict:
        engine = Engine(
            model,
            EngineConfig(
                max_seqs=4,
                deterministic=True,
                cuda_graphs=False,
                speculative=2,
                max_batch_tokens=64,
                prefix_caching=False,
            ),
        )
        reqs = {
            "greedy": SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True),
            "seeded": SamplingParams(max_tokens=12, temperature=0.9, top_p=0.9, seed=5, ignore_eos=True),
        }
        for j, (name, sp) in enumerate(reqs.items()):
            engine.add_request(name, prompts[j, : 70 + 30 * j].tolist(), sp)
        toks: dict[str, list[int]] = {name: [] for name in reqs}
        while engine.has_work():
            for out in engine.step():
                toks[out.request_id].extend(out.new_tokens)
        return toks

    res["engine_one"], res["engine_par"] = serve(full), serve(par)
    return res


def _quantized(rank: int, qdir: str) -> dict:
    """A kept-quantized checkpoint (FP8 linears, MXFP4 experts): loaded per rank, or loaded whole and cut
    by the pass, vs one process."""
    from dsv4.checkpoint.quantized import QuantExperts, QuantLinear

    full = load_pretrained(qdir, keep_quantized=True)
    per_rank = P.parallelize_for_serving(load_pretrained(qdir, keep_quantized=True, rank=rank, world_size=WORLD))
    cut = P.parallelize_for_serving(load_pretrained(qdir, keep_quantized=True))
    ex = per_rank.layers[1].ffn.experts
    gen = torch.Generator().manual_seed(4)
    prompts = torch.randint(0, full.cfg.vocab_size, (2, 136), generator=gen)
    with exact_accumulation():
        want = _paged_run(full, prompts, (100, 36), 3)
        eq_rank = _equal(_paged_run(per_rank, prompts, (100, 36), 3), want)
        eq_cut = _equal(_paged_run(cut, prompts, (100, 36), 3), want)

    def nbytes(m):
        return sum(t.numel() * t.element_size() for t in [*m.parameters(), *m.buffers()])

    experts = sum(nbytes(m.experts) for m in P.moe_layers(full))
    return {
        "equal_per_rank": eq_rank,
        "equal_cut": eq_cut,
        "quant_experts": isinstance(ex, QuantExperts),
        "quant_linear": isinstance(per_rank.layers[1].attn.wq_b, QuantLinear),
        "held": list(P.held(ex)),
        "bytes_full": nbytes(full),
        "bytes_rank": nbytes(per_rank),
        "bytes_cut": nbytes(cut),
        "bytes_experts": experts,
    }


def _broadcast(rank: int) -> dict:
    """The scheduler's step from rank 0, rebuilt on rank 1, runs to the same logits."""
    from dsv4.model import DeepSeekV4

    model = P.parallelize_for_serving(DeepSeekV4.from_config("tiny", seed=2).eval())
    cache = model.new_cache(3, max_len=64)
    tok = torch.randint(0, 1024, (3, 40), generator=torch.Generator().manual_seed(9))
    local = cache.step_inputs(tok, static_start=0, last_only=True)
    got_tok, got = P.broadcast_step(tok if rank == 0 else None, local if rank == 0 else None, device="cpu")
    same = torch.equal(got_tok, tok) and got.shape == local.shape and got.groups.keys() == local.groups.keys()
    for f in ("tokens", "positions", "rows", "seg_start", "start", "length", "wtable", "ctable", "state", "out"):
        same &= torch.equal(getattr(got, f), getattr(local, f))
    same &= all(torch.equal(got.groups[r], local.groups[r]) for r in local.groups if local.groups[r] is not None)
    same &= all(torch.equal(a, b) for a, b in zip(got.index_maps + got.index_rows, local.index_maps + local.index_rows))
    with torch.no_grad():
        logits = model.append(got_tok, got, cache.kv)
    both = [torch.empty_like(logits) for _ in range(WORLD)]
    dist.all_gather(both, logits)
    return {"inputs_equal": bool(same), "logits_equal_across_ranks": torch.equal(both[0], both[1])}


def _memory(rank: int) -> dict:
    """Per-rank estimate (`dsv4.memory.rank_bytes`) vs the measured peak of one rank serving."""
    from dsv4 import memory as mem
    from dsv4.memory import rank_bytes
    from dsv4.model import DeepSeekV4

    model = P.parallelize_for_serving(DeepSeekV4.from_config("tiny", seed=0, dtype=torch.float32).eval())
    rows = []
    for context, batch, chunk in ((768, 2, 384),):
        got = mem.measure_inference(model, context, batch, chunk)
        est = rank_bytes(
            model.cfg,
            WORLD,
            context=context,
            batch=batch,
            chunk=chunk * batch,
            dtype=torch.float32,
            keep_quantized=False,
            fused=False,
            prefix_caching=False,
        )
        rows.append(
            {
                "measured": got["peak"],
                "estimated": est.total,
                "weights": got["weights"],
                "est_weights": est.weights,
                "cache": got["cache"],
                "est_cache": est.cache,
            }
        )
    return {"rows": rows}


def _worker(rank: int, world: int, port: int, out_dir: str, qdir: str) -> None:
    torch.set_num_threads(1)
    P.init_workers(rank, world, master_port=port, device="cpu", timeout_s=TIMEOUT_S)
    tiny = _tiny(0)
    gen = torch.Generator().manual_seed(11)
    prompts = torch.randint(0, tiny.cfg.vocab_size, (2, 200), generator=gen)
    res = {
        "moe": _moe_checks(rank),
        # prefill chunks crossing the 128-token window and compression groups of 4 and 128, then decodes
        "append_tiny": _append_replicated(tiny, prompts, (130, 70), 5),
        "data_parallel": _data_parallel(rank),
        "shipped": _shipped(rank),
        "quantized": _quantized(rank, qdir),
        "broadcast": _broadcast(rank),
        "memory": _memory(rank),
    }
    P.shutdown_workers()
    Path(out_dir, f"rank{rank}.json").write_text(json.dumps(res))


@pytest.fixture(scope="module")
def ranks(tmp_path_factory) -> list[dict]:
    out = tmp_path_factory.mktemp("parallel")
    qdir = out / "tiny-fp8-fp4"
    init_checkpoint(qdir, ModelConfig.preset("tiny"), to="fp8", expert_dtype="fp4", seed=3)
    return launch(_worker, out, str(qdir), world=WORLD, timeout_s=TIMEOUT_S)


# ----------------------------------------------------------------------------- the judgements
def test_expert_parallel_moe_equals_the_unsharded_moe_per_element(ranks):
    for r, res in enumerate(ranks):
        m = res["moe"]
        assert m["layers"] == 5  # tiny: 4 layers + the MTP block
        assert m["ranges"] == [[4 * r, 4]] * 5  # rank r holds experts [4r, 4r + 4)
        assert m["names_kept"] and m["swapped"] == ["ExpertParallelExperts"] and m["options_reach"]
        assert all(m["exact_equal"]) and all(m["dp_exact_equal"])
        assert max(m["fast_ratio"]) <= 1.0, m["fast_ratio"]


def test_two_process_append_equals_one_process_bit_for_bit(ranks):
    for res in ranks:
        assert res["append_tiny"] == {"equal": True, "steps": 7}
        assert res["data_parallel"]["equal"]
        assert res["shipped"]["append_equal"]
        assert res["quantized"]["equal_per_rank"] and res["quantized"]["equal_cut"]


def test_unordered_combine_is_not_bit_exact_so_the_ordered_one_is_needed(ranks):
    """The contrast: per-rank partial sums of 4 terms, even under exact accumulation, round differently
    somewhere in 5 layers x 37 tokens x 128 channels."""
    for res in ranks:
        assert not all(res["moe"]["unordered_equal"])


def test_engine_tokens_on_two_processes_equal_one_process(ranks):
    for res in ranks:
        s = res["shipped"]
        assert s["engine_par"] == s["engine_one"]
        assert all(len(t) == 12 for t in s["engine_one"].values())


def test_a_rank_reads_only_the_tensors_it_owns(ranks):
    for r, res in enumerate(ranks):
        s = res["shipped"]
        per = s["n_experts"] // WORLD  # (the shipped model's routed experts, split evenly)
        assert s["experts"] == [per * r, per * r + per]
        assert s["foreign_read"] == [] and s["read_equal_owned"]
        assert s["read"] < s["stored"]
        assert s["plan_read"] > 0


def test_kept_quantized_weights_shard(ranks):
    for r, res in enumerate(ranks):
        q = res["quantized"]
        assert q["quant_experts"] and q["quant_linear"] and q["held"] == [4 * r, 4]
        # a rank holds everything but half the routed experts' bytes (stored FP4 codes + E8M0 scales)
        assert q["bytes_rank"] == q["bytes_cut"] == q["bytes_full"] - q["bytes_experts"] // 2


def test_broadcast_step_rebuilds_the_schedulers_step(ranks):
    for res in ranks:
        assert res["broadcast"] == {"inputs_equal": True, "logits_equal_across_ranks": True}


def test_rank_memory_estimate_within_25_percent_of_measured(ranks):
    """Weights and cache exactly (they mirror what a rank allocates), the peak within 25% as
    tests/model/test_memory.py holds the single-device estimate."""
    for res in ranks:
        for row in res["memory"]["rows"]:
            assert row["est_weights"] == row["weights"] and row["est_cache"] == row["cache"]
            assert abs(row["estimated"] / row["measured"] - 1) <= 0.25, row


# ----------------------------------------------------------------------------- a worker that dies or hangs
def _stall_worker(rank: int, world: int, port: int, out_dir: str, how: str) -> None:
    torch.set_num_threads(1)
    # a rendezvous as long as a loaded machine needs to start both processes; the collective under test
    # runs in a group whose timeout is 2 s
    P.init_workers(rank, world, master_port=port, device="cpu", timeout_s=60.0)
    group = dist.new_group(timeout=timedelta(seconds=2.0))
    dist.barrier()
    if rank == 1:
        if how == "dies":
            os._exit(3)
        time.sleep(8)  # alive, but never joins the collective
        os._exit(0)
    t0 = time.monotonic()
    try:
        dist.all_reduce(torch.ones(4), group=group)
        err = ""
    except RuntimeError as e:
        err = str(e).splitlines()[0][:200]
    Path(out_dir, "rank0.json").write_text(json.dumps({"error": err, "waited": time.monotonic() - t0}))
    os._exit(0)  # the group is broken: no orderly teardown


@pytest.mark.parametrize("how", ["hangs", "dies"])
def test_a_stalled_or_dead_peer_raises_instead_of_hanging(tmp_path, how):
    codes = run_workers(_stall_worker, WORLD, tmp_path, (how,), timeout_s=120, stop_on_death=False)
    res = json.loads((tmp_path / "rank0.json").read_text())
    assert res["error"], res
    # a live peer that never joins: the collective gives up after the 2 s timeout (the peer sleeps 8 s,
    # so it is the timeout that ended the wait); a dead one: at the latest after the timeout as well
    assert res["waited"] < 7, res
    if how == "hangs":
        assert res["waited"] >= 1.8, res
    assert codes[1] == (3 if how == "dies" else 0)


# ----------------------------------------------------------------------------- one process
def test_per_rank_loading_of_fused_experts_reads_only_their_rows(tmp_path):
    """A transformers checkpoint stores each layer's experts fused ([E, 2I, D]): rank 1 of 2 reads rows
    [4, 8) as one byte range and holds exactly the whole load's experts 4..7."""
    from dsv4.checkpoint import convert

    init_checkpoint(tmp_path / "rel", ModelConfig.preset("tiny"), seed=5)
    convert(tmp_path / "rel", tmp_path / "hf", "hf")
    whole = load_pretrained(tmp_path / "hf")
    with _ReadLog() as log:
        part = load_pretrained(tmp_path / "hf", rank=1, world_size=2)
    for a, b in zip(P.moe_layers(part), P.moe_layers(whole)):
        assert P.held(a.experts) == (4, 4)
        assert all(torch.equal(getattr(a.experts, w), getattr(b.experts, w)[4:8]) for w in ("w1", "w2", "w3"))
    assert part.checkpoint_plan["read"]["bytes"] < whole.checkpoint_plan["read"]["bytes"]
    assert len(log.names) == whole.checkpoint_plan["read"]["tensors"]  # every tensor once, fused ones cut


def test_bad_ranks_and_passes_are_refused_in_one_line(tmp_path):
    from dsv4.checkpoint import CheckpointError
    from dsv4.model import DeepSeekV4

    init_checkpoint(tmp_path / "t", ModelConfig.preset("tiny"))
    for rank, world, words in ((2, 2, "is not one of 2 ranks"), (0, 3, "cannot be split evenly over 3")):
        with pytest.raises(CheckpointError, match=words):
            load_pretrained(tmp_path / "t", rank=rank, world_size=world)
    model = DeepSeekV4.from_config("tiny")
    with pytest.raises(ValueError, match="by expert only"):
        P.parallelize_for_serving(model, expert_parallel=False)
    with pytest.raises(ValueError, match="attention must be one of"):
        P.parallelize_for_serving(model, attention="heads")
    # outside a process group the pass leaves the model whole, and says so
    assert P.serving_layout(model) is None
    assert P.serving_layout(P.parallelize_for_serving(model)) == P.ServingLayout(0, 1, "replicated", True)
    assert not any(isinstance(m.experts, P.ExpertParallel) for m in P.moe_layers(model))
    with pytest.raises(RuntimeError, match="already parallelized"):
        P.parallelize_for_serving(model)
    with pytest.raises(ValueError, match="is not one of 2 workers"):
        P.init_workers(2, 2, master_port=1)


def test_info_states_gpus_and_memory_per_worker(capsys):
    """`dsv4 info`: with N workers each holds the replicated weights and 1/N of the routed experts; at N = 1
    that is the one-device figure exactly."""
    from dsv4.cli import main
    from dsv4.memory import expert_bytes, rank_bytes

    assert main(["info", "--preset", "flash", "--context", "65536", "--gpu-memory", "141GB", "--json"]) == 0
    info = json.loads(capsys.readouterr().out)
    par, m = info["serving_parallel"], info["memory"]
    cfg = ModelConfig.preset("flash")
    kw = {"context": 65536, "batch": 1, "chunk": 4096}
    assert rank_bytes(cfg, 1, keep_quantized=True, **kw).total == m["inference_total_quantized"]
    assert rank_bytes(cfg, 1, keep_quantized=False, **kw).total == m["inference_total"]
    deq, kept = expert_bytes(cfg)
    two = rank_bytes(cfg, 2, keep_quantized=True, **kw)
    assert two.weights == m["weights"]["kept_quantized"] - kept // 2 and two.experts == kept // 2
    assert par["per_gpu"]["2"]["kept_quantized"] == two.total
    fewest = par["fewest"]["kept_quantized"]
    # 165 GB does not fit one 141 GB GPU (92% usable); half the experts does
    assert fewest["gpus"] == 2 and fewest["total"] <= 0.92 * 141e9 < m["inference_total_quantized"]
    assert main(["info", "--preset", "tiny"]) == 0
    assert "serving on N GPUs (--tensor-parallel-size N --enable-expert-parallel" in capsys.readouterr().out


@pytest.mark.parametrize("keep_quantized", [False, True])
def test_per_rank_loading_holds_its_share_plus_one_tensor(tmp_path, keep_quantized):
    """Peak host allocations while rank 1 of 2 loads = the model it ends with (its share) + what one tensor
    costs in flight: its stored bytes, its fp32 dequantized copy and the finite-check's bool mask."""
    from dsv4.checkpoint.reader import plan
    from dsv4.memory import allocation_peak

    src = SHIPPED
    if keep_quantized:
        src = tmp_path / "q"
        init_checkpoint(src, ModelConfig.preset("tiny"), to="fp8", expert_dtype="fp4")

    def nbytes(m) -> int:
        return sum(t.numel() * t.element_size() for t in [*m.parameters(), *m.buffers()])

    model, peak = allocation_peak(lambda: load_pretrained(src, rank=1, world_size=2, keep_quantized=keep_quantized))
    share = nbytes(model)
    one = max(e.nbytes + 5 * torch.Size(e.spec.shape).numel() for e in plan(src).entries.values())
    assert share <= peak <= share + one + (64 << 10), (peak, share, one)
    assert share < nbytes(load_pretrained(src, keep_quantized=keep_quantized))


def _crash_once_worker(rank: int, world: int, port: int, out_dir: str, marker: str) -> None:
    """First launch: rank 0 aborts (a native crash), rank 1 exits 1 (as a peer on a broken link does); second
    launch: both report."""
    first = Path(f"{marker}.{rank}")  # each rank's own: the other's progress cannot change its launch
    if not first.exists():
        first.write_text("launched")
        if rank == 0:
            deadline = time.monotonic() + 60
            while not Path(f"{marker}.1").exists() and time.monotonic() < deadline:
                time.sleep(0.05)  # (rank 1 has seen its first launch before rank 0 dies)
            os.abort()
        time.sleep(1.0)
        os._exit(1)
    Path(out_dir, f"rank{rank}.json").write_text(json.dumps({"rank": rank}))


def test_a_crashed_worker_is_launched_once_more_whatever_its_peer_did(tmp_path):
    """tests/spawn.py: a worker killed by a signal sends the workers round once more (with a warning naming
    the signal), also where its peer then exited non-zero; a crash in the second launch would fail."""
    out = tmp_path / "out"
    out.mkdir()
    with pytest.warns(UserWarning, match="SIGABRT"):
        reports = launch(_crash_once_worker, out, str(tmp_path / "marker"), world=2, timeout_s=120)
    assert [r["rank"] for r in reports] == [0, 1]
