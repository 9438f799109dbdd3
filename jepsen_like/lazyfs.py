"""A filesystem that forgets what was not fsynced when its machine "loses power" (like LazyFS).

A node's data directory is mounted on it (FUSE, one process per node); the power-loss nemesis
SIGKILLs the node and then tells its filesystem to lose power: every file goes back to its content
as of its last ``fsync``/``fdatasync`` and every directory to the names it had at its last
directory ``fsync``, which is what a power loss may do to a real disk. A SIGKILL alone loses
nothing (the page cache survives a process), so without this a fault-injection run cannot tell a
node that syncs from one that does not. etcd's robustness tests do the same with LazyFS; this is
a small Python one (LazyFS itself is a C++ build no registry here serves).

The model is strict POSIX, the worst a real filesystem may do: data reaches the disk only when its
file is synced; a new name, a rename or an unlink only when its directory is synced (ext4 and XFS
often keep more; a node must not count on it). It lives in ``LazyFiles``, pure and in memory (the
FUSE process stays up across the node's power loss, as the disk does); ``LazyFS`` maps FUSE
calls onto it. Everything is served with ``direct_io`` and no attribute or entry caching, so the
kernel keeps no copy of what the model drops (so no shared writable mmap either: pysyncobj's own
``FileJournal`` cannot run on it; the nodes' ``DurableJournal`` writes with pwrite). File
handles opened before a power loss are dead after it: a write that the killed node had in flight
and that arrives late is refused, as the machine that would have done it is gone.

Control (``LazyMount``, the harness side): a Unix socket next to the mount takes one line,
``lose-power``, and answers one JSON line saying what was lost (files reverted, with their sizes
before and after, names lost or back). At unmount the process writes the files as they are then
into the directory it was mounted on, so the run keeps its data directories; a directory mounted
with files in it starts with them, as durable.

    python -m jepsen_like.lazyfs MOUNTPOINT --control SOCKET     # the FUSE process (foreground)
"""

from __future__ import annotations

import errno
import json
import os
import shutil
import socket
import stat
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

__all__ = ["LazyFiles", "LazyMount", "LazyFSUnavailable", "available"]

ROOT_INO = 1


class LazyFSUnavailable(RuntimeError):
    """The lazy filesystem cannot run here; the message says why and what to install."""


def available() -> tuple[bool, str]:
    """Whether a lazy filesystem can be mounted here, and why not: root (or fusermount3), /dev/fuse,
    Debian's fuse3 (libfuse3) and the ``mfusepy`` package (pyproject's test extra)."""
    if not os.path.exists("/dev/fuse"):
        return False, "no /dev/fuse on this machine"
    if shutil.which("fusermount3") is None:
        return False, "fusermount3 is not installed (apt-get install -y fuse3)"
    try:
        import mfusepy  # noqa: F401
    except (ImportError, OSError, EnvironmentError) as e:
        return False, f"mfusepy cannot load libfuse3: {e} (pip install mfusepy; apt-get install -y fuse3)"
    if os.geteuid() != 0:
        return False, "mounting needs root here"
    return True, ""


# -- the model (pure) --------------------------------------------------------------------------------


@dataclass
class Inode:
    """A file or directory: what reads see now, and what survives a power loss."""

    is_dir: bool
    mode: int
    data: bytearray = field(default_factory=bytearray)            # a file's content now
    durable: bytes = b""                                          # a file's content at its last fsync
    entries: dict[str, int] = field(default_factory=dict)         # a directory's names now
    durable_entries: dict[str, int] = field(default_factory=dict)  # its names at its last fsync
    mtime_ns: int = field(default_factory=time.time_ns)


