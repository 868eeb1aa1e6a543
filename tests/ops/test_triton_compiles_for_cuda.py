"""Every Triton kernel the model launches compiles for a Hopper GPU (sm_90), checked on a machine without one.

The CPU interpreter runs the kernels' arithmetic but not the compiler's type rules: an MMA of an fp16 tile
with a bf16 one ran there and failed to compile on the H200 (`--dtype fp16`). Here a child process runs
the tiny model on the interpreter (bf16 and fp16: a prefill, then a decode step) and records every
launch (and one of the engine's token draw): the kernel, its argument dtypes and its compile-time
constants. A second child, which has never run the interpreter (it patches the kernels' modules, libdevice
among them, in the process it runs in), compiles each launch for sm_90 with Triton's own CUDA backend (its
bundled ptxas; no driver needed), once as recorded and once in the GPU's form where the interpreter's
differs (`UPCAST`: tensor-core dots; `INTERP`: libdevice math; `ROWWISE`, the fixed-plan GEMM's
interpreter-only sums, in its GPU form only).
"""

from __future__ import annotations

import importlib
import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

triton = pytest.importorskip("triton")

from subproc import checkout_env  # noqa: E402

RECORD = r"""
import json, sys
import torch
import triton.language as tl
from triton.runtime import interpreter as interp
from dsv4 import ops
from dsv4.config import ModelConfig
from dsv4.model import DeepSeekV4

records, keys = [], set()
plain_run = interp.InterpretedFunction.run

def enc(v):
    if isinstance(v, torch.Tensor):
        return ["tensor", str(v.dtype).removeprefix("torch.")]
    if isinstance(v, tl.dtype):
        return ["tl", v.name]
    if v is None or isinstance(v, (bool, int, float, str)):
        return ["value", v]
    return ["other", repr(v)]

def run(self, *args, grid, warmup, **kwargs):
    rec = {"module": self.fn.__module__, "name": self.fn.__name__,
           "args": [enc(a) for a in args], "kwargs": {k: enc(v) for k, v in kwargs.items()}}
    key = json.dumps(rec, sort_keys=True)
    if key not in keys:
        keys.add(key)
        records.append(rec)
    return plain_run(self, *args, grid=grid, warmup=warmup, **kwargs)

interp.InterpretedFunction.run = run
cfg = ModelConfig.preset("tiny")
tokens = torch.randint(0, cfg.vocab_size, (1, 9), generator=torch.Generator().manual_seed(0))
for dtype in (torch.bfloat16, torch.float16):
    model = DeepSeekV4.from_config(cfg, seed=0, dtype=dtype)
    with ops.prefer_backend("triton"), torch.no_grad():
        cache = model.new_cache(1, max_len=9)
        model.prefill(tokens[:, :8], cache)
        model.decode_step(tokens[:, 8:], cache)
B = 3  # the engine's token draw
for dt in (torch.float32, torch.float64):  # (float64: the speculative step's draws, `sampling.draw`)
    ops.gumbel_argmax(torch.randn(B, 300, dtype=dt), torch.ones(B, dtype=torch.float64),
                      torch.zeros(B, dtype=torch.bool), torch.arange(B), torch.arange(B), backend="triton")
ops.uniform(torch.arange(B), torch.arange(B), 1, backend="triton")  # speculative acceptance's tests
for dt in (torch.bfloat16, torch.float32):  # the fixed-shape speculative step's acceptance (K = 2)
    ops.speculative_accept(torch.randn(B, 3, 300).to(dt), torch.randn(B, 2, 300), torch.zeros(B, 2, dtype=torch.long),
                           torch.arange(B), torch.ones(B, dtype=torch.float64), torch.arange(B) == 1,
                           torch.arange(B), torch.arange(B), backend="triton")
ops.speculative_accept(torch.randn(B, 3, 300), torch.randn(5, 2, 300), torch.zeros(B, 2, dtype=torch.long),  # a store
                       torch.arange(B), torch.ones(B, dtype=torch.float64), torch.arange(B) == 1, torch.arange(B),
                       torch.arange(B), torch.arange(B) + 1, backend="triton")
ints = torch.zeros(B, 9, dtype=torch.long)  # the fixed-shape speculative step's carry (K = 2; strided columns)
ints[:, 5] = torch.arange(B)  # (each row's table row)
one = torch.ones(B, dtype=torch.long)
ops.write_carry(torch.zeros(8, 6, dtype=torch.long), ints[:, :6], ints[:, 6], ints[:, 8], one, torch.arange(B),
                torch.zeros(B, 2, dtype=torch.long), 40, backend="triton")
for counters in (None, ints[:, 7]):  # what the step derives from its acceptance (greedy, sampled)
    ops.spec_advance(one, torch.arange(B), ints[:, 1:3], ints[:, 4], counters, backend="triton")
for cols in (9, 13):  # ... and how the next step reads it (greedy and sampled columns)
    ints = torch.zeros(B, cols, dtype=torch.long)
    ints[:, 5] = torch.arange(B)
    ops.read_carry(ints, torch.zeros(8, 6, dtype=torch.long), torch.zeros(8, 5, dtype=torch.long),
                   torch.zeros(8, 5, dtype=torch.long), 7, backend="triton")
for dt in (torch.float32, torch.bfloat16):  # the verified tokens' log-probabilities
    ops.token_logprobs(torch.randn(B, 300).to(dt), torch.arange(B), backend="triton")
for dt in (torch.bfloat16, torch.float32):  # the fixed-plan GEMM with K split (a narrow weight, a long K)
    ops.linear_fp32(torch.randn(3, 1024).bfloat16(), torch.randn(40, 1024).to(dt), backend="triton")
ops.linear(torch.randn(3, 1024).bfloat16(), torch.randn(40, 1024).bfloat16(), backend="triton")
x = torch.randn(1, 20, 4, 64).bfloat16().requires_grad_()  # hc_pre's backward (training): its three kernels
fnw = (torch.randn(24, 256) * 0.05).requires_grad_()
y, post, comb = ops.hc_pre(x, fnw, torch.ones(3), torch.zeros(24), 1e-6, 1e-6, 20, backend="triton")
(y.float().sum() + post.sum() + comb.sum()).backward()
for dt in (torch.bfloat16, torch.float32):  # clamped SwiGLU's backward (training): weighted, clamped or not
    gu = [torch.randn(5, 40).to(dt).requires_grad_() for _ in range(2)]
    wt = torch.rand(5, 1).requires_grad_()
    ops.clamped_swiglu(*gu, 7.0, torch.bfloat16, wt, backend="triton").float().sum().backward()
    ops.clamped_swiglu(*gu, 0.0, dt, backend="triton").float().sum().backward()
import dsv4.ops.triton.mhc_bwd as mhc_bwd  # its projection kernel also with the GPU's tiles (smaller here)
mhc_bwd.GX_BT, mhc_bwd.GX_BK = 32, 128
mhc_bwd.projection_grads(torch.randn(70, 256).bfloat16(), torch.randn(70, 64).bfloat16(), torch.randn(24, 256),
                         torch.randn(70, 24), torch.randn(70), torch.rand(70, 4))
from dsv4.ops.precision import exact_accumulation
with exact_accumulation():  # the router under exact accumulation (float64), as deterministic serving runs it
    ops.route(torch.randn(3, 8), torch.zeros(8), 2, "sqrtsoftplus", 2.5, backend="triton")
from dsv4 import formats  # the W8A8 GEMMs of FP8 / MXFP4 checkpoints (dense and split-K): not in a bf16 model
from dsv4.ops import reference as R
q, s = R.act_quant(torch.randn(2, 256), 128, True)
wq, ws = formats.quantize_fp8(torch.randn(64, 256))
wp, wps = formats.quantize_mxfp4(torch.randn(64, 256))
iw8, iws8 = R.int8_quant(torch.randn(64, 256))
for dt in (torch.float32, torch.bfloat16, torch.float16):
    ops.int8_quant(torch.randn(2, 256).to(dt), backend="triton")
    ops.int8_linear(torch.randn(2, 256).to(dt), iw8, iws8.squeeze(-1), backend="triton")
    ops.int8_linear(torch.randn(2, 256), iw8, iws8.squeeze(-1), dt, backend="triton")  # fp32 in (SwiGLU), dt out
iq, iqs = R.int8_quant(torch.randn(2, 256))
iw, iws = R.int8_quant(torch.randn(64, 256))
experts = {}
for fmt in ("fp8", "fp4"):  # 4 experts [256 x 256] as gate, up and down
    w = torch.randn(4, 256, 256)
    pairs = [formats.quantize_fp8(w[j]) if fmt == "fp8" else formats.quantize_mxfp4(w[j]) for j in range(4)]
    ew = (torch.stack([p[0] for p in pairs]).view(torch.uint8), torch.stack([p[1] for p in pairs]).view(torch.uint8))
    experts[fmt] = (torch.randn(2, 256).bfloat16(), torch.ones(2, 2), torch.tensor([[0, 1], [2, 3]]), *ew, *ew, *ew)
for be in ("triton", "triton_splitk"):
    ops.fp8_gemm(q, s, wq, ws, torch.bfloat16, backend=be)
    ops.fp4_gemm(q, s, wp, wps, torch.bfloat16, backend=be)
    ops.int8_gemm(iq, iqs, iw, iws.squeeze(-1), torch.bfloat16, backend=be)
    for fmt, ex in experts.items():
        ops.quantized_moe_experts(*ex, 8.0, 0, fmt, "ue8m0", backend=be)
print(json.dumps(records))
"""

