"""The CUDA routes, on a CPU-only machine.

* ragged_mm / ragged_wgrad off the CPU run one torch._grouped_mm per segment with no host sync.
  torch 2.13 runs torch._grouped_mm on CPU too, so that code path is forced on CPU tensors and
  checked against the float64 reference, forward and backward; with FakeTensorMode CUDA tensors
  (where any host read of the offsets would raise) the kernels pick it by themselves.
* expert_matmul(path="auto") on CUDA picks the native kernels (W4A16 at decode, FP8 block) when
  native/build.sh has built them: the choice, and the call up to the launch, with fake CUDA tensors.
"""
import os
import warnings

import pytest
import torch

import fmoe  # noqa: F401
from fmoe import _native
from fmoe.ops import ragged as RG
from fmoe.quant import matmul as QM
from fmoe.quant.tensor import QuantizedTensor

GPU_PRESENT = torch.cuda.is_available() or os.path.exists("/dev/nvidiactl")


@pytest.fixture
def fake():
    from torch._subclasses.fake_tensor import FakeTensorMode

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        yield FakeTensorMode(allow_non_fake_inputs=True)


@pytest.fixture
def grouped(monkeypatch):
    """Force the CUDA route (torch._grouped_mm) on CPU tensors; count its calls."""
    calls = []
    real = torch._grouped_mm

    def counted(*args, **kw):
        calls.append(args[0].shape)
        return real(*args, **kw)
    monkeypatch.setattr(RG, "_takes_grouped_mm", lambda t: t.dtype in RG._GROUPED_DTYPES)
    monkeypatch.setattr(torch, "_grouped_mm", counted)
    return calls


OFFSETS = torch.tensor([0, 7, 7, 20, 31, 36])   # 5 experts, expert 1 empty, rows 36..39 padding
E, R, K, N = 5, 40, 64, 32
# relative (norm) error bounds against float64: K * eps for float32 sums of at most K = 64 terms;
# bf16 results round once to 8 bits (2^-9) after FP32 accumulation, with margin
TOL = {torch.float32: K * 2.0 ** -24, torch.bfloat16: 1e-2}


def _rel(a, b):
    return ((a.double() - b.double()).norm() / b.double().norm()).item()


@pytest.mark.parametrize("transposed", [False, True])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_grouped_route_matches_the_reference_forward_and_backward(grouped, dtype, transposed):
    g = torch.Generator().manual_seed(0)
    x = torch.randn(R, K, generator=g).to(dtype).requires_grad_()
    w = torch.randn(*((E, N, K) if transposed else (E, K, N)), generator=g).to(dtype).requires_grad_()
    gy = torch.randn(R, N, generator=g).to(dtype)
    y = RG.ragged_mm(x, w, OFFSETS, transposed=transposed)
    gx, gw = torch.autograd.grad(y, (x, w), gy)
    assert len(grouped) == 3   # forward, dgrad and wgrad each one torch._grouped_mm
    x64, w64 = x.detach().double().requires_grad_(), w.detach().double().requires_grad_()
    y64 = RG.ragged_mm_reference(x64, w64, OFFSETS, transposed=transposed)
    gx64, gw64 = torch.autograd.grad(y64, (x64, w64), gy.double())
    errs = [_rel(y, y64), _rel(gx, gx64), _rel(gw, gw64)]
    assert max(errs) < TOL[dtype], errs
    assert y.dtype == dtype and bool((y[36:] == 0).all()) and bool((gw[1] == 0).all())
    # the bound catches a wrong row: one row moved to the neighbouring expert is far outside it
    wrong = RG.ragged_mm_reference(x64, w64, torch.tensor([0, 8, 8, 20, 31, 36]), transposed=transposed)
    assert _rel(wrong, y64) > 20 * TOL[dtype]


