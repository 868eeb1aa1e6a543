"""The fast optimizer step (OptimConfig(fast=True)) against exact arithmetic and against the previous step.

- Newton-Schulz in bf16, batched over same-shape matrices: its normalisation and each iteration are within the
  rounding bounds of their bf16 arithmetic of the fp64 evaluation on the same input (elementwise, derived
  below); the whole chain is within the stated bound of fp64 Newton-Schulz and of torch's per-matrix Muon.
- MuonAdamW fast vs fast=False: AdamW (fused / foreach vs torch's default) within fp32 rounding, derived from
  the operations of one step; Muon within the Newton-Schulz bound.
- The training step reads the device once (grad norm, losses, expert loads) and skips a non-finite step.
- The stacked router-bias update gives the same numbers as the rule applied router by router.
"""

from __future__ import annotations

import math

import pytest
import torch
from bounds import U32, U_BF16, gamma, within
from test_train import _train_cfg, micro_model
from torch.utils._python_dispatch import TorchDispatchMode

from dsv4 import ops
from dsv4.train import balance, optim
from dsv4.train.trainer import Trainer

A, B, C = optim.NS_COEFFICIENTS
U = U_BF16
DEV = torch.device("cuda" if torch.cuda.is_available() else "cpu")


# ------------------------------------------------------------------------------------------ bounds
def _mm(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return x @ y


def ns_iteration_bound(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x [E, m, n] bf16 (m <= n) -> (the iteration G = x x^T, x' = a x + (b G + c G G) x in fp64, elementwise
    bound on |bf16 iteration - fp64|).

    Each product is a sum of K terms accumulated in fp32 (any order: gamma(K) * sum |term|), the epilogue
    (beta * input + alpha * product) adds at most one rounding per term, and the result is rounded to bf16
    (u = 2^-8 of its magnitude). The rounding of G carries into b G + c G G (and of that into x'), bounded with
    absolute values: |dGG| <= |dG| |G| + |G| |dG| + |dG| |dG|."""
    k = x.size(-2) + 3  # m products + input + two epilogue roundings
    X = x.double()
    Xa = X.abs()
    G = X @ X.mT
    dG = U * G.abs() + (1 + U) * gamma(x.size(-1)) * (Xa @ Xa.mT)
    Ga = G.abs() + dG  # |G| and |computed G| are below this
    Bx = B * G + C * G @ G
    prop = abs(B) * dG + abs(C) * (dG @ Ga + G.abs() @ dG)
    acc = (gamma(k) + U) * (abs(B) * Ga + abs(C) * Ga @ Ga)
    dB = prop + acc + U * (Bx.abs() + prop + acc)
    Y = A * X + Bx @ X
    prop = dB @ Xa
    acc = (gamma(k) + U) * (abs(A) * Xa + (Bx.abs() + dB) @ Xa)
    dY = prop + acc + U * (Y.abs() + prop + acc)
    return Y, dY


def ns_fp64(g: torch.Tensor, steps: int = optim.NS_STEPS) -> torch.Tensor:
    """Muon's Newton-Schulz of each matrix of g [E, m, n] in fp64 (exact to ~1e-15 for these sizes)."""
    x = g.double()
    wide = x.size(-2) > x.size(-1)
    if wide:
        x = x.mT
    x = x / x.norm(dim=(-2, -1), keepdim=True)
    for _ in range(steps):
        gram = x @ x.mT
        x = A * x + (B * gram + C * gram @ gram) @ x
    return x.mT if wide else x


def _grads(shape: tuple[int, ...], seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    # a spread of row scales makes the spectrum uneven, as in real gradients
    return torch.randn(*shape, generator=g) * torch.logspace(-1, 1, shape[-2])[:, None]


SHAPES = [(3, 24, 48), (3, 48, 24), (2, 32, 32)]


# ------------------------------------------------------------------------------------------ Newton-Schulz
@pytest.mark.parametrize("shape", SHAPES)
def test_ns_normalisation_within_bf16_rounding(shape):
    """x0 = bf16(g) / bf16(||bf16(g)||): rounding g (u), the fp32 norm of the rounded g (a sum of m n squares,
    gamma(m n), then sqrt and the bf16 rounding: u), the division (u): |x0 - g/||g||| <= (4u + 8u^2 +
    gamma(mn)) |g/||g|||; the rounding of g moves ||g|| by at most u relatively, counted in the 4u."""
    g = _grads(shape, 0)
    x0 = optim.batched_newton_schulz(g, optim.NS_COEFFICIENTS, 0, 1e-7)
    exact = ns_fp64(g, steps=0)
    rel = 4 * U + 8 * U * U + gamma(shape[-1] * shape[-2])
    ok, msg = within(x0, exact, rel * exact.abs())
    assert x0.dtype == torch.bfloat16 and ok, msg


@pytest.mark.parametrize("shape", SHAPES)
def test_ns_iterations_within_bf16_rounding_of_fp64(shape):
    """Every iteration of the batched bf16 chain, from the chain's own bf16 iterate, agrees with the fp64
    iteration of that same iterate within ns_iteration_bound (elementwise)."""
    g = _grads(shape, 1)
    for k in range(optim.NS_STEPS):
        x = optim.batched_newton_schulz(g, optim.NS_COEFFICIENTS, k, 1e-7)
        tall = x.size(-2) > x.size(-1)
        got = optim.ns_iteration(x, A, B, C, tall)  # a tall stack iterates in its own layout
        if tall:
            x, got = x.mT, got.mT
        exact, bound = ns_iteration_bound(x)
        ok, msg = within(got, exact, bound)
        assert ok, f"iteration {k + 1}: {msg}"
        if tall:  # the same iteration written on the transpose: within the bound too
            ok, msg = within(optim.ns_iteration(x, A, B, C), exact, bound)
            assert ok, f"iteration {k + 1}, transposed: {msg}"


def _chain_bound(g: torch.Tensor) -> torch.Tensor:
    """Stated bound on ||bf16 chain - fp64 chain||_F per matrix: the Frobenius norm of the last iteration's own
    rounding bound (ns_iteration_bound from the chain's 4th iterate). Errors of the earlier iterations are
    not added: after four iterations the singular values sit in the band [0.68, 1.2] that the quintic maps
    into itself, where it is a contraction for most of them (|p'(s)| < 1 on [0.75, 1.15]), so an earlier
    iteration's rounding shrinks under the last one; this test checks that this holds."""
    x = optim.batched_newton_schulz(g, optim.NS_COEFFICIENTS, optim.NS_STEPS - 1, 1e-7)
    if x.size(-2) > x.size(-1):
        x = x.mT
    return ns_iteration_bound(x)[1].norm(dim=(-2, -1))


@pytest.mark.parametrize("shape", SHAPES)
def test_batched_ns_matches_fp64_and_torch_per_matrix(shape):
    """The batched bf16 chain vs (1) fp64 Newton-Schulz, within the stated chain bound per matrix (itself under
    25% of the output's norm: the bound is worst-case, the errors measure 1-2%; one iteration too few or a
    wrong coefficient moves the output by more), and (2) torch.optim.Muon's own per-matrix
    computation, within twice it (both are within it of fp64). torch's Muon with momentum 0, no Nesterov, no
    weight decay, on a zero weight, leaves -lr' NS(g) in the weight (one fp32 rounding, u32)."""
    g = _grads(shape, 2)
    fast = optim.batched_newton_schulz(g, optim.NS_COEFFICIENTS, optim.NS_STEPS, 1e-7).double()
    exact = ns_fp64(g)
    bound = _chain_bound(g)
    err = (fast - exact).norm(dim=(-2, -1))
    assert (bound < 0.25 * exact.norm(dim=(-2, -1))).all()
    assert (err <= bound).all(), f"errors {err.tolist()} vs bounds {bound.tolist()}"
    lr = 0.1
    for e in range(g.size(0)):
        w = torch.nn.Parameter(torch.zeros(g.shape[1:]))
        w.grad = g[e].clone()
        torch.optim.Muon(
            [w], lr=lr, weight_decay=0.0, momentum=0.0, nesterov=False, adjust_lr_fn="match_rms_adamw"
        ).step()
        adj = lr * 0.2 * math.sqrt(max(g.shape[1:]))
        per_matrix = -w.detach().double() / adj
        diff = float((per_matrix - fast[e]).norm())
        assert diff <= 2 * float(bound[e]) + U32 * float(per_matrix.norm()), (e, diff, float(bound[e]))


_GROUP = {
    "lr": 0.05,
    "weight_decay": 0.1,
    "momentum": 0.9,
    "nesterov": True,
    "ns_coefficients": optim.NS_COEFFICIENTS,
    "ns_steps": optim.NS_STEPS,
    "eps": 1e-7,
    "adjust_lr_fn": "match_rms_adamw",
}


def _plan_step(
    ws: list[torch.Tensor], gs: list[torch.Tensor], max_elems: int, backend: str = "reference"
) -> list[torch.Tensor]:
    """One MuonPlan step from zero momentum on copies of ws (each [k, m, n]), its elementwise passes
    (`ops.muon_momentum`, `ops.muon_apply`) on `backend`, on DEV; -> the new weights (on the CPU)."""
    w = [t.clone().to(DEV) for t in ws]
    views = [[torch.nn.Parameter(t[i]) for i in range(t.size(0))] for t in w]
    state: dict = {}
    plan = optim.MuonPlan(w, views, state, _GROUP, max_elems)
    with ops.use_backend({"muon_momentum": backend, "muon_apply": backend}):
        plan.step([g.clone().to(DEV) for g in gs], torch.tensor(_GROUP["lr"], device=DEV))
    assert (ops.last_backend("muon_momentum"), ops.last_backend("muon_apply")) == (backend, backend)
    bufs = {ch.buf.data_ptr() for ch in plan.chunks}
    for vs, g in zip(views, gs):  # the state keeps each matrix's momentum, (1 - 0.9) g, as a
        for v, gi in zip(vs, g):  # slice of its chunk's buffer
            mom = state[v]["momentum_buffer"]
            torch.testing.assert_close(mom.cpu(), 0.1 * gi, rtol=0, atol=0)
            assert mom.untyped_storage().data_ptr() in bufs
    return [t.cpu() for t in w]


@pytest.mark.parametrize("backend", ["reference", "triton"])
def test_plan_chunks_and_mixes_stacks_and_matrices(backend, monkeypatch):
    """A MuonPlan over a stack [4, m, n], two [m, n] weights and a [2, n, m] stack equals the per-matrix
    reference (`reference_muon_step`, torch's Muon arithmetic) whatever the chunking (the batch entries
    are independent: chunking changes which matrices share a call, not the arithmetic of any one), within
    twice the chain bound of the update times the adjusted lr plus two fp32 roundings of the weight; with
    the elementwise passes on either backend (Triton: compiled on CUDA, else the CPU interpreter)."""
    if backend == "triton":
        pytest.importorskip("triton", reason="triton is not installed: no triton backend to test")
        from triton_interp import interpret_unless_cuda

        interpret_unless_cuda(monkeypatch)
    torch.manual_seed(0)
    shapes = [(4, 16, 24), (1, 16, 24), (1, 16, 24), (2, 24, 16)]
    ws = [torch.randn(s) for s in shapes]
    gs = [torch.randn(s) for s in shapes]
    ref = []
    for t, g in zip(ws, gs):
        w = t.clone()
        for i in range(t.size(0)):
            optim.reference_muon_step(w[i], g[i], torch.zeros_like(g[i]), _GROUP)
        ref.append(w)
    for max_elems in (1 << 20, 16 * 24 * 3, 1):
        for got, want, g in zip(_plan_step(ws, gs, max_elems, backend), ref, gs):
            upd = g.lerp(0.1 * g, 0.9)
            adj = 0.05 * 0.2 * math.sqrt(max(g.shape[-2:]))
            bound = 2 * adj * _chain_bound(upd) + 2 * U32 * want.norm(dim=(-2, -1)).double()
            assert ((got - want).double().norm(dim=(-2, -1)) <= bound).all(), max_elems


# ------------------------------------------------------------------------------------------ AdamW
def _adamw_error_bound(
    grads: list[torch.Tensor], p0: torch.Tensor, lr: float, wd: float, betas: tuple[float, float], eps: float
) -> torch.Tensor:
    """Elementwise bound on |fp32 AdamW after len(grads) steps - exact|, for fixed gradients (they do not
    depend on the weights, so no error feeds back through them).

    Per step t: m = b1 m + (1 - b1) g and v = b2 v + (1 - b2) g^2 each take 3 roundings, so |dm_t| <= 3 t u M_t
    with M_t the same recursion on |g| (no cancellation), and v (all terms >= 0) is relatively within 3 t u;
    the update lr / bc1 * m / (sqrt(v / bc2) + eps) takes 10 more roundings (bias corrections, their square
    root, division, sqrt, + eps, division, the lr factors) plus half of v's relative error through the sqrt;
    the weight decay product and the subtraction round the weight twice (2u |p|)."""
    b1, b2 = betas
    p, m, v, M = p0.double(), 0.0, 0.0, 0.0
    err = torch.zeros_like(p)
    for t, g in enumerate(grads, start=1):
        g = g.double()
        m, v, M = b1 * m + (1 - b1) * g, b2 * v + (1 - b2) * g * g, b1 * M + (1 - b1) * g.abs()
        bc1, bc2 = 1 - b1**t, 1 - b2**t
        denom = (v / bc2).sqrt() + eps
        step = lr / bc1 * m / denom
        d_step = lr / bc1 * (3 * t * U32 * M + m.abs() * (1.5 * t + 10) * U32) / denom
        p = p * (1 - lr * wd) - step
        err = err * (1 - lr * wd) + d_step + 2 * U32 * (p.abs() + step.abs())
    return err


def test_fast_adamw_matches_the_default_within_fp32_rounding():
    """The fused (CPU has the kernel) and foreach AdamW against torch's default on CPU (single-tensor),
    over 5 steps of fixed gradients: each within _adamw_error_bound of exact, so within twice it of each
    other."""
    torch.manual_seed(0)
    p0 = torch.randn(64, 33)
    grads = [torch.randn(64, 33) * 10 ** torch.empty(64, 33).uniform_(-3, 1) for _ in range(5)]
    kw = dict(lr=3e-3, weight_decay=0.1, betas=(0.9, 0.95), eps=1e-8)
    bound = 2 * _adamw_error_bound(grads, p0, 3e-3, 0.1, (0.9, 0.95), 1e-8)
    out = {}
    for impl in ({}, {"fused": True}, {"foreach": True}):
        w = torch.nn.Parameter(p0.clone())
        opt = torch.optim.AdamW([w], **kw, **impl)
        for g in grads:
            w.grad = g.clone()
            opt.step()
        out[next(iter(impl), "default")] = w.detach()
    for name in ("fused", "foreach"):
        ok, msg = within(out[name], out["default"], bound)
        assert ok, f"{name}: {msg}"


def test_muonadamw_fast_matches_old_step():
    """MuonAdamW(fast=True) vs fast=False on the micro model, one step from the same gradients: AdamW
    parameters within the AdamW bound, Muon matrices within twice the chain bound of their update (times the
    adjusted lr) plus two fp32 roundings of the weight; the fast AdamW is fused on this CPU."""
    grads = {}
    torch.manual_seed(3)
    outs = []
    for fast in (True, False):
        m = micro_model()
        opt = optim.MuonAdamW(m, optim.OptimConfig(lr=0.02, weight_decay=0.1, fast=fast))
        if fast:
            assert opt.adamw.defaults["fused"] is True
        for n, p in m.named_parameters():
            p.grad = grads.setdefault(n, torch.randn_like(p)).clone()
        before = {n: p.detach().clone() for n, p in m.named_parameters()}
        opt.step()
        outs.append((opt, {n: p.detach().clone() for n, p in m.named_parameters()}))
    (opt, fast), (_, old) = outs
    for n in opt.adamw_names:
        bound = 2 * _adamw_error_bound(
            [grads[n]],
            before[n],
            0.02,
            0.1 if before[n].dim() >= 2 and not n.startswith("embed.") else 0.0,
            (0.9, 0.95),
            1e-8,
        )
        ok, msg = within(fast[n], old[n], bound)
        assert ok, f"{n}: {msg}"
    for n in opt.muon_names:
        g = grads[n].reshape(-1, *grads[n].shape[-2:])
        upd = g.lerp(0.05 * g, 0.95)  # Nesterov mix of the first step's momentum
        adj = 0.02 * 0.2 * math.sqrt(max(g.shape[-2:]))
        bound = 2 * adj * _chain_bound(upd) + 2 * U32 * fast[n].reshape(g.shape).norm(dim=(-2, -1)).double()
        diff = (fast[n] - old[n]).reshape(g.shape).double().norm(dim=(-2, -1))
        assert (diff <= bound).all(), n
        assert not torch.equal(fast[n], before[n])


def test_fast_state_round_trips_and_keeps_torch_muon_state():
    """fast=True keeps the momentum in torch's Muon state under each 2-D parameter (so checkpoints do not
    change), and two fast steps after a state_dict round trip equal two uninterrupted ones."""
    torch.manual_seed(5)
    runs = []
    for reload in (False, True):
        m = micro_model()
        opt = optim.MuonAdamW(m, optim.OptimConfig(lr=0.01))
        gen = torch.Generator().manual_seed(7)
        for step in range(2):
            for p in m.parameters():
                p.grad = torch.randn(p.shape, generator=gen)
            opt.step()
            if reload and step == 0:
                opt.load_state_dict(opt.state_dict())
        runs.append({n: p.detach().clone() for n, p in m.named_parameters()})
        w = dict(m.named_parameters())["layers.1.attn.wq_a.weight"]
        assert opt.muon.state[w]["momentum_buffer"].abs().sum() > 0
    for n in runs[0]:
        assert torch.equal(runs[0][n], runs[1][n]), n


# ------------------------------------------------------------------------------------------ several steps, structured
class _Mixed(torch.nn.Module):
    """Mixed shapes: a wide and a tall matrix, stacked experts [4, 16, 24], a [16, 24] matrix that shares
    their Newton-Schulz batch, and AdamW tensors (embedding, norm)."""

    def __init__(self):
        super().__init__()
        gen = torch.Generator().manual_seed(11)
        shapes = {
            "layers.0.attn.wide": (24, 48),
            "layers.0.attn.tall": (48, 24),
            "layers.0.ffn.experts": (4, 16, 24),
            "layers.0.ffn.zero": (16, 24),
            "embed.weight": (32, 16),
            "layers.0.norm.weight": (16,),
        }
        for n, shape in shapes.items():
            self.register_parameter(n.replace(".", "_"), torch.nn.Parameter(torch.randn(shape, generator=gen)))
        self.names = {n.replace(".", "_"): n for n in shapes}

    def named_parameters(self, *args, **kw):  # the dotted names MuonAdamW sorts by
        for k, p in super().named_parameters(*args, **kw):
            yield self.names[k], p


def _mixed_grads(step: int, right: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Step `step`'s gradients: random for the wide matrix, experts and AdamW tensors; rank 3 for the tall
    one (always the same right factor right["tall"], so every update lies in its row space); zero for
    "zero"."""
    gen = torch.Generator().manual_seed(100 + step)
    m = _Mixed()
    out = {}
    for n, p in m.named_parameters():
        if n.endswith("tall"):
            out[n] = torch.randn(48, 3, generator=gen) @ right["tall"]
        elif n.endswith("zero"):
            out[n] = torch.zeros(p.shape)
        else:
            out[n] = torch.randn(p.shape, generator=gen) * torch.logspace(-1, 1, p.shape[-1])
    return out


def _reference_run(grads: list[dict[str, torch.Tensor]], cfg: optim.OptimConfig) -> dict[str, torch.Tensor]:
    """The plain per-parameter reference: `reference_muon_step` on every 2-D matrix (each expert its own),
    torch's default AdamW (single-tensor) on the rest, with MuonAdamW's groups and lr."""
    m = _Mixed()
    params = dict(m.named_parameters())
    muon, adamw = optim.split_params(m)
    group = {
        "lr": cfg.lr,
        "weight_decay": cfg.weight_decay,
        "momentum": cfg.muon_momentum,
        "nesterov": True,
        "ns_coefficients": optim.NS_COEFFICIENTS,
        "ns_steps": optim.NS_STEPS,
        "eps": 1e-7,
        "adjust_lr_fn": "match_rms_adamw",
    }
    bufs = {n: torch.zeros_like(p) for n, p in muon}
    decay = [p for n, p in adamw if p.dim() >= 2 and not n.startswith("embed.")]
    no_decay = [p for n, p in adamw if not (p.dim() >= 2 and not n.startswith("embed."))]
    opt = torch.optim.AdamW(
        [
            g
            for g in ({"params": decay, "weight_decay": cfg.weight_decay}, {"params": no_decay, "weight_decay": 0.0})
            if g["params"]
        ],
        lr=cfg.lr,
        betas=cfg.betas,
        eps=cfg.eps,
        foreach=False,
    )
    with torch.no_grad():
        for g in grads:
            for n, p in adamw:
                p.grad = g[n].clone()
            opt.step()
            for n, p in muon:
                w, gr, b = p.data.view(-1, *p.shape[-2:]), g[n].view(-1, *p.shape[-2:]), bufs[n].view(-1, *p.shape[-2:])
                for i in range(w.size(0)):
                    optim.reference_muon_step(w[i], gr[i], b[i], group)
    return {n: p.detach().clone() for n, p in params.items()}


def test_batched_optimizer_matches_the_per_parameter_reference_over_steps_and_a_checkpoint(tmp_path):
    """MuonAdamW(fast=True) over 4 steps, saved and restored through the training checkpoint's optimizer
    tensors after step 2 (a fresh optimizer on a fresh model), against the per-parameter reference:

    - the restored run equals the uninterrupted fast run bit for bit (same arithmetic, same order);
    - Muon weights: per step, each update is within twice the chain bound of its Nesterov mix (times the
      adjusted lr) of the reference's, and the weight products round twice (2 u32 |w|); the bounds add over
      the steps (weight decay only shrinks an earlier difference), and their sum stays under half of what
      the steps move the weight (so a wrong coefficient or iteration count shows). The rank-3 gradients of
      the tall matrix are compared on their row space: bf16 rounding puts noise of order one into the null space, which
      Newton-Schulz amplifies (3.44 per iteration at singular value 0) in both implementations
      differently; on the row space the errors behave as for full rank;
    - the zero-gradient matrix only decays: within 3 t u32 |w| (the factor 1 - lr wd is rounded differently);
    - AdamW tensors within twice _adamw_error_bound of exact (fused vs single-tensor)."""
    from dsv4.train import checkpoint

    cfg = optim.OptimConfig(lr=0.02, weight_decay=0.1)
    right = {"tall": torch.randn(3, 24, generator=torch.Generator().manual_seed(5))}
    grads = [_mixed_grads(t, right) for t in range(4)]
    runs = []
    for restore in (False, True):
        m = _Mixed()
        opt = optim.MuonAdamW(m, cfg)
        for t, g in enumerate(grads):
            if restore and t == 2:
                saved = checkpoint.optimizer_tensors(opt, m)
                m2 = _Mixed()
                m2.load_state_dict(m.state_dict())
                m, opt = m2, optim.MuonAdamW(m2, cfg)
                checkpoint.load_optimizer_tensors(opt, m, saved)
            for n, p in m.named_parameters():
                p.grad = g[n].clone()
            opt.step()
        runs.append({n: p.detach().clone() for n, p in m.named_parameters()})
    for n in runs[0]:
        assert torch.equal(runs[0][n], runs[1][n]), n
    fast, ref = runs[0], _reference_run(grads, cfg)
    init = dict(_Mixed().named_parameters())
    muon_names = set(opt.muon_names)
    v_tall = torch.linalg.svd(right["tall"].double(), full_matrices=False)[2].mT  # [24, 3] row space
    for n in fast:
        diff = (fast[n] - ref[n]).double()
        if n not in muon_names:
            bound = 2 * _adamw_error_bound(
                [g[n] for g in grads],
                init[n].detach(),
                cfg.lr,
                cfg.weight_decay if init[n].dim() >= 2 and not n.startswith("embed.") else 0.0,
                cfg.betas,
                cfg.eps,
            )
            ok, msg = within(fast[n], ref[n], bound)
            assert ok, f"{n}: {msg}"
            continue
        if n.endswith("zero"):
            assert (diff.abs() <= 3 * 4 * U32 * init[n].detach().abs()).all()
            continue
        shape = (-1, *init[n].shape[-2:])
        adj = cfg.lr * 0.2 * math.sqrt(max(init[n].shape[-2:]))
        bound = torch.zeros(diff.view(shape).size(0), dtype=torch.float64)
        moved = torch.zeros_like(bound)  # sum of the steps' update norms (fp64 Newton-Schulz)
        buf = torch.zeros_like(grads[0][n]).view(shape)
        for g in grads:
            g = g[n].view(shape)
            buf = buf.lerp(g, 1 - cfg.muon_momentum)
            upd = g.lerp(buf, cfg.muon_momentum)
            bound += 2 * adj * _chain_bound(upd) + 2 * U32 * ref[n].view(shape).norm(dim=(-2, -1)).double()
            moved += adj * ns_fp64(upd).norm(dim=(-2, -1))
        if n.endswith("tall"):
            diff = diff @ v_tall
        err = diff.view(diff.size(0) if diff.dim() == 3 else 1, *diff.shape[-2:]).norm(dim=(-2, -1))
        assert (err <= bound).all(), (n, err.tolist(), bound.tolist())
        assert (bound < 0.5 * moved).all(), n  # the bound is well below what the steps move


def test_fast_step_reads_nothing_on_the_host():
    """The fast step (fused AdamW with a device lr, every Muon matrix through the plan) makes no scalar read
    and no copy to the host, also after set_lr_factor (the lrs are device scalars, filled in place)."""
    m = micro_model()
    opt = optim.MuonAdamW(m, optim.OptimConfig(lr=0.01))
    gen = torch.Generator().manual_seed(0)
    for p in m.parameters():
        p.grad = torch.randn(p.shape, generator=gen)
    opt.step()  # the first step builds the plan and the state
    opt.set_lr_factor(0.5)
    with _HostReads() as reads:
        opt.step()
    assert (reads.scalar, reads.to_cpu) == (0, 0)
    assert opt.implementation == {"muon": "batched", "adamw": "fused", "muon_passes": "reference"}
    assert float(opt.adamw.param_groups[0]["lr"]) == pytest.approx(0.005)
    assert float(opt._muon_lr) == pytest.approx(0.005)


@pytest.mark.gpu  # CUDA sync debug mode and graph capture
def test_fast_step_on_cuda_has_no_sync_and_replays_from_a_graph():
    """On a GPU: the step never raises under torch.cuda.set_sync_debug_mode("error") (no host sync); a CUDA
    graph of it (graphed.GraphedUpdate, captured after one eager step), replayed, gives the eager steps'
    weights bit for bit and follows set_lr_factor."""
    from dsv4.train.graphed import GraphedUpdate

    outs = []
    for graphed in (False, True):
        torch.manual_seed(0)
        m = micro_model().cuda()
        opt = optim.MuonAdamW(m, optim.OptimConfig(lr=0.01))
        gen = torch.Generator().manual_seed(0)
        grads = [torch.randn(p.shape, generator=gen).cuda() for p in m.parameters()]
        for p, g in zip(m.parameters(), grads):
            p.grad = g
        opt.step()
        step = GraphedUpdate(opt.step) if graphed else opt.step
        for k in range(3):
            opt.set_lr_factor(1.0 / (k + 2))
            torch.cuda.set_sync_debug_mode("error")
            try:
                step()
            finally:
                torch.cuda.set_sync_debug_mode(0)
        outs.append([p.detach().clone() for p in m.parameters()])
    for a, b in zip(*outs):
        assert torch.equal(a, b)


# ------------------------------------------------------------------------------------------ the training step
class _HostReads(TorchDispatchMode):
    """Counts the ops that read a tensor on the host: .item()/float()/int()/bool() (aten._local_scalar_dense;
    a host sync on a GPU) and copies to the CPU device."""

    def __init__(self):
        super().__init__()
        self.scalar = 0
        self.to_cpu = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is torch.ops.aten._local_scalar_dense.default:
            self.scalar += 1
        elif func is torch.ops.aten._to_copy.default and kwargs.get("device") == torch.device("cpu"):
            self.to_cpu += 1
        return func(*args, **kwargs)


def test_train_step_reads_the_device_once(tmp_path):
    """One training step (losses, backward, norm, clipping, Muon + AdamW, bias update) reads the device once
    beyond what the model's forward and backward read: one copy to the host and no .item() (before: one per
    gradient for the non-finite count, the norm, one per loss part and one per MoE layer)."""
    t = Trainer(_train_cfg(tmp_path, steps=3, eval_every=0, diag_every=0), log=lambda *_: None)
    t.train_step(t.loader.next_batch())  # first calls' one-time work (on CUDA: two reads) left out of the counts
    batch = t.loader.next_batch()
    with _HostReads() as fwd_bwd:  # the model's own reads (token-range checks, one_hot): not counted
        t._losses(batch.to(t.device)).total.backward()
    t.opt.zero_grad()
    with _HostReads() as reads:
        row = t.train_step(batch)
    assert (reads.scalar - fwd_bwd.scalar, reads.to_cpu - fwd_bwd.to_cpu) == (0, 1)
    assert row["nonfinite"] == 0 and not row["skipped"] and math.isfinite(row["grad_norm"])
    assert row["expert_load_max_min"] == balance.load_ratios(t.model) and len(row["expert_load_max_min"]) == 4
    assert all(r >= 1 for r in row["expert_load_max_min"])  # 3 layers + the MTP block


def test_train_step_skips_a_non_finite_step_and_counts_it(tmp_path):
    """A gradient with two non-finite elements: the step is skipped (no weight moves), the count is 2, and
    the next clean step trains again."""
    t = Trainer(_train_cfg(tmp_path, steps=3, eval_every=0, diag_every=0), log=lambda *_: None)
    w = dict(t.model.named_parameters())["layers.1.attn.wq_a.weight"]

    def poison(g: torch.Tensor) -> torch.Tensor:
        g = g.clone()
        g.view(-1)[:2] = torch.tensor([math.nan, math.inf])
        return g

    handle = w.register_hook(poison)
    before = {n: p.detach().clone() for n, p in t.model.named_parameters()}
    row = t.train_step(t.loader.next_batch())
    handle.remove()
    assert row["skipped"] and row["nonfinite"] == 2 and not math.isfinite(row["grad_norm"])
    assert all(torch.equal(p, before[n]) for n, p in t.model.named_parameters())
    row = t.train_step(t.loader.next_batch())
    assert not row["skipped"] and not torch.equal(w.detach(), before["layers.1.attn.wq_a.weight"])


def test_clipping_matches_torch_clip_grad_norm(tmp_path):
    """The step's norm and clipping (device scalars, foreach) equal torch.nn.utils.clip_grad_norm_ on the same
    gradients: the same per-tensor norms and coefficient, so within fp32 rounding of the norm (gamma(n))."""
    t = Trainer(_train_cfg(tmp_path, steps=1, eval_every=0, diag_every=0, grad_clip=0.01), log=lambda *_: None)
    gen = torch.Generator().manual_seed(0)
    for p in t.model.parameters():  # drawn on the CPU, placed where the model is (CPU or a GPU)
        p.grad = torch.randn(p.shape, generator=gen).to(p.device)
    ref = [torch.nn.Parameter(p.detach().clone()) for p in t.model.parameters()]
    for r, p in zip(ref, t.model.parameters()):
        r.grad = p.grad.clone()
    n = sum(r.numel() for r in ref)
    total = t._grad_norm()
    t._clip(0.01, total)
    want = torch.nn.utils.clip_grad_norm_(ref, 0.01, foreach=False)
    assert float(want) > 1 and abs(float(total) - float(want)) <= gamma(n) * float(want)
    for p, r in zip(t.model.parameters(), ref):
        torch.testing.assert_close(p.grad, r.grad, rtol=4 * gamma(n), atol=0)


# ------------------------------------------------------------------------------------------ router bias
def test_stacked_bias_update_equals_the_per_router_rule():
    """update_bias (one stacked computation, one foreach add) == bias += gamma * sign(mean - load) router by
    router, exactly: the loads are token counts, so every mean is the same exact sum / E in fp32."""
    m = micro_model()
    moes = balance.routers(m)
    assert len(moes) >= 2
    gen = torch.Generator().manual_seed(0)
    for moe in moes:
        moe.set_load(torch.randint(0, 50, (moe.gate.bias.numel(),), generator=gen))
        moe.gate.bias.data = torch.randn(moe.gate.bias.shape, generator=gen) * 1e-3
    want = [
        moe.gate.bias.detach().clone() + 0.01 * torch.sign(moe.load.float().mean() - moe.load.float()) for moe in moes
    ]
    assert balance.update_bias(m, 0.01) == len(moes)
    for moe, w in zip(moes, want):
        assert torch.equal(moe.gate.bias.detach(), w)
    ratios = balance.load_ratios(m)
    loads = [mod.load for mod in m.modules() if hasattr(mod, "gate") and getattr(mod, "load", None) is not None]
    assert ratios == [round(float(ld.max() / ld.min().clamp_min(1)), 3) for ld in loads]
