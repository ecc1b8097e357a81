"""File helpers shared by the package's on-disk caches (the tuning cache, the CuTe-DSL kernel cache, the XQA
cubin cache): the lock their writers take, and the one fingerprint of the sources an entry was made from."""

from __future__ import annotations

import contextlib
import hashlib
from collections.abc import Iterable
from pathlib import Path


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


def fingerprint(sources: Iterable, suffixes: tuple[str, ...] = (".py",), extra: bytes = b"") -> str:
    """sha256 (hex) of source files: every file with one of ``suffixes`` under each folder of ``sources``
    (recursively, ``__pycache__`` left out, in sorted order) and each single file named there, as its path
    relative to the folder's parent (a single file: its name), a NUL, its bytes and a NUL; then ``extra`` (what
    else an entry depends on, e.g. a compiler version and flags). Where the files live does not matter, only
    their names from the named folder down and their bytes."""
    h = hashlib.sha256()
    for root in sources:
        root = Path(root)
        files = [root] if root.is_file() else sorted(
            p for p in root.rglob("*") if p.suffix in suffixes and p.is_file() and "__pycache__" not in p.parts)
        for path in files:
            rel = root.name if path == root else f"{root.name}/{path.relative_to(root).as_posix()}"
            h.update(rel.encode() + b"\0" + path.read_bytes() + b"\0")
    h.update(extra)
    return h.hexdigest()
