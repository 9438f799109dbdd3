"""The dashboard as a user sees it, in a real headless browser: Debian's Chromium driven by
Playwright for Python (no browser download: ``executable_path`` is the system Chromium).

A real 3-node cluster (``LocalCluster`` with HTTP ports and an admin token) and simulated replica
groups, each its own process with a torchft-like manager server whose Kill exits the process at
once, as torchft's manager does (``std::process::exit(1)`` inside the handler). The tests read
only what the page shows (table cells, the status line, the kill result) and check it against
what the cluster and the replica groups actually did. Every wait is bounded.

Skips when Chromium or Playwright is missing; .ci/run installs both.
"""

from __future__ import annotations

import asyncio
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, Callable, Iterator

import pytest

from support.job_admin import add_job
from support.waiting import wait_for
from lighthouse_cluster.local.cluster import LocalCluster, free_ports
from lighthouse_cluster.proto import lighthouse_cluster_pb2 as cpb

# quiet: its waits for the page to match every node's Status (10 s) failed once beside a loaded host
# (load 25); beside another quiet test the host has a core to spare
pytestmark = [pytest.mark.integration, pytest.mark.quiet]

CHROMIUM = os.environ.get("LIGHTHOUSE_CLUSTER_TEST_CHROMIUM", "/usr/bin/chromium")
# Root-safe, and quiet on a machine without internet (no background connections to refuse).
CHROMIUM_ARGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
                 "--disable-background-networking", "--disable-component-update", "--disable-sync"]
# Where to also save the leader's screenshot (docs/dashboard.png is made this way).
SCREENSHOT_ENV = "LIGHTHOUSE_CLUSTER_DASHBOARD_PNG"
TOKEN = "dashboard-admin-token-5b2e"
KILLED_EXIT = 1  # torchft's manager exits with status 1 on Kill
ROLES = {cpb.FOLLOWER: "follower", cpb.CANDIDATE: "candidate", cpb.LEADER: "leader"}


# -- the replica group process (this file run as a script) -------------------------------------------


def replica_main(replica_id: str, endpoint: str, fallbacks: str, step_time_s: float, job: str | None) -> None:
    """One simulated replica group with a manager server: prints ``MANAGER <address>``, one
    ``ROUND <quorum id> <step sent> <participants>`` line per quorum, and ``KILLED <msg>`` when
    killed, then exits with status 1 without answering (torchft's manager does the same). Its calls
    name ``job`` (None: the default job)."""
    import grpc

    from lighthouse_cluster.proto import torchft_pb2_grpc as pb_grpc
    from lighthouse_cluster.local.simulated_group import RoundResult, SimulatedReplicaGroup

    class Manager(pb_grpc.ManagerServiceServicer):
        async def Kill(self, request: Any, context: Any) -> Any:  # noqa: N802 - gRPC method name
            print(f"KILLED {request.msg}", flush=True)
            os._exit(KILLED_EXIT)

    def on_round(r: RoundResult) -> None:
        if r.quorum_id is not None:
            print(f"ROUND {r.quorum_id} {r.step} {','.join(r.participants)}", flush=True)

    async def main() -> None:
        server = grpc.aio.server()
        pb_grpc.add_ManagerServiceServicer_to_server(Manager(), server)
        port = server.add_insecure_port("127.0.0.1:0")
        await server.start()
        group = SimulatedReplicaGroup(replica_id, endpoint, quorum_timeout_s=5.0, step_time_s=step_time_s,
                                      address=f"http://127.0.0.1:{port}", on_round=on_round,
                                      fallback_endpoints=tuple(fallbacks.split(",")), job=job)
        print(f"MANAGER {group.address}", flush=True)
        await group.run()

    asyncio.run(main())


if __name__ == "__main__" and len(sys.argv) in (6, 7) and sys.argv[1] == "replica":
    replica_main(sys.argv[2], sys.argv[3], sys.argv[4], float(sys.argv[5]), sys.argv[6] if len(sys.argv) == 7 else None)
    sys.exit(0)


# -- helpers ----------------------------------------------------------------------------------------