def test_grouped_route_under_vmap_is_one_call_per_segment(grouped):
    # vmap folds the batch into segments: per-batch offsets and x, shared w
    g = torch.Generator().manual_seed(1)
    B = 3
    xs = torch.randn(B, R, K, generator=g)
    w = torch.randn(E, K, N, generator=g)
    offs = torch.stack([OFFSETS, torch.tensor([0, 0, 10, 10, 40, 40]), torch.tensor([0, 1, 2, 3, 4, 5])])
    ys = torch.func.vmap(lambda x, o: RG.ragged_mm(x, w, o))(xs, offs)
    assert len(grouped) == B
    for b in range(B):
        ref = RG.ragged_mm_reference(xs[b].double(), w.double(), offs[b])
        assert _rel(ys[b], ref) < TOL[torch.float32]
        assert bool((ys[b][int(offs[b, -1]):] == 0).all())


def test_grouped_route_wgrad_with_an_empty_expert_and_padding(grouped):
    g = torch.Generator().manual_seed(2)
    a, b = torch.randn(R, K, generator=g), torch.randn(R, N, generator=g)
    b[36:] = float("nan")   # padding rows are in no group: never read
    z = RG.ragged_wgrad(a, b, OFFSETS)
    assert len(grouped) == 1
    ref = RG.ragged_wgrad_reference(a.double(), b.double(), OFFSETS)
    assert bool((z[1] == 0).all()) and _rel(z, ref) < TOL[torch.float32]


def test_grouped_route_checks_the_offsets_without_reading_them(grouped):
    # one assertion on the device (on CUDA a device-side assert: no host sync); here it raises at once
    x, w = torch.randn(R, K), torch.randn(E, K, N)
    for bad in ([1, 7, 7, 20, 31, 36], [0, 7, 6, 20, 31, 36], [0, 7, 7, 20, 31, 41]):
        with pytest.raises(RuntimeError, match=r"ragged_mm: offsets must have offsets\[0\] = 0, be non-decreasing "
                                               r"and have offsets\[E\] <= the 40 rows of the input"):
            RG.ragged_mm(x, w, torch.tensor(bad))


def test_cuda_tensors_take_the_grouped_route_with_no_host_sync(fake, monkeypatch):
    # Under FakeTensorMode any host read of a CUDA tensor's values (tolist, item) raises, so these
    # calls passing shows the CUDA kernels read no offsets on the host; float64 has no grouped
    # kernel and takes the per-expert loop, whose one host read is refused.
    calls = []
    real = torch._grouped_mm
    monkeypatch.setattr(torch, "_grouped_mm", lambda *a, **k: calls.append(1) or real(*a, **k))
    from torch._subclasses.fake_tensor import DataDependentOutputException

    with fake:
        bf = dict(device="cuda", dtype=torch.bfloat16)
        off = torch.zeros(2, E + 1, dtype=torch.int64, device="cuda")
        y = RG._mm_impl(torch.empty(2, R, K, **bf), torch.empty(1, E, N, K, **bf), off, True)
        z = RG._wgrad_impl(torch.empty(2, R, K, **bf), torch.empty(2, R, N, **bf), off)
        assert y.shape == (2, R, N) and z.shape == (2, E, K, N) and y.device.type == "cuda"
        assert len(calls) == 4
        with pytest.raises(DataDependentOutputException):
            RG._mm_impl(torch.empty(1, R, K, device="cuda", dtype=torch.float64),
                        torch.empty(1, E, N, K, device="cuda", dtype=torch.float64), off, True)


def test_misaligned_operands_leave_the_grouped_route():
    x = torch.randn(1, R * K + 1)[:, 1:].view(1, R, K)   # 4 bytes past a 16-byte boundary
    w = torch.randn(1, E, K, N)
    assert RG._grouped_layout_ok(w) and not RG._grouped_layout_ok(x)
    assert not RG._grouped_layout_ok(torch.randn(1, R, 6))   # 24-byte rows


# --------------------------------------------------------------------------- quantized "auto" on CUDA

