"""Suite-wide: the tests never read or write this machine's wisdom file (measured kernel choices
and regime thresholds, fmoe.engine.wisdom), so every host runs them on the defaults. Each test
gets a path of its own that does not exist until something records there."""
import itertools
import os
import tempfile

import pytest

from fmoe.engine import wisdom

_N = itertools.count()


@pytest.fixture(autouse=True)
def _own_wisdom_file(monkeypatch):
    p = os.path.join(tempfile.gettempdir(), f"fmoe-test-wisdom-{os.getpid()}", str(next(_N)), "wisdom.json")
    monkeypatch.setattr(wisdom, "path", lambda: p)
    yield p
