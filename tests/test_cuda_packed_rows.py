"""Packed weights over a rows plan on CUDA (fmoe.quant.matmul.rows_matmul), on a CPU-only machine.

* The dequantize + ONE torch._grouped_mm route (path "grouped") is plain torch, and torch 2.13 runs
  torch._grouped_mm on CPU: it is forced on CPU tensors and checked against the per-expert
  reference for every format, with an empty expert, zero rows and operands that need padding.
* FakeTensorMode CUDA tensors drive rows_matmul through its checks up to the launch: which kernel
  "auto" picks, and that nothing reads the offsets on the host (any .item()/.tolist()/nonzero of a
  fake tensor raises DataDependentOutputException, so an added host read fails these tests).
* The C entry fmoe_w4a16_rows_matmul's return codes through ctypes on the built library.
* Bad input: the error type and message before anything is launched.

What needs a GPU (the ragged W4A16 kernel's results) is benchmarks/gpu_check.py's "rows" section.
"""
import ctypes
import os
import re
import warnings

import pytest
import torch

import fmoe.quant as Q
from fmoe import _native as N
from fmoe.quant import matmul as QM
from fmoe.quant import native as QN
from fmoe.quant import packed
from fmoe.quant.tensor import QuantizedTensor, dequantize

GPU_PRESENT = torch.cuda.is_available() or os.path.exists("/dev/nvidiactl")
needs_no_gpu = pytest.mark.skipif(GPU_PRESENT, reason="a GPU is visible: fake CUDA tensors would reach a real "
                                                      "launch (the GPU run is benchmarks/gpu_check.py)")
needs_lib = pytest.mark.skipif(not N.built(), reason="native/build.sh has not been run (needs nvcc; CI has none)")
LAUNCH = r"cannot launch the CUDA kernel on cuda:0: no CUDA driver or device is available"
FORMATS = ("mxfp4", "nvfp4", "mxfp8", "fp8_block", "fp8_row")
EPS32 = 2.0 ** -24


@pytest.fixture
def fake():
    from torch._subclasses.fake_tensor import FakeTensorMode

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")   # data_ptr() of a fake tensor warns
        yield FakeTensorMode(allow_non_fake_inputs=True)


@pytest.fixture
def grouped_calls(monkeypatch):
    """The real torch._grouped_mm, its calls counted (operand shapes)."""
    calls = []
    real = torch._grouped_mm

    def counted(a, b, *args, **kw):
        calls.append((tuple(a.shape), tuple(b.shape)))
        return real(a, b, *args, **kw)
    monkeypatch.setattr(torch, "_grouped_mm", counted)
    return calls


def _quantize(w, fmt):
    return Q.quantize_fp8_block(w) if fmt == "fp8_block" else Q.quantize(w, fmt)


def _reference(a, w, offsets):
    """Per expert: fmoe.quant.matmul.expert_matmul_reference on that expert's rows (FP32)."""
    o = offsets.tolist()
    y = torch.zeros(a.shape[0], w.logical_shape[1])
    for e in range(len(o) - 1):
        if o[e + 1] > o[e]:
            y[o[e]:o[e + 1]] = QM.expert_matmul_reference(a[o[e]:o[e + 1]].float().unsqueeze(0), w[e:e + 1])[0]
    return y


def _bound(a, w, offsets):
    """|y - reference| per element: both sum the same K FP32 products of the exact decoded weights
    in another order, so within (K + 2) * eps32 * (|a| @ |dequant(w[e])|.T)."""
    o = offsets.tolist()
    wd = dequantize(w).abs()
    b = torch.zeros(a.shape[0], w.logical_shape[1])
    for e in range(len(o) - 1):
        b[o[e]:o[e + 1]] = a[o[e]:o[e + 1]].abs() @ wd[e].T
    return (a.shape[1] + 2) * EPS32 * b


# --------------------------------------------------------------------------- the grouped route, on CPU

OFFSETS = torch.tensor([0, 7, 7, 20, 31, 36])   # 5 experts, expert 1 empty; R = 36