class LazyFiles:
    """A tree of files and directories in memory that loses unsynced writes on ``lose_power()``.
    Paths are absolute within the filesystem (``/raft.journal``). Errors are ``OSError`` with the
    errno a filesystem would give. Not thread-safe: ``LazyFS`` holds one lock around every call."""

    def __init__(self) -> None:
        self.inodes: dict[int, Inode] = {ROOT_INO: Inode(is_dir=True, mode=stat.S_IFDIR | 0o755)}
        self._next_ino = ROOT_INO + 1
        self.generation = 0          # bumped by every power loss: older handles are dead
        self.power_losses = 0

    # -- names --------------------------------------------------------------------------------------

    @staticmethod
    def _split(path: str) -> list[str]:
        return [p for p in path.split("/") if p]

    def lookup(self, path: str) -> int:
        ino = ROOT_INO
        for part in self._split(path):
            node = self.inodes[ino]
            if not node.is_dir:
                raise OSError(errno.ENOTDIR, path)
            if part not in node.entries:
                raise OSError(errno.ENOENT, path)
            ino = node.entries[part]
        return ino

    def _parent(self, path: str) -> tuple[Inode, str]:
        parts = self._split(path)
        if not parts:
            raise OSError(errno.EEXIST, path)
        parent = self.inodes[self.lookup("/" + "/".join(parts[:-1]))]
        if not parent.is_dir:
            raise OSError(errno.ENOTDIR, path)
        return parent, parts[-1]

    def _new(self, node: Inode) -> int:
        ino = self._next_ino
        self._next_ino += 1
        self.inodes[ino] = node
        return ino

    def create(self, path: str, mode: int) -> int:
        parent, name = self._parent(path)
        if name in parent.entries:
            ino = parent.entries[name]
            if self.inodes[ino].is_dir:
                raise OSError(errno.EISDIR, path)
            return ino
        ino = self._new(Inode(is_dir=False, mode=stat.S_IFREG | (mode & 0o7777)))
        parent.entries[name] = ino
        parent.mtime_ns = time.time_ns()
        return ino

    def mkdir(self, path: str, mode: int) -> None:
        parent, name = self._parent(path)
        if name in parent.entries:
            raise OSError(errno.EEXIST, path)
        parent.entries[name] = self._new(Inode(is_dir=True, mode=stat.S_IFDIR | (mode & 0o7777)))

    def unlink(self, path: str) -> None:
        parent, name = self._parent(path)
        ino = parent.entries.get(name)
        if ino is None:
            raise OSError(errno.ENOENT, path)
        if self.inodes[ino].is_dir:
            raise OSError(errno.EISDIR, path)
        del parent.entries[name]

    def rmdir(self, path: str) -> None:
        parent, name = self._parent(path)
        ino = parent.entries.get(name)
        if ino is None:
            raise OSError(errno.ENOENT, path)
        if not self.inodes[ino].is_dir:
            raise OSError(errno.ENOTDIR, path)
        if self.inodes[ino].entries:
            raise OSError(errno.ENOTEMPTY, path)
        del parent.entries[name]

    def rename(self, old: str, new: str) -> None:
        src_parent, src_name = self._parent(old)
        ino = src_parent.entries.get(src_name)
        if ino is None:
            raise OSError(errno.ENOENT, old)
        dst_parent, dst_name = self._parent(new)
        target = dst_parent.entries.get(dst_name)
        if target is not None and self.inodes[target].is_dir and self.inodes[target].entries:
            raise OSError(errno.ENOTEMPTY, new)
        del src_parent.entries[src_name]
        dst_parent.entries[dst_name] = ino

    def listdir(self, path: str) -> list[str]:
        node = self.inodes[self.lookup(path)]
        if not node.is_dir:
            raise OSError(errno.ENOTDIR, path)
        return sorted(node.entries)

    # -- contents ------------------------------------------------------------------------------------

    def file(self, ino: int) -> Inode:
        node = self.inodes.get(ino)
        if node is None:
            raise OSError(errno.ENOENT, str(ino))
        if node.is_dir:
            raise OSError(errno.EISDIR, str(ino))
        return node

    def read(self, ino: int, size: int, offset: int) -> bytes:
        return bytes(self.file(ino).data[offset:offset + size])

    def write(self, ino: int, data: bytes, offset: int) -> int:
        node = self.file(ino)
        if offset > len(node.data):
            node.data.extend(b"\0" * (offset - len(node.data)))
        node.data[offset:offset + len(data)] = data
        node.mtime_ns = time.time_ns()
        return len(data)

    def truncate(self, ino: int, length: int) -> None:
        node = self.file(ino)
        if length < len(node.data):
            del node.data[length:]
        else:
            node.data.extend(b"\0" * (length - len(node.data)))
        node.mtime_ns = time.time_ns()

    def fsync(self, ino: int) -> None:
        """A file's data (``fsync``/``fdatasync``), or a directory's names, made durable."""
        node = self.inodes[ino]
        if node.is_dir:
            node.durable_entries = dict(node.entries)
        else:
            node.durable = bytes(node.data)

    # -- power loss -------------------------------------------------------------------------------------

    def paths(self) -> dict[str, int]:
        """Every file's path now (directories walked from the root), path -> inode."""
        out: dict[str, int] = {}
        stack = [("", ROOT_INO)]
        while stack:
            prefix, ino = stack.pop()
            for name, child in self.inodes[ino].entries.items():
                path = f"{prefix}/{name}"
                if self.inodes[child].is_dir:
                    stack.append((path, child))
                else:
                    out[path] = child
        return out

    def lose_power(self) -> dict[str, Any]:
        """Drop everything not synced: each file back to its last synced content, each directory
        back to its last synced names (a file never named durably is gone, a name removed but not
        synced is back). Returns what changed, for the history."""
        before = self.paths()
        reverted = []
        for path, ino in sorted(before.items()):
            node = self.inodes[ino]
            if bytes(node.data) != node.durable:
                reverted.append({"path": path, "size": len(node.data), "synced_size": len(node.durable)})
        for node in self.inodes.values():
            if node.is_dir:
                node.entries = dict(node.durable_entries)
            else:
                node.data = bytearray(node.durable)
        after = self.paths()
        self.generation += 1
        self.power_losses += 1
        return {"reverted": reverted, "names_lost": sorted(set(before) - set(after)),
                "names_back": sorted(set(after) - set(before)),
                "unsynced_bytes": sum(abs(r["size"] - r["synced_size"]) for r in reverted)}

    # -- the directory it is mounted on ------------------------------------------------------------------

    def load(self, directory: Path) -> None:
        """Take ``directory``'s files as the initial, durable content."""
        for path in sorted(directory.rglob("*")):
            rel = "/" + path.relative_to(directory).as_posix()
            if path.is_dir():
                self.mkdir(rel, path.stat().st_mode)
            elif path.is_file():
                ino = self.create(rel, path.stat().st_mode)
                self.write(ino, path.read_bytes(), 0)
        for ino in list(self.inodes):
            self.fsync(ino)

    def dump(self, directory: Path) -> None:
        """Write the files as they are now into ``directory`` (replacing what it held)."""
        for child in directory.iterdir():
            shutil.rmtree(child) if child.is_dir() and not child.is_symlink() else child.unlink()
        stack = [(directory, ROOT_INO)]
        while stack:
            where, ino = stack.pop()
            for name, child in self.inodes[ino].entries.items():
                node = self.inodes[child]
                if node.is_dir:
                    (where / name).mkdir()
                    stack.append((where / name, child))
                else:
                    (where / name).write_bytes(bytes(node.data))
                    os.chmod(where / name, node.mode & 0o7777)


