"""Quantized expert matmul: y[e] = x[e] @ dequant(w[e]).T.

x: float32/bfloat16 [E, C, K]; w: QuantizedTensor of logical shape [E, N, K]; y: [E, C, N] in
x's dtype, accumulated in FP32. Differentiable with respect to x only (weights are frozen):
dx = dy @ dequant(w).

Paths:
  "reference"  dequantize all experts, torch.bmm (the obviously-right baseline)
  "dequant"    dequantize one expert at a time, matmul (bounded memory, fast for large C)
  "fused"      numba kernels decoding 4/8-bit weights in registers (fast for small C)
  "auto"       "fused" when C <= crossover(fmt), else "dequant", on CPU
On CUDA tensors "auto" takes the native kernels where one fits and native/build.sh has built them
(:func:`_cuda_choice`): W4A16 for FP4 weights at decode (bf16 x, C <= 16), the FP8 block GEMM for
fp8_block 128x128 weights (bf16 x, quantized to 1x128 FP8 tiles first: DeepSeek-V3's inference
recipe, so y carries that rounding, relative 2^-4 per activation at most); "reference" otherwise.

Rows sorted by expert (a rows plan: a [R, K] with offsets [E + 1] on the device) take
:func:`rows_matmul`: the native ragged W4A16 kernel at decode, else all experts dequantized once
and one torch._grouped_mm; no Python per expert and no host sync on CUDA.
"""
from __future__ import annotations

import time

from typing import Optional

import torch

from . import _codecs as C
from .formats import dequantize
from .tensor import FP4_FORMATS, QuantizedTensor

# Largest tokens-per-expert C for which the fused kernel beat per-expert dequantize+matmul by
# more than ~5%. Measured 2026-11-30 with benchmarks/bench_quant.py --repeats 5 --tokens 64 128
# 256 512 1024 (E=8, N=1024, K=2048, 2 threads) on the shared 2-core AVX-512 dev VM with another
# job running (noisy), after the FP4/FP8 kernel rewrite. fused / dequant speedup at each C:
#   mxfp4      64: 5.2  128: 2.6  256: 2.0  512: 1.35  1024: 1.01
#   nvfp4      64: 2.5  128: 1.8  256: 1.11 512: 1.01  1024: 0.76
#   mxfp8      64: 2.8  128: 2.9  256: 4.1  512: 2.4   1024: 1.40
#   fp8_block  64: 10   128: 5.8  256: 3.6  512: 2.2   1024: 1.21
#   fp8_row    64: 8.6  128: 4.0  256: 2.9  512: 1.8   1024: 1.10   (C > 1024 not measured)
# Per-expert dequantize+matmul is slow here partly because every expert alternates a numba
# (TBB) or torch decode with an MKL (OpenMP) matmul on 2 cores. Machines differ:
# calibrate_crossover() re-measures; pass its result as expert_matmul(crossover=...).
# The table is constant: no call changes which path another call takes.
_CROSSOVER = {"mxfp4": 512, "nvfp4": 256, "mxfp8": 1024, "fp8_block": 1024, "fp8_row": 1024}

PATHS = ("auto", "fused", "dequant", "reference")

# fp4_matmul / fp8_matmul work split: rows of one expert per parallel task, and packed bytes of K
# decoded per pass (fp8: 2 * _FP4_CHUNK elements). 1024 bytes (2048 k: 4 rows x 8 KB of decoded
# floats) beat 256 and 512 at C >= 4 by 5-15% and lost ~5% at C = 1 (E=8, N=1024, K=2048,
# 2-core dev VM, 2026-11-30); the row tile (16..128) made no measurable difference.
_FP4_TILE_N = 64
_FP4_CHUNK = 1024


def crossover(fmt: str) -> int:
    """Default fused/dequant crossover (tokens per expert) for fmt."""
    if fmt not in _CROSSOVER:
        raise ValueError(f"unknown format {fmt!r}")
    return _CROSSOVER[fmt]


def _check(x: torch.Tensor, w: QuantizedTensor) -> None:
    if not isinstance(w, QuantizedTensor):
        raise TypeError(f"expert_matmul: w must be a QuantizedTensor, got {type(w).__name__}")
    if x.dtype not in (torch.float32, torch.bfloat16):
        raise TypeError(f"expert_matmul: x must be float32 or bfloat16, got {x.dtype}")
    ws = w.logical_shape
    if x.dim() != 3 or len(ws) != 3 or x.shape[0] != ws[0] or x.shape[2] != ws[2]:
        raise ValueError(f"expert_matmul: expected x [E, C, K] and w [E, N, K], got x "
                         f"{tuple(x.shape)} and w {ws}")


