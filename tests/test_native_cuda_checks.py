"""The CUDA wrappers' checks, on a CPU-only machine.

FakeTensorMode lets a CPU-only torch make CUDA-device tensors (metadata, no memory). Each native
wrapper (fmoe._native.dispatch / combine, fmoe.quant.native.w4a16_matmul / fp8_block_matmul) is
driven with them: bad input must fail before any launch with the error type and message of the
CPU kernels (fmoe.ops.numba_cpu) and the reference (fmoe.quant.matmul.expert_matmul); good input
must reach the launch, where the missing CUDA driver is a clear error. The C side's own validation
(bad argument, empty input, misalignment) is called through ctypes on the built library.

What needs a GPU (the kernels' results, the position flag the kernels set, a device-side assert)
is checked by benchmarks/gpu_check.py.
"""
import ctypes
import os
import re
import warnings

import pytest
import torch

import fmoe  # noqa: F401  (registers the ops' kernels)
from fmoe import _native as N
from fmoe.quant import native as QN
from fmoe.quant.tensor import QuantizedTensor

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
GPU_PRESENT = torch.cuda.is_available() or os.path.exists("/dev/nvidiactl")
needs_no_gpu = pytest.mark.skipif(
    GPU_PRESENT, reason="a GPU is visible: fake CUDA tensors would reach a real launch (the GPU run is "
                        "benchmarks/gpu_check.py)")
needs_lib = pytest.mark.skipif(not N.built(), reason="native/build.sh has not been run (needs nvcc)")
LAUNCH = r"cannot launch the CUDA kernel on cuda:0: no CUDA driver or device is available"


@pytest.fixture
def fake():
    from torch._subclasses.fake_tensor import FakeTensorMode

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")   # data_ptr() of a fake tensor warns
        yield FakeTensorMode(allow_non_fake_inputs=True)   # entered by each test's `with fake:`


def cuda(*shape, dtype=torch.float32):
    return torch.empty(*shape, dtype=dtype, device="cuda")


# --------------------------------------------------------------------------- dispatch / combine

T, M, K_, R = 5, 8, 2, 6


def _cpu_error(fn):
    try:
        fn()
    except Exception as e:  # noqa: BLE001
        return type(e), str(e)
    return None, None


# bad input, run through the CPU op (numba kernel) and the CUDA wrapper: same type, same message
# after the function's name (the numba kernels prefix some with "fmoe numba kernels"). Built with
# the ops fake CUDA tensors support (reshape, narrow; not indexing or copies).
BAD = {
    "weights [T, k]": (lambda x, p, w: (x, p, w.reshape(T, K_)), ValueError,
                       r"weights must have the positions' shape \[k, T\] = \[2, 5\], got \[5, 2\]"),
    "weights [1, T]": (lambda x, p, w: (x, p, w.narrow(0, 0, 1)), ValueError,
                       r"weights must have the positions' shape \[k, T\] = \[2, 5\], got \[1, 5\]"),
    "positions 1-D": (lambda x, p, w: (x, p.narrow(0, 0, 1).reshape(T), None), ValueError,
                      r"positions must be \[k, T\], got shape \(5,\)"),
    "positions float": (lambda x, p, w: (x, p.float(), w), TypeError, r"positions must be int64.*got torch.float32"),
}


@pytest.mark.parametrize("case", sorted(BAD))
@pytest.mark.parametrize("op", ["dispatch", "combine"])
def test_rows_wrappers_refuse_what_the_cpu_kernels_refuse(fake, case, op):
    make, exc, msg = BAD[case]
    with fake:
        x, p, w = make(cuda(T if op == "dispatch" else R, M), torch.zeros(K_, T, dtype=torch.int64, device="cuda"),
                       cuda(K_, T))
        with pytest.raises(exc, match=f"^{op}: {msg}"):
            N.dispatch(x, p, w, R) if op == "dispatch" else N.combine(x, p, w)
    # the CPU op (numba kernel) refuses the same input with the same type and message
    xc, pc, wc = make(torch.zeros(T if op == "dispatch" else R, M), torch.zeros(K_, T, dtype=torch.int64),
                      torch.zeros(K_, T))
    call = (lambda: torch.ops.fmoe.dispatch(xc, pc, wc, R)) if op == "dispatch" else \
        (lambda: torch.ops.fmoe.combine(xc, pc, wc))
    etype, emsg = _cpu_error(call)
    assert etype is exc and re.search(msg, emsg), (etype, emsg)


