"""FSDP2 data parallelism + expert parallelism on 2 gloo processes (CPU) against one process.

One module-scoped launch runs every scenario in two real processes; each rank also trains a single-process
replica on the whole global batch and reports the differences, which the tests below judge.

The processes run on the CPU with gloo whatever the machine has (a GPU present changes nothing here), and
the parity scenarios run under `exact_accumulation()`: every reference matmul and reduction adds in float64
and rounds once, so splitting the batch over ranks no longer changes how the per-token values round; what
remains are the additions across ranks and of the loss terms, which the bounds below derive.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch
from bounds import U32, gamma
from spawn import launch
from test_train import MICRO

from dsv4.engine import generate
from dsv4.ops.precision import exact_accumulation
from dsv4.parallel import expert as EP
from dsv4.train import distributed as D
from dsv4.train import parity as P

pytestmark = pytest.mark.slow  # several processes, each with a model

WORLD = 2
TIMEOUT_S = 420  # a mismatched collective hangs; fail instead of waiting forever
N_MOE = 5  # tiny: 4 layers + 1 MTP block
N_LOCAL = 4  # 8 routed experts over 2 ranks
BATCH, SEQ = 4, 32  # parity_check's global batch
# The loss is a sum of positive per-token terms (cross-entropy of the main and MTP heads, the indexer's KL,
# the balance loss): 4 parts x BATCH*SEQ tokens. Each term is computed row by row, identically in both runs;
# the sums differ only in order (one process vs a per-rank sum, then the mean over ranks), so by the
# summation bound |L_par - L_ref| <= (2 gamma(N) + 2u) L with N the number of terms.
LOSS_BOUND = 2 * gamma(4 * BATCH * SEQ) + 2 * U32
# Logits: per row, the same operations in both runs, each sum accumulated in float64 and rounded once to
# fp32; a float64 sum added in another order (another GEMM blocking for another row count) can move that
# rounding by one fp32 ulp: norm-wise at most 2u.
FORWARD_BOUND = 2 * U32


def _route_to_first_half(model: torch.nn.Module) -> None:
    """Bias every learned router towards experts 0..E/2-1, so rank 1 receives no tokens in those layers."""
    with torch.no_grad():
        for moe in D.moe_layers(model):
            if not moe.gate.hash:
                moe.gate.bias[: moe.n_experts // 2] += 100.0


def _helper_checks() -> dict:
    """grad_norm / clip_grad_norm_, full state dict round trip and expert-load sync on a sharded model."""
    from dsv4.model.transformer import DeepSeekV4

    rank = torch.distributed.get_rank()
    tokens = torch.randint(0, 1024, (4, 24), generator=torch.Generator().manual_seed(5))
    local = tokens[rank * 2 : rank * 2 + 2]
    ref = DeepSeekV4.from_config("tiny", seed=3)
    par = D.shard_model(DeepSeekV4.from_config("tiny", seed=3))
    P._loss(ref(tokens, mtp=True), tokens).backward()
    P._loss(par(local, mtp=True), local).backward()

    loads = [load.clone() for load in D.all_reduce_expert_load(par)]
    ref_loads = [m.load for m in D.moe_layers(ref)]
    ref_grads = {n: p.grad for n, p in ref.named_parameters() if p.grad is not None}
    norm_ref = torch.nn.utils.get_total_norm(list(ref_grads.values()))
    clipped_norm = D.clip_grad_norm_(par, max_norm=0.25 * float(norm_ref))
    clipped = D.full_grads(par)
    coef = 0.25 * norm_ref / (norm_ref + 1e-6)
    clip_rel = P._max_rel(clipped, {n: g * coef for n, g in ref_grads.items()})[0]
    after = float(D.grad_norm(par))

    prompts = [[1, 2, 3, 4, 5], [9, 8, 7, 6, 5]]
    with torch.no_grad():  # sharded model: FSDP gathers weights around prefill/decode
        same_greedy = generate(par, prompts, max_new_tokens=3, stop_at_eos=False) == generate(
            ref, prompts, max_new_tokens=3, stop_at_eos=False
        )
    plain = D.unsharded_copy(par)  # collective; then usable by one rank alone
    if rank == 0:
        with torch.no_grad():
            same_greedy &= generate(plain, prompts, max_new_tokens=3, stop_at_eos=False) == generate(
                ref, prompts, max_new_tokens=3, stop_at_eos=False
            )
            same_greedy &= not any(D._is_dtensor(p) or D.is_expert_param(p) for p in plain.parameters())

    state = {
        k: v + 0.01 * torch.randn(v.shape, generator=torch.Generator().manual_seed(7)).to(v.dtype)
        if v.is_floating_point()
        else v
        for k, v in ref.state_dict().items()
    }
    D.load_full_state_dict(par, state)
    back = D.full_state_dict(par)
    return {
        "load_equal": all(torch.equal(a, b) for a, b in zip(loads, ref_loads)) and len(loads) == N_MOE,
        "norm_rel": abs(float(clipped_norm) - float(norm_ref)) / float(norm_ref),
        "clip_rel": clip_rel,
        "clipped_norm_rel": abs(after - 0.25 * float(norm_ref)) / (0.25 * float(norm_ref)),
        "state_keys_equal": back.keys() == state.keys(),
        "generate_equal": same_greedy,
        "state_equal": all(torch.equal(back[k], state[k]) for k in state),
        "expert_shapes": [tuple(p.shape) for n, p in par.named_parameters() if D.is_expert_param(p)][:3],
    }


def _muon_checks() -> dict:
    """One MuonAdamW step on the sharded model vs one process: every 2-D weight's update (parameter change),
    and for contrast Newton-Schulz run on this rank's rows alone (what a shard-local step would do)."""
    from dsv4.model.transformer import DeepSeekV4
    from dsv4.train.optim import MuonAdamW, OptimConfig, newton_schulz

    rank = torch.distributed.get_rank()
    tokens = torch.randint(0, 1024, (4, 24), generator=torch.Generator().manual_seed(6))
    local = tokens[rank * 2 : rank * 2 + 2]
    ref = DeepSeekV4.from_config("tiny", seed=4)
    par = D.shard_model(DeepSeekV4.from_config("tiny", seed=4))
    before = {n: v.clone() for n, v in ref.state_dict().items()}
    with exact_accumulation():
        P._loss(ref(tokens, mtp=True), tokens).backward()
        P._loss(par(local, mtp=True), local).backward()
    cfg = OptimConfig(lr=1e-2, weight_decay=0.0)
    opt_ref, opt_par = MuonAdamW(ref, cfg), MuonAdamW(par, cfg)
    sharded = [n for n, p in par.named_parameters() if D._is_dtensor(p) and n in opt_par.muon_names]
    name = max(sharded, key=lambda n: dict(par.named_parameters())[n].numel())
    g = dict(par.named_parameters())[name].grad
    rows = g.to_local()
    full_ns = newton_schulz(g.full_tensor())
    lo = rank * -(-g.size(0) // 2)  # torch.chunk's rows of this rank
    shard_rel = P._rel(newton_schulz(rows), full_ns[lo : lo + rows.size(0)])
    opt_ref.step()
    opt_par.step()
    after = D.full_state_dict(par)
    new = ref.state_dict()
    update_rel = max(P._rel(after[n] - before[n], new[n] - before[n]) for n in opt_ref.muon_names)
    return {"n_sharded": len(sharded), "update_rel": update_rel, "shard_ns_rel": shard_rel}


def _worker(rank: int, world: int, port: int, out_dir: str) -> None:
    os.environ.update(
        RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port)
    )
    torch.set_num_threads(1)
    D.setup_distributed(device="cpu", timeout_s=TIMEOUT_S)  # gloo on the CPU, GPU or not
    cpu = torch.device("cpu")
    with exact_accumulation():
        res = {
            # several steps: without the QAT round trips, which amplify rounding into discrete top-k flips
            "sgd": P.parity_check(steps=3, optimizer="sgd", lr=0.1, device=cpu, qat=False),
            "adamw": P.parity_check(steps=2, optimizer="adamw", lr=1e-3, device=cpu, qat=False),
            "no_tokens": P.parity_check(steps=1, optimizer="sgd", lr=0.1, prepare=_route_to_first_half, device=cpu),
            "fsdp_only": P.parity_check(steps=1, optimizer="sgd", lr=0.1, ep=False, device=cpu),
            "infer": P.inference_check(modes=("all_reduce", "all_to_all"), device=cpu),
        }
    res["helpers"] = _helper_checks()
    res["muon"] = _muon_checks()
    # docs/bugzoo.md Z08 mutant: the expert-parallel rank read as 0 in every process
    live = EP._ep_rank
    EP._ep_rank = lambda group: 0
    try:
        res["z08_mutant"] = P.parity_check(steps=1, optimizer="sgd", lr=0.1, device=cpu)
    finally:
        EP._ep_rank = live
    D.teardown_distributed()
    Path(out_dir, f"rank{rank}.json").write_text(json.dumps(res))