def _fp4(E_, N_, K_, fmt="mxfp4"):
    blk = 32 if fmt == "mxfp4" else 16
    cu = dict(device="cuda")
    return QuantizedTensor(torch.empty(E_, N_, K_ // 2, dtype=torch.uint8, **cu),
                           torch.empty(E_, N_, K_ // blk, dtype=torch.uint8 if fmt == "mxfp4" else torch.float8_e4m3fn,
                                       **cu),
                           torch.empty(E_, **cu) if fmt == "nvfp4" else None, fmt, (E_, N_, K_), (1, blk))


def _fp8(E_, N_, K_, block, fmt="fp8_block"):
    cu = dict(device="cuda")
    if fmt == "mxfp8":
        return QuantizedTensor(torch.empty(E_, N_, K_, dtype=torch.float8_e4m3fn, **cu),
                               torch.empty(E_, N_, K_ // 32, dtype=torch.uint8, **cu), None, fmt, (E_, N_, K_), (1, 32))
    return QuantizedTensor(torch.empty(E_, N_, K_, dtype=torch.float8_e4m3fn, **cu),
                           torch.empty(E_, -(-N_ // block[0]), -(-K_ // block[1]), **cu), None, fmt, (E_, N_, K_),
                           block)


@pytest.mark.skipif(not _native.built(), reason="native/build.sh has not been run: 'auto' keeps the reference on CUDA")
def test_cuda_auto_chooses_the_native_kernels(fake, monkeypatch, tmp_path):
    with fake:
        x = lambda C, dtype=torch.bfloat16, K_=256: torch.empty(2, C, K_, device="cuda", dtype=dtype)  # noqa: E731
        cases = [
            (x(1), _fp4(2, 64, 256), "w4a16"),
            (x(16), _fp4(2, 64, 256, "nvfp4"), "w4a16"),
            (x(17), _fp4(2, 64, 256), "reference"),                     # past decode: dequantize + bmm
            (x(1, torch.float32), _fp4(2, 64, 256), "reference"),       # the kernels take bf16 x
            (x(1, K_=48), _fp4(2, 64, 48, "nvfp4"), "reference"),       # K not a multiple of 32
            (x(64), _fp8(2, 64, 256, (128, 128)), "fp8_block"),
            (x(64), _fp8(2, 64, 256, (1, 128)), "reference"),
            (x(4), _fp8(2, 64, 256, None, "mxfp8"), "reference"),
        ]
        for xx, w, want in cases:
            assert QM._cuda_choice(xx, w) == want, (tuple(xx.shape), xx.dtype, w)
    assert QM._cuda_choice(torch.zeros(2, 1, 256, dtype=torch.bfloat16), _fp4_cpu()) == "reference"
    monkeypatch.setattr(_native, "library_path", lambda: str(tmp_path / "libfmoe_native.so"))   # not built
    with fake:
        assert QM._cuda_choice(torch.empty(2, 1, 256, device="cuda", dtype=torch.bfloat16),
                               _fp4(2, 64, 256)) == "reference"


def _fp4_cpu():
    return QuantizedTensor(torch.zeros(2, 64, 128, dtype=torch.uint8), torch.zeros(2, 64, 8, dtype=torch.uint8), None,
                           "mxfp4", (2, 64, 256), (1, 32))


@pytest.mark.skipif(not _native.built(), reason="native/build.sh has not been run")
@pytest.mark.skipif(GPU_PRESENT, reason="a GPU is visible: fake tensors would reach a real launch")
@pytest.mark.parametrize("fmt", ["mxfp4", "nvfp4"])
def test_expert_matmul_auto_on_cuda_runs_w4a16_up_to_the_launch(fake, fmt):
    from fmoe.quant import expert_matmul

    with fake:
        x = torch.empty(2, 3, 256, device="cuda", dtype=torch.bfloat16)
        with pytest.raises(RuntimeError, match=r"^w4a16_matmul: cannot launch the CUDA kernel on cuda:0: no CUDA "
                                               r"driver or device is available"):
            expert_matmul(x, _fp4(2, 64, 256, fmt))
