"""Output that reads in any terminal (#13): `status`, `health` and `members list` print plain,
greppable lines (``node: id=n1 ... role=follower``) when stdout is not a terminal, and tables that
fit 80 columns, with no value cut short, on an 80-column terminal (a real pseudo-terminal)."""

from __future__ import annotations

import io
import os
import pty
import re
import select
import subprocess
import sys
import time
from pathlib import Path

import pytest
from rich.console import Console

from support.cluster import cli, started_cluster
from lighthouse_cluster.local.cluster import LocalCluster
from lighthouse_cluster.cli.output import Cell, plain_line, print_record, print_table

ROOT = Path(__file__).resolve().parents[2]
ANSI = re.compile(r"\x1b\[[0-9;?]*[A-Za-z]")
BOX = set("┏┓┗┛┃━│─┡┩╇┳┻")


def visible_lines(text: str) -> list[str]:
    return [ANSI.sub("", line) for line in text.replace("\r", "").split("\n")]


# -- the layout alone (no processes) -----------------------------------------------------------------


def test_plain_lines_off_a_terminal() -> None:
    buf = io.StringIO()
    out = Console(file=buf, force_terminal=False, width=80)
    print_table("nodes", ("id", "client address", "role"), [("n1", "127.0.0.1:1", Cell("leader", "bold green")),
                                                             ("n2", "", "follower")], out=out, record="node")
    print_table("quorum 7", ("replica id", "data"), [("a", "two words")], out=out, record="participant")
    print_record("snapshot saved to /tmp/x y.json", {"term": "3", "file": "/tmp/x y.json"}, out=out)
    print_table("heartbeats", ("replica id",), [], out=out, record="heartbeat")
    assert buf.getvalue().splitlines() == [
        "node: id=n1 client_address=127.0.0.1:1 role=leader",
        "node: id=n2 role=follower",          # an empty value is left out, never "client_address="
        "quorum 7",
        "participant: replica_id=a data='two words'",
        "snapshot saved to /tmp/x y.json: term=3 file='/tmp/x y.json'",
        "heartbeat: none",
    ]
    assert plain_line("x", ("commit index",), ("5",)) == "x: commit_index=5"


def test_tables_fit_80_columns_without_cutting_values() -> None:
    buf = io.StringIO()
    out = Console(file=buf, force_terminal=True, width=80)
    rows = [(f"n{i}", f"127.0.0.1:{40000 + i}", "yes", "yes", "follower", "12", "n3", "123456", "0") for i in range(3)]
    print_table("health", ("id", "client address", "live", "ready", "role", "term", "leader", "commit index", "lag"),
                rows, out=out)
    print_record("snapshot saved", {"file": "/very/long/" + "directory/" * 12 + "backup.json", "term": "3"}, out=out)
    lines = visible_lines(buf.getvalue())
    assert max(len(line) for line in lines) <= 80, "\n".join(lines)
    text = "\n".join(lines)
    assert "…" not in text and text.count("follower") == 3 and "backup.json" in text


# -- the commands, against a real cluster --------------------------------------------------------------


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory):
    with started_cluster(tmp_path_factory.mktemp("output")) as c:
        yield c


def endpoints(cluster: LocalCluster) -> dict[str, str]:
    return {"LIGHTHOUSE_CLUSTER_ENDPOINTS": ",".join(f"http://{a}" for a in cluster.client_addresses)}


COMMANDS = (("status",), ("health",), ("members", "list"))


@pytest.mark.integration
@pytest.mark.parametrize("args", COMMANDS, ids=" ".join)
def test_through_a_pipe_every_node_is_one_greppable_line(cluster: LocalCluster, args: tuple[str, ...]) -> None:
    res = cli(*args, env=endpoints(cluster))
    assert res.returncode == 0, res.stderr
    assert not BOX & set(res.stdout), res.stdout
    rows = [line for line in res.stdout.splitlines() if re.match(r"^(node|member): id=n\d ", line)]
    assert len(rows) == 3, res.stdout
    roles = sorted(re.search(r"role=(\w+)", line).group(1) for line in rows)
    assert roles == ["follower", "follower", "leader"], res.stdout


def run_in_pty(args: tuple[str, ...], env: dict[str, str], columns: int = 80, timeout: float = 30.0) -> str:
    """``lighthouse-cluster ARGS`` with stdout on a real pseudo-terminal ``columns`` wide."""
    master, slave = pty.openpty()
    full_env = {**os.environ, **env, "COLUMNS": str(columns), "LINES": "50", "TERM": "xterm"}
    proc = subprocess.Popen([sys.executable, "-m", "lighthouse_cluster", *args], stdout=slave, stderr=slave,
                            stdin=subprocess.DEVNULL, env=full_env, cwd=ROOT)
    os.close(slave)
    chunks: list[bytes] = []
    deadline = time.monotonic() + timeout
    try:
        while time.monotonic() < deadline:
            ready, _, _ = select.select([master], [], [], 0.2)
            if ready:
                try:
                    data = os.read(master, 65536)
                except OSError:  # EIO: the child closed the terminal
                    break
                if not data:
                    break
                chunks.append(data)
            elif proc.poll() is not None:
                break
        else:
            raise AssertionError(f"{args} did not finish within {timeout}s")
    finally:
        os.close(master)
        if proc.poll() is None:
            proc.kill()
        proc.wait(timeout=10)
    assert proc.returncode == 0, b"".join(chunks).decode(errors="replace")
    return b"".join(chunks).decode(errors="replace")


@pytest.mark.integration
@pytest.mark.parametrize("args", COMMANDS, ids=" ".join)
def test_on_an_80_column_terminal_tables_fit_and_nothing_is_cut(cluster: LocalCluster,
                                                                 args: tuple[str, ...]) -> None:
    lines = visible_lines(run_in_pty(args, endpoints(cluster)))
    text = "\n".join(lines)
    assert max(len(line) for line in lines) <= 80, text
    assert "…" not in text, text
    assert text.count("follower") >= (2 if args != ("members", "list") else 0), text
    for address in cluster.client_addresses:
        assert address in text, text
