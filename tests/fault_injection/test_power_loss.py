"""Power losses (issue 32): the lazy filesystem, and a node's Raft state through it.

* ``LazyFiles`` (pure, unit tests): a write survives a power loss only once its file was synced,
  a name only once its directory was; what was lost is reported.
* Mounted (integration, FUSE; ~1 s): the same through real system calls, and the project's own
  Raft journal on it, synced and not: it keeps every entry ``sync()`` returned for, term and vote
  included; with ``--unsafe-no-fsync`` it loses the file altogether.
* A cluster (integration, serial on the fault harness; ~35 s): one schedule, run with syncing on and with
  ``--unsafe-no-fsync``: a follower paused, the two other nodes lose power together, restart and
  serve before the paused one is back (the survivor that could have carried the committed log is
  out of the picture), later the leader alone loses power. Without fsync the two restarted nodes
  come back with empty logs, elect a leader and issue quorum ids again from the start: the
  checkers find it (ids going back, one id with two member sets, acknowledged quorums missing
  from the logs). With fsync the same schedule passes every checker.

Runs need FUSE (``/dev/fuse``, Debian's fuse3, mfusepy: pyproject's test extra; ``.ci/run``
installs fuse3); without it the mounted tests skip with the reason (a failure in CI, where the
skip is not expected).
"""

from __future__ import annotations

import os
import shutil
import tempfile
from pathlib import Path

import pytest

from support.run_lock import serial_on

from jepsen_like.clients import ClientSettings, job_names
from jepsen_like.cluster import ClusterSettings
from jepsen_like.history import NEMESIS, OK, read_history
from jepsen_like.lazyfs import LazyFiles, LazyMount, available
from jepsen_like.runner import RunOptions, RunResult, run_schedule
from jepsen_like.schedule import FaultOp, Schedule

# -- the model -----------------------------------------------------------------------------------------


def write_file(fs: LazyFiles, path: str, data: bytes, sync: bool = False) -> int:
    ino = fs.create(path, 0o644)
    fs.write(ino, data, 0)
    if sync:
        fs.fsync(ino)
    return ino


def test_a_write_survives_a_power_loss_only_once_its_file_was_synced() -> None:
    fs = LazyFiles()
    a = write_file(fs, "/a", b"synced", sync=True)
    fs.fsync(fs.lookup("/"))                        # the name too
    fs.write(a, b"unsynced tail", 6)
    fs.write(write_file(fs, "/b", b"never synced"), b"!", 0)
    lost = fs.lose_power()
    assert fs.read(fs.lookup("/a"), 100, 0) == b"synced"
    assert fs.listdir("/") == ["a"]                 # /b's name was never synced either
    assert lost["reverted"] == [{"path": "/a", "size": 19, "synced_size": 6},
                                {"path": "/b", "size": 12, "synced_size": 0}]
    assert lost["names_lost"] == ["/b"] and lost["unsynced_bytes"] == 25
    assert fs.lose_power() == {"reverted": [], "names_lost": [], "names_back": [], "unsynced_bytes": 0}


def test_a_rename_survives_only_once_its_directory_was_synced() -> None:
    fs = LazyFiles()
    write_file(fs, "/meta", b"term 1", sync=True)
    fs.fsync(fs.lookup("/"))
    write_file(fs, "/meta.tmp", b"term 2", sync=True)   # the temp file synced, as it should be...
    fs.rename("/meta.tmp", "/meta")
    fs.lose_power()                                      # ...but not the directory after the rename
    assert fs.read(fs.lookup("/meta"), 100, 0) == b"term 1" and fs.listdir("/") == ["meta"]
    write_file(fs, "/meta.tmp", b"term 2", sync=True)
    fs.rename("/meta.tmp", "/meta")
    fs.fsync(fs.lookup("/"))
    lost = fs.lose_power()
    assert fs.read(fs.lookup("/meta"), 100, 0) == b"term 2" and lost["names_back"] == []


def test_an_unlink_not_synced_comes_back_and_a_truncate_is_data() -> None:
    fs = LazyFiles()
    ino = write_file(fs, "/f", b"0123456789", sync=True)
    fs.mkdir("/d", 0o755)
    fs.fsync(fs.lookup("/"))
    fs.truncate(ino, 3)
    fs.unlink("/f")
    lost = fs.lose_power()
    assert fs.read(fs.lookup("/f"), 100, 0) == b"0123456789" and lost["names_back"] == ["/f"]
    assert fs.listdir("/") == ["d", "f"]


