"""Pipeline stages (``torch.distributed.pipelining``) of a char-LM made of fmoe MoE blocks.

    m = fmoe.comm.mesh(pp=2, ep=2)                       # 4 ranks: 2 stages x 2 expert ranks
    model = CharLM(cfg, comm=m.ep_comm)                  # each stage's MoE layers use its ep group
    pipe = fmoe.distributed.pipeline.CharLMPipeline(model, m, batch_size=8, microbatches=2)
    loss = pipe.step(tokens, targets)                    # the loss on the last stage, None elsewhere
    fmoe.distributed.ddp.reduce_grads(pipe.stage, m)     # dense over dp x ep, experts over dp
    opt.step()                                           # opt over pipe.stage.parameters()

Stage ``pp_rank`` holds blocks ``[pp_rank * L/pp, (pp_rank + 1) * L/pp)`` of the model (the
first stage also the embeddings, the last the final norm and head) under the model's own
parameter names, so checkpoints are interchangeable between pipelined and flat runs. Inside a
stage the MoE layers are expert-parallel over ``mesh.ep_comm`` (every rank of a stage runs
the same schedule, so the all-to-alls of a microbatch pair up); stage boundaries go point to
point over ``mesh.pp_comm``.

The balance loss crosses the stages as an extra output: every stage returns ``(h, l_aux)``
with ``l_aux`` float32 ``[1]`` the running sum of its blocks' aux losses (a 1-element tensor,
not a scalar, so the schedule can send it and merge microbatches); the last stage returns
``(logits, l_aux)`` and the loss function adds ``aux_weight * l_aux``. Its gradient
(aux_weight) flows back through the stages with the activations'.

The objective per rank is the mean over microbatches of ``cross_entropy + aux_weight * l_aux``
(the schedule scales gradients by 1 / microbatches); each microbatch is one MoE call, so its
capacity is computed from the microbatch's tokens.
"""
from __future__ import annotations

import dataclasses
from typing import Optional

import torch
import torch.nn.functional as F
from torch import Tensor, nn

__all__ = ["CharLMStage", "CharLMPipeline", "SCHEDULES"]

SCHEDULES = ("1F1B", "GPipe")


class CharLMStage(nn.Module):
    """Blocks ``[lo, hi)`` of a :class:`fmoe.examples.charlm.CharLM` (same Parameter objects, same names).

    forward: first stage ``tokens int64 [b, L] -> (h float [b, L, M], l_aux float32 [1])``;
    other stages ``(h, l_aux) -> (h, l_aux)``; the last returns ``(logits [b, L, 256], l_aux)``.
    """

    def __init__(self, model: nn.Module, lo: int, hi: int, *, first: bool, last: bool):
        super().__init__()
        self.first, self.last = first, last
        if first:
            self.embed = model.embed
            self.pos = model.pos
        # ModuleDict keyed by the block's index: names stay "blocks.<i>...", as in the model.
        self.blocks = nn.ModuleDict({str(i): model.blocks[i] for i in range(lo, hi)})
        if last:
            self.norm = model.norm
            self.head = model.head

    def forward(self, x: Tensor, l_aux: Optional[Tensor] = None) -> tuple[Tensor, Tensor]:
        if self.first:
            x = self.embed(x) + self.pos[: x.shape[1]]
            l_aux = x.new_zeros(1)
        for block in self.blocks.values():
            x, la = block(x)
            l_aux = l_aux + la
        if self.last:
            return self.head(self.norm(x)), l_aux
        return x, l_aux


def _charlm_loss(aux_weight: float):
    def loss_fn(output, target: Tensor) -> Tensor:
        logits, l_aux = output
        return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), target.reshape(-1)) + aux_weight * l_aux.sum()
    return loss_fn