# --- the three implementations (plain tensors, no autograd) ----------------------------------

def _reference(x, w: QuantizedTensor) -> torch.Tensor:
    return torch.bmm(x.float(), dequantize(w).transpose(1, 2)).to(x.dtype)


def _dequant_one(w: QuantizedTensor, e: int) -> torch.Tensor:
    """Expert e of w as FP32 [N, K]; FP4 on CPU decodes through a numba kernel (the torch
    unpack/lookup chain is several times slower), everything else through dequantize()."""
    we = w[e]
    if w.fmt in FP4_FORMATS and w.device.type == "cpu":
        from .. import _numba
        from . import _cpu_kernels as K

        n, k = we.logical_shape
        out = torch.empty(n, k, dtype=torch.float32)
        table = C.E8M0_TABLE if w.fmt == "mxfp4" else C.E4M3_TABLE
        g = 1.0 if w.fmt == "mxfp4" else float(we.global_scale)
        with _numba.kernel_call():  # thread count follows torch; serialised on the workqueue fallback
            K.fp4_dequant(we.data.contiguous().numpy(), we.scales.contiguous().view(torch.uint8).numpy(),
                          table.numpy(), g, out.numpy())
        return out
    return dequantize(we)


def _dequant_per_expert(x, w: QuantizedTensor) -> torch.Tensor:
    E, Cn, _ = x.shape
    y = torch.empty(E, Cn, w.logical_shape[1], dtype=torch.float32, device=x.device)
    xf = x.float()
    for e in range(E):
        torch.matmul(xf[e], _dequant_one(w, e).T, out=y[e])
    return y.to(x.dtype)


def _fused(x, w: QuantizedTensor) -> torch.Tensor:
    from .. import _numba
    from . import _cpu_kernels as K

    E, Cn, k = x.shape
    n = w.logical_shape[1]
    xf = x.float().contiguous()
    out = torch.empty(E, Cn, n, dtype=torch.float32)
    with _numba.kernel_call():  # thread count follows torch; serialised on the workqueue fallback
        if w.fmt in FP4_FORMATS:
            if w.fmt == "mxfp4":
                table, gs = C.E8M0_TABLE, torch.ones(E)
            else:
                table, gs = C.E4M3_TABLE, w.global_scale.float().reshape(E).contiguous()
            K.fp4_matmul(xf.numpy(), w.data.contiguous().numpy(),
                         w.scales.contiguous().view(torch.uint8).numpy(), table.numpy(), gs.numpy(),
                         out.numpy(), _FP4_TILE_N, _FP4_CHUNK)
        else:
            if w.fmt == "mxfp8":
                sb = w.scales.contiguous().view(torch.uint8)
                scales, bn, bk = torch.empty(sb.shape, dtype=torch.float32), 1, 32
                K.table_decode(sb.reshape(-1).numpy(), C.E8M0_TABLE.numpy(), scales.view(-1).numpy())
            else:
                scales, (bn, bk) = w.scales.float(), w.block
            K.fp8_matmul(xf.numpy(), w.data.contiguous().view(torch.uint8).numpy(),
                         scales.contiguous().numpy(), bn, bk, C.E4M3_TABLE.numpy(), out.numpy(),
                         _FP4_TILE_N, 2 * _FP4_CHUNK)
    return out.to(x.dtype)


# --- CUDA "auto": the native kernels where one fits ------------------------------------------

# Tokens per expert up to which CUDA "auto" takes the W4A16 kernel: a decode kernel (a warp per
# output row, 8 tokens per weight pass, CUDA cores), so larger C goes to dequantize + bmm. 16 is
# the kernel's design point (native/README.md), not a measurement: gpu_check.py times both sides.
_W4A16_MAX_TOKENS = 16