def test_a_directory_loads_as_durable_and_dumps_as_it_is(tmp_path: Path) -> None:
    (tmp_path / "in" / "sub").mkdir(parents=True)
    (tmp_path / "in" / "sub" / "x").write_bytes(b"x")
    (tmp_path / "in" / "y").write_bytes(b"y")
    fs = LazyFiles()
    fs.load(tmp_path / "in")
    fs.lose_power()
    assert fs.read(fs.lookup("/sub/x"), 9, 0) == b"x" and fs.listdir("/") == ["sub", "y"]
    fs.unlink("/y")
    out = tmp_path / "out"
    out.mkdir()
    (out / "stale").write_bytes(b"")
    fs.dump(out)
    assert sorted(p.relative_to(out).as_posix() for p in out.rglob("*")) == ["sub", "sub/x"]


def test_power_faults_are_opt_in_and_a_majority_is_drawn_for_a_majority_loss() -> None:
    from jepsen_like import schedule

    assert not set(schedule.POWER_FAULTS) & set(schedule.DEFAULT_FAULTS)   # every seed's default schedule as before
    assert not schedule.uses_power_faults(schedule.generate(7, time_limit_s=60))
    for nodes in (3, 5):
        s = schedule.generate(5, nodes=nodes, time_limit_s=120, nemeses=schedule.POWER_FAULTS)
        assert schedule.uses_power_faults(s)
        for op in (op for op in s.ops if op.f == "lose-power-majority"):
            assert len(op.args["nodes"]) == nodes // 2 + 1 and len(set(op.args["nodes"])) == len(op.args["nodes"])
        assert {op.f for op in s.ops} == {"lose-power", "lose-power-majority", "recover"}
        assert schedule.Schedule.loads(s.dumps()).ops == s.ops


# -- mounted -----------------------------------------------------------------------------------------------


def need_fuse() -> None:
    ok, why = available()
    if not ok:
        pytest.skip(f"lazy filesystem unavailable: {why}")


@pytest.fixture
def mount(tmp_path: Path):  # type: ignore[no-untyped-def]
    need_fuse()
    with LazyMount(tmp_path / "data") as m:
        yield m


@pytest.mark.integration
def test_system_calls_on_the_mount_lose_exactly_what_was_not_synced(mount: LazyMount) -> None:
    d = mount.directory
    fd = os.open(d / "kept", os.O_WRONLY | os.O_CREAT, 0o644)
    os.write(fd, b"kept")
    os.fsync(fd)
    os.close(fd)
    dfd = os.open(d, os.O_RDONLY | os.O_DIRECTORY)
    os.fsync(dfd)
    os.close(dfd)
    (d / "lost").write_bytes(b"lost")
    with open(d / "kept", "ab") as f:
        f.write(b" and more")
    assert (d / "kept").read_bytes() == b"kept and more"
    lost = mount.lose_power()
    assert sorted(os.listdir(d)) == ["kept"] and (d / "kept").read_bytes() == b"kept"
    assert lost["names_lost"] == ["/lost"]


@pytest.mark.integration
def test_the_journal_keeps_what_it_synced_and_without_fsync_loses_everything(mount: LazyMount) -> None:
    from lighthouse_cluster.raft.durable_journal import DurableJournal

    d = mount.directory
    durable = DurableJournal(str(d / "synced" / "raft.journal"))
    unsafe = DurableJournal(str(d / "unsynced" / "raft.journal"), sync=False)   # --unsafe-no-fsync
    for journal in (durable, unsafe):
        for i in range(1, 6):
            journal.add(b"\x00entry %d" % i, i, 1)
        journal.sync()                                    # what the node does before it acknowledges
        journal.setCurrentTerm(2, "n2")                   # before it votes
        journal.add(b"\x00entry 6", 6, 2)                 # appended, not yet synced: may be lost
    reader = DurableJournal(str(d / "unsynced" / "raft.journal"), sync=False)
    assert len(reader) == 5                                # all there, until...
    reader.close()
    lost = mount.lose_power()
    for dead in (durable, unsafe):                       # the "machine" is gone: its files are closed
        dead.close()
    again = DurableJournal(str(d / "synced" / "raft.journal"))
    assert [again[i][1] for i in range(len(again))] == [1, 2, 3, 4, 5]
    assert (again.getCurrentTerm(), again.getVotedForNodeId()) == (2, "n2")
    again.close()
    # Never synced: the directory, the journal and the meta file are gone, acknowledged or not
    # (pysyncobj's own FileJournal, an mmap never flushed, is the same; it cannot run here: the
    # lazy filesystem serves no shared mmap).
    assert not (d / "unsynced").exists() and "/unsynced/raft.journal" in lost["names_lost"]