COMPILE = r"""
import json, sys
sys.path[:0] = [".", ".."]
import test_triton_compiles_for_cuda as check
print(json.dumps(check.compile_launches(json.load(sys.stdin))))
"""

TL_NAMES = {"fp16": "float16", "bf16": "bfloat16", "fp32": "float32", "fp64": "float64", "fp8e4nv": "float8e4nv"}


def _compiler():
    """Triton's internals this check drives, or a skip naming what this Triton lacks."""
    try:
        from triton.backends.compiler import GPUTarget
        from triton.compiler import ASTSource, make_backend
        from triton.compiler import compile as triton_compile
        from triton.runtime.jit import JITFunction, create_function_from_signature

        backend = make_backend(GPUTarget("cuda", 90, 32))
    except Exception as e:  # noqa: BLE001 - any missing piece means this Triton cannot do it
        pytest.skip(f"this Triton ({triton.__version__}) cannot compile for CUDA without a GPU here: {e}")
    if not hasattr(JITFunction, "_pack_args"):
        pytest.skip(f"this Triton ({triton.__version__}) has no JITFunction._pack_args to bind a launch")
    return GPUTarget("cuda", 90, 32), backend, ASTSource, triton_compile, JITFunction, create_function_from_signature


def _jit_function(module: str, name: str, JITFunction):
    mod = importlib.import_module(module)
    for obj in vars(mod).values():
        if type(obj).__name__ == "Kernel" and getattr(obj, "fn", None) is not None and obj.fn.__name__ == name:
            # dsv4's launch-time choice of compiled / interpreted: its compiled form, whatever TRITON_INTERPRET
            # says now (triton.jit would give an interpreted function where a test left it set)
            return JITFunction(obj.fn)
        f = obj
        for _ in range(3):  # an autotuner or heuristics wraps the JITFunction as .fn
            if isinstance(f, JITFunction):
                if f.fn.__name__ == name:
                    return f
                break
            f = getattr(f, "fn", None)
    raise LookupError(f"{module}.{name}")