def _cuda_choice(x: torch.Tensor, w: QuantizedTensor) -> str:
    """What "auto" runs for a CUDA x [E, C, K]: "w4a16" (mxfp4/nvfp4 weights, bf16 x, K % 32 == 0,
    C <= _W4A16_MAX_TOKENS), "fp8_block" (fp8_block weights in 128x128 blocks, bf16 x), else
    "reference"; always "reference" where native/build.sh has not built the library."""
    from .. import _native

    if not (x.is_cuda and x.dtype == torch.bfloat16 and _native.built()):
        return "reference"
    if w.fmt in FP4_FORMATS and x.shape[2] % 32 == 0 and x.shape[1] <= _W4A16_MAX_TOKENS:
        return "w4a16"
    if w.fmt == "fp8_block" and tuple(w.block) == (128, 128):
        return "fp8_block"
    return "reference"


def _cuda_auto(x: torch.Tensor, w: QuantizedTensor) -> torch.Tensor:
    """Path "auto" on CUDA: the kernel :func:`_cuda_choice` names (bf16 [E, C, N] out)."""
    choice = _cuda_choice(x, w)
    if choice == "reference":
        return _reference(x, w)
    from . import native
    from .formats import quantize_fp8_act_tiles

    if choice == "w4a16":
        return native.w4a16_matmul(x, w)
    return native.fp8_block_matmul(quantize_fp8_act_tiles(x, 128), w)


# --- rows sorted by expert (a rows plan), no host sync: the kernel table's packed CUDA entry ---

ROWS_PATHS = ("auto", "w4a16", "grouped")


def _rows_check(a, w: QuantizedTensor, offsets) -> None:
    """rows_matmul's operands by their metadata only (the offsets' values are never read)."""
    what = "rows_matmul"
    if not isinstance(w, QuantizedTensor):
        raise TypeError(f"{what}: w must be a QuantizedTensor, got {type(w).__name__}")
    if not isinstance(a, torch.Tensor) or a.dtype not in (torch.float32, torch.bfloat16):
        raise TypeError(f"{what}: a must be a float32 or bfloat16 tensor, got {getattr(a, 'dtype', type(a).__name__)}")
    ws = w.logical_shape
    if a.dim() != 2 or len(ws) != 3 or a.shape[1] != ws[2]:
        raise ValueError(f"{what}: expected a [R, K] and w [E, N, K], got a {tuple(a.shape)} and w {ws}")
    from .native import _offsets
    _offsets(what, offsets, ws[0])
    if offsets.device != a.device:
        raise RuntimeError(f"{what}: offsets is on {offsets.device} but a is on {a.device}; pass the offsets on "
                           f"a's device (a plan keeps them there)")


def _rows_choice(a: torch.Tensor, w: QuantizedTensor) -> str:
    """What rows_matmul's "auto" runs for CUDA rows a [R, K], from shapes and dtypes only:
    "w4a16" for mxfp4/nvfp4 weights, bf16 rows, K % 32 == 0, at most _W4A16_MAX_TOKENS rows per
    expert on average (R <= 16 E: decode; the kernel re-reads the weights every 8 rows) and no
    gradient wanted (the kernel has no backward), with the library built; else "grouped"."""
    from .. import _native

    E, _, K = w.logical_shape
    if (a.is_cuda and w.fmt in FP4_FORMATS and a.dtype == torch.bfloat16 and K % 32 == 0
            and a.shape[0] <= _W4A16_MAX_TOKENS * E and not (a.requires_grad and torch.is_grad_enabled())
            and _native.built()):
        return "w4a16"
    return "grouped"


