"""A child process for a node's event loop, started without ``fork()`` (a job's port process).

Why not ``asyncio.create_subprocess_exec``: on the node's loop, uvloop, that is libuv's
``uv_spawn``, a real ``fork()``, and a real fork runs the process's ``pthread_atfork`` handlers.
gRPC core registers some (its fork support; a node's log shows "Other threads are currently
calling into gRPC, skipping fork() handlers" at each such spawn). When no gRPC thread happens to be
busy, they run: the node's gRPC server is paused and reset around the fork while it serves. Seen
as clients of that node failing calls on live connections while it started a port process
("Stream removed (Socket closed)", "Failed parsing HTTP/2 (Received unexpected settings ack)"):
6 of 99 runs of tests/torchft_interop/test_torchft_job_port.py's port-processes case under load
(and in CI); started as here, 0 of 100.

``subprocess.Popen`` starts it with ``vfork()`` + ``exec`` (CPython on Linux), where no atfork
handler runs, and the parent's thread is suspended only until the ``exec``. The pipes are then
the event loop's, as plain file descriptors this module owns and closes once: ``stdin`` is written
in full and closed (``write_stdin``), ``stdout`` is an ``asyncio.StreamReader``, and the exit is
seen through a pidfd (Linux 5.3+) or, elsewhere, by polling every ``EXIT_POLL_S``.

Call ``start`` from the thread that should be the child's parent thread (Linux's parent-death
signal follows the thread that started the child: ``parent_death.py``), the event loop's own.
"""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
from collections.abc import Sequence

# Where no pidfd is available: how often ``wait`` looks whether the child exited.
EXIT_POLL_S = 0.05
_READ_CHUNK = 65536


class ChildProcess:
    """A started child (``start``): ``pid``, ``returncode`` (None while it runs), ``stdout``,
    ``write_stdin``, ``send_signal``, ``kill`` and ``wait``, as ``asyncio.subprocess.Process``
    has them."""

    def __init__(self, popen: subprocess.Popen[bytes], stdin_fd: int, stdout_fd: int,
                 loop: asyncio.AbstractEventLoop) -> None:
        self._popen = popen
        self._loop = loop
        self._stdin_fd: int | None = stdin_fd
        self._stdin_pending = b""
        self._stdout_fd: int | None = stdout_fd
        self.stdout = asyncio.StreamReader(loop=loop)
        os.set_blocking(stdout_fd, False)
        loop.add_reader(stdout_fd, self._read_stdout)
        self._pidfd: int | None = None
        self._exited = asyncio.Event()
        pidfd_open = getattr(os, "pidfd_open", None)
        if pidfd_open is not None:
            try:
                self._pidfd = pidfd_open(popen.pid)
                loop.add_reader(self._pidfd, self._exited.set)
            except OSError:  # a kernel before 5.3, or seccomp: poll instead
                self._close_pidfd()

    @classmethod
    def start(cls, args: Sequence[str]) -> ChildProcess:
        """Start ``args`` with pipes for stdin and stdout (stderr: this process's). Blocks the
        calling thread until the child has called ``exec`` (``OSError`` if it could not)."""
        loop = asyncio.get_running_loop()
        popen = subprocess.Popen(list(args), stdin=subprocess.PIPE, stdout=subprocess.PIPE)
        assert popen.stdin is not None and popen.stdout is not None
        # Descriptors of this object's own (os.dup: not inherited by later children); Popen's
        # file objects are closed now, so nothing else ever closes these numbers.
        stdin_fd, stdout_fd = os.dup(popen.stdin.fileno()), os.dup(popen.stdout.fileno())
        popen.stdin.close()
        popen.stdout.close()
        popen.stdin = popen.stdout = None
        return cls(popen, stdin_fd, stdout_fd, loop)

    @property
    def pid(self) -> int:
        return self._popen.pid

    @property
    def returncode(self) -> int | None:
        """The exit status (negative: the signal that ended it), None while it runs."""
        return self._popen.poll()

    def write_stdin(self, data: bytes) -> None:
        """Write ``data`` to the child's stdin, then close it (end of input). Never blocks: what
        the pipe does not take now is written as it drains; a child that exits first drops it."""
        if self._stdin_fd is None:
            raise ValueError("stdin is already closed")
        self._stdin_pending = data
        os.set_blocking(self._stdin_fd, False)
        self._write_stdin()
        if self._stdin_fd is not None:
            self._loop.add_writer(self._stdin_fd, self._write_stdin)

    def _write_stdin(self) -> None:
        fd = self._stdin_fd
        if fd is None:
            return
        try:
            while self._stdin_pending:
                written = os.write(fd, self._stdin_pending)
                self._stdin_pending = self._stdin_pending[written:]
        except BlockingIOError:
            return  # the rest when the pipe drains
        except OSError:  # BrokenPipeError: the child is gone
            self._stdin_pending = b""
        self._close_stdin()

    def _close_stdin(self) -> None:
        fd, self._stdin_fd = self._stdin_fd, None
        if fd is not None:
            self._loop.remove_writer(fd)
            os.close(fd)

    def _unwatch(self, fd: int | None) -> None:
        """Stop reading ``fd`` on the loop and close it (None: already done)."""
        if fd is not None:
            self._loop.remove_reader(fd)
            os.close(fd)

    def _read_stdout(self) -> None:
        fd = self._stdout_fd
        if fd is None:
            return
        try:
            chunk = os.read(fd, _READ_CHUNK)
        except BlockingIOError:
            return
        except OSError:
            chunk = b""
        if chunk:
            self.stdout.feed_data(chunk)
            return
        self._close_stdout()
        self.stdout.feed_eof()

    def _close_stdout(self) -> None:
        fd, self._stdout_fd = self._stdout_fd, None
        if fd is not None:
            self._loop.remove_reader(fd)
            os.close(fd)

    def _close_pidfd(self) -> None:
        fd, self._pidfd = self._pidfd, None
        if fd is not None:
            self._loop.remove_reader(fd)
            os.close(fd)

    def send_signal(self, sig: int) -> None:
        """Signal the child; nothing once it has exited (and been waited for)."""
        self._popen.send_signal(sig)

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)

    async def wait(self) -> int:
        """Until the child exits: its exit status. (Its stdout stays readable to its end; the
        end closes it.)"""
        while (rc := self._popen.poll()) is None:
            if self._pidfd is not None:
                await self._exited.wait()
                self._exited.clear()
            else:
                await asyncio.sleep(EXIT_POLL_S)
        self._close_pidfd()
        return rc

    def close(self) -> None:
        """Release this object's descriptors (the child is not signalled; a ``wait`` still pending
        looks for its exit every ``EXIT_POLL_S`` from now on)."""
        self._close_pidfd()
        self._exited.set()
        self._close_stdin()
        if self._stdout_fd is not None:
            self._close_stdout()
            self.stdout.feed_eof()
