"""The ops' CUDA implementation: ``fmoe::dispatch`` / ``fmoe::combine`` on CUDA tensors run the
native kernels (native/dispatch_combine.cu through :mod:`fmoe._native`).

Registered on the ops' CUDA dispatch key at import, so ``fmoe.dispatch`` / ``fmoe.combine`` on
CUDA tensors (and everything built on them: autograd, vmap, compile) reach the kernels. The
kernels take float32/bfloat16 rows and accumulate combine in fp32 with fused multiply-adds
(equal to the reference within one fp32 rounding per slot); other dtypes, and a checkout where
``native/build.sh`` has not been run, use the pure-torch reference on the GPU. ``gate_grad``
has no native kernel: the reference runs on CUDA.

The native wrappers check what the CPU kernels check, with their error types (wrong shapes,
``weights`` [T, k] for [k, T], a position >= the buffer's rows: IndexError). The range check
reads one flag the kernel sets: one 4-byte device->host copy per call, so an eager call waits
for its kernel (during CUDA graph capture a device-side assertion replaces the read).
"""
from __future__ import annotations

from typing import Optional

import torch
from torch import Tensor

from .. import _native
from . import reference


_NATIVE_DTYPES = (torch.float32, torch.bfloat16)


def native_ready(*ts: Optional[Tensor]) -> bool:
    """True when the native library is built and every tensor has a kernel dtype."""
    return _native.built() and all(t is None or t.dtype in _NATIVE_DTYPES or not t.is_floating_point()
                                   for t in ts)


def dispatch(x: Tensor, pos: Tensor, weights: Optional[Tensor], num_rows: int) -> Tensor:
    """CUDA kernel of ``fmoe::dispatch``: rows [num_rows, M] in x's dtype."""
    if native_ready(x):
        return _native.dispatch(x, pos, weights, num_rows)
    return reference.dispatch(x, pos, weights, num_rows)


def combine(y: Tensor, pos: Tensor, weights: Optional[Tensor]) -> Tensor:
    """CUDA kernel of ``fmoe::combine``: tokens [T, M] in y's dtype."""
    if native_ready(y):
        return _native.combine(y, pos, weights)
    return reference.combine(y, pos, weights)


torch.library.register_kernel("fmoe::dispatch", "cuda", dispatch)
torch.library.register_kernel("fmoe::combine", "cuda", combine)