# -- the FUSE shell ---------------------------------------------------------------------------------------


def _operations_class() -> type:
    import mfusepy

    class LazyFS(mfusepy.Operations):  # type: ignore[misc]
        """FUSE calls onto a ``LazyFiles`` under one lock (the control thread shares it)."""

        use_ns = True

        def __init__(self, files: LazyFiles, mutex: threading.Lock) -> None:
            self.files = files
            self.mutex = mutex
            self.handles: dict[int, tuple[int, int]] = {}   # fh -> (inode, generation)
            self.next_fh = 1

        def _call(self, fn: Any, *args: Any) -> Any:
            with self.mutex:
                try:
                    return fn(*args)
                except OSError as e:
                    raise mfusepy.FuseOSError(e.errno or errno.EIO) from e

        def _handle(self, ino: int) -> int:
            fh = self.next_fh
            self.next_fh += 1
            self.handles[fh] = (ino, self.files.generation)
            return fh

        def _live(self, fh: int) -> int:
            """The inode of a handle opened since the last power loss (a late write of the killed
            node, through a handle of before, is refused)."""
            ino, generation = self.handles.get(fh, (0, -1))
            if generation != self.files.generation:
                raise OSError(errno.EIO, "a file handle from before the power loss")
            return ino

        def init_with_config(self, conn_info: Any, config: Any) -> None:
            if config is not None:  # no kernel caching: what the model drops, no cache keeps
                config.direct_io = 1
                config.kernel_cache = 0
                config.auto_cache = 0
                config.attr_timeout = 0.0
                config.entry_timeout = 0.0
                config.negative_timeout = 0.0

        def getattr(self, path: str, fh: int | None = None) -> dict[str, Any]:
            def attrs() -> dict[str, Any]:
                ino = self.files.lookup(path)
                node = self.files.inodes[ino]
                size = len(node.data) if not node.is_dir else 0
                return {"st_mode": node.mode, "st_ino": ino, "st_nlink": 2 if node.is_dir else 1, "st_size": size,
                        "st_uid": os.getuid(), "st_gid": os.getgid(), "st_blocks": (size + 511) // 512,
                        "st_atime": node.mtime_ns, "st_mtime": node.mtime_ns, "st_ctime": node.mtime_ns}
            return self._call(attrs)

        def readdir(self, path: str, fh: int) -> list[str]:
            return [".", "..", *self._call(self.files.listdir, path)]

        def opendir(self, path: str) -> int:
            return self._call(lambda: self._handle(self.files.lookup(path)))

        def releasedir(self, path: str, fh: int) -> int:
            with self.mutex:
                self.handles.pop(fh, None)
            return 0

        def fsyncdir(self, path: str, datasync: int, fh: int) -> int:
            self._call(lambda: self.files.fsync(self._live(fh)))
            return 0

        def mkdir(self, path: str, mode: int) -> int:
            self._call(self.files.mkdir, path, mode)
            return 0

        def rmdir(self, path: str) -> int:
            self._call(self.files.rmdir, path)
            return 0

        def unlink(self, path: str) -> int:
            self._call(self.files.unlink, path)
            return 0

        def rename(self, old: str, new: str) -> int:
            self._call(self.files.rename, old, new)
            return 0

        def create(self, path: str, mode: int, flags: int = 0) -> int:
            def create() -> int:
                ino = self.files.create(path, mode)
                if flags & os.O_TRUNC:
                    self.files.truncate(ino, 0)
                return self._handle(ino)
            return self._call(create)

        def open(self, path: str, flags: int) -> int:
            def open_() -> int:
                ino = self.files.lookup(path)
                self.files.file(ino)
                if flags & os.O_TRUNC:
                    self.files.truncate(ino, 0)
                return self._handle(ino)
            return self._call(open_)

        def release(self, path: str, fh: int) -> int:
            with self.mutex:
                self.handles.pop(fh, None)
            return 0

        def flush(self, path: str, fh: int) -> int:
            return 0

        def read(self, path: str, size: int, offset: int, fh: int) -> bytes:
            # Reads through an old handle are harmless (a reader outside the node, the monitor).
            def read() -> bytes:
                handle = self.handles.get(fh)
                return self.files.read(handle[0] if handle is not None else self.files.lookup(path), size, offset)
            return self._call(read)

        def write(self, path: str, data: bytes, offset: int, fh: int) -> int:
            return self._call(lambda: self.files.write(self._live(fh), bytes(data), offset))

        def truncate(self, path: str, length: int, fh: int | None = None) -> int:
            self._call(lambda: self.files.truncate(self._live(fh) if fh is not None else self.files.lookup(path),
                                                   length))
            return 0

        def fsync(self, path: str, datasync: int, fh: int) -> int:
            self._call(lambda: self.files.fsync(self._live(fh)))
            return 0

        def chmod(self, path: str, mode: int) -> int:
            def chmod() -> None:
                node = self.files.inodes[self.files.lookup(path)]
                node.mode = (node.mode & ~0o7777) | (mode & 0o7777)
            self._call(chmod)
            return 0

        def chown(self, path: str, uid: int, gid: int) -> int:
            return 0

        def utimens(self, path: str, times: Any = None) -> int:
            return 0

        def access(self, path: str, amode: int) -> int:
            self._call(self.files.lookup, path)
            return 0

        def statfs(self, path: str) -> dict[str, int]:
            return {"f_bsize": 4096, "f_frsize": 4096, "f_blocks": 1 << 20, "f_bfree": 1 << 19, "f_bavail": 1 << 19,
                    "f_files": 1 << 16, "f_ffree": 1 << 15, "f_favail": 1 << 15, "f_namemax": 255}

    return LazyFS