class Replica:
    """A replica group process started by ``replicas``; its output goes to a log file."""

    def __init__(self, replica_id: str, process: subprocess.Popen[bytes], log: Path) -> None:
        self.replica_id, self.process, self.log = replica_id, process, log

    def lines(self, prefix: str) -> list[str]:
        try:
            text = self.log.read_text(errors="replace")
        except FileNotFoundError:
            return []
        return [ln[len(prefix) + 1:] for ln in text.splitlines() if ln.startswith(prefix + " ")]

    @property
    def address(self) -> str:
        found = wait_for(f"{self.replica_id}'s manager address", lambda: self.lines("MANAGER"), 20, interval=0.1)
        return found[0]

    def rounds(self) -> list[tuple[int, int, tuple[str, ...]]]:
        """(quorum id, the step this group sent, the participants) per successful round. As in
        torchft, the quorum id changes only with the membership; every round has new steps."""
        out = []
        for ln in self.lines("ROUND"):
            qid, step, parts = ln.split(" ")
            out.append((int(qid), int(step), tuple(sorted(parts.split(",")))))
        return out


def table(page: Any, table_id: str) -> dict[str, dict[str, Any]]:
    """A dashboard table as the user sees it: row key -> {column header: cell text, _cls: row class}."""
    return page.evaluate("""id => {
        const t = document.getElementById(id);
        const heads = [...t.querySelectorAll("thead th")].map(h => h.innerText.trim());
        const out = {};
        for (const tr of t.querySelectorAll("tbody tr")) {
            if (!tr.dataset.key) continue;
            const row = {_cls: tr.className};
            [...tr.cells].forEach((c, i) => { row[heads[i] || "_" + i] = c.innerText.trim(); });
            out[tr.dataset.key] = row;
        }
        return out;
    }""", table_id)


def text(page: Any, element_id: str) -> str:
    return page.inner_text(f"#{element_id}").strip()


def node_id(cluster: LocalCluster, i: int) -> str:
    return cluster.members[i].peer.node_id


@pytest.fixture
def browser(tmp_path: Path) -> Iterator[Any]:
    """A Chromium browser context with a fresh profile, or a skip saying what is missing. No page
    may throw an uncaught JavaScript error."""
    if not (os.path.isfile(CHROMIUM) and os.access(CHROMIUM, os.X_OK)):
        pytest.skip(f"no Chromium at {CHROMIUM} (apt-get install chromium chromium-driver)")
    try:
        from playwright.sync_api import sync_playwright
    except ImportError:
        pytest.skip("Playwright for Python is not installed (pip install -e '.[test]')")
    with sync_playwright() as p:
        context = p.chromium.launch_persistent_context(
            str(tmp_path / "chromium-profile"), executable_path=CHROMIUM, headless=True, args=CHROMIUM_ARGS,
            viewport={"width": 1200, "height": 800}, timeout=30_000)
        context.set_default_timeout(10_000)
        JS_ERRORS.clear()
        try:
            yield context
        finally:
            context.close()
        assert JS_ERRORS == [], JS_ERRORS


@pytest.fixture
def replicas(tmp_path: Path) -> Iterator[Callable[..., Replica]]:
    """Start replica group processes; every one still running is SIGKILLed at the end."""
    started: list[Replica] = []

    def start(replica_id: str, endpoint: str, endpoints: list[str], step_time_s: float,
              job: str | None = None) -> Replica:
        log = tmp_path / f"{replica_id}.log"
        # The package importable without an installed package too, and tests/ for ``support``.
        root, tests = str(Path(__file__).resolve().parents[2]), str(Path(__file__).resolve().parents[1])
        env = {**os.environ, "PYTHONUNBUFFERED": "1",
               "PYTHONPATH": os.pathsep.join(filter(None, [root, tests, os.environ.get("PYTHONPATH")]))}
        with open(log, "wb") as f:
            proc = subprocess.Popen(
                [sys.executable, __file__, "replica", replica_id, endpoint, ",".join(endpoints), str(step_time_s),
                 *([job] if job is not None else [])],
                stdout=f, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, env=env)
        r = Replica(replica_id, proc, log)
        started.append(r)
        return r

    yield start
    for r in started:
        if r.process.poll() is None:
            r.process.send_signal(signal.SIGKILL)
            r.process.wait(timeout=10)


def start_cluster(make_cluster: Callable[..., LocalCluster], **kwargs: Any) -> tuple[LocalCluster, int]:
    cluster = make_cluster(http_ports=free_ports(3), admin_token=TOKEN, heartbeat_timeout_ms=2000,
                           join_timeout_ms=2000, **kwargs)
    # Stable for a second: the nodes start within a few milliseconds of one another, and a second
    # start-up election (a node timing out on a loaded host, 150 ms) can follow the first.
    leader, _ = cluster.wait_for_stable_leader(timeout=30, stable_for=1.0)
    return cluster, leader