def _rows_grouped(a: torch.Tensor, w: QuantizedTensor, offsets: torch.Tensor) -> torch.Tensor:
    """Every expert of w dequantized once to a's dtype, then ONE ``torch._grouped_mm`` over the rows.

    Memory (every call, all E experts, busy or not): the dequantized weights live through the
    call, E*N*K elements of a's dtype (bf16: 2 bytes per weight, ~3.8x an mxfp4 tensor; fp32: 4),
    and :func:`dequantize`'s intermediates (int64 decode indices or expanded block scales beside
    FP32 products) peak higher: 13.1 (mxfp4) and 12.0 (fp8_block) bytes per weight, the bf16
    result included (CPU peak RSS, E=8, N=1024, K=4096; CUDA's caching allocator keeps such
    blocks for reuse). Time likewise scales with E, not with the busy experts. That is the cost the
    W4A16 kernel avoids at decode; for FP8 weights a ragged W8A16 kernel would. Rows and weights
    are zero-padded to torch._grouped_mm's 16-byte layout rule where K or N is not a multiple of
    16 bytes. Offsets are clamped to [0, R] and made non-decreasing on the device (never read on
    the host), so no access leaves a; rows past offsets[-1] are zero. Differentiable in a
    (torch._grouped_mm's backward).

    torch's own limits (2.13): on CUDA its sync-free grouped kernel takes bf16 operands on sm90 /
    sm100; fp32 rows, or other GPUs, run torch's fallback, which copies the offsets to the host
    (one sync inside torch) and loops over the groups in C++; and its fake/meta kernel (what
    torch.compile traces) accepts bf16 only, so fp32 rows on CUDA do not trace."""
    R, K = a.shape
    E, Nn, _ = w.logical_shape
    if R == 0 or E == 0 or Nn == 0:
        return a.new_zeros(R, Nn)
    align = 16 // a.element_size()
    Kp, Np = -(-K // align) * align, -(-Nn // align) * align
    wd = dequantize(w, a.dtype)
    if (Kp, Np) != (K, Nn):
        wd = torch.nn.functional.pad(wd, (0, Kp - K, 0, Np - Nn))
        a = torch.nn.functional.pad(a, (0, Kp - K))
    # narrow/select, not Python indexing: the latter needs a CUDA device guard, which FakeTensorMode
    # CUDA tensors of a CPU-only torch (the tests' way to run this without a GPU) cannot take
    ends = offsets.narrow(0, 1, E).clamp(0, R).cummax(0).values
    y = torch._grouped_mm(a.contiguous(), wd.transpose(1, 2), offs=ends.to(torch.int32))
    y = y.masked_fill((torch.arange(R, device=a.device) >= ends.select(0, E - 1)).unsqueeze(1), 0)
    return y.narrow(1, 0, Nn) if Np != Nn else y


def rows_matmul(a: torch.Tensor, w: QuantizedTensor, offsets: torch.Tensor, *, path: str = "auto") -> torch.Tensor:
    """y[r] = a[r] @ dequant(w[e]).T for expert e's rows offsets[e]:offsets[e + 1].

    a: float32 or bfloat16 [R, K], rows sorted by expert (a rows plan's rows); w: QuantizedTensor
    [E, N, K] of any fmoe format; offsets: int64 (or int32) [E + 1] on a's device, from 0, never
    decreasing, ending at R. Returns [R, N] in a's dtype. No Python per expert, and no host sync
    (for fp32 rows on CUDA torch._grouped_mm syncs inside torch: :func:`_rows_grouped`).
    path: "auto" (CUDA: :func:`_rows_choice`; elsewhere "grouped". On the CPU the fast kernel is
    :func:`fmoe.quant.packed.grouped_matmul`, which the kernel table calls there), "w4a16" (the
    native ragged W4A16 kernel, :func:`fmoe.quant.native.w4a16_rows_matmul`: bf16 rows of
    mxfp4/nvfp4 weights, not differentiable) or "grouped" (:func:`_rows_grouped`: dequantize all
    experts once, one torch._grouped_mm; any format, wherever torch._grouped_mm runs,
    differentiable in a).
    Numerics: "w4a16" accumulates the exact decoded weights in FP32 and rounds once to bf16;
    "grouped" first rounds the decoded weights to a's dtype (exact for mxfp4 in bf16; relative
    2^-9 per weight for nvfp4 and the FP8 formats) and accumulates as torch._grouped_mm does.
    """
    _rows_check(a, w, offsets)
    if path not in ROWS_PATHS:
        raise ValueError(f"rows_matmul: path must be one of {ROWS_PATHS}, got {path!r}")
    if path == "auto":
        path = _rows_choice(a, w)
    if path == "w4a16":
        if a.requires_grad and torch.is_grad_enabled():
            raise ValueError("rows_matmul: path='w4a16' has no backward; pass a.detach() or run under "
                             "torch.no_grad(), or take path='grouped' (differentiable in a)")
        from .native import w4a16_rows_matmul
        return w4a16_rows_matmul(a, w, offsets)
    return _rows_grouped(a, w, offsets)


def _run(x, w: QuantizedTensor, path: str) -> torch.Tensor:
    if path == "auto":
        if x.device.type != "cpu":
            return _cuda_auto(x, w)
        else:
            path = "fused" if x.shape[1] <= _CROSSOVER[w.fmt] else "dequant"
    if path == "fused":
        if x.device.type != "cpu":
            raise ValueError("expert_matmul: the fused numba path runs on CPU tensors only")
        return _fused(x, w)
    if path == "dequant":
        return _dequant_per_expert(x, w)
    if path == "reference":
        return _reference(x, w)
    raise ValueError(f"expert_matmul: path must be one of {PATHS}, got {path!r}")


# --- autograd / torch.func front ------------------------------------------------------------

class _ExpertMatmul(torch.autograd.Function):
    """Weights travel as their leaves (tensors) so vmap can see their batch dims."""

    @staticmethod
    def forward(x, data, scales, gscale, meta):
        fmt, shape, block, path = meta
        return _run(x, QuantizedTensor(data, scales, gscale, fmt, shape, block), path)

    @staticmethod
    def setup_context(ctx, inputs, output):
        x, data, scales, gscale, meta = inputs
        ctx.meta = meta
        ctx.x_dtype = x.dtype
        ctx.save_for_backward(data, scales, gscale)

    @staticmethod
    def backward(ctx, dy):
        data, scales, gscale = ctx.saved_tensors
        fmt, shape, block, _ = ctx.meta
        w = dequantize(QuantizedTensor(data, scales, gscale, fmt, shape, block))
        dx = torch.bmm(dy.float(), w).to(ctx.x_dtype)
        return dx, None, None, None, None

    @staticmethod
    def vmap(info, in_dims, x, data, scales, gscale, meta):
        # One call per batch element: simple and always correct; the kernels already run
        # parallel over experts and rows.
        def pick(t, d, b):
            return t if (t is None or d is None) else t.select(d, b)

        outs = [_ExpertMatmul.apply(*(pick(t, d, b) for t, d in zip((x, data, scales, gscale),
                                                                     in_dims[:4])), meta)
                for b in range(info.batch_size)]
        return torch.stack(outs), 0


def expert_matmul(x: torch.Tensor, w: QuantizedTensor, *, path: str = "auto",
                  crossover: Optional[int] = None) -> torch.Tensor:
    """y[e] = x[e] @ dequant(w[e]).T.

    x: float32 or bfloat16 [E, C, K]; w: QuantizedTensor [E, N, K] (any fmoe format).
    Returns [E, C, N] in x.dtype (FP32 accumulation). Differentiable w.r.t. x.
    path: "auto" | "fused" | "dequant" | "reference" (see module docstring).
    crossover: with path "auto" on CPU, use the fused kernel for C <= crossover
        (default: the measured table, :func:`crossover`; see :func:`calibrate_crossover`).
    """
    _check(x, w)
    if path not in PATHS:
        raise ValueError(f"expert_matmul: path must be one of {PATHS}, got {path!r}")
    if path == "auto" and x.device.type == "cpu":
        limit = _CROSSOVER[w.fmt] if crossover is None else int(crossover)
        path = "fused" if x.shape[1] <= limit else "dequant"
    meta = (w.fmt, w.shape, w.block, path)
    return _ExpertMatmul.apply(x, w.data, w.scales, w.global_scale, meta)


def expert_matmul_reference(x: torch.Tensor, w: QuantizedTensor) -> torch.Tensor:
    """Reference: dequantize all of w to FP32, torch.bmm. Same shapes/dtypes as expert_matmul."""
    _check(x, w)
    return torch.bmm(x.float(), dequantize(w).transpose(1, 2)).to(x.dtype)


def _median_time(fn, repeats: int) -> float:
    fn()
    ts = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        ts.append(time.perf_counter() - t0)
    ts.sort()
    return ts[len(ts) // 2]


def calibrate_crossover(w: QuantizedTensor, *, max_c: int = 64, repeats: int = 5) -> int:
    """Measure fused vs per-expert dequantize+matmul on w for C = 1, 2, 4, ... max_c and return
    the largest C below which the fused kernel always won (pass it as ``crossover=``)."""
    best = 0
    c = 1
    E, _, k = w.logical_shape
    while c <= max_c:
        x = torch.randn(E, c, k)
        tf = _median_time(lambda: _fused(x, w), repeats)
        td = _median_time(lambda: _dequant_per_expert(x, w), repeats)
        if tf >= td:
            break
        best = c
        c *= 2
    return best
