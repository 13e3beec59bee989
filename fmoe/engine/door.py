"""Which door of the expert engine a call takes: decided once per call, in one place.

    d = door(form, tensors, precision=None, order="fmoe", prescore=False, plan="auto")

* 'rows': a rows plan in eager mode (:func:`fmoe.engine.kinds.run` on the kernel table);
* 'compiled': the same plan and kernels inside torch.compile's custom op (:mod:`.traced`);
* 'layout': a layout plan, the staged kernel (under torch.func transforms, for pre-scored gates,
  combine 'grouped', ``MoESpec(plan='layout')``, and what the custom op does not take).

:func:`fmoe.moe` (one process) and :func:`fmoe.parallel.expert_stage` (each rank's received
rows) both ask here.
"""
from __future__ import annotations

from typing import Optional

from torch import Tensor

from . import kinds, traced
from .kinds import ExpertForm

__all__ = ["DOORS", "door"]

DOORS = ("rows", "compiled", "layout")


def door(form: Optional[ExpertForm], tensors: tuple, *, precision=None, order: str = "fmoe", prescore: bool = False,
         plan: str = "auto") -> str:
    """The door of one call.

    Args:
        form: the kind (None: custom experts, which have no compiled door).
        tensors: the call's x, gates and weights (packed weights, None biases allowed).
        precision: the quantized-training recipe or None. order: the combine order.
        prescore: gates scale the experts' inputs. plan: :attr:`fmoe.MoESpec.plan`.
    Returns:
        one of :data:`DOORS`.
    """
    if plan != "auto" or prescore or order not in kinds.ORDERS:
        return "layout"
    if kinds.applies(*(t for t in tensors if t is None or isinstance(t, Tensor))):
        return "rows"
    if form is not None and traced.applies(form, tensors, precision, order):
        return "compiled"
    return "layout"
