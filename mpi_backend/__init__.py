"""MPI communicator for fmoe over mpi4py (optional extra: ``pip install fmoe[mpi]``).

    from mpi_backend import MPIComm
    comm = MPIComm()                      # MPI.COMM_WORLD
    y, aux = fmoe.moe(params, x, spec, comm=comm)
"""
from .comm import MPIComm, mpi_launched

__all__ = ["MPIComm", "mpi_launched"]