@dataclasses.dataclass
class CharLMPipeline:
    """This rank's stage of a CharLM and its schedule.

    Args:
        model: a CharLM built with ``comm=mesh.ep_comm`` (num_layers % pp == 0).
        mesh: a :class:`fmoe.comm.MoEMesh` from :func:`fmoe.comm.mesh`.
        batch_size: tokens rows per step on this rank (divisible by ``microbatches``).
        microbatches: microbatches per step (>= pp keeps every stage busy in 1F1B).
        schedule_name: "1F1B" or "GPipe".

        ddp: wrap the stage in :func:`fmoe.distributed.ddp.wrap` (dense gradients all-reduced by
            DDP on the last microbatch's backward; then call
            :func:`fmoe.distributed.ddp.reduce_expert_grads` on ``stage``).

    Without ``ddp``, gradients are reduced by the caller after :meth:`step`
    (:func:`fmoe.distributed.ddp.reduce_grads`: dense over the stage's dp x ep ranks, experts over
    dp). FSDP2 inside the stages is not offered yet: with the dropless router it hits the issue
    described in :mod:`fmoe.distributed.fsdp`.

    Attributes:
        stage: this rank's :class:`CharLMStage` (optimise ``stage.parameters()``).
        schedule: the torch.distributed.pipelining schedule.
    """

    model: nn.Module
    mesh: object
    batch_size: int
    microbatches: int = 2
    schedule_name: str = "1F1B"
    ddp: bool = False

    def __post_init__(self):
        from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleGPipe
        m, cfg = self.mesh, self.model.cfg
        if m.device_mesh is None:
            raise ValueError("CharLMPipeline needs a torch DeviceMesh: build the mesh with fmoe.comm.mesh(...)")
        L = cfg.num_layers
        if L % m.pp:
            raise ValueError(f"{L} blocks cannot be split into pp={m.pp} equal stages (num_layers % pp must be 0)")
        if self.microbatches < 1 or self.batch_size % self.microbatches:
            raise ValueError(f"batch_size {self.batch_size} must be a positive multiple of microbatches="
                             f"{self.microbatches}")
        if self.schedule_name not in SCHEDULES:
            raise ValueError(f"schedule must be one of {SCHEDULES}, got {self.schedule_name!r}")
        per = L // m.pp
        first, last = m.pp_rank == 0, m.pp_rank == m.pp - 1
        self.stage = CharLMStage(self.model, m.pp_rank * per, (m.pp_rank + 1) * per, first=first, last=last)
        b, ctx, M = self.batch_size // self.microbatches, cfg.context, cfg.model_dim
        # Static shapes (no metadata inference: that would run the MoE layers, collectives
        # included, on placeholder tensors).
        # requires_grad marks the received activations as needing gradients (sent back upstream).
        hidden = (torch.empty(b, ctx, M, requires_grad=True), torch.empty(1, requires_grad=True))
        inputs = (torch.empty(b, ctx, dtype=torch.int64),) if first else hidden
        outputs = (torch.empty(b, ctx, self.model.head.out_features), torch.empty(1)) if last else hidden
        module = self.stage
        if self.ddp:  # DDP inside the stage; the schedule syncs on the last microbatch only
            from .ddp import wrap
            module = wrap(self.stage, m)
        # Static mode also needs the gradients' shapes: those of the float tensors crossing the
        # boundaries (received from the next stage / sent to the previous one).
        pstage = PipelineStage(module, m.pp_rank, m.pp, torch.device("cpu"), input_args=inputs,
                               output_args=outputs, output_grads=None if last else hidden,
                               input_grads=None if first else hidden, group=m.pp_comm.group)
        cls = Schedule1F1B if self.schedule_name == "1F1B" else ScheduleGPipe
        self.schedule = cls(pstage, self.microbatches, loss_fn=_charlm_loss(cfg.aux_weight), scale_grads=True)

    def step(self, tokens: Tensor, targets: Tensor) -> Optional[Tensor]:
        """One forward + backward over ``microbatches`` microbatches of ``tokens`` / ``targets`` int64 [B, L].

        Every stage of a pipeline is given the same batch (only the first reads the tokens, only
        the last the targets). Returns the mean loss over microbatches (float32 []) on the last
        stage, None on the others. Gradients accumulate into ``stage`` parameters' ``.grad``.
        """
        m = self.mesh
        if m.pp == 1:
            losses = []
            self.schedule.step(tokens, target=targets, losses=losses)
        elif m.pp_rank == 0:
            self.schedule.step(tokens)
            return None
        elif m.pp_rank == m.pp - 1:
            losses = []
            self.schedule.step(target=targets, losses=losses)
        else:
            self.schedule.step()
            return None
        return torch.stack([l.detach() for l in losses]).mean()
