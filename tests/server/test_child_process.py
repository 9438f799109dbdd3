"""``server/child_process.py``: a node's port process is started without fork(), so gRPC's fork
handlers never run in a serving node; and the child's pipes, exit status and signals work on the
node's event loop (uvloop) and on asyncio's, with no descriptor left open.

The fork check runs a small gRPC server with a live channel on uvloop in a process of its own,
which starts children one way or the other, with gRPC's fork tracing on: gRPC core logs
"... fork() handlers" whenever its handlers are called (running or skipped), which is what a
spawn through uvloop (libuv's fork) did in every node (and, when they ran, broke calls on live
connections: the module's docstring)."""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import uvloop

from lighthouse_cluster.server.child_process import ChildProcess

pytestmark = [pytest.mark.integration, pytest.mark.timeout(120)]

REPO = Path(__file__).resolve().parents[2]

SPAWNING_SERVER = textwrap.dedent('''
    import asyncio, sys
    import grpc, uvloop
    from lighthouse_cluster.server.child_process import ChildProcess

    async def main(how):
        async def echo(raw, context):
            return raw
        server = grpc.aio.server()
        server.add_generic_rpc_handlers([grpc.method_handlers_generic_handler(
            "t.S", {"M": grpc.unary_unary_rpc_method_handler(echo)})])
        port = server.add_insecure_port("127.0.0.1:0")
        await server.start()
        async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
            call = channel.unary_unary("/t.S/M")
            assert await call(b"x") == b"x"
            for _ in range(3):
                if how == "asyncio":
                    child = await asyncio.create_subprocess_exec(sys.executable, "-c", "pass")
                    assert await child.wait() == 0
                else:
                    child = ChildProcess.start([sys.executable, "-c", "pass"])
                    assert await child.wait() == 0
                    child.close()
                assert await call(b"x") == b"x"
        await server.stop(0)
        print("spawned 3", flush=True)

    uvloop.run(main(sys.argv[1]))
''')


def fork_handler_lines(how: str) -> list[str]:
    env = {**os.environ, "GRPC_VERBOSITY": "INFO", "GRPC_TRACE": "fork", "PYTHONPATH": str(REPO)}
    done = subprocess.run([sys.executable, "-c", SPAWNING_SERVER, how], capture_output=True, text=True,
                          env=env, timeout=60)
    assert done.returncode == 0 and "spawned 3" in done.stdout, done.stderr[-3000:]
    return [line for line in done.stderr.splitlines() if "fork() handlers" in line]


def test_a_child_started_on_uvloop_runs_no_grpc_fork_handler() -> None:
    # The check itself: a spawn through uvloop's subprocess calls gRPC's handlers (logged).
    assert fork_handler_lines("asyncio"), "gRPC logged nothing for uvloop's fork(): this check sees nothing now"
    assert fork_handler_lines("child") == []


def open_fds() -> set[int]:
    return {int(fd) for fd in os.listdir("/proc/self/fd")}


@pytest.fixture(params=["uvloop", "asyncio"])
def run(request: pytest.FixtureRequest):
    if request.param == "uvloop":
        return uvloop.run
    return asyncio.run


@pytest.mark.skipif(not Path("/proc/self/fd").exists(), reason="counts descriptors in /proc")
def test_stdin_larger_than_a_pipe_reaches_the_child_and_stdout_is_read_to_its_end(run) -> None:
    data = os.urandom(1 << 20)  # 16 pipe buffers: written as the child drains them

    async def main() -> tuple[bytes, int]:
        child = ChildProcess.start([sys.executable, "-c",
                                    "import sys; sys.stdout.buffer.write(sys.stdin.buffer.read())"])
        child.write_stdin(data)
        out = await asyncio.wait_for(child.stdout.read(), 30)
        rc = await asyncio.wait_for(child.wait(), 30)
        return out, rc

    run(asyncio.sleep(0))  # uvloop's first loop keeps a pipe of its own for the process's life
    before = open_fds()
    out, rc = run(main())
    assert rc == 0 and out == data
    assert open_fds() <= before, "a pipe or pidfd was left open"


def test_exit_status_signals_and_lines(run) -> None:
    async def main() -> dict[str, object]:
        seen: dict[str, object] = {}
        child = ChildProcess.start([sys.executable, "-c", textwrap.dedent('''
            import sys, time
            data = sys.stdin.read()
            print("listening", len(data), flush=True)
            time.sleep(60)
        ''')])
        child.write_stdin(b"abc")
        seen["line"] = (await asyncio.wait_for(child.stdout.readline(), 30)).decode().strip()
        seen["running"] = child.returncode
        child.send_signal(signal.SIGTERM)
        seen["rc"] = await asyncio.wait_for(child.wait(), 30)
        seen["returncode"] = child.returncode
        child.kill()  # after it exited: nothing to signal, no error
        seen["eof"] = await asyncio.wait_for(child.stdout.read(), 30)
        failing = ChildProcess.start([sys.executable, "-c", "raise SystemExit(3)"])
        failing.write_stdin(b"")
        seen["exit3"] = await asyncio.wait_for(failing.wait(), 30)
        failing.close()
        return seen

    seen = run(main())
    assert seen == {"line": "listening 3", "running": None, "rc": -signal.SIGTERM,
                    "returncode": -signal.SIGTERM, "eof": b"", "exit3": 3}


def test_a_child_that_exits_before_reading_its_stdin_is_no_error(run) -> None:
    async def main() -> int:
        child = ChildProcess.start([sys.executable, "-c", "pass"])
        rc = await asyncio.wait_for(child.wait(), 30)
        child.write_stdin(os.urandom(1 << 20))  # a broken pipe, dropped
        child.close()
        return rc

    assert run(main()) == 0


def test_a_program_that_cannot_start_raises_oserror(run) -> None:
    async def main() -> None:
        ChildProcess.start(["/nonexistent/program"])

    with pytest.raises(OSError):
        run(main())


def test_a_wait_pending_when_the_descriptors_are_closed_still_sees_the_exit(run) -> None:
    async def main() -> int:
        child = ChildProcess.start([sys.executable, "-c", "import time; time.sleep(0.3)"])
        waiting = asyncio.ensure_future(child.wait())
        await asyncio.sleep(0)  # one step of the loop: the wait now awaits the pidfd
        child.close()
        return await asyncio.wait_for(waiting, 30)

    assert run(main()) == 0