def _value(v):
    kind, x = v
    if kind == "tensor":
        return torch.empty(64, dtype=getattr(torch, x))
    if kind == "tl":
        return getattr(triton.language, TL_NAMES.get(x, x))
    assert kind == "value", v
    return x


def compile_launches(launches: list[dict]) -> list[str]:
    """Compile each recorded launch for sm_90 (in a process that has not run the interpreter) -> the
    failures, one line each."""
    target, backend, ASTSource, triton_compile, JITFunction, binder_for = _compiler()
    failed = []
    for r in launches:
        fn = _jit_function(r["module"], r["name"], JITFunction)
        kwargs = {k: _value(v) for k, v in r["kwargs"].items()}
        kwargs.setdefault("debug", False)
        try:
            bound, spec, opts = binder_for(fn.signature, fn.params, backend)(*map(_value, r["args"]), **kwargs)
            options, signature, constexprs, attrs = fn._pack_args(backend, kwargs, bound, spec, opts)
            triton_compile(ASTSource(fn, signature, constexprs, attrs), target=target, options=options.__dict__)
        except Exception as e:  # noqa: BLE001 - collected and reported together
            while e.__cause__ is not None:
                e = e.__cause__
            failed.append(f"{r['module']}.{r['name']} {r['kwargs']}: {type(e).__name__}: {str(e)[-300:]}")
    return failed