@pytest.fixture(scope="module")
def ranks(tmp_path_factory) -> list[dict]:
    return launch(_worker, tmp_path_factory.mktemp("dist"), world=WORLD, timeout_s=TIMEOUT_S)


def test_expert_ranges_follow_the_live_rank(ranks):
    for r, res in enumerate(ranks):
        want = [[r * N_LOCAL, (r + 1) * N_LOCAL]] * N_MOE
        assert res["sgd"]["expert_ranges"] == want
        assert res["infer"]["all_reduce"]["expert_ranges"] == want
        assert res["infer"]["all_to_all"]["expert_ranges"] == want
        assert res["helpers"]["expert_shapes"][0][0] == N_LOCAL


def test_z08_mutant_rank_cached_as_zero_is_caught(ranks):
    # the mutant serves experts 0..3 on both ranks: ranges say so and the logits are visibly wrong
    assert all(res["z08_mutant"]["expert_ranges"] == [[0, N_LOCAL]] * N_MOE for res in ranks)
    assert max(res["z08_mutant"]["forward_rel"] for res in ranks) > 1e-2
    assert ranks[1]["z08_mutant"]["expert_ranges"] != ranks[1]["sgd"]["expert_ranges"]


def test_ep_forward_equals_single_process(ranks):
    for res in ranks:
        assert res["sgd"]["forward_rel"] <= FORWARD_BOUND
        assert res["no_tokens"]["forward_rel"] <= FORWARD_BOUND