# -- a cluster -------------------------------------------------------------------------------------------

# A follower paused; the other two lose power together and restart, and serve for 4 s before the
# paused one is back; later the leader alone loses power. The same for both runs.
POWER_LOSS_OPS = [
    (2.5, "pause", {"node": 2}),
    (4.0, "lose-power-majority", {"nodes": [0, 1]}),
    (4.3, "restart", {"node": 0}),
    (4.3, "restart", {"node": 1}),
    (9.0, "recover", {}),
    (11.0, "lose-power", {"node": "leader"}),
    (12.0, "recover", {}),
]
# Any of these shows committed quorums lost: ids issued again from the start.
LOSS_CHECKERS = {"monotonic-quorum-ids", "no-split-brain", "acknowledged-committed"}


def power_loss_run(directory: Path, unsafe_no_fsync: bool) -> RunResult:
    schedule = Schedule(seed=32, nodes=3, clients=4, time_limit_s=14.0, name="ci-power-loss",
                        ops=[FaultOp(t, f, a) for t, f, a in POWER_LOSS_OPS])
    options = RunOptions(backend="none", cluster=ClusterSettings(unsafe_no_fsync=unsafe_no_fsync),
                         clients=ClientSettings(jobs=job_names(1)))
    return run_schedule(directory, schedule, options)


def lost_reports(result: RunResult) -> list[dict]:
    return [e["value"]["lost"] for e in read_history(result.directory / "history.jsonl")
            if e["process"] == NEMESIS and e["type"] == OK and e["f"].startswith("lose-power")]


def explain(result: RunResult) -> str:
    return "\n".join([f"{c.status} {c.name}: {c.summary}\n    {c.offending[:2]}" for c in result.checks]
                     + [f"ERROR {e}" for e in result.errors] + [f"run directory: {result.directory}"])


@pytest.mark.integration
@serial_on("fault-harness")  # 3 nodes, 3 FUSE processes, 4 clients: one harness run at a time
@pytest.mark.low_cpu  # a fixed-length schedule: about a third of a core
@pytest.mark.timeout(240)
def test_a_majority_power_loss_loses_committed_quorums_without_fsync_and_nothing_with_it() -> None:
    need_fuse()
    base = Path(os.environ.get("JEPSEN_RUNS_DIR") or tempfile.mkdtemp(prefix="jepsen-ci-power-loss-"))
    unsafe = power_loss_run(base / "unsafe-no-fsync", unsafe_no_fsync=True)
    safe = power_loss_run(base / "fsync", unsafe_no_fsync=False)

    # Without fsync: both nodes lost their whole journal (never synced) and the checkers see the
    # committed quorums go.
    majority = lost_reports(unsafe)[0]
    assert sorted(majority) == ["n1", "n2"]
    for node, lost in majority.items():
        assert "/raft.journal" in lost["names_lost"], (node, lost)
    failed = {c.name for c in unsafe.checks if not c.valid}
    assert failed & LOSS_CHECKERS, explain(unsafe)

    # With fsync: every checker passes; what a power loss took was at most an unacknowledged tail.
    assert safe.valid, explain(safe)
    reports = lost_reports(safe)
    assert len(reports) == 2
    for lost in (r for report in reports for r in report.values()):
        assert "/raft.journal" not in lost["names_lost"] and "/raft.journal.meta" not in lost["names_lost"], lost
    assert safe.counts["client"]["quorum"]["ok"] > 50
    if not os.environ.get("JEPSEN_RUNS_DIR"):
        shutil.rmtree(base, ignore_errors=True)
