"""Error bounds the tests assert, derived from the arithmetic (sizes and dtypes), never from one machine's output.

Notation (Higham, "Accuracy and Stability of Numerical Algorithms", ch. 3): u is the unit roundoff of a
dtype (half the distance from 1 to the next number): one rounding changes a value v by at most u * |v|. A sum
of n terms evaluated in ANY order in that dtype is off from the exact sum by at most gamma(n) * sum |term|
with gamma(n) = n u / (1 - n u). Two implementations that add the same terms in different orders therefore
differ by at most 2 gamma(n) * sum |term|; rounding both results to a narrower dtype (u_out) adds at most
u_out * (|a| + |b|).
"""

from __future__ import annotations

import torch

U = {torch.float64: 2.0**-53, torch.float32: 2.0**-24, torch.bfloat16: 2.0**-8, torch.float16: 2.0**-11}
U32 = U[torch.float32]
U_BF16 = U[torch.bfloat16]
# elementary functions (exp, rsqrt, sigmoid, ...) of torch's CPU kernels and of numpy under the Triton
# interpreter are accurate to a few ulp; 4 ulp is the allowance used for one such evaluation
FUNC_ULPS = 4


def gamma(n: int, dtype: torch.dtype = torch.float32) -> float:
    """gamma(n) = n u / (1 - n u): relative bound of an n-term sum (or dot product) against sum |term|."""
    nu = n * U[dtype]
    if nu >= 1:
        raise ValueError(f"gamma({n}) undefined for {dtype}: n * u >= 1")
    return nu / (1 - nu)


