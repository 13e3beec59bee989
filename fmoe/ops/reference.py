"""Pure-torch reference kernels for the three MoE data-movement primitives.

Slow, obviously right, and the oracle for every fast backend. All three work on
a flat *position* index ``pos`` (int64 [k, T]): ``pos[j, t]`` is the row of the
[R, M] expert buffer (``R = E * C``; row ``e * C + slot``) that slot j of token
t occupies, or -1 when the pair is masked or dropped. Kept positions are
unique, so dispatch is a pure scatter.

Precision: float32/float64 compute in their own dtype (fp64 stays fp64, unlike
Tutel); float16/bfloat16 compute products and sums in float32 and round once.
"""
from __future__ import annotations

from typing import Optional

import torch
from torch import Tensor


def compute_dtype(dtype: torch.dtype) -> torch.dtype:
    """The accumulation dtype for data of ``dtype``."""
    return torch.float32 if dtype in (torch.float16, torch.bfloat16) else dtype


def _safe(pos: Tensor, dummy: int) -> Tensor:
    return torch.where(pos >= 0, pos, torch.full_like(pos, dummy))


def dispatch(x: Tensor, pos: Tensor, weights: Optional[Tensor], num_rows: int) -> Tensor:
    """D[pos[j, t]] = w[j, t] * x[t] (w = 1 when ``weights`` is None); other rows 0.

    Args:
        x: float [T, M]. pos: int64 [k, T]. weights: float [k, T] or None.
        num_rows: R, rows of the output.
    Returns:
        [R, M] in x's dtype.
    """
    k, T = pos.shape
    acc = compute_dtype(x.dtype)
    src = x.to(acc).unsqueeze(0).expand(k, T, x.shape[1])
    if weights is not None:
        src = weights.to(acc).unsqueeze(-1) * src
    out = torch.zeros(num_rows + 1, x.shape[1], dtype=acc, device=x.device)
    # Row num_rows is a bin for skipped pairs; kept rows are written exactly once.
    out.index_add_(0, _safe(pos, num_rows).reshape(-1), src.reshape(k * T, x.shape[1]))  # -1 fails at T = 0
    return out[:num_rows].to(x.dtype)


def combine(y: Tensor, pos: Tensor, weights: Optional[Tensor]) -> Tensor:
    """out[t] = sum_j w[j, t] * y[pos[j, t]] over kept pairs, summed in order j = 0, 1, ...

    Args:
        y: float [R, M]. pos: int64 [k, T]. weights: float [k, T] or None.
    Returns:
        [T, M] in y's dtype; a token with no kept pair is 0.
    """
    k, T = pos.shape
    R, M = y.shape
    acc = compute_dtype(y.dtype)
    padded = torch.cat([y.to(acc), y.new_zeros(1, M, dtype=acc)])
    rows = padded[_safe(pos, R)]  # [k, T, M]
    out = torch.zeros(T, M, dtype=acc, device=y.device)
    for j in range(k):
        term = rows[j] if weights is None else weights[j].to(acc).unsqueeze(-1) * rows[j]
        out = out + term
    return out.to(y.dtype)


def gate_grad(a: Tensor, b: Tensor, pos: Tensor) -> Tensor:
    """g[j, t] = <a[t], b[pos[j, t]]> for kept pairs, 0 otherwise.

    This is the gradient of combine w.r.t. its weights (a = grad of the output,
    b = expert outputs) and of weighted dispatch (a = x, b = grad of the buffer).

    Args:
        a: float [T, M]. b: float [R, M]. pos: int64 [k, T].
    Returns:
        [k, T] in a's dtype.
    """
    R, M = b.shape
    acc = compute_dtype(a.dtype)
    padded = torch.cat([b.to(acc), b.new_zeros(1, M, dtype=acc)])
    rows = padded[_safe(pos, R)]  # [k, T, M]
    return (rows * a.to(acc).unsqueeze(0)).sum(-1).to(a.dtype)
