"""Injected faults under real launchers end in an error naming the problem and a non-zero exit, never a hang.

Each run is a subprocess in its own session, bounded by a timeout; on timeout the whole process group is
killed (no rank is left behind) and the test fails. The program is tests/_fault_prog.py.
"""
from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys

import pytest

HERE = os.path.dirname(os.path.abspath(__file__))
PROG = os.path.join(HERE, "_fault_prog.py")
BIN = os.path.dirname(sys.executable)
LIMIT_S = 120


def _tool(name):
    path = os.path.join(BIN, name)
    return path if os.path.exists(path) else shutil.which(name)


def _run(cmd) -> tuple[int, str]:
    env = dict(os.environ, PATH=BIN + os.pathsep + os.environ.get("PATH", ""), OMP_NUM_THREADS="1")
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            start_new_session=True, env=env)
    try:
        out, _ = proc.communicate(timeout=LIMIT_S)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, _ = proc.communicate()
        pytest.fail(f"{' '.join(cmd)} hung for {LIMIT_S} s (process group killed); output:\n{out[-3000:]}")
    finally:
        try:  # a launcher that exited may have left a rank: end the whole group
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    return proc.returncode, out


def _mpi(n, *args):
    return _run([_tool("mpiexec"), "-n", str(n), sys.executable, PROG, "--steps", "2", *args])


def _torchrun(*args):
    return _run([_tool("torchrun"), "--standalone", "--nproc_per_node=2", "--max-restarts=0", PROG,
                 "--steps", "2", *args])


SKEW = "ranks are at different steps"
MISMATCH = "ranks entered different collectives: rank 0: all_reduce(sum)"

needs_mpi = pytest.mark.skipif(_tool("mpiexec") is None, reason="mpiexec not found")
needs_torchrun = pytest.mark.skipif(_tool("torchrun") is None, reason="torchrun not found")


@needs_mpi
@pytest.mark.parametrize("n,fault,args,want", [
    (2, "repeat", [], [SKEW, "rank 0 is in end-of-job check #3; rank 1 is in fmoe call #3"]),
    (2, "skip", [], [SKEW, "end-of-job check #2", "rank 0 is in fmoe call #2"]),
    (2, "skip", ["--timeout", "20", "--no-abort-on-error"], [SKEW, "StepMismatchError"]),
    (2, "collective", ["--timeout", "20"], [MISMATCH, "all_gather #"]),
    (2, "raise", [], ["uncaught RuntimeError on rank 1", "injected failure on the last rank"]),
    (2, "kill", [], ["BAD TERMINATION", "signal 9"]),
    (2, "hang", ["--timeout", "3"], ["did not complete within 3.0 s"]),
    (4, "skip", [], [SKEW, "rank 3 is in end-of-job check"]),
])
def test_mpiexec_fault_ends_in_a_clear_error(n, fault, args, want):
    code, out = _mpi(n, "--fault", fault, *args)
    assert code != 0, out[-3000:]
    for text in want:
        assert text in out, f"{text!r} not in output:\n{out[-3000:]}"
    assert "finished" not in out, out[-3000:]  # no rank reports success


@needs_torchrun
@pytest.mark.parametrize("fault,args,want", [
    ("skip", [], [SKEW, "rank 1 is in end-of-job check #2"]),
    ("hang", ["--timeout", "5"], ["(header) failed"]),
])
def test_torchrun_fault_ends_in_a_clear_error(fault, args, want):
    code, out = _torchrun("--fault", fault, *args)
    assert code != 0, out[-3000:]
    for text in want:
        assert text in out, f"{text!r} not in output:\n{out[-3000:]}"
    assert "finished" not in out, out[-3000:]