def rounding_pair(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """Elementwise: what two roundings to the dtype of a and b can add to |a - b| (u * (|a| + |b|))."""
    u = U[a.dtype]
    return u * (a.double().abs() + b.double().abs())


def within(got: torch.Tensor, want: torch.Tensor, bound: torch.Tensor | float) -> tuple[bool, str]:
    """(|got - want| <= bound everywhere, a message naming the worst element against its bound)."""
    diff = (got.double() - want.double()).abs()
    bound = torch.as_tensor(bound, dtype=torch.float64).expand_as(diff)
    ratio = diff / bound.clamp_min(1e-300)
    i = int(ratio.flatten().argmax())
    msg = (
        f"worst element {i}: |diff| {float(diff.flatten()[i]):.3e} vs bound {float(bound.flatten()[i]):.3e} "
        f"({float(ratio.flatten()[i]):.2f} of it)"
    )
    return bool((diff <= bound).all()), msg


def hc_mix_error(x: torch.Tensor, fn: torch.Tensor, norm_eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """mHC mixing mixes_j = rsqrt(mean(x^2) + eps) * sum_k fn_jk x_k evaluated in fp32 in any order:
    -> (exact mixes in float64 [..., mix], bound on |fp32 - exact| [..., mix]).

    Terms: the K = hc*d products summed (gamma(K) * r * sum |fn x|); the mean of squares, a sum of positive
    terms (relative gamma(K)), through rsqrt (relative half of it, plus FUNC_ULPS u); the final product (u).
    """
    xf = x.double().flatten(-2)  # [..., K]
    k = xf.size(-1)
    r = torch.rsqrt(xf.square().mean(-1, keepdim=True) + norm_eps)  # [..., 1]
    mixes = (xf @ fn.double().t()) * r  # [..., mix]
    mag = (xf.abs() @ fn.double().abs().t()) * r  # r * sum |fn x|
    rel_r = gamma(k) / 2 + FUNC_ULPS * U32
    return mixes, (gamma(k) + rel_r + U32) * mag


def hc_weighted_sum_error(
    x: torch.Tensor, fn: torch.Tensor, scale: torch.Tensor, base: torch.Tensor, norm_eps: float, hc_eps: float
) -> torch.Tensor:
    """Bound on |v - exact| for v = sum_h pre_h x_h in fp32, pre_h = sigmoid(mix_h * scale + base_h) + eps
    (hc_pre's sublayer input and hc_head's output before their rounding to x.dtype) -> [..., d].

    sigmoid' <= 1/4, so |d pre_h| <= |scale| / 4 * |d mix_h| + FUNC_ULPS u; then the 4-term weighted sum
    adds gamma(hc) * sum_h pre_h |x_h| (pre_h <= 1 + eps).
    """
    hc = x.size(-2)
    _, mix_err = hc_mix_error(x, fn, norm_eps)
    pre_err = abs(float(scale[0])) / 4 * mix_err[..., :hc] + FUNC_ULPS * U32  # [..., hc]
    xa = x.double().abs()  # [..., hc, d]
    return (pre_err.unsqueeze(-1) * xa).sum(-2) + gamma(hc) * (1 + hc_eps) * xa.sum(-2)


def _hc_head_backward(
    x: torch.Tensor,
    fn: torch.Tensor,
    scale: torch.Tensor,
    base: torch.Tensor,
    gy: torch.Tensor,
    norm_eps: float,
    hc_eps: float,
) -> dict:
    """hc_head's backward up to the mixes' gradient, in float64, with first-order bounds on an fp32
    evaluation (what `hc_head_grad_x` and `hc_head_param_grads` share): the mixes and the sigmoid s, the
    gradient g_s = g_pre sigmoid' of the sigmoid's argument before the scale, g_m = g_s scale of the mixes,
    and gmr = g_m r of the projection's output (before the RMS scale)."""
    u, d = U32, x.size(-1)
    mix, mix_err = hc_mix_error(x, fn, norm_eps)  # [..., hc]
    xd, gyd, sv = x.double(), gy.double().unsqueeze(-2), float(scale.reshape(-1)[0])
    sc = abs(sv)
    xf = xd.flatten(-2)
    k = xf.size(-1)
    r = torch.rsqrt(xf.square().mean(-1, keepdim=True) + norm_eps)  # [..., 1]
    rel_r = gamma(k) / 2 + FUNC_ULPS * u
    s = torch.sigmoid(mix * sv + base.double())
    g_pre = (xd * gyd).sum(-1)  # [..., hc]
    g_pre_err = gamma(d) * (xd * gyd).abs().sum(-1)
    sigp = s * (1 - s)
    sigp_err = 0.1 * sc * mix_err + (FUNC_ULPS + 2) * u
    g_s = g_pre * sigp
    g_s_err = g_pre_err * sigp + g_pre.abs() * sigp_err + 2 * u * g_s.abs()
    g_m, g_m_err = g_s * sv, sc * g_s_err + 3 * u * (g_s * sv).abs()
    gmr, gmr_err = g_m * r, (g_m_err + g_m.abs() * (rel_r + u)) * r
    return dict(
        k=k, xf=xf, r=r, rel_r=rel_r, gyd=gyd, s=s, pre_err=sc / 4 * mix_err + FUNC_ULPS * u,
        mix=mix, mix_err=mix_err, g_s=g_s, g_s_err=g_s_err, g_m=g_m, g_m_err=g_m_err, gmr=gmr, gmr_err=gmr_err,
    )  # fmt: skip


def hc_head_param_grads(
    x: torch.Tensor,
    fn: torch.Tensor,
    scale: torch.Tensor,
    base: torch.Tensor,
    gy: torch.Tensor,
    norm_eps: float,
    hc_eps: float,
) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    """hc_head's parameter gradients in float64 and a first-order bound on an fp32 evaluation's distance
    from them, in any order of its sums -> {"fn": (exact [hc, hc d], bound), "scale": ..., "base": ...}.

    Each is a sum over the T tokens (and the hc mixes) of per-token terms whose fp32 values carry the
    errors of `_hc_head_backward`: fn's gradient sum_t gmr_t x_t (T terms), the scale's sum_t,j g_s mix
    (T hc terms), the base's sum_t g_s (T terms); each sum adds gamma(terms + 1) * sum |term|. fn's sum may
    run on tensor cores over exact three-way bf16 splits (`mhc_bwd.projection_grads`): up to six part
    products per token and the token splits' partial sums (gamma(6 T + 8)), the three dropped part
    products, each below 2^-24 of its term (3 u), and the product's own rounding (u)."""
    t = _hc_head_backward(x, fn, scale, base, gy, norm_eps, hc_eps)
    hc = x.size(-2)
    gmr, gmr_err = t["gmr"].reshape(-1, hc), t["gmr_err"].reshape(-1, hc)  # [T, hc]
    g_s, g_s_err = t["g_s"].reshape(-1, hc), t["g_s_err"].reshape(-1, hc)
    mix, mix_err = t["mix"].reshape(-1, hc), t["mix_err"].reshape(-1, hc)
    xf = t["xf"].reshape(gmr.size(0), -1)  # [T, K]
    n = gmr.size(0)
    fn_g = gmr.t() @ xf
    fn_b = gmr_err.t() @ xf.abs() + (gamma(6 * n + 8) + 4 * U32) * (gmr.abs().t() @ xf.abs())
    sc_g = (g_s * mix).sum()
    sc_b = (g_s_err * mix.abs() + g_s.abs() * mix_err).sum() + gamma(n * hc + 1) * (g_s * mix).abs().sum()
    base_g = g_s.sum(0)
    base_b = g_s_err.sum(0) + gamma(n + 1) * g_s.abs().sum(0)
    return {"fn": (fn_g, fn_b), "scale": (sc_g.reshape(1), sc_b.reshape(1)), "base": (base_g, base_b)}


def hc_head_grad_x(
    x: torch.Tensor,
    fn: torch.Tensor,
    scale: torch.Tensor,
    base: torch.Tensor,
    gy: torch.Tensor,
    norm_eps: float,
    hc_eps: float,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """hc_head's input gradient g_x = t1 + proj + rms in float64 (t1 = pre_i g_y, the weighted sum's; proj and
    rms, the mixes': their projection's and the RMS scale's) and a first-order bound on an fp32 evaluation's
    |g_x - exact| before any rounding to x's dtype -> (t1, proj, rms, bound), each [..., hc, d].

    Propagated: the mixes' error (`hc_mix_error`) through pre (sigmoid' <= 1/4) and sigmoid'' (<= 0.1);
    g_pre = sum_d x g_y (gamma(d)); g_m = g_pre sigmoid' scale; the RMS scale r (relative gamma(K) / 2 plus
    FUNC_ULPS u); the hc-term projection sum_m g_m r fn_mk and c = r^2 / K sum_m g_m mix_m (gamma(hc + 2));
    each product and the final three-term sum add their roundings.
    """
    t = _hc_head_backward(x, fn, scale, base, gy, norm_eps, hc_eps)
    u, hc, k, fnd, xf, r, rel_r = U32, x.size(-2), t["k"], fn.double(), t["xf"], t["r"], t["rel_r"]
    mix, mix_err, g_m, g_m_err, gmr, gmr_err = (t[n] for n in ("mix", "mix_err", "g_m", "g_m_err", "gmr", "gmr_err"))
    t1 = (t["s"] + hc_eps).unsqueeze(-1) * t["gyd"]
    t1_err = t["pre_err"].unsqueeze(-1) * t["gyd"].abs() + u * t1.abs()
    proj = (gmr @ fnd).view_as(t1)
    proj_err = (gmr_err @ fnd.abs() + gamma(hc + 2) * (gmr.abs() @ fnd.abs())).view_as(t1)
    dot = (g_m * mix).sum(-1, keepdim=True)  # [..., 1]
    dot_err = (g_m_err * mix.abs() + g_m.abs() * mix_err).sum(-1, keepdim=True) + gamma(hc + 2) * (g_m * mix).abs().sum(
        -1, keepdim=True
    )
    c = dot * r.square() / k
    c_err = dot_err * r.square() / k + c.abs() * (2 * rel_r + 4 * u)
    rms = (-c * xf).view_as(t1)
    rms_err = (c_err * xf.abs() + u * (c * xf).abs()).view_as(t1)
    bound = t1_err + proj_err + rms_err + gamma(3) * (t1.abs() + proj.abs() + rms.abs())
    return t1, proj, rms, bound