def _serve_control(sock_path: str, files: LazyFiles, lock: threading.Lock) -> None:
    """Answer ``lose-power`` (and ``ping``) on a Unix socket, one JSON line per request."""
    server = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    server.bind(sock_path)
    server.listen(4)
    while True:
        conn, _ = server.accept()
        with conn, conn.makefile("rwb") as f:
            line = f.readline().decode().strip()
            if line == "lose-power":
                with lock:
                    reply: dict[str, Any] = files.lose_power()
            elif line == "ping":
                reply = {"ok": True}
            else:
                reply = {"error": f"unknown command {line!r}"}
            f.write((json.dumps(reply) + "\n").encode())
            f.flush()


def main(argv: list[str] | None = None) -> int:
    import argparse

    import mfusepy

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("mountpoint", type=Path)
    parser.add_argument("--control", required=True, help="Unix socket for lose-power")
    opts = parser.parse_args(argv)
    files, lock = LazyFiles(), threading.Lock()
    files.load(opts.mountpoint)
    threading.Thread(target=_serve_control, args=(opts.control, files, lock), daemon=True).start()
    mfusepy.FUSE(_operations_class()(files, lock), str(opts.mountpoint), foreground=True, nothreads=False,
                 fsname="lazyfs", default_permissions=False)
    with lock:  # unmounted: the directory underneath gets the files as they are now
        files.dump(opts.mountpoint)
    return 0