def test_sgd_training_matches_single_process(ranks):
    for res in ranks:
        t = res["sgd"]
        assert len(t["loss_par"]) == 3
        # later steps start from parameters that differ by the rounding of one update (param_rel below, a few
        # fp32 ulp): to first order a change of the same relative size in the loss, far inside LOSS_BOUND
        assert t["loss_rel"] <= LOSS_BOUND, (t["loss_ref"], t["loss_par"])
        assert t["grad_rel"][0] < 1e-4, t["grad_worst"]
        # later steps: parameters already differ by rounding; near-zero gradients (mHC of identical
        # copies) carry relative noise of the same size as a single-process 2-microbatch run
        assert max(t["grad_rel"]) < 1e-2, t["grad_worst"]
        assert t["param_rel"] < 1e-4
        assert abs(t["grad_norm_par"] - t["grad_norm_ref"]) / t["grad_norm_ref"] < 1e-5
    assert ranks[0]["sgd"]["loss_par"] == ranks[1]["sgd"]["loss_par"]


def test_adamw_training_losses_match_single_process(ranks):
    for res in ranks:
        t = res["adamw"]
        assert t["grad_rel"][0] < 1e-4, t["grad_worst"]
        # AdamW normalizes near-zero gradients, magnifying rounding noise; losses stay close
        assert t["loss_rel"] < 5e-4, (t["loss_ref"], t["loss_par"])


