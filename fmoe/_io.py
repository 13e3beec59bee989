"""Atomic file writes: every file fmoe writes appears whole or not at all.

The data goes to a temporary file in the destination's folder (same file
system, so the final rename is atomic), is flushed and fsynced, then renamed
over the destination; the folder is fsynced so the rename itself survives a
crash. A failure at any point (disk full, an exception while serialising)
removes the temporary file and leaves an existing destination untouched.
"""
from __future__ import annotations

import contextlib
import os
import tempfile
from typing import Callable, Iterator


def _fsync_dir(folder: str) -> None:
    try:
        fd = os.open(folder, os.O_RDONLY)
    except OSError:  # e.g. a platform without directory fds: the rename is still atomic
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def _mode_for(path: str) -> int:
    """The permissions a plain open() would give (mkstemp makes files 0600): keep an existing
    file's mode, else 0666 minus the umask."""
    try:
        return os.stat(path).st_mode & 0o7777
    except FileNotFoundError:
        mask = os.umask(0)
        os.umask(mask)
        return 0o666 & ~mask


@contextlib.contextmanager
def _temp_beside(path: str) -> Iterator[tuple]:
    folder = os.path.dirname(os.path.abspath(path))
    fd, tmp = tempfile.mkstemp(prefix="." + os.path.basename(path) + ".", suffix=".tmp", dir=folder)
    try:
        os.chmod(tmp, _mode_for(path))
        with os.fdopen(fd, "wb") as f:
            yield f, tmp, folder
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)
        raise


def atomic_write(path, write: Callable) -> None:
    """Call ``write(f)`` on a binary file object, then move the result to ``path`` atomically."""
    path = os.fspath(path)
    with _temp_beside(path) as (f, tmp, folder):
        write(f)
        f.flush()
        os.fsync(f.fileno())
    try:
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)
        raise
    _fsync_dir(folder)


def atomic_save(obj, path) -> None:
    """``torch.save(obj, path)``, atomically."""
    import torch
    atomic_write(path, lambda f: torch.save(obj, f))


def atomic_write_text(path, text: str) -> None:
    """Write ``text`` (UTF-8) to ``path`` atomically."""
    atomic_write(path, lambda f: f.write(text.encode()))


def replace_all(items) -> None:
    """Write several files all or none: ``items`` is an iterable of ``(path, write)`` pairs.

    Every file is first written to a temporary file beside its destination; only
    when all are complete are they renamed into place. If writing any of them
    fails, the temporaries are removed and no destination changes. (The renames
    themselves are individually atomic; a crash between two renames can leave a
    mix, which the readers' metadata check detects.)
    """
    staged = []
    try:
        for path, write in items:
            path = os.fspath(path)
            with _temp_beside(path) as (f, tmp, folder):
                write(f)
                f.flush()
                os.fsync(f.fileno())
            staged.append((tmp, path, folder))
    except BaseException:
        for tmp, _, _ in staged:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(tmp)
        raise
    for tmp, path, _ in staged:
        os.replace(tmp, path)
    for folder in {f for _, _, f in staged}:
        _fsync_dir(folder)
