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


def test_checks_setting_names_the_choices():
    assert [matching.check_mode(c) for c in matching.CHECKS] == ["full", "step", "off"]
    with pytest.raises(ValueError, match=r"checks must be one of \('full', 'step', 'off'\)"):
        matching.check_mode("auto")
    with pytest.raises(ValueError, match="checks must be one of"):
        from fmoe.comm import from_env
        from_env("local", checks=True)


def test_control_record_carries_header_record_and_inline_data():
    x = torch.arange(6, dtype=torch.float32).reshape(2, 3)
    rec = _record(1, 4, False, {"k": 2}).numpy()
    w = matching.control("all_reduce", 7, x, op="sum", record=rec, payload=x)
    assert w.shape == (matching.CTRL,) and w.dtype == np.int64 and matching.CTRL * 8 == 512
    assert np.array_equal(w[:matching.HEADER], matching.header("all_reduce", 7, x, op="sum"))
    table = np.stack([w, w])
    matching.check_control(table, 0, "all_reduce", None, lambda t: [t, t], None)  # all agree: no error
    assert torch.equal(matching.payload_of(table, x), torch.stack([x, x]))
    assert torch.equal(matching.reduce_rows(table, x, "sum"), 2 * x)
    for dtype in (torch.bfloat16, torch.bool, torch.int32):  # tensor path and numpy path
        y = torch.ones(5, dtype=dtype)
        t = np.stack([matching.control("all_reduce", 1, y, op="max", payload=y)] * 3)
        assert torch.equal(matching.reduce_rows(t, y, "max"), y) and matching.reduce_rows(t, y, "sum").dtype == dtype
    assert matching.fits(torch.ones(matching.PAYLOAD_BYTES // 4)) and not matching.fits(torch.ones(37))


def test_control_table_decisions():
    from fmoe.comm.agreement import Pending, StepMismatchError, _kind
    x = torch.ones(3)
    rec = _record(_kind("call"), 2, False, {"k": 2}).numpy()
    pend = Pending(rec, 2, None, {"k": 2})
    inside = matching.control("all_reduce", 5, x, op="sum", record=rec)
    outside = matching.control("all_reduce", 5, x, op="sum")
    with pytest.raises(StepMismatchError, match=r"rank 0 is in fmoe call #2; rank 1 is in all_reduce\(sum\) #5 "
                                                r"float32 \[3\], outside any fmoe call"):
        matching.check_control(np.stack([inside, outside]), 0, "all_reduce", None, lambda t: [t, t], pend)
    ahead = matching.control("all_reduce", 5, x, op="sum", record=_record(_kind("call"), 3, False, {"k": 2}).numpy())
    with pytest.raises(StepMismatchError, match=r"rank 0 is in fmoe call #2; rank 1 is in fmoe call #3"):
        matching.check_control(np.stack([inside, ahead]), 0, "all_reduce", None, lambda t: [t, t], pend)
    other = matching.control("all_gather", 5, x)
    with pytest.raises(matching.CollectiveMismatchError, match="ranks entered different collectives"):
        matching.check_control(np.stack([outside, other]), 0, "all_reduce", None, lambda t: [t, t], None)


def test_covered_scope_is_per_communicator_and_leaves_no_trace():
    a, b = Plain(), Plain()
    before = dict(vars(a))
    with matching.covered(a):
        assert matching.is_covered(a) and not matching.is_covered(b)
        with matching.covered(b):
            assert matching.is_covered(a) and matching.is_covered(b)
        assert not matching.is_covered(b)
    assert not matching.is_covered(a) and vars(a) == before
