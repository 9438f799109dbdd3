"""deploy/README.md stays true: every `lighthouse-cluster` command it shows names a real
subcommand and real flags, and the "Start here" walk-through works as written (its commands run
against a real `lighthouse-cluster up --demo`, on free ports instead of 29510-29712)."""

from __future__ import annotations

import os
import re
import shlex
import shutil
import signal
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import click
import pytest

from support.waiting import wait_for
from lighthouse_cluster.cli.commands import main as cli_main
from lighthouse_cluster.local.cluster import port_is_free

README = Path(__file__).resolve().parents[2] / "deploy" / "README.md"
WALKTHROUGH_HEADING = "## Start here"


def bash_blocks(text: str) -> list[str]:
    return re.findall(r"```bash\n(.*?)```", text, flags=re.S)


def commands(block: str) -> list[str]:
    """The block's command lines: continuations joined, comments dropped."""
    out, pending = [], ""
    for raw in block.splitlines():
        line = pending + raw
        if line.rstrip().endswith("\\"):
            pending = line.rstrip()[:-1] + " "
            continue
        pending = ""
        line = re.sub(r"\s+#\s.*$", "", line).strip()
        if line and not line.startswith("#"):
            out.append(line)
    return out


def walkthrough() -> str:
    text = README.read_text()
    start = text.index(WALKTHROUGH_HEADING)
    return text[start:text.index("\n## ", start + 1)]


def cli_invocations(line: str) -> list[list[str]]:
    """Every `lighthouse-cluster ...` invocation in a shell line, as argv after the program name
    (up to the next shell operator)."""
    try:
        tokens = shlex.split(line, comments=False)
    except ValueError:  # an unbalanced quote inside $(...): split on blanks instead
        tokens = line.split()
    out = []
    for k, tok in enumerate(tokens):
        after_option = k > 0 and tokens[k - 1].startswith("-") and tokens[k - 1] != "--"  # kubectl -n NAME
        if (tok == "lighthouse-cluster" or tok.endswith("/bin/lighthouse-cluster")) and not after_option:
            argv = []
            for t in tokens[k + 1:]:
                if t in ("|", "||", "&&", ";", ">", "2>&1") or t.startswith(">"):
                    break
                argv.append(t)
            out.append(argv)
    return out


def resolve(argv: list[str]) -> tuple[click.Command, list[str]]:
    """The (sub)command argv names and the rest of argv."""
    cmd: click.Command = cli_main
    rest = list(argv)
    while isinstance(cmd, click.Group) and rest and not rest[0].startswith("-"):
        names = rest.pop(0).split("/")  # prose: `members add/remove`
        for name in names:
            assert name in cmd.commands, f"`lighthouse-cluster ... {name}`: no such subcommand (have {sorted(cmd.commands)})"
        cmd = cmd.commands[names[0]]
    return cmd, rest


def test_every_documented_command_and_flag_exists() -> None:
    text = README.read_text()
    lines = [ln for block in bash_blocks(text) for ln in commands(block)]
    # and the commands named in the prose and tables: `lighthouse-cluster status --endpoints ...`
    lines += [" ".join(span.split()) for span in re.findall(r"`(lighthouse-cluster\s[^`]*)`", text)]
    seen = 0
    for line in lines:
        for argv in cli_invocations(line):
            cmd, rest = resolve(argv)
            known = {o for p in cmd.params for o in (*p.opts, *p.secondary_opts)} | {"-h", "--help"}
            if cmd is cli_main:
                known |= {"--version"}
            for tok in rest:
                flag = tok.split("=", 1)[0]
                if flag.startswith("-") and flag != "-":
                    assert flag in known, f"{line!r}: `{cmd.name}` has no flag {flag} (has {sorted(known)})"
            seen += 1
    assert seen >= 20  # the walk-through, Docker, Kubernetes, systemd, Slurm and admin sections


def test_walkthrough_names_the_ports_up_uses() -> None:
    text = walkthrough()
    for port in ("29510", "29610", "29710", "29711", "29712"):
        assert port in text
    assert "lighthouse-cluster up --min_replicas 1 --demo" in text
    assert "](../docs/dashboard.png)" in text and (README.parent.parent / "docs" / "dashboard.png").is_file()


def free_base() -> int:
    """A client port P with P..P+2, P+100..P+102 and P+200..P+202 free (`up`'s layout)."""
    for _ in range(200):
        base = 20000 + (os.getpid() * 7 + int(time.monotonic() * 1000)) % 30000
        if all(port_is_free(base + d + i) for d in (0, 100, 200) for i in range(3)):
            return base
    pytest.skip("no free block of ports for `up`")


