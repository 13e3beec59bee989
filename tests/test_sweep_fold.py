"""The vmapped sweep's fold (fmoe.engine.traced._shared_pairs): the huge-page advice on its output
touches only whole 2 MiB pages inside that output's fresh storage."""
from __future__ import annotations

import torch

from fmoe.engine import traced


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
