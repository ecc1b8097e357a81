"""File helpers shared by the package's on-disk caches (the tuning cache, the CuTe kernel cache)."""

from __future__ import annotations

import contextlib


@contextlib.contextmanager
def locked(path: str):
    """Hold an exclusive advisory lock on ``path`` (created if missing) across processes: writers of one cache
    entry, e.g. the ranks of a tensor-parallel engine, take turns. Without POSIX locks it does nothing (the
    caches' renames stay atomic; concurrent writers may then repeat each other's work)."""
    try:
        import fcntl
    except ImportError:
        yield
        return
    with open(path, "a") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)
