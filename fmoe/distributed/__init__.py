"""Expert + data + pipeline parallelism on torch's own engines, over an fmoe mesh.

One recipe per module, all over a :class:`fmoe.comm.MoEMesh` (:func:`fmoe.comm.mesh`):

* :mod:`.fsdp`: FSDP2 ``fully_shard``: dense parameters sharded over the stage's dp x ep ranks,
  experts over the dp replicas of their expert group.
* :mod:`.ddp`: ``DistributedDataParallel`` for the dense parameters, an explicit dp all-reduce
  for the experts.
* :mod:`.pipeline`: ``torch.distributed.pipelining`` stages of the char-LM, each expert-parallel.
* :mod:`.dcp`: ``torch.distributed.checkpoint`` save / load that reshards between meshes,
  atomic and verified.

Submodules import torch.distributed lazily; this package imports only the parameter helpers.
"""
from ._params import expert_parameter_names, load_logical, logical_tensors, named_parameters_by_kind, unwrap

__all__ = ["expert_parameter_names", "load_logical", "logical_tensors", "named_parameters_by_kind", "unwrap",
           "fsdp", "ddp", "pipeline", "dcp"]


def __getattr__(name):
    # fmoe.distributed.fsdp etc. without importing every engine up front
    if name in ("fsdp", "ddp", "pipeline", "dcp"):
        import importlib
        return importlib.import_module(f"{__name__}.{name}")
    raise AttributeError(name)
