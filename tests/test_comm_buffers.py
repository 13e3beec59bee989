"""The communicators' receive-buffer pool (fmoe.comm.buffers): a buffer is lent again only when no
tensor uses its memory any more, so an exchange never overwrites a result someone still holds."""
from __future__ import annotations

import gc

import pytest
import torch

from fmoe.comm import LocalComm
from fmoe.comm.buffers import BufferPool, recv_buffer

MB = 1 << 20


def _ptr(t):
    return t.untyped_storage().data_ptr()


def test_take_gives_a_plain_contiguous_tensor_and_reuses_a_freed_buffer():
    pool = BufferPool(min_bytes=MB)
    a = pool.take((1000, 768), torch.float32)
    assert a.shape == (1000, 768) and a.dtype == torch.float32 and a.is_contiguous() and a._base is None
    a.fill_(3.0)
    b = pool.take((1000, 768), torch.float32)           # a is alive: another buffer
    assert _ptr(b) != _ptr(a) and len(pool) == 2
    b.fill_(-1.0)
    assert torch.all(a == 3.0)
    p = _ptr(a)
    del a
    c = pool.take((990, 768), torch.float32)            # a's buffer is free: lent again
    assert _ptr(c) == p and c.shape == (990, 768) and len(pool) == 2
    d = pool.take((400, 768), torch.float64)            # any dtype on the byte storage
    assert d.dtype == torch.float64 and _ptr(d) not in (_ptr(b), _ptr(c))


def test_a_view_or_a_saved_tensor_keeps_the_buffer_busy():
    pool = BufferPool(min_bytes=MB)
    t = pool.take((512, 1024), torch.float32).fill_(1.0)
    p = _ptr(t)
    view = t[10:20]
    del t
    assert _ptr(pool.take((512, 1024), torch.float32)) != p     # the view still reads it
    del view
    gc.collect()
    t = pool.take((512, 1024), torch.float32)
    assert _ptr(t) == p
    w = torch.ones(1024, requires_grad=True)
    y = (t * w).sum()          # autograd saves t for w's gradient
    del t
    u = pool.take((512, 1024), torch.float32)
    assert _ptr(u) != p
    u.fill_(7.0)
    y.backward()
    assert torch.all(w.grad == 512.0)   # the saved tensor was not overwritten
    del y, u
    assert _ptr(pool.take((512, 1024), torch.float32)) == p


def test_small_requests_are_plain_and_large_buffers_are_not_pinned_by_small_ones():
    pool = BufferPool(min_bytes=MB)
    small = pool.take((10, 10), torch.float32)
    assert len(pool) == 0 and small.shape == (10, 10)
    big = pool.take((4 * MB // 4,), torch.float32)
    p = _ptr(big)
    del big
    half = pool.take((MB // 4 + 1,), torch.float32)     # 1 MB + 4 B: under half of the 4 MB buffer
    assert _ptr(half) != p and len(pool) == 2


def test_a_full_pool_replaces_its_oldest_free_buffer_or_allocates_plainly():
    pool = BufferPool(max_buffers=2, min_bytes=MB)
    a, b = pool.take((MB,), torch.uint8), pool.take((MB,), torch.uint8)
    c = pool.take((MB,), torch.uint8)                   # both busy, pool full: a plain tensor
    assert len(pool) == 2 and len({_ptr(a), _ptr(b), _ptr(c)}) == 3
    pb = _ptr(b)
    del a
    d = pool.take((8 * MB,), torch.uint8)               # a's buffer is free but too small: replaced
    assert len(pool) == 2 and _ptr(d) != pb
    pd = _ptr(d)
    del d
    assert _ptr(pool.take((8 * MB,), torch.uint8)) == pd    # d's buffer joined the pool
    assert BufferPool(max_buffers=0).take((8 * MB,), torch.uint8).shape == (8 * MB,)
    with pytest.raises(ValueError, match="max_buffers must be an int >= 0, got -1"):
        BufferPool(max_buffers=-1)


def test_recv_buffer_pools_per_communicator_on_the_cpu_only():
    c1, c2 = LocalComm(), LocalComm()
    a = recv_buffer(c1, (1024, 512), torch.float32)
    p = _ptr(a)
    del a
    assert _ptr(recv_buffer(c1, (1024, 512), torch.float32)) == p
    assert _ptr(recv_buffer(c2, (1024, 512), torch.float32)) != p
    m = recv_buffer(c1, (1024, 512), torch.float32, device="meta")
    assert m.device.type == "meta" and m.shape == (1024, 512)
