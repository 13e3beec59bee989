"""Single-process parts of the fault handling: the registry keeps nothing on the communicator,
the matching header describes collectives, agreement records are fixed-size, and the
end-of-job check is a no-op on one process."""
from __future__ import annotations

import gc

import numpy as np
import pytest
import torch

from fmoe.comm import LocalComm, abort_on_error, matching, registry
from fmoe.comm.agreement import FIELDS, _record, end_of_job_check


class Plain:
    rank, size = 0, 2


class Slotted:
    __slots__ = ("rank", "size")

    def __init__(self):
        self.rank, self.size = 0, 2


def test_registry_sets_no_attribute_on_the_communicator():
    c = Plain()
    before = dict(vars(c))
    h = registry.handle_of(c)
    assert registry.handle_of(c) == h and registry.lookup(h) is c
    assert registry.next_call(c) == 1 and registry.next_call(c) == 2 and registry.calls_of(c) == 2
    assert vars(c) == before  # nothing stored on the user's object (was: c._fmoe_handle)
    registry.forget(c)
    with pytest.raises(KeyError, match="no communicator registered"):
        registry.lookup(h)
    assert registry.calls_of(c) == 0


def test_registry_handles_slotted_communicators_and_frees_weakly_held_ones():
    s = Slotted()  # no __dict__, no __weakref__: held strongly until forget
    h = registry.handle_of(s)
    assert registry.handle_of(s) == h
    registry.forget(s)
    c = Plain()
    registry.next_call(c)  # only a counter: held weakly, gone with the object
    key = id(c)
    del c
    gc.collect()
    assert key not in registry._by_id
    assert Plain() is not None and registry.calls_of(Plain()) == 0


def test_headers_differ_by_kind_dtype_shape_and_op():
    x = torch.ones(2, 3)
    a = matching.header("all_reduce", 1, x, op="sum")
    assert a.shape == (matching.HEADER,) and a.dtype == np.int64
    for other in (matching.header("all_gather", 1, x), matching.header("all_reduce", 2, x, op="sum"),
                  matching.header("all_reduce", 1, x.double(), op="sum"),
                  matching.header("all_reduce", 1, torch.ones(3, 2), op="sum"),
                  matching.header("all_reduce", 1, x, op="max")):
        assert not np.array_equal(a, other)
    table = np.stack([a, matching.header("all_gather", 1, x)])
    with pytest.raises(matching.CollectiveMismatchError,
                       match=r"rank 0: all_reduce\(sum\) #1 float32 \[2, 3\]; rank 1: all_gather #1 float32 \[2, 3\]"):
        matching.check(table, 0, "all_reduce", None, lambda t: [t, t])
    v = np.stack([matching.header("all_to_all_v", 3, torch.ones(4, 2)),
                     matching.header("all_to_all_v", 3, torch.ones(7, 2))])
    matching.check(v, 0, "all_to_all_v", None, lambda t: [t, t])  # rows may differ
    counts = torch.tensor([[1, 2, 1, 3], [3, 4, 3, 4]])  # rank 0 sends 2 to rank 1, rank 1 expects 3
    with pytest.raises(matching.CollectiveMismatchError, match="rank 1 expects 3 rows from rank 0, which sends it 2"):
        matching.check_counts(counts, 3)


def test_agreement_record_has_a_fixed_size():
    small = _record(1, 1, False, {"k": 2})
    big = _record(1, 1, False, {f"f{i}": i for i in range(3 * FIELDS)})
    assert small.shape == big.shape == (6 + FIELDS,)
    assert not torch.equal(_record(1, 1, False, {f"f{i}": i for i in range(3 * FIELDS)} | {"f70": -1}), big)


def test_single_process_end_check_and_abort_on_error_are_transparent():
    c = LocalComm()
    end_of_job_check(c)  # no-op
    with pytest.raises(RuntimeError, match="boom"):
        with abort_on_error(c):
            raise RuntimeError("boom")