def leader_now(cluster: LocalCluster) -> str:
    """The node id of the serving leader now (a loaded host can still move it mid-test)."""
    i = cluster.leader_index()
    return node_id(cluster, i) if i is not None else "(none)"


JS_ERRORS: list[str] = []


def open_dashboard(browser: Any, cluster: LocalCluster, i: int, fragment: str = "") -> Any:
    page = browser.new_page()
    page.on("dialog", lambda dialog: dialog.accept())  # the kill button's "Kill replica ...?"
    page.on("pageerror", lambda error: JS_ERRORS.append(f"{node_id(cluster, i)}: {error}"))
    page.goto(f"http://{cluster.http_address(i)}/{fragment}")
    page.wait_for_function("document.getElementById('self').textContent === " + repr(node_id(cluster, i)))
    return page


def nodes_shown_correctly(page: Any, cluster: LocalCluster, leader: int) -> dict[str, Any] | None:
    """The Nodes table and the leader card agree with every node's own Status."""
    rows = table(page, "nodes")
    leader_id = node_id(cluster, leader)
    if sorted(rows) != sorted(node_id(cluster, i) for i in range(3)) or text(page, "leader") != leader_id:
        return None
    for i in range(3):
        st, row = cluster.status(i), rows[node_id(cluster, i)]
        if st is None or row["role"] != ("\u2605 leader" if st.role == cpb.LEADER else ROLES[st.role]):
            return None
        if row["term"] != str(st.term) or row["health"] != "healthy" or row["client address"] != st.node.client_address:
            return None
        if ("is-leader" in row["_cls"]) != (i == leader):
            return None
    if text(page, "term") != rows[leader_id]["term"] or text(page, "nodes-up") != "3 / 3":
        return None
    return rows


# -- tests ------------------------------------------------------------------------------------------


def test_dashboard_shows_cluster_quorum_and_live_heartbeats(make_cluster, browser, replicas, tmp_path) -> None:
    # Bound to [::] as `lighthouse-cluster up` binds them, opened at 127.0.0.1 as `up` prints.
    cluster, leader = start_cluster(make_cluster, client_bind_host="[::]")
    addrs = cluster.client_addresses
    # Two groups train for a few steps, then a third joins at step 0: it must show as recovering.
    g0 = replicas("g0", addrs[0], addrs, 2.0)
    g1 = replicas("g1", addrs[1], addrs, 2.0)
    wait_for("g0 and g1 past step 1", lambda: any(s >= 2 and len(p) == 2 for _, s, p in g0.rounds()),
             20, context=cluster.tail_logs, interval=0.1)
    g2 = replicas("g2", addrs[2], addrs, 2.0)
    managers = {r.replica_id: r.address for r in (g0, g1, g2)}

    page = open_dashboard(browser, cluster, leader)
    leader_id = node_id(cluster, leader)
    assert "(this node)" in table(page, "nodes")[leader_id]["node"]
    assert text(page, "ready").startswith("ready")
    wait_for("the Nodes table to match every node's Status", lambda: nodes_shown_correctly(page, cluster, leader),
             10, context=cluster.tail_logs, interval=0.1)

    # The quorum in which g2 joined: g2 recovering, at the step it sent; g0 and g1 ahead.
    def recovering_shown() -> Any:
        rows = table(page, "quorum")
        if set(rows) == {"g0", "g1", "g2"} and rows["g2"]["state"].startswith("recovering"):
            return rows, text(page, "qid")
        return None
    rows, qid = wait_for("g2 shown recovering in the current quorum", recovering_shown, 20, context=cluster.tail_logs,
                         interval=0.1)
    shot = tmp_path / "dashboard-leader.png"
    page.screenshot(path=str(shot), full_page=True)
    if os.environ.get(SCREENSHOT_ENV):
        page.screenshot(path=os.environ[SCREENSHOT_ENV], full_page=True)
    qid_n = int(qid.lstrip("#"))
    for rid, r in (("g0", g0), ("g1", g1), ("g2", g2)):
        # The group itself got this quorum, with the step shown for it.
        shown = (qid_n, int(rows[rid]["step"]), ("g0", "g1", "g2"))
        wait_for(f"{rid}'s own record of round {shown}", lambda r=r, shown=shown: shown in r.rounds(), 10, interval=0.1)
        assert rows[rid]["address"] == managers[rid]
        assert rows[rid]["store address"] == f"sim-store://{rid}"
        assert rows[rid]["world size"] == "1"
    assert rows["g0"]["state"] == rows["g1"]["state"] == "up to date"
    assert int(rows["g2"]["step"]) < int(rows["g0"]["step"]) == int(rows["g1"]["step"])
    assert "1 recovering" in text(page, "members-card")

    # The next round: everyone at the same step, which moves on round after round.
    def all_up_to_date() -> Any:
        rows = table(page, "quorum")
        steps = {r["step"] for r in rows.values()}
        ok = set(rows) == {"g0", "g1", "g2"} and {r["state"] for r in rows.values()} == {"up to date"}
        return ok and len(steps) == 1 and steps.pop()
    step = wait_for("every member up to date", all_up_to_date, 20, context=cluster.tail_logs, interval=0.1)
    wait_for("the step to move on", lambda: all_up_to_date() not in (False, step), 10, context=cluster.tail_logs,
             interval=0.1)

    # Heartbeat ages are live: the page shows a new age for g0 without being reloaded.
    hb = table(page, "heartbeats")
    assert set(hb) >= {"g0", "g1", "g2"} and all(hb[r]["health"] == "healthy" for r in ("g0", "g1", "g2")), hb
    assert re.fullmatch(r"\d+ ms", hb["g0"]["age"]), hb["g0"]
    first_age, first_update = hb["g0"]["age"], text(page, "updated")
    wait_for("g0's heartbeat age to change on the page",
             lambda: table(page, "heartbeats")["g0"]["age"] != first_age and text(page, "updated") != first_update, 10,
             interval=0.1)

    assert shot.stat().st_size > 10_000  # a rendered page, not a blank one

    # A follower's dashboard shows the same cluster, from its own point of view.
    follower = (leader + 1) % 3
    fpage = open_dashboard(browser, cluster, follower)
    wait_for("the follower's Nodes table", lambda: nodes_shown_correctly(fpage, cluster, leader), 10,
             context=cluster.tail_logs, interval=0.1)
    assert "(this node)" in table(fpage, "nodes")[node_id(cluster, follower)]["node"]
    assert "(this node)" not in table(fpage, "nodes")[leader_id]["node"]
    wait_for("the follower's quorum and heartbeats",
             lambda: set(table(fpage, "quorum")) == {"g0", "g1", "g2"}
             and set(table(fpage, "heartbeats")) >= {"g0", "g1", "g2"}, 10, interval=0.1)
    fpage.screenshot(path=str(tmp_path / "dashboard-follower.png"), full_page=True)


