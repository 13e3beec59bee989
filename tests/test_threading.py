"""Threading guarantees of the numba CPU backend.

TBB layer active (the tbb wheel's library is loaded by fmoe._numba), numba's
thread count follows torch's on the calling thread, forked children (DataLoader
workers) and concurrent Python threads run the kernels without crashing and
with the right values. Crash-prone checks run in a subprocess so a failure
is an assertion, not a dead test session.
"""
import os
import subprocess
import sys
import textwrap
import threading

import numba
import torch

import fmoe
from fmoe import _numba
from fmoe.ops import numba_cpu, reference

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _run(code: str, timeout: float = 120) -> str:
    env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    p = subprocess.run([sys.executable, "-c", textwrap.dedent(code)], capture_output=True, text=True,
                       timeout=timeout, cwd=ROOT, env=env)
    assert p.returncode == 0, f"rc={p.returncode}\nstdout:\n{p.stdout}\nstderr:\n{p.stderr}"
    return p.stdout


def _case(T=64, M=32, E=8, k=2, seed=0):
    g = torch.Generator().manual_seed(seed)
    r = fmoe.top_k_routing(torch.rand(T, E, generator=g).softmax(1), k, 1.0)
    return torch.randn(T, M, generator=g), r


def test_tbb_layer_is_active():
    x, r = _case()
    fmoe.dispatch(x, r)  # the layer is chosen at the first parallel launch
    assert _numba.TBB_ERROR is None, _numba.TBB_ERROR
    assert _numba.threading_layer() == "tbb"
    assert numba_cpu.threading_layer() == "tbb"


def test_thread_count_follows_torch_on_calling_thread():
    x, r = _case()
    before = torch.get_num_threads()
    try:
        for n in (1, 2):
            torch.set_num_threads(n)
            fmoe.combine(fmoe.dispatch(x, r), r)
            assert numba.get_num_threads() == min(n, numba.config.NUMBA_NUM_THREADS)
    finally:
        torch.set_num_threads(before)

    seen = []

    def worker():  # numba's count is per thread: a new thread must be synced too
        numba.set_num_threads(1)
        fmoe.dispatch(x, r)
        seen.append(numba.get_num_threads())

    t = threading.Thread(target=worker)
    t.start()
    t.join()
    assert seen == [min(torch.get_num_threads(), numba.config.NUMBA_NUM_THREADS)]


def test_two_python_threads_call_the_same_op():
    x, r = _case(T=512, M=64)
    want_d = reference.dispatch(x, r.positions(), None, r.num_experts * r.capacity)
    errors, results = [], []

    def worker():
        try:
            for _ in range(50):
                d = fmoe.dispatch(x, r).reshape(want_d.shape)
                results.append(torch.equal(d, want_d))
                fmoe.combine(d.reshape(r.num_experts, r.capacity, -1), r)
        except Exception as exc:  # surfaced below
            errors.append(exc)

    threads = [threading.Thread(target=worker) for _ in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors and len(results) == 100 and all(results)


def test_fork_after_use_dataloader_workers():
    out = _run("""
        import torch, fmoe
        from fmoe.ops import reference
        g = torch.Generator().manual_seed(0)
        r = fmoe.top_k_routing(torch.rand(256, 8, generator=g).softmax(1), 2, 1.0)
        x = torch.randn(256, 32, generator=g)
        pos, R = r.positions(), r.num_experts * r.capacity
        want = reference.combine(reference.dispatch(x, pos, None, R), pos, r.weights)
        fmoe.combine(fmoe.dispatch(x, r), r)  # parent starts the TBB pool before forking

        class DS(torch.utils.data.Dataset):
            def __len__(self): return 4
            def __getitem__(self, i):
                return fmoe.combine(fmoe.dispatch(x, r), r)

        dl = torch.utils.data.DataLoader(DS(), batch_size=None, num_workers=2,
                                         multiprocessing_context="fork")
        got = list(dl)
        assert len(got) == 4 and all(torch.equal(y, want) for y in got)
        assert torch.equal(fmoe.combine(fmoe.dispatch(x, r), r), want)  # parent still fine
        print("ok", fmoe._numba.threading_layer())
    """)
    assert out.split() == ["ok", "tbb"]