def test_dispatch_refuses_wrong_token_count_rows_dtype_and_devices(fake):
    with fake:
        p = torch.zeros(K_, T, dtype=torch.int64, device="cuda")
        with pytest.raises(ValueError, match=r"^dispatch: x has 4 rows but the positions are for T=5 tokens"):
            N.dispatch(cuda(4, M), p, None, R)
        with pytest.raises(TypeError, match=r"^dispatch: x must be float32 or bfloat16 .* got torch.float16"):
            N.dispatch(cuda(T, M, dtype=torch.float16), p, None, R)
        with pytest.raises(ValueError, match=r"^dispatch: x must be 2-D"):
            N.dispatch(cuda(T, M, 1), p, None, R)
        with pytest.raises(ValueError, match=r"^dispatch: num_rows must be an int >= 0, got -1"):
            N.dispatch(cuda(T, M), p, None, -1)
        with pytest.raises(RuntimeError, match=r"^dispatch: pos is on cpu but x is on cuda:0; every tensor must "
                                               r"be on x's device"):
            N.dispatch(cuda(T, M), torch.zeros(K_, T, dtype=torch.int64), None, R)
        with pytest.raises(RuntimeError, match=r"^dispatch: weights is on cpu but x is on cuda:0"):
            N.dispatch(cuda(T, M), p, torch.zeros(K_, T), R)
        with pytest.raises(ValueError, match=r"^combine: y must be a CUDA tensor, got one on cpu"):
            N.combine(torch.zeros(R, M), torch.zeros(K_, T, dtype=torch.int64), None)


@needs_no_gpu
@pytest.mark.parametrize("pos_dtype", [torch.int64, torch.int32])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_valid_rows_calls_reach_the_launch(fake, pos_dtype, dtype):
    # int32 positions (the reference accepts them) and bf16 weights pass every check (a
    # non-contiguous x is copied first: a copy fake CUDA tensors cannot make, so not tried here)
    with fake:
        p = torch.zeros(K_, T, dtype=pos_dtype, device="cuda")
        x = cuda(T, M, dtype=dtype)
        with pytest.raises(RuntimeError, match="^dispatch: " + LAUNCH):
            N.dispatch(x, p, cuda(K_, T, dtype=torch.bfloat16), R)
        with pytest.raises(RuntimeError, match="^combine: " + LAUNCH):
            N.combine(cuda(R, M, dtype=dtype), p, None)


def test_empty_rows_calls_return_zeros_without_a_launch(fake):
    with fake:
        D = N.dispatch(cuda(0, M), torch.zeros(K_, 0, dtype=torch.int64, device="cuda"), None, R)
        y = N.combine(cuda(R, M), torch.zeros(0, T, dtype=torch.int64, device="cuda"), None)
        assert D.shape == (R, M) and D.device.type == "cuda"
        assert y.shape == (T, M) and y.device.type == "cuda"


def test_the_position_flag_raises_the_reference_index_error():
    # the host half of the range check (the kernels' half, setting the flag, runs on the GPU)
    N._raise_if_flagged(torch.zeros(1, dtype=torch.int32), IndexError, "unused")
    with pytest.raises(IndexError, match="dispatch: a position is >= num_rows=6"):
        N._raise_if_flagged(torch.ones(1, dtype=torch.int32), IndexError, "dispatch: a position is >= num_rows=6")
    # the CPU op raises that message for that input
    with pytest.raises(IndexError, match="dispatch: a position is >= num_rows=6"):
        torch.ops.fmoe.dispatch(torch.zeros(2, 3), torch.tensor([[0, 6]]), None, 6)
    with pytest.raises(IndexError, match="combine: a position is >= the buffer's 6 rows"):
        torch.ops.fmoe.combine(torch.zeros(6, 3), torch.tensor([[0, 6]]), None)


