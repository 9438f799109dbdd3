"""Files that survive a power loss: what "written" means for every file the cluster trusts later.

A ``write()`` or ``rename()`` that returned is in the kernel's page cache, not on the disk: a
process crash (SIGKILL, OOM) keeps it, a power loss or a kernel crash of the machine can lose it,
and a rename can reach the disk before the data of the file it names (an empty or torn file
under the new name). So a file that must survive is written the way databases write theirs:

1. to a temporary file in the same directory, which is ``fsync``'d (its data on the disk);
2. renamed over the old file (atomic: a reader sees the old file or the new one, never half);
3. then the *directory* is ``fsync``'d (the rename itself on the disk: POSIX keeps a name in the
   directory's data, so a new or renamed file is durable only once its directory is synced).

``write_durably`` does all three; ``replace_durably`` the last two for a temporary file someone
else wrote (pysyncobj's snapshot); ``make_directory_durably`` creates a directory and syncs its
parent. Each takes ``sync``: False skips every fsync and keeps the same order of writes and
renames (``--unsafe-no-fsync``: tests and benchmarks, never the default; what a power loss then
loses is exactly what these fsyncs would have kept).
"""

from __future__ import annotations

import os
from pathlib import Path

__all__ = ["EX_IOERR", "fsync_directory", "fsync_file", "halt_on_storage_failure", "make_directory_durably",
           "replace_durably", "write_durably"]

EX_IOERR = 74   # sysexits.h: an input/output error

TEMP_SUFFIX = ".tmp"


def fsync_directory(directory: str | os.PathLike[str]) -> None:
    """``fsync`` a directory, so that the names created, renamed or removed in it are durable."""
    fd = os.open(directory, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def fsync_file(path: str | os.PathLike[str]) -> None:
    """``fsync`` the file at ``path`` (an fsync syncs the file, whichever descriptor asks)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def replace_durably(tmp: str | os.PathLike[str], final: str | os.PathLike[str], *, sync: bool = True) -> None:
    """Rename the complete file ``tmp`` over ``final``: first ``tmp``'s data is synced, then the
    rename, then ``final``'s directory (with ``sync=False``: the rename alone)."""
    if sync:
        fsync_file(tmp)
    os.replace(tmp, final)
    if sync:
        fsync_directory(os.path.dirname(os.path.abspath(final)))


def write_durably(path: str | os.PathLike[str], data: bytes, *, mode: int = 0o644, sync: bool = True) -> None:
    """Replace the file ``path`` with ``data`` atomically and durably: a temporary file beside it
    (created with ``mode``: 0o600 for keys and tokens), written and synced, renamed over ``path``,
    the directory synced. After a crash ``path`` holds the old content or ``data``, never a mix;
    after this returns, ``data`` (with ``sync=False``: only after the kernel wrote it back)."""
    tmp = os.fspath(path) + TEMP_SUFFIX
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, mode)
    try:
        view = memoryview(data)
        while view:
            view = view[os.write(fd, view):]
        if sync:
            os.fsync(fd)
    finally:
        os.close(fd)
    os.chmod(tmp, mode)  # an older temporary file keeps its mode through O_CREAT
    os.replace(tmp, path)
    if sync:
        fsync_directory(os.path.dirname(os.path.abspath(path)))


def make_directory_durably(directory: str | os.PathLike[str], *, sync: bool = True) -> None:
    """``mkdir -p directory``; every directory created is made durable in its parent."""
    directory = Path(directory).absolute()
    missing: list[Path] = []
    d = directory
    while not d.exists():
        missing.append(d)
        d = d.parent
    directory.mkdir(parents=True, exist_ok=True)
    if sync:
        for created in reversed(missing):
            fsync_directory(created.parent)


def halt_on_storage_failure(what: str, error: BaseException) -> None:
    """End this process at once, from any thread, after a write or sync of state it must not lose
    failed (exit status ``EX_IOERR``). After a failed fsync Linux may drop the dirty pages and
    report the next fsync clean: a process that goes on cannot know what is on its disk, and could
    acknowledge what it will not have after a restart (PostgreSQL and etcd stop too)."""
    import logging

    logging.getLogger(__name__).critical("stopping: %s: %s (after a failed sync this process cannot know what is "
                                         "on its disk; restart it once the disk is sound)", what, error)
    logging.shutdown()
    os._exit(EX_IOERR)