def test_rank_that_receives_no_tokens(ranks):
    for res in ranks:
        t = res["no_tokens"]
        assert t["loss_rel"] <= LOSS_BOUND and t["grad_rel"][0] < 1e-4, t["grad_worst"]


def test_fsdp_without_expert_parallelism(ranks):
    for res in ranks:
        t = res["fsdp_only"]
        assert t["expert_ranges"] == [[0, 8]] * N_MOE  # every rank sees all experts (FSDP-gathered)
        assert t["forward_rel"] <= FORWARD_BOUND and t["loss_rel"] <= LOSS_BOUND
        assert t["grad_rel"][0] < 1e-4, t["grad_worst"]


@pytest.mark.parametrize("mode", ["all_reduce", "all_to_all"])
def test_inference_experts_split_gives_same_logits(ranks, mode):
    for res in ranks:
        t = res["infer"][mode]
        assert t["forward_rel"] < 1e-5 and t["decode_rel"] < 1e-5
        assert t["greedy_equal"]


def test_helpers_norm_clip_state_and_load(ranks):
    for res in ranks:
        h = res["helpers"]
        assert h["norm_rel"] < 1e-5
        assert h["clipped_norm_rel"] < 1e-5
        assert h["clip_rel"] < 1e-3  # per tensor, norm-wise; tiny mHC gradients carry rounding noise
        assert h["state_keys_equal"] and h["state_equal"]
        assert h["load_equal"]
        assert h["generate_equal"]


def test_muon_orthogonalizes_whole_matrices_under_fsdp(ranks):
    for res in ranks:
        m = res["muon"]
        assert m["n_sharded"] > 10  # the dense 2-D weights are FSDP shards
        # both runs feed the same gradients (to fp32 rounding, exact accumulation) into a bf16 Newton-Schulz
        # on the whole matrix: torch's Muon (addmm) in one process, the batched one (baddbmm) on the shards.
        # The two round differently: 5 iterations x 3 bf16 products, each rounding by at most 2^-8 relative,
        # bound the norm-wise difference by 15 * 2^-8 (to first order)
        assert m["update_rel"] < 15 * 2.0**-8, m
        # orthogonalizing a block of rows alone is a different map: the contrast the bound above separates
        assert m["shard_ns_rel"] > 1e-1, m


# ----------------------------------------------------------------------------- resume with N processes
K, M = 2, 2  # steps before the checkpoint, steps after it