@needs_no_gpu
def test_the_ops_cuda_kernels_call_the_checked_wrappers(fake):
    # fmoe::dispatch / combine's CUDA kernels (fmoe.ops.cuda; a fake tensor runs the ops' fake
    # kernel instead, so they are called directly) go through the checked wrappers
    from fmoe.ops import cuda as ops_cuda

    if not N.built():
        pytest.skip("native/build.sh has not been run: the ops use the reference on CUDA")
    with fake:
        p = torch.zeros(K_, T, dtype=torch.int64, device="cuda")
        with pytest.raises(ValueError, match=r"^dispatch: weights must have the positions' shape"):
            ops_cuda.dispatch(cuda(T, M), p, cuda(T, K_), R)
        with pytest.raises(RuntimeError, match="^combine: " + LAUNCH):
            ops_cuda.combine(cuda(R, M), p, cuda(K_, T))


# --------------------------------------------------------------------------- quantized GEMMs

def fp4(E, Nn, K, fmt="mxfp4", data=None):
    blk = 32 if fmt == "mxfp4" else 16
    scales = cuda(E, Nn, K // blk, dtype=torch.uint8 if fmt == "mxfp4" else torch.float8_e4m3fn)
    gs = cuda(E) if fmt == "nvfp4" else None
    data = cuda(E, Nn, K // 2, dtype=torch.uint8) if data is None else data
    return QuantizedTensor(data, scales, gs, fmt, (E, Nn, K), (1, blk))


def fp8(E, rows, K, block):
    return QuantizedTensor(cuda(E, rows, K, dtype=torch.float8_e4m3fn),
                           cuda(E, -(-rows // block[0]), -(-K // block[1])), None, "fp8_block", (E, rows, K), block)


def test_w4a16_refuses_what_the_reference_refuses(fake):
    with fake:
        w = fp4(2, 64, 256)
        x = cuda(2, 3, 256, dtype=torch.bfloat16)
        with pytest.raises(TypeError, match=r"^w4a16_matmul: w must be a QuantizedTensor, got (Fake)?Tensor"):
            QN.w4a16_matmul(x, cuda(2, 64, 256))
        with pytest.raises(TypeError, match=r"^w4a16_matmul: x must be bfloat16 .* got torch.float32"):
            QN.w4a16_matmul(cuda(2, 3, 256), w)
        with pytest.raises(ValueError, match=r"^w4a16_matmul: expected x \[E, C, K\] and w \[E, N, K\], got x "
                                             r"\(3, 3, 256\) and w \(2, 64, 256\)"):
            QN.w4a16_matmul(cuda(3, 3, 256, dtype=torch.bfloat16), w)
        with pytest.raises(ValueError, match=r"^w4a16_matmul: expected x \[E, C, K\]"):
            QN.w4a16_matmul(cuda(2, 3, 128, dtype=torch.bfloat16), w)
        with pytest.raises(ValueError, match=r"^w4a16_matmul: needs mxfp4 or nvfp4 weights, got fp8_block"):
            QN.w4a16_matmul(x, fp8(2, 64, 256, (128, 128)))
        with pytest.raises(ValueError, match=r"^w4a16_matmul: w must be \[E, N, K\]"):
            QN.w4a16_matmul(x, QuantizedTensor(cuda(64, 128, dtype=torch.uint8), cuda(64, 8, dtype=torch.uint8),
                                               None, "mxfp4", (64, 256), (1, 32)))
        with pytest.raises(ValueError, match=r"^w4a16_matmul: K = 48 must be a multiple of 32"):
            QN.w4a16_matmul(cuda(2, 3, 48, dtype=torch.bfloat16), fp4(2, 64, 48, "nvfp4"))
        with pytest.raises(ValueError, match=r"^w4a16_matmul: E = 65536 experts exceeds the kernel's grid limit"):
            QN.w4a16_matmul(cuda(65536, 1, 32, dtype=torch.bfloat16), fp4(65536, 8, 32))
    # the same four reference errors, on CPU tensors
    from fmoe.quant import expert_matmul

    wc = QuantizedTensor(torch.zeros(2, 64, 128, dtype=torch.uint8), torch.zeros(2, 64, 8, dtype=torch.uint8),
                         None, "mxfp4", (2, 64, 256), (1, 32))
    with pytest.raises(TypeError, match=r"x must be float32 or bfloat16"):
        expert_matmul(torch.zeros(2, 3, 256, dtype=torch.float16), wc)
    with pytest.raises(ValueError, match=r"^expert_matmul: expected x \[E, C, K\] and w \[E, N, K\], got x "
                                         r"\(3, 3, 256\) and w \(2, 64, 256\)"):
        expert_matmul(torch.zeros(3, 3, 256), wc)


def test_w4a16_checks_devices_contiguity_and_alignment_of_the_weights(fake):
    with fake:
        x = cuda(2, 3, 256, dtype=torch.bfloat16)
        w_cpu = QuantizedTensor(torch.zeros(2, 64, 128, dtype=torch.uint8), torch.zeros(2, 64, 8, dtype=torch.uint8),
                                None, "mxfp4", (2, 64, 256), (1, 32))
        with pytest.raises(RuntimeError, match=r"^w4a16_matmul: w.data is on cpu but x is on cuda:0"):
            QN.w4a16_matmul(x, w_cpu)
        with pytest.raises(ValueError, match=r"^w4a16_matmul: x must be a CUDA tensor, got one on cpu"):
            QN.w4a16_matmul(torch.zeros(2, 3, 256, dtype=torch.bfloat16), w_cpu)
        # a contiguous view 8 bytes into its storage: the kernel's 16-byte loads would fault
        store = cuda(2 * 64 * 128 + 8, dtype=torch.uint8)
        shifted = store.as_strided((2, 64, 128), (64 * 128, 128, 1), 8)
        assert shifted.is_contiguous()
        with pytest.raises(ValueError, match=r"^w4a16_matmul: w.data starts at byte 8 of a 16-byte line; .*clone"):
            QN.w4a16_matmul(x, fp4(2, 64, 256, data=shifted))
        strided = cuda(2, 128, 64, dtype=torch.uint8).transpose(1, 2)
        with pytest.raises(ValueError, match=r"^w4a16_matmul: w.data must be contiguous"):
            QN.w4a16_matmul(x, fp4(2, 64, 256, data=strided))


@needs_no_gpu
@pytest.mark.parametrize("fmt", ["mxfp4", "nvfp4"])
def test_w4a16_valid_calls_reach_the_launch_with_a_misaligned_x_copied(fake, fmt):
    with fake:
        w = fp4(2, 64, 256, fmt)
        with pytest.raises(RuntimeError, match="^w4a16_matmul: " + LAUNCH):
            QN.w4a16_matmul(cuda(2, 3, 256, dtype=torch.bfloat16), w)
        # x one bf16 element into its storage: copied to an aligned buffer, not refused
        store = cuda(2 * 3 * 256 + 1, dtype=torch.bfloat16)
        x = store.as_strided((2, 3, 256), (768, 256, 1), 1)
        assert N.address(x) % 16 == 2
        with pytest.raises(RuntimeError, match="^w4a16_matmul: " + LAUNCH):
            QN.w4a16_matmul(x, w)
        assert QN.w4a16_matmul(cuda(2, 0, 256, dtype=torch.bfloat16), w).shape == (2, 0, 64)   # empty: no launch


def test_fp8_block_refuses_bad_operands(fake):
    with fake:
        a, b = fp8(2, 40, 256, (1, 128)), fp8(2, 64, 256, (128, 128))
        with pytest.raises(TypeError, match=r"^fp8_block_matmul: a must be a QuantizedTensor"):
            QN.fp8_block_matmul(cuda(2, 40, 256), b)
        with pytest.raises(ValueError, match=r"^fp8_block_matmul: a must be fp8_block \(1, 128\)"):
            QN.fp8_block_matmul(fp8(2, 40, 256, (128, 128)), b)
        with pytest.raises(ValueError, match=r"^fp8_block_matmul: b must be fp8_block \(128, 128\)"):
            QN.fp8_block_matmul(a, fp8(2, 64, 256, (1, 128)))
        with pytest.raises(ValueError, match=r"^fp8_block_matmul: a \(2, 40, 256\) and b \(2, 64, 128\) disagree"):
            QN.fp8_block_matmul(a, fp8(2, 64, 128, (128, 128)))
        with pytest.raises(ValueError, match=r"^fp8_block_matmul: M = 4194241 rows exceeds"):
            QN.fp8_block_matmul(fp8(1, 65535 * 64 + 1, 128, (1, 128)), fp8(1, 64, 128, (128, 128)))
        b_cpu = QuantizedTensor(torch.zeros(2, 64, 256, dtype=torch.float8_e4m3fn), torch.zeros(2, 1, 2), None,
                                "fp8_block", (2, 64, 256), (128, 128))
        with pytest.raises(RuntimeError, match=r"^fp8_block_matmul: b.data is on cpu but a.data is on cuda:0"):
            QN.fp8_block_matmul(a, b_cpu)
        strided = QuantizedTensor(cuda(2, 256, 64, dtype=torch.float8_e4m3fn).transpose(1, 2), cuda(2, 1, 2), None,
                                  "fp8_block", (2, 64, 256), (128, 128))
        with pytest.raises(ValueError, match=r"^fp8_block_matmul: b.data must be contiguous"):
            QN.fp8_block_matmul(a, strided)


@needs_no_gpu
def test_fp8_block_valid_calls_reach_the_launch_at_any_alignment(fake):
    with fake:
        b = fp8(2, 64, 256, (128, 128))
        store = cuda(2 * 40 * 256 + 1, dtype=torch.float8_e4m3fn)
        a_odd = QuantizedTensor(store.as_strided((2, 40, 256), (40 * 256, 256, 1), 1), cuda(2, 40, 2), None,
                                "fp8_block", (2, 40, 256), (1, 128))
        for a in (fp8(2, 40, 256, (1, 128)), a_odd):   # the kernel takes byte loads for the odd one
            with pytest.raises(RuntimeError, match="^fp8_block_matmul: " + LAUNCH):
                QN.fp8_block_matmul(a, b)


# --------------------------------------------------------------------------- the C side, via ctypes

VP = ctypes.c_void_p
P16, P18 = VP(16), VP(18)   # never dereferenced: every call below returns before a launch


@needs_lib
def test_c_validation_return_codes():
    L = N.lib()
    # dispatch(x, pos, w, D, dtype, k, T, M, R, bad, stream)
    assert L.fmoe_dispatch(P16, P16, None, P16, 0, -1, 4, 8, 8, None, None) == N.ERR_BAD_SHAPE
    assert L.fmoe_dispatch(P16, P16, None, P16, 0, 2 ** 16, 2 ** 16, 8, 8, None, None) == N.ERR_BAD_SHAPE  # k*T > int32
    assert L.fmoe_dispatch(None, None, None, None, 0, 2, 0, 8, 8, None, None) == 0        # T == 0: nothing to do
    assert L.fmoe_dispatch(None, None, None, None, 0, 0, 4, 8, 8, None, None) == 0        # k == 0
    assert L.fmoe_dispatch(None, P16, None, P16, 0, 2, 4, 8, 8, None, None) == N.ERR_BAD_ARGUMENT
    assert L.fmoe_dispatch(P16, P16, None, P16, 7, 2, 4, 8, 8, None, None) == N.ERR_BAD_DTYPE
    # combine(Y, pos, w, y, dtype, k, T, M, R, bad, stream)
    assert L.fmoe_combine(P16, P16, None, P16, 0, 2, -4, 8, 8, None, None) == N.ERR_BAD_SHAPE
    assert L.fmoe_combine(None, None, None, None, 1, 2, 0, 8, 8, None, None) == 0
    assert L.fmoe_combine(P16, P16, None, None, 0, 2, 4, 8, 8, None, None) == N.ERR_BAD_ARGUMENT
    assert L.fmoe_combine(P16, P16, None, P16, 5, 2, 4, 8, 8, None, None) == N.ERR_BAD_DTYPE
    # w4a16(x, w, scales, gscale, y, fmt, E, C, N, K, stream)
    assert L.fmoe_w4a16_grouped_matmul(P16, P16, P16, None, P16, 0, 2, 3, 64, 48, None) == N.ERR_BAD_SHAPE
    assert L.fmoe_w4a16_grouped_matmul(P16, P16, P16, None, P16, 0, 65536, 3, 64, 64, None) == N.ERR_BAD_SHAPE
    assert L.fmoe_w4a16_grouped_matmul(None, None, None, None, None, 0, 2, 0, 64, 64, None) == 0
    assert L.fmoe_w4a16_grouped_matmul(None, P16, P16, None, P16, 0, 2, 3, 64, 64, None) == N.ERR_BAD_ARGUMENT
    assert L.fmoe_w4a16_grouped_matmul(P18, P16, P16, None, P16, 0, 2, 3, 64, 64, None) == N.ERR_MISALIGNED
    assert L.fmoe_w4a16_grouped_matmul(P16, P18, P16, None, P16, 0, 2, 3, 64, 64, None) == N.ERR_MISALIGNED
    assert L.fmoe_w4a16_grouped_matmul(P16, P16, P16, None, P16, 1, 2, 3, 64, 64, None) == N.ERR_BAD_ARGUMENT  # nvfp4
    assert L.fmoe_w4a16_grouped_matmul(P16, P16, P16, None, P16, 9, 2, 3, 64, 64, None) == N.ERR_BAD_FORMAT
    # fp8(a, a_s, b, b_s, y, E, M, N, K, stream)
    assert L.fmoe_fp8_block_grouped_gemm(P16, P16, P16, P16, P16, -1, 4, 64, 128, None) == N.ERR_BAD_SHAPE
    assert L.fmoe_fp8_block_grouped_gemm(P16, P16, P16, P16, P16, 1, 65535 * 64 + 1, 64, 128, None) == N.ERR_BAD_SHAPE
    assert L.fmoe_fp8_block_grouped_gemm(None, None, None, None, None, 2, 0, 64, 128, None) == 0
    assert L.fmoe_fp8_block_grouped_gemm(P16, None, P16, P16, P16, 2, 4, 64, 128, None) == N.ERR_BAD_ARGUMENT
    for code, text in ((N.ERR_BAD_SHAPE, "invalid shape"), (N.ERR_BAD_DTYPE, "unsupported dtype"),
                       (N.ERR_BAD_FORMAT, "unsupported weight format"), (N.ERR_BAD_ARGUMENT, "NULL data pointer"),
                       (N.ERR_MISALIGNED, "not 16-byte aligned")):
        assert text in L.fmoe_native_error_string(code).decode()
    with pytest.raises(RuntimeError, match=r"^dispatch: fmoe_native: invalid shape \(code -1\)"):
        N.check_rc(N.ERR_BAD_SHAPE, "dispatch")


@needs_lib
@needs_no_gpu
def test_c_launch_without_a_driver_returns_a_cuda_error():
    # every check passes, so the kernel is launched: with no driver the launch fails and the code
    # is the CUDA runtime's (35 insufficient driver, 100 no device), reported with its text
    L = N.lib()
    rc = L.fmoe_dispatch(P16, P16, None, P16, 0, 1, 1, 4, 4, None, None)
    assert rc > 0
    assert re.search(r"driver|device", L.fmoe_native_error_string(rc).decode(), re.I)
    with pytest.raises(RuntimeError, match=rf"^dispatch: .*(driver|device).* \(code {rc}\)$"):
        N.check_rc(rc, "dispatch")


def test_library_version_is_the_abi_the_wrappers_call():
    src = open(os.path.join(ROOT, "native", "version.cu")).read()
    (version,) = re.findall(r'return "(fmoe_native [0-9.]+)"', src)
    assert version.startswith(N.ABI)


@needs_lib
def test_built_library_is_not_stale():
    # a library built before the ABI changed is refused by lib(); this one (built here) loads
    assert N.lib().fmoe_native_version().decode().startswith(N.ABI)