def test_kill_button_and_leader_failover(make_cluster, browser, replicas, tmp_path) -> None:
    cluster, leader = start_cluster(make_cluster)
    addrs = cluster.client_addresses
    groups = {rid: replicas(rid, addrs[k], addrs, 0.5) for k, rid in enumerate(("g0", "g1", "g2"))}
    page = open_dashboard(browser, cluster, leader)
    follower = (leader + 1) % 3
    fpage = open_dashboard(browser, cluster, follower)
    wait_for("all three groups in the quorum on the page", lambda: set(table(page, "quorum")) == {"g0", "g1", "g2"},
             20, context=cluster.tail_logs, interval=0.1)
    victim = groups["g1"]
    kill_button = page.locator('#quorum tr[data-key="g1"] button')
    assert kill_button.inner_text() == "kill" and kill_button.is_enabled()

    # Without the token, and with a wrong one: refused, and the page says so; g1 lives on.
    kill_button.click()
    wait_for("the refusal on the page", lambda: "refused (401): enter the admin token" in text(page, "kill-result"), 10,
             interval=0.1)
    assert "Bearer" in text(page, "kill-result")
    page.fill("#token", "not-the-token")
    kill_button.click()
    wait_for("the second refusal", lambda: "refused (401): the admin token was not accepted"
             in text(page, "kill-result"), 10, interval=0.1)
    assert victim.process.poll() is None and victim.lines("KILLED") == []

    # With the token: the replica group's manager gets the Kill and its process exits.
    page.fill("#token", TOKEN)
    kill_button.click()
    wait_for("the kill confirmed on the page", lambda: text(page, "kill-result") == f"killed g1 at {victim.address}",
             10, context=lambda: text(page, "kill-result"), interval=0.1)
    assert victim.process.wait(timeout=10) == KILLED_EXIT
    killed_by = victim.lines("KILLED")
    assert len(killed_by) == 1 and f"node {node_id(cluster, leader)}" in killed_by[0], killed_by
    assert all(g.process.poll() is None for rid, g in groups.items() if rid != "g1")

    # The dashboard follows: g1's heartbeat goes stale, and the next quorum goes on without it.
    # The leader learns of the death from g1's manager server's closed connection (it is declared
    # dead and its heartbeat forgotten: gone from the table) or, without that, when its heartbeat
    # goes stale (shown unhealthy).
    wait_for("g1's heartbeat gone or shown unhealthy",
             lambda: table(page, "heartbeats").get("g1", {"health": "unhealthy"})["health"] == "unhealthy", 15,
             interval=0.1)
    wait_for("a quorum without g1", lambda: set(table(page, "quorum")) == {"g0", "g2"}, 20, context=cluster.tail_logs,
             interval=0.1)
    assert table(page, "heartbeats").get("g1", {"in quorum": "no"})["in quorum"] == "no"

    # SIGKILL the leader: its page says its status is unavailable; the follower's page shows the
    # new leader and the old one unreachable. The leader now: a second start-up election (a node
    # timing out on a loaded machine) may have moved it since the test began.
    now = cluster.wait_for_agreed_leader(timeout=30)
    if now != leader:
        leader, follower = now, (now + 1) % 3
        page, fpage = open_dashboard(browser, cluster, leader), open_dashboard(browser, cluster, follower)
    old_id = node_id(cluster, leader)
    wait_for("the follower's page to show the leader", lambda: text(fpage, "leader") == old_id, 10, interval=0.1)
    old_term = int(text(fpage, "term"))
    cluster.kill(leader)
    new_leader = cluster.wait_for_leader(timeout=20, exclude_term=old_term)
    new_id = node_id(cluster, new_leader)
    t0 = time.monotonic()
    wait_for("the follower's dashboard to show the new leader",
             lambda: text(fpage, "leader") == new_id
             and table(fpage, "nodes")[old_id]["health"] == "unreachable"
             and table(fpage, "nodes")[new_id]["role"] == "\u2605 leader", 10, context=cluster.tail_logs, interval=0.1)
    shown_after = time.monotonic() - t0
    assert shown_after < 5, f"the new leader took {shown_after:.1f}s to appear after it was elected"
    assert int(text(fpage, "term")) > old_term
    assert text(fpage, "nodes-up") == "2 / 3"
    wait_for("the dead leader's page to say so", lambda: "status unavailable" in text(page, "banner"), 10, interval=0.1)
    # The surviving groups go on through the new leader, and the page shows their rounds.
    steps_before = {r["step"] for r in table(fpage, "quorum").values()}
    wait_for("rounds through the new leader", lambda: set(table(fpage, "quorum")) == {"g0", "g2"}
             and not {r["step"] for r in table(fpage, "quorum").values()} & steps_before, 20, context=cluster.tail_logs,
             interval=0.1)
    fpage.screenshot(path=str(tmp_path / "dashboard-after-failover.png"), full_page=True)


