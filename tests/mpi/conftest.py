"""Run these tests under an MPI launcher; a plain ``pytest tests`` skips them.

    mpiexec -n 2 python -m pytest tests/mpi -q
    mpiexec -n 4 python -m pytest tests/mpi -q

Only rank 0 prints its pytest report (stderr stays for abort messages). After every test all ranks exchange pass/fail, so a failure on
any rank fails the test on rank 0 with that rank's message. Every collective
in a test runs with a timeout: a rank that never joins aborts the job with a
message instead of hanging it.
"""
from __future__ import annotations

import os

import pytest

from mpi_backend import mpi_launched

COLLECTIVE_TIMEOUT_S = 60.0
_HERE = os.path.dirname(os.path.abspath(__file__))

_WORLD = None
if mpi_launched():
    from mpi4py import MPI
    if MPI.COMM_WORLD.Get_size() > 1:
        _WORLD = MPI.COMM_WORLD


@pytest.hookimpl(trylast=True)  # after the terminal plugin has made its reporter
def pytest_configure(config):
    if _WORLD is not None and _WORLD.Get_rank() != 0:
        # pytest writes its report to a copy of the original stdout, so swap its writer.
        from _pytest.config import create_terminal_writer
        reporter = config.pluginmanager.get_plugin("terminalreporter")
        if reporter is not None:
            reporter._tw = create_terminal_writer(config, open(os.devnull, "w"))


def pytest_collection_modifyitems(config, items):
    if _WORLD is not None:
        return
    skip = pytest.mark.skip(reason="MPI test: run with `mpiexec -n 2|4 python -m pytest tests/mpi`")
    for item in items:
        if str(item.fspath).startswith(_HERE):
            item.add_marker(skip)


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    outcome = yield
    rep = outcome.get_result()
    setattr(item, f"_rep_{rep.when}", rep)


@pytest.fixture(scope="session")
def comm():
    """MPIComm over COMM_WORLD with a per-collective timeout."""
    from mpi_backend import MPIComm
    return MPIComm(_WORLD, timeout=COLLECTIVE_TIMEOUT_S)


@pytest.fixture(autouse=True)
def _ranks_agree(request):
    """Fail the test on every rank if it failed on any rank (and say where)."""
    yield
    if _WORLD is None or not str(request.node.fspath).startswith(_HERE):
        return
    from mpi_backend import MPIComm
    from fmoe.comm.agreement import _gather_text
    rep = getattr(request.node, "_rep_call", None)
    failed = bool(rep is not None and rep.failed)
    text = ""
    if failed:
        lines = rep.longreprtext.strip().splitlines() or ["failed"]
        text = " | ".join([ln[1:].strip() for ln in lines if ln.startswith("E ")][:3] or lines[-1:])
    sync = MPIComm(_WORLD, timeout=COLLECTIVE_TIMEOUT_S)
    msgs = _gather_text(sync, ("FAIL " + text) if failed else "")
    others = [(r, m) for r, m in enumerate(msgs) if m and r != _WORLD.Get_rank()]
    if others and not failed:
        pytest.fail("failed on other rank(s): " + "; ".join(f"rank {r}: {m[5:]}" for r, m in others),
                    pytrace=False)