# -- the harness side -----------------------------------------------------------------------------------


class LazyMount:
    """A lazy filesystem mounted on ``directory`` (a node's data directory) by a process of its
    own; ``lose_power()`` drops what was not synced; ``close()`` unmounts, and the directory then
    holds the files as they were. A context manager."""

    def __init__(self, directory: Path, log_path: Path | None = None) -> None:
        self.directory = Path(directory)
        self.control = str(self.directory.parent / f".{self.directory.name}.lazyfs.sock")
        self.log_path = log_path or self.directory.parent / f"{self.directory.name}.lazyfs.log"
        self.process: subprocess.Popen[bytes] | None = None

    def start(self, timeout: float = 10.0) -> "LazyMount":
        ok, why = available()
        if not ok:
            raise LazyFSUnavailable(f"lazy filesystem unavailable: {why}")
        self.directory.mkdir(parents=True, exist_ok=True)
        if os.path.exists(self.control):
            os.unlink(self.control)
        with open(self.log_path, "ab") as log:
            self.process = subprocess.Popen(
                [sys.executable, "-m", "jepsen_like.lazyfs", str(self.directory), "--control", self.control],
                stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, start_new_session=True)
        deadline = time.monotonic() + timeout
        while not (os.path.ismount(self.directory) and self._ping()):
            if self.process.poll() is not None:
                raise LazyFSUnavailable(f"the lazy filesystem on {self.directory} exited with status "
                                        f"{self.process.returncode}; see {self.log_path}")
            if time.monotonic() > deadline:
                self.close()
                raise LazyFSUnavailable(f"the lazy filesystem on {self.directory} was not mounted within "
                                        f"{timeout:.0f} s; see {self.log_path}")
            time.sleep(0.05)
        return self

    def _request(self, command: str, timeout: float = 10.0) -> dict[str, Any]:
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
            s.settimeout(timeout)
            s.connect(self.control)
            s.sendall((command + "\n").encode())
            with s.makefile("rb") as f:
                return json.loads(f.readline())

    def _ping(self) -> bool:
        try:
            return bool(self._request("ping", timeout=1.0).get("ok"))
        except OSError:
            return False

    def lose_power(self) -> dict[str, Any]:
        """Drop every write not synced (call with the node killed); what was lost."""
        reply = self._request("lose-power")
        if "error" in reply:
            raise RuntimeError(reply["error"])
        return reply

    def close(self, timeout: float = 10.0) -> None:
        """Unmount (lazily if still busy) and wait for the process; never raises."""
        if self.process is None:
            return
        if os.path.ismount(self.directory):
            subprocess.run(["fusermount3", "-u", str(self.directory)], capture_output=True, check=False)
            if os.path.ismount(self.directory):
                subprocess.run(["fusermount3", "-u", "-z", str(self.directory)], capture_output=True, check=False)
        try:
            self.process.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait(timeout=timeout)
        self.process = None
        if os.path.exists(self.control):
            os.unlink(self.control)

    def __enter__(self) -> "LazyMount":
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.close()


if __name__ == "__main__":
    sys.exit(main())
