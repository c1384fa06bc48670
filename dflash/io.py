"""Writing files and directories so that a crash, even kill -9, never leaves a partial one under its final name.

Everything the stages keep outside Snakemake's bookkeeping (checkpoints, the
hidden-state cache, converted targets, verdicts, drafters) is written through
``atomic_path``: into a temporary sibling, synced, then renamed into place.
Leftovers of a crash carry the ``.tmp-`` or ``.trash-`` prefix and are never read.
"""

from __future__ import annotations

import os
import shutil
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

STAGING_PREFIX = ".tmp-"
TRASH_PREFIX = ".trash-"


def fsync(path: Path) -> None:
    """Flush a file's (or a directory's entries') data to disk."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _remove(path: Path) -> None:
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path)
    elif path.exists() or path.is_symlink():
        path.unlink()


def discard(path: Path) -> None:
    """Delete a file or directory so that no crash leaves a part of it under its name: rename, then delete."""
    path = Path(path)
    if not (path.exists() or path.is_symlink()):
        return
    trash = path.with_name(f"{TRASH_PREFIX}{path.name}")
    _remove(trash)
    path.rename(trash)
    _remove(trash)


@contextmanager
def atomic_path(final: str | Path) -> Iterator[Path]:
    """A staging path beside ``final`` to write a file or a directory at; on success it replaces ``final``.

    The staged data is fsynced before the rename, and the parent directory after
    it, so the new ``final`` is on disk should the machine go down. On an
    exception the staging path is removed and ``final`` is left as it was.
    """
    final = Path(final)
    final.parent.mkdir(parents=True, exist_ok=True)
    staging = final.with_name(f"{STAGING_PREFIX}{final.name}")
    _remove(staging)
    try:
        yield staging
        if staging.is_dir():
            for path in staging.rglob("*"):
                fsync(path)
        fsync(staging)
        if final.is_dir():
            discard(final)  # a directory cannot be renamed over a non-empty one
        os.replace(staging, final)
        fsync(final.parent)
    except BaseException:
        _remove(staging)
        raise


def atomic_write_text(path: str | Path, text: str) -> Path:
    with atomic_path(path) as staging:
        staging.write_text(text)
    return Path(path)


def remove_leftovers(directory: Path) -> None:
    """Delete what crashes mid-write or mid-delete left in ``directory`` (staging and trash entries)."""
    if Path(directory).is_dir():
        for path in Path(directory).iterdir():
            if path.name.startswith((STAGING_PREFIX, TRASH_PREFIX)):
                _remove(path)