def _resume_worker(rank: int, world: int, port: int, out_dir: str) -> None:
    """The trainer under 2 gloo processes (FSDP2 + expert parallelism, deterministic): K+M steps in one
    go (checkpoint at K), then resumed from step K; plus a resume whose optimizer state is dropped."""
    from safetensors.torch import load_file
    from test_train import MICRO, _corpus

    from dsv4.train.trainer import TrainConfig, Trainer

    os.environ.update(
        RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port)
    )
    torch.set_num_threads(1)
    D.setup_distributed(device="cpu", timeout_s=TIMEOUT_S)  # gloo on the CPU, GPU or not
    root = Path(out_dir)
    if rank == 0:
        _corpus(root)
    torch.distributed.barrier()
    base = dict(
        preset="tiny",
        model={k: list(v) if isinstance(v, tuple) else v for k, v in MICRO.items()},
        data=[str(root / "corpus")],
        seq_len=32,
        batch_size=4,
        steps=K + M,
        warmup=1,
        lr=5e-3,
        eval_every=0,
        diag_every=0,
        progress=False,
        deterministic=True,
        sample_prompt="",
        held_out_pct=10.0,
        cache_dir=str(root / "cache"),
        device="cpu",
    )
    quiet = {"log": lambda *_: None}

    full = Trainer(TrainConfig(**base, out=str(root / "full"), save_every=K), **quiet)
    full.fit()
    ckpt = root / "full" / "checkpoints" / f"step_{K:08d}"
    tok = str(root / "full" / "tokenizer")

    def resume(name: str) -> Trainer:
        return Trainer(
            TrainConfig(**base, out=str(root / name), save_every=-1, resume=str(ckpt), tokenizer=tok), **quiet
        )

    resumed = resume("resumed")
    restored = D.full_optimizer_state(resumed.opt, resumed.model)
    saved = load_file(str(ckpt / "optimizer.safetensors"))
    resumed.fit()

    live = D.load_full_optimizer_state
    D.load_full_optimizer_state = lambda *a, **k: None  # mutant: moments restart at zero
    try:
        dropped = resume("dropped")
        dropped.fit()
    finally:
        D.load_full_optimizer_state = live
    D.teardown_distributed()

    losses = lambda t: [r["loss"] for r in t.history if "loss" in r]  # noqa: E731
    moments = [k for k in saved if not k.endswith("/step")]
    res = {
        "straight": losses(full),
        "resumed": losses(resumed),
        "dropped": losses(dropped),
        "start_step": resumed.step - M,
        "keys_equal": restored.keys() == saved.keys(),
        "moments_equal": all(torch.equal(restored[k], saved[k]) for k in saved),
        "nonzero_moments": sum(int(saved[k].abs().sum() > 0) for k in moments),
        "n_moments": len(moments),
        "adamw_steps": sorted({float(saved[k]) for k in saved if k.endswith("/step")}),
        "expert_momentum_shape": list(saved["muon/layers.1.ffn.experts.w1/momentum_buffer"].shape),
        "expert_local_shape": list(resumed.model.layers[1].ffn.experts.w1.shape),
    }
    Path(out_dir, f"rank{rank}.json").write_text(json.dumps(res))


