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
