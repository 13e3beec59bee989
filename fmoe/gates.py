"""Deprecated location of the Tutel gate functions: they live in :mod:`fmoe.routers`.

Kept only until ``fmoe.moe`` imports from :mod:`fmoe.routers`; then this file is deleted.
Nothing is defined here, so there is one implementation.
"""
from __future__ import annotations

from .routers import (SCORE_FNS, add_gate_noise, cosine_gate, gate_logits, init_cosine_gate,  # noqa: F401
                      init_linear_gate, linear_gate, scores_from_logits)

__all__ = [
    "linear_gate",
    "cosine_gate",
    "gate_logits",
    "add_gate_noise",
    "scores_from_logits",
    "init_linear_gate",
    "init_cosine_gate",
    "SCORE_FNS",
]