@pytest.fixture(scope="module")
def resume_dir(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("resume")


@pytest.fixture(scope="module")
def resumed(resume_dir) -> list[dict]:
    return launch(_resume_worker, resume_dir, world=WORLD, timeout_s=TIMEOUT_S)


def test_two_process_resume_restores_optimizer_state(resumed):
    for res in resumed:
        assert res["start_step"] == K
        # the whole file: every moment by name, full (unsharded) shapes; experts gathered over both ranks
        assert res["keys_equal"] and res["moments_equal"]
        assert res["expert_momentum_shape"] == [MICRO["n_routed_experts"], MICRO["moe_inter_dim"], MICRO["dim"]]
        assert res["expert_local_shape"][0] == MICRO["n_routed_experts"] // WORLD
        assert res["nonzero_moments"] > 0.9 * res["n_moments"]
        assert res["adamw_steps"] == [float(K)]
        # same losses as the uninterrupted run, exactly (deterministic mode, same world size)
        assert len(res["straight"]) == K + M
        assert res["resumed"] == res["straight"], (res["resumed"], res["straight"])
        # without the optimizer state the step after the checkpoint changes the next loss
        assert res["dropped"][: K + 1] == res["straight"][: K + 1]
        assert res["dropped"][K + 1] != res["straight"][K + 1]
    assert resumed[0]["resumed"] == resumed[1]["resumed"]


def test_checkpoint_of_two_processes_resumes_in_one(resumed, resume_dir):
    """The 2-process checkpoint (single-process layout) continues in one process with the same losses, up
    to the rounding of a batch no longer split over ranks."""
    from test_train import MICRO

    from dsv4 import ops
    from dsv4.train.trainer import TrainConfig, Trainer

    base = dict(
        preset="tiny",
        model={k: list(v) if isinstance(v, tuple) else v for k, v in MICRO.items()},
        data=[str(resume_dir / "corpus")],
        seq_len=32,
        batch_size=4,
        steps=K + M,
        warmup=1,
        lr=5e-3,
        eval_every=0,
        diag_every=0,
        progress=False,
        deterministic=True,
        sample_prompt="",
        held_out_pct=10.0,
        cache_dir=str(resume_dir / "cache"),
        device="cpu",
        save_every=-1,
        tokenizer=str(resume_dir / "full" / "tokenizer"),
    )
    ckpt = resume_dir / "full" / "checkpoints" / f"step_{K:08d}"
    try:
        one = Trainer(TrainConfig(**base, out=str(resume_dir / "one"), resume=str(ckpt)), log=lambda *_: None)
        one.fit()
    finally:
        torch.use_deterministic_algorithms(False)
        ops.set_deterministic(False)
    losses = [r["loss"] for r in one.history if "loss" in r]
    straight, dropped = resumed[0]["straight"], resumed[0]["dropped"]
    assert len(losses) == K + M and losses[:K] == straight[:K]  # the checkpoint's own history
    rel = [abs(a - b) / b for a, b in zip(losses[K:], straight[K:])]
    # step K+1: the same weights on the same global batch; the 2-process loss is the mean of two half-batch
    # means, the 1-process one a single mean: fp32 summation order alone (~1e-7 relative)
    assert rel[0] < 1e-5, (losses, straight)
    # later steps: the update after step K+1 saw gradients summed in another order (their bf16
    # Newton-Schulz can round a few elements differently); losing the optimizer state moves it far more
    assert max(rel) < 1e-3, (losses, straight)
    assert abs(dropped[K + 1] - straight[K + 1]) / straight[K + 1] > 10 * max(rel), (dropped, losses)


def test_single_process_is_left_alone():
    from dsv4.config import ModelConfig
    from dsv4.model.transformer import DeepSeekV4

    assert not D.is_distributed()
    cfg = ModelConfig.preset("tiny")
    model = DeepSeekV4(cfg, device="meta")
    assert D.shard_model(model) is model
    assert not any(isinstance(m.experts, D.ExpertParallel) for m in D.moe_layers(model))
    if "WORLD_SIZE" not in os.environ:
        assert D.setup_distributed(device="cpu") == (0, 1, torch.device("cpu"))


def _selftest_result(mode: str, grad_rel: list[float], spread_rel: list[float]) -> dict:
    """A selftest result of rank 0 with the given gradient differences and everything else exact."""
    train = {
        "rank": 0,
        "expert_ranges": [[0, 4]],
        "grad_rel": grad_rel,
        "spread_rel": spread_rel,
        "grad_worst": ["w"] * len(grad_rel),
        "loss_rel": 0.0,
        "forward_rel": 0.0,
        "param_rel": 0.0,
        "param_spread": 0.0,
        "loss_spread": 0.0,
    }
    infer = {"all_reduce": {"forward_rel": 0.0, "decode_rel": 0.0, "greedy_equal": True, "expert_ranges": [[0, 4]]}}
    return {"mode": mode, "train": train, "inference": infer}


def test_selftest_judges_tight_runs_by_tol_and_others_by_the_spread():
    tol = 1e-4
    # the first-step gradient difference of a GPU run with QAT and atomics: 4%
    assert not P._selftest_ok(_selftest_result("tight", [0.04, 0.0, 0.0], [0.0] * 3), tol)
    # the same run where one device's own micro-batched replica wanders by 1%: within SPREAD_FACTOR x
    assert P._selftest_ok(_selftest_result("spread", [0.04, 0.0, 0.0], [0.01, 0.0, 0.0]), tol)
    # a difference far above what rounding gives on one device (a missing reduction) still fails
    assert not P._selftest_ok(_selftest_result("spread", [0.5, 0.0, 0.0], [1e-3, 0.0, 0.0]), tol)
    # later steps may not exceed the largest spread seen so far by more than SPREAD_FACTOR either
    assert not P._selftest_ok(_selftest_result("spread", [0.0, 0.0, 0.5], [1e-3, 1e-3, 1e-3]), tol)
    assert P._selftest_ok(_selftest_result("tight", [5e-5, 5e-3, 5e-3], [0.0] * 3), tol)