def localize(line: str, base: int) -> str:
    """The README's default ports as this test's ports."""
    def sub(m: re.Match[str]) -> str:
        n = int(m.group(0))
        return str(base + (n - 29510))
    return re.sub(r"\b29[567]1[0-2]\b", sub, line)


def fetch(url: str) -> tuple[int, str]:
    try:
        with urllib.request.urlopen(url, timeout=5) as r:
            return r.status, r.read().decode()
    except urllib.error.HTTPError as e:
        return e.code, e.read().decode()


@pytest.mark.integration
def test_walkthrough_runs_as_written(tmp_path: Path) -> None:
    lines = [ln for block in bash_blocks(walkthrough()) for ln in commands(block)]
    up = [ln for ln in lines if ln.startswith("lighthouse-cluster up ")]
    assert len(up) == 1, lines
    base = free_base()
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "COLUMNS": "200", "TMPDIR": str(tmp_path)}
    out_path = tmp_path / "up.out"
    argv = shlex.split(up[0])
    with open(out_path, "wb") as out:
        proc = subprocess.Popen([sys.executable, "-m", "lighthouse_cluster", *argv[1:], "--bind", f"127.0.0.1:{base}"],
                                stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, env=env,
                                # Ctrl-C must reach it even where this test runs with SIGINT ignored.
                                preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    try:
        def came_up() -> bool:
            if "Ctrl-C stops every node." in (text := out_path.read_text()) and "quorum " in text:
                return True
            assert proc.poll() is None, text
            return False

        wait_for(f"`{up[0]}` to come up", came_up, 40, context=out_path.read_text, interval=0.1)
        printed = out_path.read_text()
        # The dashboard URLs it prints are the client port + 200, as the walk-through says.
        urls = re.findall(r"http://127\.0\.0\.1:(\d+)\s", printed)
        assert [int(u) for u in urls if int(u) >= base + 200] == [base + 200, base + 201, base + 202], printed
        status, html = fetch(f"http://127.0.0.1:{base + 200}/")
        assert status == 200 and "/status.json" in html

        # Every metric the walk-through's table explains is on /metrics.
        documented = set(re.findall(r"`(lighthouse_cluster_[a-z_]+)", walkthrough()))
        assert len(documented) >= 8
        exposed = ""

        def all_exposed() -> bool:
            nonlocal exposed
            # The leader has the quorum commit histogram; any node has the rest.
            exposed = "\n".join(fetch(f"http://127.0.0.1:{base + 200 + i}/metrics")[1] for i in range(3))
            return all(re.search(rf"^{m}(_count)?[ {{]", exposed, re.M) for m in documented)

        wait_for("every documented metric on /metrics", all_exposed, 20, interval=0.2,
                 context=lambda: f"missing: {[m for m in documented if m not in exposed]}")

        # Each command of the walk-through (other than install and `up`) succeeds.
        ran = 0
        for line in lines:
            if line.startswith(("python3 -m pip", "lighthouse-cluster up ")):
                continue
            cmd = localize(line, base)
            if cmd.startswith("curl ") and shutil.which("curl") is None:
                url = re.search(r"http://\S+", cmd).group(0)
                res_code, body = fetch(url)
                assert res_code == 200, (cmd, body)
            else:
                cmd = re.sub(r"^lighthouse-cluster\b", f"{shlex.quote(sys.executable)} -m lighthouse_cluster", cmd)
                res = subprocess.run(["bash", "-o", "pipefail", "-c", cmd], capture_output=True, text=True,
                                     timeout=30, env=env)
                assert res.returncode == 0, (cmd, res.stdout, res.stderr)
                if "/readyz" in cmd:
                    assert re.match(r"(leader in term|follower of n\d in term) \d+", res.stdout), res.stdout
                if " status " in cmd:
                    assert "leader:" in res.stdout, res.stdout
            ran += 1
        assert ran >= 5, lines

        # Ctrl-C stops every node and removes the temporary data directory.
        data = re.search(r"^data: (\S+)", printed, re.M).group(1)
        assert Path(data).is_dir()
        proc.send_signal(signal.SIGINT)
        assert proc.wait(timeout=30) == 0, out_path.read_text()
        assert "stopping nodes" in out_path.read_text()
        assert not Path(data).exists()
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(timeout=20)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(timeout=10)
