"""fmoe.quant.huge_pages: weights copied onto transparent huge pages keep their values, and the
memory they land in is advised for huge pages (the kernel's own record of the advice, VmFlags 'hg')."""
from __future__ import annotations

import gc

import pytest
import torch

import fmoe
import fmoe.quant as Q
from fmoe.quant import hugepages, packed

needs_thp = pytest.mark.skipif(not hugepages.available(), reason="no transparent huge pages by advice here")


def _vm_flags(addr: int) -> list:
    """The VmFlags of this process's mapping that holds ``addr`` (Linux /proc/self/smaps)."""
    inside = False
    with open("/proc/self/smaps") as f:
        for line in f:
            head = line.split()[0]
            if "-" in head and ":" not in head:
                lo, hi = (int(v, 16) for v in head.split("-"))
                inside = lo <= addr < hi
            elif inside and head == "VmFlags:":
                return line.split()[1:]
    raise AssertionError(f"no mapping holds {addr:#x}")


@needs_thp
def test_leaves_keep_their_values_and_land_on_advised_aligned_memory():
    g = torch.Generator().manual_seed(0)
    big = torch.randn(1024, 1024, generator=g)                                     # 4 MiB float32
    tree = {"w": big, "wt": big.t(),                                               # a transposed view
            "b16": torch.randn(2048, 1024, generator=g).bfloat16(),
            "q": Q.quantize(torch.randn(4, 512, 2048, generator=g), "mxfp4"),     # data 2 MiB: moved
            "small": torch.randn(8, generator=g), "n": 3}
    out = hugepages.huge_pages(tree)
    for k in ("w", "wt", "b16"):
        assert out[k].dtype == tree[k].dtype and out[k].shape == tree[k].shape and out[k].is_contiguous()
        assert torch.equal(out[k], tree[k]) and out[k].data_ptr() != tree[k].data_ptr()
        assert out[k].data_ptr() % hugepages.HUGE == 0
        assert "hg" in _vm_flags(out[k].data_ptr()), k
    q, q0 = out["q"], tree["q"]
    assert isinstance(q, Q.QuantizedTensor) and (q.fmt, q.shape, q.block) == (q0.fmt, q0.shape, q0.block)
    assert q.data.data_ptr() % hugepages.HUGE == 0 and torch.equal(q.data, q0.data)
    for small, small0 in ((q.scales, q0.scales), (out["small"], tree["small"])):   # below min_bytes: cloned
        assert torch.equal(small, small0) and small.data_ptr() != small0.data_ptr()
    assert out["n"] == 3


@needs_thp
def test_the_memory_lives_as_long_as_a_view_of_it():
    t = torch.arange(1 << 20, dtype=torch.float32)
    h = hugepages.huge_pages(t)
    tail = h[-4:].clone()
    v = h[(1 << 20) - 4:]
    del h
    gc.collect()
    assert torch.equal(v, tail) and torch.equal(v, t[-4:])


@needs_thp
@pytest.mark.parametrize("n", [1024, 4])   # on huge pages, cloned
def test_parameters_and_requires_grad_are_kept(n):
    p = torch.nn.Parameter(torch.ones(1024, n))
    r = torch.ones(1024, n, requires_grad=True)
    out = hugepages.huge_pages({"p": p, "r": r})
    assert type(out["p"]) is torch.nn.Parameter and out["p"].requires_grad
    assert type(out["r"]) is torch.Tensor and out["r"].requires_grad and out["r"].is_leaf


@needs_thp
def test_a_memory_mapped_tree_lets_go_of_its_file(tmp_path):
    """No leaf of the copy views the input: once the input is dropped, the file's mapping goes."""
    path = tmp_path / "w.bin"
    torch.arange(1 << 20, dtype=torch.float32).numpy().tofile(path)
    src = {"big": torch.from_file(str(path), size=1 << 20, dtype=torch.float32),
           "small": torch.from_file(str(path), size=16, dtype=torch.float32)}
    out = hugepages.huge_pages(src)
    del src
    gc.collect()
    with open("/proc/self/maps") as f:
        assert str(path) not in f.read()
    assert torch.equal(out["big"], torch.arange(1 << 20, dtype=torch.float32))
    assert torch.equal(out["small"], torch.arange(16, dtype=torch.float32))


@needs_thp
@pytest.mark.parametrize("fmt", ["mxfp4", "nvfp4", "fp8_block", "float32"])
def test_a_decode_layer_on_huge_pages_gives_the_same_bits(fmt):
    """The same kernels on the same values and thread count: the same output, by construction."""
    g = torch.Generator().manual_seed(1)
    E, M, I = 8, 256, 128
    spec = fmoe.MoESpec(model_dim=M, num_experts=E, gate=fmoe.GateSpec(k=2, capacity_factor=0.0),
                        experts=fmoe.ExpertSpec(type="swiglu", hidden_size=I))
    ex = {"gate_up_proj": torch.randn(E, 2 * I, M, generator=g) * 0.05,
          "down_proj": torch.randn(E, M, I, generator=g) * 0.05}
    if fmt != "float32":
        ex = {k: Q.quantize(v, fmt) for k, v in ex.items()}
    params = {"gate": {"wg": torch.randn(E, M, generator=g)}, "experts": ex}
    moved = {"gate": params["gate"], "experts": hugepages.huge_pages(ex, min_bytes=1)}
    x = torch.randn(3, M, generator=g)
    with torch.no_grad():
        assert torch.equal(fmoe.moe(moved, x, spec)[0], fmoe.moe(params, x, spec)[0])
    if fmt != "float32" and packed.AVAILABLE:
        o = torch.tensor([0, 2, 2, 3] + [3] * (E - 3), dtype=torch.int64)
        a = torch.randn(3, M, generator=g)
        assert torch.equal(packed.grouped_matmul(a, moved["experts"]["gate_up_proj"], o),
                           packed.grouped_matmul(a, ex["gate_up_proj"], o))


def test_without_huge_pages_the_tree_comes_back_as_given(monkeypatch):
    monkeypatch.setattr(hugepages, "_MODE", "never")
    tree = {"w": torch.ones(1024, 1024)}
    assert not hugepages.available() and hugepages.huge_pages(tree) is tree


def test_bad_min_bytes_is_refused():
    for bad in (-1, 1.5, True, "2M"):
        with pytest.raises(ValueError, match="min_bytes"):
            hugepages.huge_pages({}, min_bytes=bad)


def test_the_mode_is_read_from_the_kernel():
    assert hugepages._MODE in ("", "always", "madvise", "never")
