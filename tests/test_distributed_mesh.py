"""Mesh helpers without a launcher: size checks, --mesh parsing, mesh_from_comm's splits."""
import itertools

import pytest

from fmoe.comm.mesh import check_mesh_sizes, mesh_from_comm, parse_mesh


@pytest.mark.parametrize("kw, needle", [
    (dict(ep=3), "pp=1 x dp=1 x ep=3 = 3 ranks, but the job has 4"),
    (dict(ep=2, dp=3), "= 6 ranks, but the job has 4"),
    (dict(ep=0, dp=4), "ep=0 must be a positive int"),
    (dict(ep=4, pp=-1), "pp=-1 must be a positive int"),
    (dict(ep=2.0, dp=2), "ep=2.0 must be a positive int"),
    (dict(ep=4, num_experts=6), "6 experts cannot be spread over ep=4 ranks"),
])
def test_bad_sizes_name_the_counts(kw, needle):
    with pytest.raises(ValueError, match=needle.replace("(", r"\(").replace(")", r"\)")):
        check_mesh_sizes(4, **kw)


def test_parse_mesh():
    assert parse_mesh("ep=2,dp=2") == {"ep": 2, "dp": 2, "pp": 1}
    assert parse_mesh(" pp=2 , ep=2 ") == {"ep": 2, "dp": 1, "pp": 2}
    for bad in ("ep2", "tp=2", "ep=two"):
        with pytest.raises(ValueError, match="--mesh"):
            parse_mesh(bad)


class Recorder:
    """A communicator stand-in: split() returns the (color, key) it was given."""

    def __init__(self, rank, size):
        self.rank, self.size = rank, size

    def split(self, color, key=None):
        return (color, key)


def test_mesh_from_comm_groups_match_the_device_mesh_layout():
    pp, dp, ep = 2, 2, 2
    world = pp * dp * ep
    views = [mesh_from_comm(Recorder(r, world), ep=ep, dp=dp, pp=pp) for r in range(world)]

    def groups(field):
        out = {}
        for r, v in enumerate(views):
            out.setdefault(getattr(v, field)[0], []).append(r)
        return sorted(out.values())
    # init_device_mesh((pp, dp, ep)) layout: rank = (pp_rank * dp + dp_rank) * ep + ep_rank
    assert groups("ep_comm") == [[0, 1], [2, 3], [4, 5], [6, 7]]
    assert groups("dp_comm") == [[0, 2], [1, 3], [4, 6], [5, 7]]
    assert groups("dense_comm") == [[0, 1, 2, 3], [4, 5, 6, 7]]
    assert groups("pp_comm") == [[0, 4], [1, 5], [2, 6], [3, 7]]
    for r, v in enumerate(views):
        assert ((v.pp_rank * dp + v.dp_rank) * ep + v.ep_rank) == r
        assert v.data_rank == r % (dp * ep) and v.data_size == dp * ep and v.world_size == world
        assert v.device_mesh is None and v.dp_group is None  # no torch groups in an MPI mesh
    assert sorted(itertools.chain.from_iterable(groups("ep_comm"))) == list(range(world))


def _mpiexec():
    import os
    import shutil
    import sys
    path = os.path.join(os.path.dirname(sys.executable), "mpiexec")
    return path if os.path.exists(path) else shutil.which("mpiexec")


@pytest.mark.skipif(_mpiexec() is None, reason="mpiexec not found")
def test_mesh_from_comm_under_mpiexec():
    import os
    import subprocess
    import sys
    here = os.path.dirname(os.path.abspath(__file__))
    script = os.path.join(here, "distributed", "check_mpi_mesh.py")
    proc = subprocess.run([_mpiexec(), "-n", "4", sys.executable, script], capture_output=True, text=True,
                          timeout=180, cwd=os.path.dirname(here))
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    assert "MPIMESH ranks ok=[1, 1, 1, 1]" in proc.stdout, proc.stdout