@pytest.mark.parametrize("fmt", FORMATS)
def test_grouped_route_matches_the_per_expert_reference(grouped_calls, fmt):
    g = torch.Generator().manual_seed(0)
    E, Nn, K = 5, 48, 256
    w = _quantize(torch.randn(E, Nn, K, generator=g) * 0.1, fmt)
    a = torch.randn(36, K, generator=g)
    y = QM.rows_matmul(a, w, OFFSETS, path="grouped")
    assert len(grouped_calls) == 1 and grouped_calls[0] == ((36, K), (E, K, Nn))   # one call, every expert
    ref = _reference(a, w, OFFSETS)
    bound = _bound(a, w, OFFSETS)
    assert y.shape == (36, Nn) and y.dtype == torch.float32
    assert bool(((y - ref).abs() <= bound).all()), (y - ref).abs().max()
    # the bound catches a wrong row: one row moved to the neighbouring expert is far outside it
    wrong = _reference(a, w, torch.tensor([0, 8, 8, 20, 31, 36]))
    assert not bool(((wrong - ref).abs() <= bound).all())
    # int32 offsets give the same bits; on the CPU "auto" is this route; the packed CPU kernel the
    # table runs there agrees within the same bound
    assert torch.equal(QM.rows_matmul(a, w, OFFSETS.int(), path="grouped"), y)
    assert torch.equal(QM.rows_matmul(a, w, OFFSETS), y)
    assert bool(((packed.grouped_matmul(a, w, OFFSETS) - ref).abs() <= bound).all())


def test_grouped_route_with_zero_rows_empty_experts_and_rows_past_the_last_offset(grouped_calls):
    g = torch.Generator().manual_seed(1)
    w = _quantize(torch.randn(3, 32, 64, generator=g), "mxfp4")
    y0 = QM.rows_matmul(torch.zeros(0, 64), w, torch.zeros(4, dtype=torch.int64), path="grouped")
    assert y0.shape == (0, 32) and not grouped_calls   # nothing to multiply: no call
    a = torch.randn(10, 64, generator=g)
    # every row to the last expert; rows 8, 9 belong to none (offsets end at 8): zero
    offs = torch.tensor([0, 0, 0, 8])
    y = QM.rows_matmul(a, w, offs, path="grouped")
    ref = _reference(a[:8], w, offs)
    assert bool(((y[:8] - ref).abs() <= _bound(a[:8], w, offs)).all())
    assert bool((y[8:] == 0).all())
    # all experts empty: all rows zero
    assert bool((QM.rows_matmul(a, w, torch.zeros(4, dtype=torch.int64), path="grouped") == 0).all())


def test_grouped_route_pads_operands_to_the_grouped_mm_layout(grouped_calls):
    # K = 34 and N = 5: 136- and 20-byte fp32 rows break torch._grouped_mm's 16-byte rule; both
    # are zero-padded (K to 36, N to 8) and the result is the reference's
    g = torch.Generator().manual_seed(2)
    w = _quantize(torch.randn(3, 5, 34, generator=g), "fp8_row")
    a = torch.randn(9, 34, generator=g)
    offs = torch.tensor([0, 4, 4, 9])
    y = QM.rows_matmul(a, w, offs, path="grouped")
    assert grouped_calls == [((9, 36), (3, 36, 8))]
    assert y.shape == (9, 5)
    assert bool(((y - _reference(a, w, offs)).abs() <= _bound(a, w, offs)).all())


def test_grouped_route_is_differentiable_in_the_rows(grouped_calls):
    g = torch.Generator().manual_seed(3)
    E, Nn, K = 4, 24, 64
    w = _quantize(torch.randn(E, Nn, K, generator=g), "nvfp4")
    offs = torch.tensor([0, 3, 3, 11, 12])
    a = torch.randn(12, K, generator=g, requires_grad=True)
    gy = torch.randn(12, Nn, generator=g)
    (ga,) = torch.autograd.grad(QM.rows_matmul(a, w, offs, path="grouped"), a, gy)
    wd = dequantize(w).double()
    o = offs.tolist()
    ref = torch.cat([gy[o[e]:o[e + 1]].double() @ wd[e] for e in range(E)])
    # dy @ dequant(w[e]) summed over N = 24 FP32 products per element
    bound = (Nn + 2) * EPS32 * torch.cat([gy[o[e]:o[e + 1]].abs().double() @ wd[e].abs() for e in range(E)])
    assert bool(((ga.double() - ref).abs() <= bound).all())
    assert len(grouped_calls) == 1   # the forward's one call (its backward is torch's, from C++)


