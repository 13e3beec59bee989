"""Launch helpers: pick a communicator for the launcher that started us,
abort the job when one rank fails, and log from rank 0 only.

All of it is explicit: nothing here runs unless called, and the environment is
read only by :func:`from_env` (the launchers' standard variables).
"""
from __future__ import annotations

import contextlib
import logging
import os
import sys
import traceback
from typing import Optional

from .base import LocalComm


KINDS = ("auto", "mpi", "torch", "local")


def _torchrun_launched() -> bool:
    return "TORCHELASTIC_RUN_ID" in os.environ or ("MASTER_ADDR" in os.environ and "RANK" in os.environ
                                                   and "WORLD_SIZE" in os.environ)


# the rank counts MPI launchers set: MPICH/Hydra and Intel MPI, Open MPI, PMIx, MVAPICH2; then srun's
# (per job step: a plain `python` inside an sbatch/salloc allocation is one process and has none)
_MPI_SIZES = (("mpiexec", "PMI_SIZE"), ("mpiexec", "OMPI_COMM_WORLD_SIZE"), ("mpiexec", "PMIX_SIZE"),
              ("mpiexec", "MV2_COMM_WORLD_SIZE"), ("srun", "SLURM_STEP_NUM_TASKS"))


def launched_world() -> tuple[str, int]:
    """(launcher, ranks) this process was started with by torchrun, an MPI launcher or srun, or ("", 1).

    Reads only the launchers' own variables and initialises nothing, so it is cheap enough to
    run on every layer call. It decides no behaviour: :mod:`fmoe.nn` and the Tutel compat layer
    use it to raise, instead of silently running each rank as its own model, when a
    multi-rank job never set up its communicator."""
    def size(var):
        try:
            return int(os.environ.get(var, "1"))
        except ValueError:
            return 1
    if _torchrun_launched() and size("WORLD_SIZE") > 1:
        return "torchrun", size("WORLD_SIZE")
    for launcher, var in _MPI_SIZES:
        if size(var) > 1:
            return launcher, size(var)
    return "", 1


def from_env(kind: str = "auto", *, timeout: Optional[float] = None, backend: str = "gloo",
             checks: str = "full"):
    """The communicator for how this process was launched.

    Args:
        kind: 'mpi' (``mpi_backend.MPIComm`` over COMM_WORLD), 'torch'
            (``TorchDistComm`` via env://, as torchrun sets it up), 'local'
            (:class:`LocalComm`), or 'auto': torch under torchrun, MPI under
            mpiexec/srun, local otherwise.
        timeout: seconds a collective may wait before the job is aborted
            (MPI: per collective; torch: the process group timeout).
        backend: torch.distributed backend for kind 'torch'.
        checks: the communicator's cross-rank checks, 'full' (default), 'step' or 'off'
            (:mod:`fmoe.comm.matching`; ignored by LocalComm, which has no peers).
    """
    if kind not in KINDS:
        raise ValueError(f"from_env: kind must be one of {KINDS}, got {kind!r}")
    if kind == "auto":
        from mpi_backend.comm import mpi_launched
        kind = "torch" if _torchrun_launched() else "mpi" if mpi_launched() else "local"
    from .matching import check_mode
    check_mode(checks)
    if kind == "local":
        return LocalComm()
    if kind == "torch":
        from .torch_dist import TorchDistComm
        return TorchDistComm.from_env(backend=backend, timeout=timeout, checks=checks)
    from mpi_backend import MPIComm
    return MPIComm(timeout=timeout, checks=checks)


def abort(comm, message: str = "", code: int = 1) -> None:
    """Print ``message`` and stop every rank of ``comm``'s job (MPI_Abort, or exit under torchrun)."""
    if hasattr(comm, "abort"):
        comm.abort(message, code)
    if message:
        sys.stderr.write(f"[fmoe rank {getattr(comm, 'rank', 0)}] aborting: {message}\n")
    sys.stderr.flush()
    os._exit(code)


@contextlib.contextmanager
def abort_on_error(comm, code: int = 1):
    """Turn an exception on one rank into a job-wide abort instead of a hang.

    Peers blocked in a collective this rank will never join cannot be woken up
    any other way. With one process the exception propagates normally.

    When the block ends normally (or by ``sys.exit(0)``) every rank runs the
    collective end-of-job check (:func:`fmoe.comm.agreement.end_of_job_check`):
    a rank that skipped or repeated a step meets a peer still inside an fmoe
    call, both raise :class:`~fmoe.comm.agreement.StepMismatchError`, and the
    job aborts with that message instead of hanging.
    """
    size = getattr(comm, "size", 1)
    try:
        yield
    except BaseException as e:  # noqa: BLE001 - includes KeyboardInterrupt on purpose
        if size == 1:
            raise
        if isinstance(e, SystemExit) and not e.code:
            _end_check(comm, code)
            raise
        tb = "".join(traceback.format_exception(e))
        abort(comm, f"uncaught {type(e).__name__} on rank {comm.rank}:\n{tb}", code)
    else:
        if size > 1:
            _end_check(comm, code)


def _end_check(comm, code: int) -> None:
    from .agreement import end_of_job_check
    try:
        end_of_job_check(comm)
    except Exception as e:  # noqa: BLE001 - any failure here means the ranks are out of step
        abort(comm, f"end-of-job check failed on rank {comm.rank}: {type(e).__name__}: {e}", code)


def install_excepthook(comm, code: int = 1) -> None:
    """Make any uncaught exception in this process abort the whole job (see :func:`abort_on_error`)."""
    previous = sys.excepthook

    def hook(etype, value, tb):
        if getattr(comm, "size", 1) == 1:
            return previous(etype, value, tb)
        text = "".join(traceback.format_exception(etype, value, tb))
        abort(comm, f"uncaught {etype.__name__} on rank {comm.rank}:\n{text}", code)

    sys.excepthook = hook


class _RankFilter(logging.Filter):
    def __init__(self, rank: int, all_ranks: bool):
        super().__init__()
        self.rank, self.all_ranks = rank, all_ranks

    def filter(self, record):
        record.rank = self.rank
        return self.all_ranks or self.rank == 0


def get_logger(comm, name: str = "fmoe", *, all_ranks: bool = False, level=logging.INFO) -> logging.Logger:
    """A logger that prints ``[rank r] message`` on rank 0 only, or on every rank if ``all_ranks``."""
    rank = getattr(comm, "rank", 0)
    logger = logging.getLogger(f"{name}.rank{rank}")
    logger.setLevel(level)
    logger.propagate = False
    for h in list(logger.handlers):
        logger.removeHandler(h)
    h = logging.StreamHandler(sys.stdout)
    h.setFormatter(logging.Formatter("[rank %(rank)s] %(message)s"))
    h.addFilter(_RankFilter(rank, all_ranks))
    logger.addHandler(h)
    return logger
