"""Weights on transparent huge pages, for decode on a CPU.

    huge_pages(tree, min_bytes=HUGE_MIN_BYTES) -> tree of the same structure

At decode a layer reads each busy expert's bytes once, from DRAM. On 4 KiB pages every 4 KiB of
them is a TLB miss, and the page-table lines were evicted by the same stream, so each miss is a
page walk that waits on memory beside the data's own loads (on a virtual machine a walk of two
page tables). On 2 MiB pages there are 512 times fewer. Measured on a 2-vCPU AMD EPYC virtual
machine (BENCHMARKS.md): one thread's read of a cold 256 MiB tensor 20 -> 32-33 GB/s, and
bench_inference's packed layer at T = 1 / 4 / 16 in 0.87-1.01x its time on 4 KiB pages.

torch's CPU allocator puts tensors on 4 KiB pages. :func:`huge_pages` copies every CPU tensor leaf
of at least ``min_bytes`` (a QuantizedTensor's data and scales are leaves) into anonymous memory
that it advises ``MADV_HUGEPAGE``, 2 MiB-aligned, and clones the smaller ones, so that the result
holds no memory of the input: a tree memory-mapped from a checkpoint lets go of its mapping (and
of the pages the copy read) once the input is dropped, where one small leaf left as given would
keep the whole file's mapping alive. Values, dtype, shape, ``requires_grad`` and the Parameter type
are kept; strides become contiguous. The memory is freed with the last tensor that views it.
Leaves that are not CPU tensors are returned as given. Where the kernel cannot give huge pages
(:func:`available`: not Linux, or transparent huge pages set to ``never``) the tree is returned
unchanged, no copy made. The kernel may still fall back to 4 KiB pages for part of a region when
memory is fragmented; the values are the same either way.

The copy of a memory-mapped tree (file-backed pages, paged in on first touch) is anonymous memory,
resident at once.
"""
from __future__ import annotations

import mmap
import sys
from typing import Any

import torch
import torch.utils._pytree as pytree

__all__ = ["HUGE_MIN_BYTES", "available", "huge_pages"]

HUGE = 2 << 20
# Below one huge page a tensor gains at most one page's TLB entries and pays a 2 MiB mapping.
HUGE_MIN_BYTES = HUGE
_THP_MODE = "/sys/kernel/mm/transparent_hugepage/enabled"


def _mode() -> str:
    """The kernel's THP mode ('always', 'madvise', 'never'), or '' where there is none to read."""
    if not sys.platform.startswith("linux") or not hasattr(mmap, "MADV_HUGEPAGE"):
        return ""
    try:
        with open(_THP_MODE) as f:
            text = f.read()
    except OSError:
        return ""
    return text.split("[", 1)[1].split("]", 1)[0] if "[" in text else ""


_MODE = _mode()


def available() -> bool:
    """Whether this process can get transparent huge pages by advice (Linux, mode 'always' or 'madvise')."""
    return _MODE in ("always", "madvise")


def _copy(t: torch.Tensor) -> torch.Tensor:
    n = t.numel() * t.element_size()
    m = mmap.mmap(-1, n + HUGE, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    raw = torch.frombuffer(m, dtype=torch.uint8)   # holds m: the mapping lives as long as a view of it
    off = (-raw.data_ptr()) % HUGE
    m.madvise(mmap.MADV_HUGEPAGE, off, n)           # before the first touch: the copy faults huge pages
    out = raw[off:off + n].view(t.dtype).view(t.shape)
    out.copy_(t.detach())
    return _like(t, out)


def _like(t: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
    """out with t's Parameter type and requires_grad."""
    if isinstance(t, torch.nn.Parameter):
        return torch.nn.Parameter(out, requires_grad=t.requires_grad)
    return out.requires_grad_(t.requires_grad)


def huge_pages(tree: Any, min_bytes: int = HUGE_MIN_BYTES) -> Any:
    """A copy of ``tree`` with each CPU tensor leaf of at least ``min_bytes`` bytes on transparent
    huge pages and each smaller one cloned (module docstring); any pytree (dicts of tensors,
    QuantizedTensors, lists).

    Args:
        tree: a pytree whose leaves are tensors (any dtype, any device; non-CPU leaves, and leaves
            that are not tensors, are returned as given).
        min_bytes: the smallest leaf put on huge pages (default one huge page, 2 MiB).
    Returns:
        the same structure; its CPU tensor leaves are contiguous copies of equal values.
    """
    if isinstance(min_bytes, bool) or not isinstance(min_bytes, int) or min_bytes < 0:
        raise ValueError(f"huge_pages: min_bytes must be a non-negative int, got {min_bytes!r}")
    if not available():
        return tree

    def move(leaf):
        if type(leaf) not in (torch.Tensor, torch.nn.Parameter) or leaf.device.type != "cpu":
            return leaf
        if leaf.numel() * leaf.element_size() < max(min_bytes, 1):
            return _like(leaf, leaf.detach().clone(memory_format=torch.contiguous_format))
        return _copy(leaf)
    return pytree.tree_map(move, tree)