# --------------------------------------------------------------------------- fake CUDA tensors

def cuda(*shape, dtype=torch.float32):
    return torch.empty(*shape, dtype=dtype, device="cuda")


def fp4(E, Nn, K, fmt="mxfp4"):
    blk = 32 if fmt == "mxfp4" else 16
    return QuantizedTensor(cuda(E, Nn, K // 2, dtype=torch.uint8),
                           cuda(E, Nn, K // blk, dtype=torch.uint8 if fmt == "mxfp4" else torch.float8_e4m3fn),
                           cuda(E) if fmt == "nvfp4" else None, fmt, (E, Nn, K), (1, blk))


def fp8_block(E, Nn, K):
    return QuantizedTensor(cuda(E, Nn, K, dtype=torch.float8_e4m3fn), cuda(E, -(-Nn // 128), -(-K // 128)), None,
                           "fp8_block", (E, Nn, K), (128, 128))


@pytest.fixture
def built(monkeypatch, tmp_path):
    """Whether the library counts as built is a file check: point it at a file that exists."""
    lib = tmp_path / "libfmoe_native.so"
    lib.write_bytes(b"")
    monkeypatch.setattr(N, "library_path", lambda: str(lib))


def test_auto_picks_the_ragged_w4a16_kernel_at_decode_and_grouped_mm_otherwise(fake, built, monkeypatch, tmp_path):
    with fake:
        rows = lambda R, dtype=torch.bfloat16, K=256: cuda(R, K, dtype=dtype)  # noqa: E731
        cases = [
            (rows(1), fp4(4, 64, 256), "w4a16"),
            (rows(64), fp4(4, 64, 256, "nvfp4"), "w4a16"),           # 16 rows per expert on average
            (rows(65), fp4(4, 64, 256), "grouped"),                  # past decode
            (rows(8, torch.float32), fp4(4, 64, 256), "grouped"),    # the kernel takes bf16 rows
            (rows(8, K=48), fp4(4, 64, 48, "nvfp4"), "grouped"),     # K not a multiple of 32
            (rows(8), fp8_block(4, 64, 256), "grouped"),
        ]
        for a, w, want in cases:
            assert QM._rows_choice(a, w) == want, (tuple(a.shape), a.dtype, w)
        assert QM._rows_choice(rows(8).requires_grad_(), fp4(4, 64, 256)) == "grouped"   # the kernel has no backward
        with torch.no_grad():
            assert QM._rows_choice(rows(8).requires_grad_(), fp4(4, 64, 256)) == "w4a16"
    monkeypatch.setattr(N, "library_path", lambda: str(tmp_path / "absent.so"))   # not built
    with fake:
        assert QM._rows_choice(cuda(1, 256, dtype=torch.bfloat16), fp4(4, 64, 256)) == "grouped"


@needs_no_gpu
@pytest.mark.parametrize("offsets_dtype", [torch.int64, torch.int32])
@pytest.mark.parametrize("fmt", ["mxfp4", "nvfp4"])
def test_auto_runs_the_ragged_w4a16_kernel_up_to_the_launch(fake, built, fmt, offsets_dtype):
    from torch._subclasses.fake_tensor import DataDependentOutputException

    with fake:
        offs = torch.zeros(5, dtype=offsets_dtype, device="cuda")
        with pytest.raises(RuntimeError, match="^w4a16_rows_matmul: " + LAUNCH):
            QM.rows_matmul(cuda(10, 256, dtype=torch.bfloat16), fp4(4, 64, 256, fmt), offs)
        # a misaligned x (one bf16 element into its storage) is copied, not refused
        x = cuda(10 * 256 + 1, dtype=torch.bfloat16).as_strided((10, 256), (256, 1), 1)
        assert N.address(x) % 16 == 2
        with pytest.raises(RuntimeError, match="^w4a16_rows_matmul: " + LAUNCH):
            QN.w4a16_rows_matmul(x, fp4(4, 64, 256, fmt), offs)
        y = QN.w4a16_rows_matmul(cuda(0, 256, dtype=torch.bfloat16), fp4(4, 64, 256, fmt), offs)
        assert y.shape == (0, 64) and y.device.type == "cuda"   # no rows: no launch
        with pytest.raises(DataDependentOutputException):
            offs.tolist()   # what a host read of the offsets on the way would have raised


@needs_no_gpu
def test_a_ragged_layout_of_packed_weights_on_cuda_runs_the_rows_kernel_with_no_host_read(fake, built):
    """A layout plan's packed GEMM over a ragged layout (fmoe.ops.grouped.layout_mm) off the CPU
    takes rows_matmul on the layout's device offsets: the launch is reached with no host read and
    no per-expert slice."""
    from torch._subclasses.fake_tensor import DataDependentOutputException
    from fmoe.layout import Layout
    from fmoe.ops import grouped as G

    with fake:
        E, T, k = 4, 5, 2
        sizes = torch.zeros(E, dtype=torch.int64, device="cuda")
        lay = Layout(torch.zeros(k, T, dtype=torch.int64, device="cuda"), torch.cumsum(sizes, 0) - sizes, sizes,
                     "ragged", k * T, E, T)
        with pytest.raises(RuntimeError, match="^w4a16_rows_matmul: " + LAUNCH):
            G.layout_mm(cuda(k * T, 256, dtype=torch.bfloat16), fp4(E, 64, 256), lay, transposed=True)
        with pytest.raises(DataDependentOutputException):
            sizes.tolist()   # what a host read of the layout on the way would have raised


@pytest.mark.parametrize("fmt", FORMATS)
def test_grouped_route_on_cuda_is_one_grouped_mm_with_no_host_read(fake, grouped_calls, monkeypatch, fmt):
    # dequantize() decodes through table lookups written with Python indexing, which needs a CUDA
    # device guard that a CPU-only torch lacks, so it cannot run on fake CUDA tensors; it is an
    # element-wise decode that reads no values on the host (and is checked on CPU tensors above).
    # Here it is replaced by an uninitialised tensor of its shape, dtype and device so that the rest
    # of the route (offsets on the device, padding, torch._grouped_mm, masking) runs on fake tensors.
    from torch._subclasses.fake_tensor import DataDependentOutputException

    seen = []

    def decoded(w, dtype=torch.float32):
        seen.append((w.fmt, dtype))
        return torch.empty(w.logical_shape, dtype=dtype, device=w.device)
    monkeypatch.setattr(QM, "dequantize", decoded)
    E, Nn, K = 4, 64, 256
    with fake:
        w = fp4(E, Nn, K, fmt) if fmt in ("mxfp4", "nvfp4") else fp8_block(E, Nn, K) if fmt == "fp8_block" else \
            QuantizedTensor(cuda(E, Nn, K, dtype=torch.float8_e4m3fn),
                            cuda(E, Nn, K // 32, dtype=torch.uint8) if fmt == "mxfp8" else cuda(E, Nn, 1), None, fmt,
                            (E, Nn, K), (1, 32) if fmt == "mxfp8" else (1, K))
        offs = torch.zeros(E + 1, dtype=torch.int64, device="cuda")
        a = cuda(100, K, dtype=torch.bfloat16)   # 25 rows per expert: past the W4A16 kernel's decode sizes
        y = QM.rows_matmul(a, w, offs)
        assert y.shape == (100, Nn) and y.dtype == torch.bfloat16 and y.device.type == "cuda"
        assert seen == [(fmt, torch.bfloat16)] and grouped_calls == [((100, K), (E, K, Nn))]
        # operands padded to the layout rule on the device too (N = 5, K = 40: 10- and 80-byte rows)
        w5 = QuantizedTensor(cuda(E, 5, 40, dtype=torch.float8_e4m3fn), cuda(E, 5, 1), None, "fp8_row", (E, 5, 40),
                             (1, 40))
        assert QM.rows_matmul(cuda(7, 40, dtype=torch.bfloat16), w5, offs).shape == (7, 5)
        with pytest.raises(DataDependentOutputException):
            offs.tolist()


# --------------------------------------------------------------------------- bad input

def test_rows_matmul_refuses_bad_operands_by_name(fake):
    w = _quantize(torch.randn(3, 32, 64), "mxfp4")
    a, offs = torch.randn(5, 64), torch.tensor([0, 2, 2, 5])
    with pytest.raises(ValueError, match=r"^rows_matmul: offsets must be an int64 \(or int32\) tensor \[E \+ 1\] = "
                                         r"\[4\] \(expert e owns rows offsets\[e\]:offsets\[e \+ 1\]\), got "
                                         r"torch.int64 \(3,\)"):
        QM.rows_matmul(a, w, offs[:3])
    with pytest.raises(ValueError, match=r"^rows_matmul: offsets must be .* got torch.float32 \(4,\)"):
        QM.rows_matmul(a, w, offs.float())
    with pytest.raises(ValueError, match=r"^rows_matmul: offsets must be .* got list"):
        QM.rows_matmul(a, w, [0, 2, 2, 5])
    with pytest.raises(ValueError, match=r"^rows_matmul: expected a \[R, K\] and w \[E, N, K\], got a \(5, 48\) and "
                                         r"w \(3, 32, 64\)"):
        QM.rows_matmul(torch.randn(5, 48), w, offs)
    with pytest.raises(TypeError, match=r"^rows_matmul: a must be a float32 or bfloat16 tensor, got torch.float16"):
        QM.rows_matmul(a.half(), w, offs)
    with pytest.raises(TypeError, match=r"^rows_matmul: w must be a QuantizedTensor, got Tensor"):
        QM.rows_matmul(a, torch.randn(3, 32, 64), offs)
    with pytest.raises(ValueError, match=r"^rows_matmul: path must be one of \('auto', 'w4a16', 'grouped'\), got 'x'"):
        QM.rows_matmul(a, w, offs, path="x")
    with pytest.raises(ValueError, match=r"^rows_matmul: path='w4a16' has no backward"):
        QM.rows_matmul(a.requires_grad_(), w, offs, path="w4a16")
    with fake:
        wc = fp4(3, 32, 64)
        with pytest.raises(RuntimeError, match=r"^rows_matmul: offsets is on cpu but a is on cuda:0; pass the offsets "
                                               r"on a's device"):
            QM.rows_matmul(cuda(5, 64, dtype=torch.bfloat16), wc, offs)


def test_w4a16_rows_matmul_refuses_what_the_kernel_cannot_take(fake):
    with fake:
        w, x = fp4(3, 64, 256), cuda(5, 256, dtype=torch.bfloat16)
        offs = torch.zeros(4, dtype=torch.int64, device="cuda")
        with pytest.raises(ValueError, match=r"^w4a16_rows_matmul: offsets must be an int64 \(or int32\) tensor "
                                             r"\[E \+ 1\] = \[4\] .* got torch.int64 \(3,\)"):
            QN.w4a16_rows_matmul(x, w, offs.narrow(0, 0, 3))
        with pytest.raises(ValueError, match=r"^w4a16_rows_matmul: offsets must be .* got torch.int16 \(4,\)"):
            QN.w4a16_rows_matmul(x, w, torch.zeros(4, dtype=torch.int16, device="cuda"))
        with pytest.raises(TypeError, match=r"^w4a16_rows_matmul: x must be bfloat16 .* got torch.float32"):
            QN.w4a16_rows_matmul(cuda(5, 256), w, offs)
        with pytest.raises(ValueError, match=r"^w4a16_rows_matmul: expected x \[R, K\] and w \[E, N, K\], got x "
                                             r"\(5, 128\) and w \(3, 64, 256\)"):
            QN.w4a16_rows_matmul(cuda(5, 128, dtype=torch.bfloat16), w, offs)
        with pytest.raises(ValueError, match=r"^w4a16_rows_matmul: needs mxfp4 or nvfp4 weights, got fp8_block"):
            QN.w4a16_rows_matmul(x, fp8_block(3, 64, 256), offs)
        with pytest.raises(ValueError, match=r"^w4a16_rows_matmul: K = 48 must be a multiple of 32"):
            QN.w4a16_rows_matmul(cuda(5, 48, dtype=torch.bfloat16), fp4(3, 64, 48, "nvfp4"), offs)
        with pytest.raises(ValueError, match=r"^w4a16_rows_matmul: E = 65536 experts exceeds the kernel's grid limit"):
            QN.w4a16_rows_matmul(cuda(1, 32, dtype=torch.bfloat16), fp4(65536, 8, 32),
                                 torch.zeros(65537, dtype=torch.int64, device="cuda"))
        with pytest.raises(RuntimeError, match=r"^w4a16_rows_matmul: offsets is on cpu but x is on cuda:0"):
            QN.w4a16_rows_matmul(x, w, torch.zeros(4, dtype=torch.int64))
        store = cuda(3 * 64 * 128 + 8, dtype=torch.uint8)
        shifted = QuantizedTensor(store.as_strided((3, 64, 128), (64 * 128, 128, 1), 8), w.scales, None, "mxfp4",
                                  (3, 64, 256), (1, 32))
        with pytest.raises(ValueError, match=r"^w4a16_rows_matmul: w.data starts at byte 8 of a 16-byte line"):
            QN.w4a16_rows_matmul(x, shifted, offs)


# --------------------------------------------------------------------------- the C side, via ctypes

VP = ctypes.c_void_p
P16, P18 = VP(16), VP(18)   # never dereferenced: every call below returns before a launch


@needs_lib
def test_c_rows_entry_return_codes():
    f = N.lib().fmoe_w4a16_rows_matmul
    # (x, offsets, w, scales, gscale, y, fmt, E, R, N, K, stream)
    assert f(P16, P16, P16, P16, None, P16, 0, 2, 3, 64, 48, None) == N.ERR_BAD_SHAPE        # K % 32
    assert f(P16, P16, P16, P16, None, P16, 0, 65536, 3, 64, 64, None) == N.ERR_BAD_SHAPE    # grid limit
    assert f(P16, P16, P16, P16, None, P16, 0, 2, -1, 64, 64, None) == N.ERR_BAD_SHAPE       # R < 0
    assert f(P16, P16, P16, P16, None, P16, 0, 2, 3, 64, 0, None) == N.ERR_BAD_SHAPE         # K == 0
    for E, R, Nn in ((2, 0, 64), (0, 3, 64), (2, 3, 0)):                                      # nothing to do
        assert f(None, None, None, None, None, None, 0, E, R, Nn, 64, None) == 0
    assert f(None, P16, P16, P16, None, P16, 0, 2, 3, 64, 64, None) == N.ERR_BAD_ARGUMENT    # x NULL
    assert f(P16, None, P16, P16, None, P16, 0, 2, 3, 64, 64, None) == N.ERR_BAD_ARGUMENT    # offsets NULL
    assert f(P18, P16, P16, P16, None, P16, 0, 2, 3, 64, 64, None) == N.ERR_MISALIGNED
    assert f(P16, P16, P18, P16, None, P16, 0, 2, 3, 64, 64, None) == N.ERR_MISALIGNED
    assert f(P16, P16, P16, P16, None, P16, 9, 2, 3, 64, 64, None) == N.ERR_BAD_FORMAT
    assert f(P16, P16, P16, P16, None, P16, 1, 2, 3, 64, 64, None) == N.ERR_BAD_ARGUMENT     # nvfp4, gscale NULL
    with pytest.raises(RuntimeError, match=r"^w4a16_rows_matmul: fmoe_native: a pointer is not 16-byte aligned "
                                           r"\(code -5\)"):
        N.check_rc(N.ERR_MISALIGNED, "w4a16_rows_matmul")


@needs_lib
@needs_no_gpu
def test_c_rows_entry_launch_without_a_driver_returns_a_cuda_error():
    L = N.lib()
    rc = L.fmoe_w4a16_rows_matmul(P16, P16, P16, P16, None, P16, 0, 2, 3, 64, 64, None)
    assert rc > 0 and re.search(r"driver|device", L.fmoe_native_error_string(rc).decode(), re.I)
