"""The vmapped sweep's fold (fmoe.engine.traced._shared_pairs): its bag sums written in place by one
numba kernel equal F.embedding_bag's, and the huge-page advice on its output touches only whole
2 MiB pages inside that output's storage."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from fmoe.engine import traced


def _bags(dtype, n_bags=37, R=23, n=19, seed=0):
    g = torch.Generator().manual_seed(seed)
    per = torch.randint(0, 5, (n_bags,), generator=g)
    per[[0, 5, n_bags - 1]] = 0   # empty bags: first, inside, last
    first = torch.zeros(n_bags + 1, dtype=torch.int64)
    torch.cumsum(per, 0, out=first[1:])
    P = int(first[-1])
    src = torch.randn(R, n, generator=g, dtype=dtype)
    return src, torch.randint(0, R, (P,), generator=g), first, torch.randn(P, generator=g, dtype=dtype)


@pytest.mark.parametrize("dtype,tol", [(torch.float64, 1e-14), (torch.float32, 1e-6)])
def test_bags_into_equals_embedding_bag(dtype, tol):
    """Each bag the weighted sum of its rows (empty bags zero), written into the given rows of y,
    on the numba kernel (contiguous out) and on the embedding-bag fallback (a strided out)."""
    src, rows, first, w = _bags(dtype)
    want = F.embedding_bag(rows, src, first[:-1], mode="sum", per_sample_weights=w)
    y = torch.full((first.numel() + 3, src.shape[1]), float("nan"), dtype=dtype)
    out = y[2:2 + first.numel() - 1]
    assert traced._bags_into(out, src, rows, first, w) is out
    torch.testing.assert_close(out, want, rtol=tol, atol=tol)
    assert (out[[0, 5, -1]] == 0).all() and y[:2].isnan().all() and y[-2:].isnan().all()
    wide = torch.full((first.numel() - 1, 2 * src.shape[1]), float("nan"), dtype=dtype)
    strided = wide[:, ::2]
    traced._bags_into(strided, src, rows, first, w)
    torch.testing.assert_close(strided, want, rtol=tol, atol=tol)
    assert wide[:, 1::2].isnan().all()


def test_huge_pages_advises_whole_pages_inside_the_storage(monkeypatch):
    """The advice covers only whole 2 MiB pages that lie inside the tensor's bytes (never a page
    another allocation shares), none below 4 MiB or already resident, and leaves the tensor as
    it was; on this host's libc the real calls run and change no value."""
    calls, resident = [], [0]

    class Libc:
        def madvise(self, lo, n, advice):
            calls.append((lo, n, advice))
            return 0

        def mincore(self, lo, n, vec):
            assert lo % (2 << 20) == 0 and n == 1
            vec[0] = resident[0]
            return 0
    monkeypatch.setattr(traced, "_LIBC", [Libc()])
    page = 2 << 20
    for nbytes in (5 * page + 4, 4 * page, 3 * page + 12):
        calls.clear()
        t = torch.arange(nbytes // 4, dtype=torch.float32)
        assert traced._huge_pages(t) is t and torch.equal(t, torch.arange(nbytes // 4, dtype=torch.float32))
        (lo, n, advice), = calls
        start, end = t.data_ptr(), t.data_ptr() + t.numel() * 4
        assert advice == 14 and lo % page == 0 and n % page == 0 and n > 0
        assert start <= lo and lo + n <= end and lo - start < page and end - (lo + n) < page
    calls.clear()
    resident[0] = 1   # already touched (memory glibc reused): left as it is
    traced._huge_pages(torch.empty(4 * page, dtype=torch.uint8))
    traced._huge_pages(torch.empty(page // 4, dtype=torch.float32))   # 2 MiB: not worth a call
    traced._huge_pages(torch.empty(4 * page, dtype=torch.uint8, device="meta"))
    assert not calls
    monkeypatch.undo()
    t = traced._huge_pages(torch.empty(5 * page // 4, dtype=torch.float32))
    t.copy_(torch.arange(t.numel(), dtype=torch.float32))
    assert torch.equal(t, torch.arange(t.numel(), dtype=torch.float32))
