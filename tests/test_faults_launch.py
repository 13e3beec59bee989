"""Injected faults under real launchers end in an error naming the problem and a non-zero exit, never a hang.

Each run is a subprocess bounded by a timeout; every process it starts carries a marker in its
environment and is killed afterwards (no rank is left behind), and a run that times out fails the test. The program is tests/_fault_prog.py.
"""
from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import uuid

import pytest

HERE = os.path.dirname(os.path.abspath(__file__))
PROG = os.path.join(HERE, "_fault_prog.py")
BIN = os.path.dirname(sys.executable)
LIMIT_S = 120


def _tool(name):
    path = os.path.join(BIN, name)
    return path if os.path.exists(path) else shutil.which(name)


def _marked(token: str) -> list[int]:
    """Pids whose environment carries ``token`` (every process a run started, wherever it re-parented)."""
    pids = []
    for d in os.listdir("/proc"):
        if d.isdigit() and int(d) != os.getpid():
            try:
                with open(f"/proc/{d}/environ", "rb") as f:
                    if token.encode() in f.read():
                        pids.append(int(d))
            except OSError:
                pass
    return pids


def _run(cmd) -> tuple[int, str]:
    # torchrun and hydra start ranks in sessions of their own, so a process-group kill could miss
    # them: every process of the run carries a marker in its environment and is killed by it.
    token = f"FMOE_FAULT_RUN={uuid.uuid4().hex}"
    name, value = token.split("=")
    env = dict(os.environ, PATH=BIN + os.pathsep + os.environ.get("PATH", ""), OMP_NUM_THREADS="1", **{name: value})
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            start_new_session=True, env=env)
    try:
        out, _ = proc.communicate(timeout=LIMIT_S)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, _ = proc.communicate()
        pytest.fail(f"{' '.join(cmd)} hung for {LIMIT_S} s (all its processes killed); output:\n{out[-3000:]}")
    finally:
        for pid in _marked(token):  # no rank is left behind, finished or not
            try:
                os.kill(pid, signal.SIGKILL)
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
        assert text in out, f"{text!r} not in output (exit {code}):\n{out[-3000:]}"
    assert "finished" not in out, out[-3000:]  # no rank reports success


@needs_torchrun
@pytest.mark.parametrize("fault,args,want", [
    ("skip", [], [SKEW, "rank 1 is in end-of-job check #2"]),
    ("hang", ["--timeout", "3"], ["(header) failed"]),
])
def test_torchrun_fault_ends_in_a_clear_error(fault, args, want):
    code, out = _torchrun("--fault", fault, *args)
    assert code != 0, out[-3000:]
    for text in want:
        assert text in out, f"{text!r} not in output (exit {code}):\n{out[-3000:]}"
    assert "finished" not in out, out[-3000:]