@pytest.mark.slow
def test_every_kernel_the_model_launches_compiles_for_sm90():
    from dsv4.ops.triton._common import interpreter_defect

    defect = interpreter_defect()
    if defect:
        pytest.skip(defect)
    _compiler()  # skips here where this Triton cannot compile for CUDA
    env = checkout_env(TRITON_INTERPRET="1")
    proc = subprocess.run(
        [sys.executable, "-c", RECORD], capture_output=True, text=True, env=env, cwd=Path(__file__).parent, timeout=900
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    records = json.loads(proc.stdout.strip().splitlines()[-1])
    names = {r["name"] for r in records}
    # attention, mHC, norms, the experts' grouped GEMM, the fixed-plan dense GEMM: the model ran its Triton
    # backends (and the engine's token draw)
    kernels = {"_fwd_kernel", "_hc_pre_part_kernel", "_norm_fwd_kernel", "_gmm_kernel", "_fixed_mm_kernel"}
    kernels |= {"_hc_pre_gpre_kernel", "_hc_split_bwd_kernel", "_hc_pre_gx_kernel"}  # hc_pre's backward
    kernels.add("_swiglu_bwd_kernel")  # clamped SwiGLU's backward
    kernels.add("_sum_splits_kernel")  # the fixed-plan GEMM's K splits added in order
    kernels.add("_write_rows_kernel")  # the caches' row writes
    kernels |= {"_w8a8_kernel", "_w8a8_splitk_kernel", "_sum_splits_rows_kernel"}  # W8A8 GEMMs, dense and split-K
    kernels |= {"_int8_mm_kernel", "_int8_splitk_kernel", "_int8_dequant_splits_kernel"}  # INT8, both
    kernels |= {"_w8a8_gmm_kernel", "_w8a8_gmm_splitk_kernel", "_sum_splits_rows_kernel"}  # W8A8 experts
    kernels.add("_route_kernel")  # the MoE router
    kernels.add("_swiglu_kernel")  # the shared expert's activation
    kernels |= {"_plan_window_kernel", "_plan_groups_kernel", "_plan_keep_kernel", "_plan_entries_kernel"}  # the plan
    kernels |= {"_select_rows_kernel", "_attend_rows_kernel"}  # each layer's attention rows
    kernels |= {"_draw_split_kernel", "_spec_accept_kernel"}  # the speculative step's draws and acceptance
    kernels |= {"_write_carry_kernel", "_read_carry_kernel", "_token_logprobs_kernel"}  # its carry, log p
    kernels.add("_spec_advance_kernel")  # its integers between acceptance and draft
    assert kernels <= names
    for r in records:  # the fixed-plan GEMM's interpreter-only sums never run on a GPU: its GPU form only
        if r["kwargs"].get("ROWWISE") == ["value", True]:
            r["kwargs"] = {**r["kwargs"], "ROWWISE": ["value", False]}
        # nor do the W8A8 GEMMs' interpreter dots of FP8 values upcast to fp32 (Triton's CUDA backend
        # refuses them: "Unsupported lhs dtype fp8e4nv"): their FP8 tensor-core form only
        fp8_dots = ("_w8a8_kernel", "_w8a8_splitk_kernel", "_w8a8_gmm_kernel", "_w8a8_gmm_splitk_kernel")
        if r["name"] in fp8_dots and r["kwargs"].get("UPCAST") == ["value", True]:
            r["kwargs"] = {**r["kwargs"], "UPCAST": ["value", False]}
    launches = list(records)
    for r in records:  # the GPU's form: tensor-core dots where the interpreter upcast them, libdevice math
        for flag in ("UPCAST", "INTERP"):
            if r["kwargs"].get(flag) == ["value", True]:
                launches.append({**r, "kwargs": {**r["kwargs"], flag: ["value", False]}})
    env = checkout_env()
    env.pop("TRITON_INTERPRET", None)
    proc = subprocess.run(
        [sys.executable, "-c", COMPILE],
        input=json.dumps(launches),
        capture_output=True,
        text=True,
        env=env,
        cwd=Path(__file__).parent,
        timeout=900,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    failed = json.loads(proc.stdout.strip().splitlines()[-1])
    assert not failed, "\n".join(failed)
