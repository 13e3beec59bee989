"""The expert engine: one plan per routing, one kernel table, one autograd Function per expert kind.

    plan = make_plan(routing, needs_grad=True, dtype=x.dtype)   # rows sorted by expert, phase, dtype
    kernel = select(plan)                                       # the one table entry for this call
    y = run(form, x, plan.row_weights(routing.weights), plan, w_in, w_out, kernel=kernel)
                                                                # gather -> GEMM -> act -> GEMM -> scatter

:mod:`.plan` builds the plan, :mod:`.table` holds the kernels keyed by (device, phase, dtype,
precision), :mod:`.kinds` the expert kinds (ffn with any activation, gated/SwiGLU, GPT-OSS) as
one autograd Function each over the plan, with a pure-torch reference as their oracle, and
:mod:`fmoe.ops.native` the C++ grouped GEMM the CPU entries call. Custom experts take the plan and
multiply through :func:`grouped_mm` (the table's kernels, differentiable). :mod:`.traced`
runs the same plan and kernels inside one torch.library custom op under torch.compile, and its
``door()`` decides, once per call, which door a call takes. A :class:`LayoutPlan`
(``make_plan(..., layout=)``: forward-mode AD, ``MoESpec(plan='layout')``) runs the same
kinds over the layout's buffers: dispatch, the table's layout kernel (its ``mm`` one op per
projection over every buffer row), combine. :class:`GroupedGemm` binds a kernel to a plan: the
seam the built-in expert functions of :mod:`fmoe.experts` multiply through.
"""
from .plan import ExpertPlan, LayoutPlan, make_plan
from .table import Kernel, explain, select
from .kinds import ExpertForm, combine_rows, reference, run, run_custom
from .grouped import GroupedGemm, grouped_mm

__all__ = ["ExpertPlan", "LayoutPlan", "make_plan", "Kernel", "select", "explain", "ExpertForm", "run", "run_custom", "reference", "GroupedGemm", "grouped_mm",
           "combine_rows"]