def test_dashboard_shows_every_job(make_cluster, browser, replicas, tmp_path) -> None:
    """A second job beside the default one: the Jobs table lists both; the job's own view (its
    settings, ports, config, quorum, heartbeats) is the leader's, on a follower's page too; its
    kill button kills that job's member, and the default job's view is unchanged."""
    cluster, leader = start_cluster(make_cluster)
    addrs = cluster.client_addresses
    ports = {node_id(cluster, i): p for i, p in enumerate(free_ports(3))}  # each node its own: all on loopback
    add_job(cluster, TOKEN, "train-b", settings=cpb.JobSettingsUpdate(min_replicas=1, heartbeat_timeout_ms=3000),
            ports=[cpb.JobPort(node_id=n, port=p) for n, p in ports.items()],
            config=[cpb.ConfigEntry(key="dataset", value="c4"), cpb.ConfigEntry(key="lr", value="3e-4")])
    g0 = replicas("g0", addrs[0], addrs, 0.5)
    b = {rid: replicas(rid, addrs[k + 1], addrs, 0.5, job="train-b") for k, rid in enumerate(("b0", "b1"))}

    follower = (leader + 1) % 3
    page = open_dashboard(browser, cluster, follower)
    wait_for("both jobs in the Jobs table", lambda: sorted(table(page, "jobs")) == ["default", "train-b"], 20,
             context=cluster.tail_logs, interval=0.1)
    wait_for("train-b's two members in the Jobs table", lambda: table(page, "jobs")["train-b"]["members"] == "2", 20,
             context=cluster.tail_logs, interval=0.1)
    jobs = table(page, "jobs")
    assert jobs["train-b"]["config"] == "dataset=c4, lr=3e-4"
    assert jobs["train-b"]["ports"] == ", ".join(f"{n}: {p}" for n, p in sorted(ports.items()))
    assert jobs["default"]["ports"] == "the client port" and "is-selected" in jobs["default"]["_cls"]
    assert text(page, "job-card") == "default"
    wait_for("the Jobs table's note naming the leader", lambda: text(page, "jobsinfo").startswith(
        f"heartbeating replicas and waiting requesters as the leader {leader_now(cluster)} sees them"), 10,
        context=lambda: text(page, "jobsinfo"), interval=0.1)

    # The job's own view, selected in the table.
    page.click('#jobs tr[data-key="train-b"] a')
    page.wait_for_function("document.getElementById('job-card').textContent === 'train-b'")
    assert page.url.endswith("#job=train-b") and page.input_value("#job") == "train-b"
    assert "is-selected" in table(page, "jobs")["train-b"]["_cls"]
    settings = {k: r["value"] for k, r in table(page, "settings").items()}
    assert settings["min_replicas"] == "1" and settings["heartbeat_timeout_ms"] == "3000"
    assert {k: r["value"] for k, r in table(page, "config").items()} == {"dataset": "c4", "lr": "3e-4"}
    assert {r["node"]: r["port"] for r in table(page, "ports").values()} == {n: str(p) for n, p in ports.items()}

    def members_shown() -> Any:
        rows = table(page, "quorum")
        return set(rows) == {"b0", "b1"} and rows
    rows = wait_for("train-b's quorum on the page", members_shown, 20, context=cluster.tail_logs, interval=0.1)
    qid = int(text(page, "qid").split(" ")[0].lstrip("#"))
    assert text(page, "qid") == f"#{qid} (job train-b)"
    for rid, r in b.items():
        assert rows[rid]["address"] == r.address
        wait_for(f"{rid}'s own record of quorum {qid}", lambda r=r: any(q == qid for q, _, _ in r.rounds()), 10,
                 interval=0.1)
    assert g0.rounds() and all(p == ("g0",) for _, _, p in g0.rounds())  # each job's quorums are its own
    wait_for("train-b's heartbeats, as the leader sees them",
             lambda: set(table(page, "heartbeats")) == {"b0", "b1"}, 10, interval=0.1)
    wait_for("the heartbeats' note naming the leader", lambda: text(page, "hbinfo").startswith(
        f"as the leader {leader_now(cluster)} last heard them"), 10, context=lambda: text(page, "hbinfo"), interval=0.1)
    page.screenshot(path=str(tmp_path / "dashboard-job.png"), full_page=True)

    # Its kill button kills train-b's member through this (follower) node.
    page.fill("#token", TOKEN)
    page.locator('#quorum tr[data-key="b1"] button').click()
    victim = b["b1"]
    wait_for("the kill confirmed on the page", lambda: text(page, "kill-result")
             == f"killed b1 of job train-b at {victim.address}", 10, context=lambda: text(page, "kill-result"),
             interval=0.1)
    assert victim.process.wait(timeout=10) == KILLED_EXIT
    assert b["b0"].process.poll() is None and g0.process.poll() is None
    wait_for("a train-b quorum without b1", lambda: set(table(page, "quorum")) == {"b0"}, 20, context=cluster.tail_logs,
             interval=0.1)

    # The default job, chosen in the selector: its own quorum, as before jobs.
    page.select_option("#job", "default")
    page.wait_for_function("document.getElementById('job-card').textContent === 'default'")
    wait_for("the default job's quorum", lambda: set(table(page, "quorum")) == {"g0"}, 10, interval=0.1)
    assert not page.url.endswith("#job=train-b")
    assert {k: r["value"] for k, r in table(page, "settings").items()}["heartbeat_timeout_ms"] == "2000"
    assert table(page, "config") == {}  # no rows: "no config"

    # A link to a job's view opens it, on the leader's page too.
    lpage = open_dashboard(browser, cluster, leader, "#job=train-b")
    lpage.wait_for_function("document.getElementById('job-card').textContent === 'train-b'")
    wait_for("the leader's page shows train-b's quorum", lambda: set(table(lpage, "quorum")) == {"b0"}, 10,
             interval=0.1)
