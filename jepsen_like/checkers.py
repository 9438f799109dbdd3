"""Checkers: pure functions from a history (a list of event dicts) to PASS/FAIL.

Each checker returns a ``CheckResult`` naming the offending events (at most ``MAX_OFFENDING``
of them, plus a count). They read only the history: client operations, the nemesis's actions,
the monitor's status observations and the ``journal`` process's ``final-state`` events (each
node's committed log, replayed after the run; see ``jepsen_like.journal.summarize``).

Jobs (``lighthouse_cluster/core/jobs.py``): every client operation names its job, and each job's
quorum ids are a namespace of their own, so every quorum property is checked per job (an id of
one job says nothing about another's); a history from before jobs is the default job's alone.
Leaders, logs and heals are the cluster's, not a job's.

* ``no_split_brain``: no quorum id of a job has two member sets, in what clients were told or in
  any node's committed log.
* ``monotonic_quorum_ids``: a client never sees a quorum id go down, and an operation invoked
  after another one of the same job completed never returns a lower id (real-time order).
* ``acknowledged_committed``: every quorum a client received is in its job's committed quorums
  in the log of every node at the end of the run.
* ``jobs_isolated``: no quorum of a job (told to a client, or committed) has a member that is
  another job's replica group.
* ``one_leader_per_term``: no two nodes lead the same term, neither in the committed log
  (``TermStart`` and ``CommitQuorum`` carry the writer's term and id) nor as observed.
* ``recovery_after_heal``: after each ``recover`` (the cluster healthy again) held for at least
  ``bound_s``, every client that keeps asking gets a quorum within ``bound_s``.
* ``survivor_wait``: after each client kill (``kill-client``), every surviving client of its job
  gets a quorum without the killed one within ``bound_s``; reports how long (median and max per run).
* ``durable_after_restart_all``: after every node is killed and restarted, each job's quorum ids
  are at least the highest acknowledged for it before.
* ``logs_agree``: nodes' committed logs are identical where they overlap (digests), and nodes
  that replayed their logs to the same index hold the same state of every job.
* ``kv_cas_linearizable`` (only in a history with key-value operations): the compare-and-set
  increments of the KV clients' register lose no acknowledged write and apply none twice (the
  model is in its docstring).
"""

from __future__ import annotations

import statistics
from collections import defaultdict
from dataclasses import dataclass, field
from typing import Any, Callable, Sequence

from lighthouse_cluster.core.jobs import DEFAULT_JOB

from .history import (FAIL, INFO, JOURNAL, KV_CAS, KV_FINAL, KV_FS, KV_READ, MONITOR, NEMESIS, OK, Event, Operation,
                      is_client, job_of, pair_operations)
from .schedule import CLIENT_FAULTS, RESTORING

MAX_OFFENDING = 20
DEFAULT_RECOVERY_BOUND_S = 10.0
SURVIVOR_WAIT_MARGIN_S = 2.0


def survivor_wait_bound(heartbeat_timeout_ms: int, join_timeout_ms: int, margin_s: float = SURVIVOR_WAIT_MARGIN_S) -> float:
    """The default bound on a survivor's wait after a client kill: the nodes' heartbeat timeout
    (until then the dead group still counts as healthy, so the quorum waits for it) plus the join
    timeout plus a margin. Generous on purpose while deaths are learnt from heartbeats going
    stale; liveness streams (docs/ftclient.md, "Liveness") should let it come down to about a
    second."""
    return round(heartbeat_timeout_ms / 1000 + join_timeout_ms / 1000 + margin_s, 3)


# The harness's node settings (``cluster.ClusterSettings``: 500 ms heartbeat timeout, 1 s join).
DEFAULT_SURVIVOR_WAIT_BOUND_S = survivor_wait_bound(500, 1000)


@dataclass
class CheckResult:
    name: str
    valid: bool
    summary: str
    offending: list[Any] = field(default_factory=list)
    count: int = 0          # how many offences in all (offending is truncated)
    figures: dict[str, Any] = field(default_factory=dict)   # measurements a checker reports

    @property
    def status(self) -> str:
        return "PASS" if self.valid else "FAIL"

    def to_json(self) -> dict[str, Any]:
        d = {"name": self.name, "status": self.status, "valid": self.valid, "summary": self.summary,
             "count": self.count, "offending": self.offending}
        if self.figures:
            d["figures"] = self.figures
        return d


def _result(name: str, offending: list[Any], ok_summary: str, fail_summary: str) -> CheckResult:
    if offending:
        return CheckResult(name, False, fail_summary.format(n=len(offending)), offending[:MAX_OFFENDING],
                           len(offending))
    return CheckResult(name, True, ok_summary)


def _members(value: Any) -> tuple[str, ...]:
    return tuple(sorted(value.get("participants") or ()))


def _quorum_oks(history: Sequence[Event]) -> list[Event]:
    return [e for e in history if e["f"] == "quorum" and e["type"] == OK and is_client(e["process"])
            and isinstance(e.get("value"), dict) and e["value"].get("quorum_id") is not None]


def committed_quorums(state: dict[str, Any]) -> list[tuple[str, int, list[str], int, int]]:
    """A node's committed quorums from its ``final-state``: (job, id, member ids, first index,
    term); a summary from before jobs (four fields) is the default job's."""
    return [(str(q[4]) if len(q) > 4 else DEFAULT_JOB, q[0], q[1], q[2], q[3]) for q in state.get("quorums", [])]


def _unverifiable(state: dict[str, Any], job: str, qid: int) -> bool:
    """Whether ``job``'s quorum id ``qid`` falls in a stretch of the node's log known only from a
    snapshot older than its history window."""
    return any(r[0] < qid < r[1] for r in state.get("unverifiable_quorum_ids", [])
               if (str(r[2]) if len(r) > 2 else DEFAULT_JOB) == job)


def replica_jobs(history: Sequence[Event]) -> dict[str, set[str]]:
    """Replica id -> the jobs its client operations named (one, unless the harness is wrong)."""
    out: dict[str, set[str]] = defaultdict(set)
    for e in history:
        if is_client(e["process"]) and e["f"] in ("quorum", "heartbeat"):
            out[e["process"]].add(job_of(e))
    return out


def final_states(history: Sequence[Event]) -> dict[str, dict[str, Any]]:
    """node -> the last ``final-state`` value recorded for it."""
    out: dict[str, dict[str, Any]] = {}
    for e in history:
        if e["process"] == JOURNAL and e["f"] == "final-state" and isinstance(e.get("value"), dict):
            out[e.get("node") or "?"] = e["value"]
    return out


# -- safety --------------------------------------------------------------------------------------


def no_split_brain(history: Sequence[Event]) -> CheckResult:
    seen: dict[tuple[str, int], dict[tuple[str, ...], Any]] = defaultdict(dict)
    for e in _quorum_oks(history):
        seen[(job_of(e), e["value"]["quorum_id"])].setdefault(_members(e["value"]), e)
    for node, st in final_states(history).items():
        for job, qid, members, first_index, term in committed_quorums(st):
            seen[(job, qid)].setdefault(tuple(sorted(members)),
                                        {"process": JOURNAL, "node": node, "job": job, "quorum_id": qid,
                                         "participants": members, "log_index": first_index, "term": term})
    offending = [{"job": job, "quorum_id": qid, "member_sets": [list(m) for m in sets],
                  "witnesses": list(sets.values())}
                 for (job, qid), sets in sorted(seen.items()) if len(sets) > 1]
    return _result("no-split-brain", offending,
                   f"{len(seen)} quorum ids{_of_jobs(k[0] for k in seen)}, each with one member set",
                   "{n} quorum ids of a job were given two or more member sets")


def _of_jobs(jobs: Any) -> str:
    names = sorted(set(jobs))
    return f" of {len(names)} jobs" if len(names) > 1 else ""


def monotonic_quorum_ids(history: Sequence[Event]) -> CheckResult:
    offending: list[Any] = []
    last: dict[str, Event] = {}
    for e in _quorum_oks(history):
        prev = last.get(e["process"])
        if prev is not None and e["value"]["quorum_id"] < prev["value"]["quorum_id"]:
            offending.append({"kind": "client", "process": e["process"], "earlier": prev, "later": e})
        last[e["process"]] = e
    # Real time, within a job: an operation invoked after another one of its job completed must
    # not see a lower id.
    ops = [op for op in pair_operations(history, "quorum") if op.type == OK and is_client(op.process)
           and isinstance(op.value, dict) and op.value.get("quorum_id") is not None]
    by_job: dict[str, list[Operation]] = defaultdict(list)
    for op in ops:
        by_job[op.job].append(op)
    for job, job_ops in sorted(by_job.items()):
        by_end = sorted(job_ops, key=lambda op: op.end_ns)
        best: Any = None
        j = 0
        for op in sorted(job_ops, key=lambda op: op.start_ns):
            while j < len(by_end) and by_end[j].end_ns < op.start_ns:
                if best is None or by_end[j].value["quorum_id"] > best.value["quorum_id"]:
                    best = by_end[j]
                j += 1
            if best is not None and op.value["quorum_id"] < best.value["quorum_id"]:
                offending.append({"kind": "real-time", "job": job, "completed_before": best.complete,
                                  "invoked": op.invoke, "returned": op.complete})
    return _result("monotonic-quorum-ids", offending,
                   f"{len(ops)} quorum acknowledgements{_of_jobs(by_job)} in per-client and per-job real-time order",
                   "{n} quorum ids went backwards")


def acknowledged_committed(history: Sequence[Event]) -> CheckResult:
    states = final_states(history)
    oks = _quorum_oks(history)
    if not states:
        return CheckResult("acknowledged-committed", False,
                           "no final committed state recorded (the run did not finish): cannot check")
    offending: list[Any] = []
    unverifiable = 0
    acked: dict[tuple[str, int, tuple[str, ...]], Event] = {}
    for e in oks:
        acked.setdefault((job_of(e), e["value"]["quorum_id"], _members(e["value"])), e)
    for node, st in sorted(states.items()):
        committed = {(job, q, tuple(sorted(m))) for job, q, m, _i, _t in committed_quorums(st)}
        for (job, qid, members), e in acked.items():
            if (job, qid, members) in committed:
                continue
            if _unverifiable(st, job, qid):
                unverifiable += 1
                continue
            offending.append({"node": node, "job": job, "quorum_id": qid, "participants": list(members),
                              "acknowledged": e, "node_commit_index": st.get("commit_index")})
    extra = (f" ({unverifiable} fell in a stretch of a node's log known only from a snapshot, older than its "
             f"history window: not verifiable there)" if unverifiable else "")
    return _result("acknowledged-committed", offending,
                   f"{len(acked)} distinct acknowledged quorums{_of_jobs(k[0] for k in acked)} committed on all "
                   f"{len(states)} nodes{extra}",
                   "{n} acknowledged quorums missing from a node's committed log" + extra)


def jobs_isolated(history: Sequence[Event]) -> CheckResult:
    """No job's quorum holds another job's replica group: neither one a client was told (its
    participants) nor one committed in any node's log. A replica's job is the one its own client
    operations name; a replica that named two jobs is an offence too (the harness is wrong)."""
    jobs_of = replica_jobs(history)
    offending: list[Any] = [{"replica": r, "jobs": sorted(js), "problem": "one replica group named two jobs"}
                            for r, js in sorted(jobs_of.items()) if len(js) > 1]
    home = {r: next(iter(js)) for r, js in jobs_of.items() if len(js) == 1}
    checked = 0

    def strangers(job: str, members: Any) -> list[str]:
        return sorted(m for m in members if m in home and home[m] != job)

    for e in _quorum_oks(history):
        checked += 1
        job = job_of(e)
        if bad := strangers(job, e["value"].get("participants") or ()):
            offending.append({"job": job, "quorum_id": e["value"]["quorum_id"], "other_jobs_replicas":
                              {m: home[m] for m in bad}, "acknowledged": e})
    for node, st in sorted(final_states(history).items()):
        for job, qid, members, first_index, term in committed_quorums(st):
            checked += 1
            if bad := strangers(job, members):
                offending.append({"job": job, "quorum_id": qid, "other_jobs_replicas": {m: home[m] for m in bad},
                                  "node": node, "log_index": first_index, "term": term})
    jobs = sorted(set(home.values()))
    return _result("jobs-isolated", offending,
                   f"{checked} quorums of {len(jobs)} job{'s' if len(jobs) != 1 else ''} ({', '.join(jobs) or '-'}), "
                   f"none with another job's replica group",
                   "{n} quorums held another job's replica group")


def one_leader_per_term(history: Sequence[Event]) -> CheckResult:
    leaders: dict[int, dict[str, Any]] = defaultdict(dict)
    for node, st in final_states(history).items():
        for term, writers in st.get("leaders", {}).items():
            for w in writers:
                leaders[int(term)].setdefault(w, {"source": "committed log", "node": node, "term": int(term)})
    observed = 0
    for e in history:
        if e["process"] == MONITOR and e["f"] == "status" and isinstance(e.get("value"), dict) \
                and e["value"].get("role") == "leader":
            observed += 1
            leaders[int(e["value"]["term"])].setdefault(e["node"], e)
    offending = [{"term": t, "leaders": sorted(ws), "witnesses": list(ws.values())}
                 for t, ws in sorted(leaders.items()) if len(ws) > 1]
    if not leaders:
        return CheckResult("one-leader-per-term", False, "no leader observed or committed: cannot check")
    return _result("one-leader-per-term", offending,
                   f"{len(leaders)} terms with a leader, one each ({observed} leader observations)",
                   "{n} terms had two or more leaders")


def logs_agree(history: Sequence[Event]) -> CheckResult:
    states = final_states(history)
    offending: list[Any] = []
    by_index: dict[str, dict[str, str]] = defaultdict(dict)
    for node, st in states.items():
        for idx in st.get("conflicts", []):
            offending.append({"node": node, "index": idx, "problem": "committed entry changed between reads"})
        for idx, digest in st.get("digests", {}).items():
            by_index[idx][node] = digest
    compared = 0
    for idx, per_node in sorted(by_index.items(), key=lambda kv: int(kv[0])):
        if len(per_node) > 1:
            compared += 1
            if len(set(per_node.values())) > 1:
                offending.append({"index": int(idx), "digests": per_node, "problem": "committed logs differ"})
    # Nodes that replayed their committed logs to the same index hold the same state of every job
    # (the state machine is deterministic; a difference means their logs or replays differ).
    by_end: dict[Any, dict[str, Any]] = defaultdict(dict)
    for node, st in states.items():
        if "jobs" in st and st.get("replayed_to"):
            by_end[st["replayed_to"]][node] = {"jobs": st["jobs"], "retired": st.get("retired", {})}
    jobs_compared = 0
    for index, per_node in sorted(by_end.items()):
        if len(per_node) > 1:
            jobs_compared += 1
            first = next(iter(per_node.values()))
            if any(v != first for v in per_node.values()):
                offending.append({"index": index, "jobs": per_node,
                                  "problem": "nodes at the same index hold different job states"})
    if not states:
        return CheckResult("logs-agree", False, "no final committed state recorded: cannot check")
    jobs_note = f"; every job's state identical on nodes at the same index ({jobs_compared} compared)" \
        if jobs_compared else ""
    return _result("logs-agree", offending, f"committed logs identical at {compared} compared indexes{jobs_note}",
                   "{n} places where committed logs differ")


def durable_after_restart_all(history: Sequence[Event]) -> CheckResult:
    ops = sorted((op for op in pair_operations(history, "quorum") if op.type == OK and is_client(op.process)
                  and isinstance(op.value, dict)), key=lambda op: op.end_ns)
    restarts = [op for op in pair_operations(history, "restart-all") if op.process == NEMESIS and op.type == OK]
    offending: list[Any] = []
    for r in restarts:
        highest: dict[str, Operation] = {}
        for op in ops:
            if op.end_ns <= r.start_ns and (op.job not in highest
                                            or op.value["quorum_id"] > highest[op.job].value["quorum_id"]):
                highest[op.job] = op
        for op in ops:
            high = highest.get(op.job)
            if high is not None and op.start_ns >= r.end_ns and op.value["quorum_id"] < high.value["quorum_id"]:
                offending.append({"restart": r.complete, "job": op.job, "highest_before": high.complete,
                                  "after": op.complete})
    return _result("durable-after-restart-all", offending,
                   f"{len(restarts)} full-cluster restarts; ids afterwards never below those acknowledged before",
                   "{n} quorums after a full restart had a lower id than one acknowledged before it")


# -- liveness ---------------------------------------------------------------------------------------


def recovery_after_heal(history: Sequence[Event], bound_s: float = DEFAULT_RECOVERY_BOUND_S) -> CheckResult:
    """A client that asks after a heal must get a quorum within ``bound_s``. A heal followed by
    another fault, or by the end of the run, sooner than that is judged only for the clients that
    did get one: the others are inconclusive, not failures."""
    bound = int(bound_s * 1e9)
    nemesis_ops = [op for op in pair_operations(history) if op.process == NEMESIS]
    faults = sorted(op.start_ns for op in nemesis_ops if op.f not in RESTORING and op.f != "wait")
    heals = [op for op in nemesis_ops if op.f == "recover" and op.type == OK]
    client_end = max((e["time_ns"] for e in history if is_client(e["process"])), default=0)
    quorum_ops = [op for op in pair_operations(history, "quorum") if is_client(op.process)]
    offending: list[Any] = []
    checked = inconclusive = 0
    for h in heals:
        t0 = h.end_ns
        full = t0 + bound
        nxt = next((t for t in faults if t > t0), None)
        window_end = min(full, nxt if nxt is not None else full, client_end)
        for proc in sorted({op.process for op in quorum_ops if t0 <= op.start_ns <= window_end}):
            got = any(op.process == proc and op.type == OK and t0 <= op.end_ns <= window_end for op in quorum_ops)
            if got:
                checked += 1
            elif window_end < full:
                inconclusive += 1
            else:
                offending.append({"process": proc, "recover": h.complete, "bound_s": bound_s,
                                  "ops": [op.complete or op.invoke for op in quorum_ops
                                          if op.process == proc and t0 <= op.start_ns <= window_end][:5]})
    note = f" ({inconclusive} cut short by the next fault or the end)" if inconclusive else ""
    if not heals:
        return CheckResult("recovery-after-heal", False, "no recover action in the history: cannot check")
    return _result("recovery-after-heal", offending,
                   f"{checked} client recoveries after {len(heals)} heals, each within {bound_s:g}s{note}",
                   f"{{n}} times a client got no quorum within {bound_s:g}s of a heal{note}")


def survivor_wait(history: Sequence[Event], bound_s: float = DEFAULT_SURVIVOR_WAIT_BOUND_S) -> CheckResult:
    """For each client kill (a ``kill-client`` that succeeded, at its invocation): how long each
    survivor waited until it completed a quorum round whose members exclude the killed client.

    Survivors are the other clients of the killed client's job that were running at the kill (not
    in its ``clients_down``) and kept asking (a quorum call of theirs overlaps the window). The window runs from the kill
    to the next fault (any nemesis action but a restoring one) or the end of the run. Once the
    killed client is back (its first quorum call after the kill completed), a quorum naming it is
    legitimate again and ends a wait too (counted as ``rejoined``). A wait over ``bound_s``, or no
    such quorum in a window at least ``bound_s`` long, fails; a window shorter than that with no
    quorum yet is inconclusive. Figures, per kill: each survivor's wait and the time until every
    survivor had its quorum; per run: the median and max of the latter. No kill: passes."""
    bound = int(bound_s * 1e9)
    nemesis_ops = [op for op in pair_operations(history) if op.process == NEMESIS]
    faults = sorted(op.start_ns for op in nemesis_ops if op.f not in RESTORING and op.f != "wait")
    kills = [op for op in nemesis_ops if op.f in CLIENT_FAULTS and op.type == OK]
    client_end = max((e["time_ns"] for e in history if is_client(e["process"])), default=0)
    quorum_ops = [op for op in pair_operations(history, "quorum") if is_client(op.process)]
    job_of_client = {op.process: op.job for op in quorum_ops}
    offending: list[Any] = []
    per_kill: list[dict[str, Any]] = []
    waits_all: list[float] = []
    inconclusive = 0
    for k in kills:
        value = k.value if isinstance(k.value, dict) else {}
        victim = value.get("client") or (k.invoke.get("value") or {}).get("client")
        t0 = k.start_ns
        window_end = min(next((t for t in faults if t > t0), client_end), client_end)
        down_before = set(value.get("clients_down") or ()) - {victim}
        back = min((op.start_ns for op in quorum_ops if op.process == victim and k.end_ns is not None
                    and op.start_ns > k.end_ns), default=None)
        # Only the victim's job waits for it: another job's quorums never hold it (jobs-isolated).
        survivors = sorted({op.process for op in quorum_ops if op.process != victim and op.process not in down_before
                            and op.job == job_of_client.get(victim, op.job)
                            and op.start_ns <= window_end and (op.end_ns is None or op.end_ns > t0)})
        waits: dict[str, float] = {}
        rejoined: list[str] = []
        pending: list[str] = []
        for proc in survivors:
            done = next((op for op in sorted((o for o in quorum_ops if o.process == proc and o.type == OK
                                              and o.end_ns is not None and t0 < o.end_ns <= window_end),
                                             key=lambda o: o.end_ns)
                         if victim not in (op.value or {}).get("participants", ())
                         or (back is not None and op.end_ns > back)), None)
            if done is None:
                if window_end - t0 >= bound:
                    offending.append({"kill": k.complete, "client": victim, "survivor": proc, "bound_s": bound_s,
                                      "problem": f"no quorum without {victim} within {bound_s:g}s",
                                      "ops": [op.complete or op.invoke for op in quorum_ops if op.process == proc
                                              and op.start_ns <= window_end
                                              and (op.end_ns is None or op.end_ns > t0)][:5]})
                else:
                    pending.append(proc)
                continue
            wait = (done.end_ns - t0) / 1e9
            waits[proc] = round(wait, 3)
            waits_all.append(wait)
            if victim in (done.value or {}).get("participants", ()):
                rejoined.append(proc)
            if done.end_ns - t0 > bound:
                offending.append({"kill": k.complete, "client": victim, "survivor": proc, "bound_s": bound_s,
                                  "wait_s": round(wait, 3), "problem": f"waited {wait:.2f}s > {bound_s:g}s",
                                  "quorum": done.complete})
        inconclusive += len(pending)
        resolved = not pending and len(waits) == len(survivors)
        per_kill.append({"client": victim, "at_s": round(t0 / 1e9, 3), "survivors": survivors, "waits_s": waits,
                         "rejoined": rejoined, "inconclusive": pending,
                         "all_survivors_s": (max(waits.values()) if waits else 0.0) if resolved else None})
    totals = [p["all_survivors_s"] for p in per_kill if p["all_survivors_s"] is not None]
    figures = {"kills": len(kills), "bound_s": bound_s,
               "median_s": round(statistics.median(totals), 3) if totals else None,
               "max_s": round(max(totals), 3) if totals else None,
               "survivor_waits": len(waits_all), "inconclusive": inconclusive, "per_kill": per_kill}
    note = f" ({inconclusive} survivor waits cut short by the next fault or the end)" if inconclusive else ""
    if not kills:
        result = CheckResult("survivor-wait", True, "no client kills in the history")
    else:
        figs = (f"until every survivor had one: median {figures['median_s']:.2f}s, max {figures['max_s']:.2f}s"
                if totals else "no kill had all its survivors' waits resolved")
        result = _result("survivor-wait", offending,
                         f"{len(kills)} client kills, {len(waits_all)} survivor waits, each within {bound_s:g}s; "
                         f"{figs}{note}",
                         f"{{n}} survivor waits longer than {bound_s:g}s after a client kill; {figs}{note}")
    result.figures = figures
    return result


# -- the key-value store --------------------------------------------------------------------------

KVRegister = tuple[str, str, str]   # (job, run id, key)


def has_kv(history: Sequence[Event]) -> bool:
    """Whether the history has key-value operations (a run with KV clients)."""
    return any(e["f"] in KV_FS and is_client(e["process"]) for e in history)


def _kv_register(op: Operation) -> KVRegister:
    v = op.invoke.get("value") or {}
    return (op.job, str(v.get("run_id", "")), str(v.get("key", "")))


def _kv_observation(op: Operation) -> tuple[Any, Any] | None:
    """(version, value) of the register an operation saw, or None: a read's or the final read's
    answer, an applied compare-and-set's new version and the value it wrote, a lost one's
    ``current_version`` and ``current_value`` (None where a duplicate answer no longer knew it)."""
    v = op.value if isinstance(op.value, dict) else {}
    if op.f in (KV_READ, KV_FINAL) and op.type == OK:
        return v.get("version"), v.get("value")
    if op.f == KV_CAS and op.type == OK:
        return v.get("version"), v.get("to")
    if op.f == KV_CAS and op.type == FAIL and "current_version" in v:
        return v.get("current_version"), v.get("current_value")
    return None


def _kv_int(x: Any) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def _check_kv_register(reg: KVRegister, ops: list[Operation],
                       states: dict[str, dict[str, Any]]) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    """The offences of one register and its figures (see ``kv_cas_linearizable``)."""
    name = "/".join(reg)
    bad: list[dict[str, Any]] = []

    def offence(kind: str, problem: str, events: list[Any], **more: Any) -> None:
        bad.append({"register": name, "kind": kind, "problem": problem, **more, "events": events[:6]})

    def ev(op: Operation) -> Event:
        return op.complete or op.invoke

    cas = [op for op in ops if op.f == KV_CAS]
    acked = [op for op in cas if op.type == OK]
    failed = [op for op in cas if op.type == FAIL]
    unknown = [op for op in cas if op.type == INFO]   # never completed counts as info too
    for op in acked:
        v = op.value if isinstance(op.value, dict) else {}
        if v.get("applied") is not True or not _kv_int(v.get("version")) or not _kv_int(v.get("to")) \
                or not _kv_int(v.get("expected_version")):
            offence("malformed", "an acknowledged compare-and-set without applied, version, expected version and value",
                    [ev(op)])
    acked = [op for op in acked if op.value.get("applied") is True and _kv_int(op.value.get("version"))
             and _kv_int(op.value.get("to")) and _kv_int(op.value.get("expected_version"))]

    # 1-3: one acknowledged compare-and-set per expected version, per new version, per value.
    for field_name, problem in (
            ("expected_version", "two acknowledged compare-and-sets from the same version: one was applied "
                                 "twice, or an update was lost"),
            ("version", "two acknowledged compare-and-sets claim the same new version"),
            ("to", "two acknowledged compare-and-sets wrote the same value: an increment was lost or applied "
                   "twice")):
        groups: dict[int, list[Operation]] = defaultdict(list)
        for op in acked:
            groups[op.value[field_name]].append(op)
        for key, group in sorted(groups.items()):
            if len(group) > 1:
                offence("applied twice", problem, [ev(op) for op in group], **{field_name: key})
    # 4: the chain. Sorted by the value written, new versions strictly increase, each above the
    # version it was set from, and the writer of x + 1 set it from the version the writer of x made.
    chain = sorted(acked, key=lambda op: (op.value["to"], op.value["version"]))
    for op in chain:
        if op.value["version"] <= op.value["expected_version"]:
            offence("chain broken", "an acknowledged compare-and-set's new version is not above the version it expected", [ev(op)])
    for a, b in zip(chain, chain[1:]):
        if a.value["to"] == b.value["to"]:
            continue    # reported above
        if a.value["version"] >= b.value["version"]:
            offence("chain broken", f"acknowledged versions not increasing in the order of the values written: {a.value['to']} at "
                    f"version {a.value['version']}, {b.value['to']} at {b.value['version']}", [ev(a), ev(b)])
        elif b.value["to"] == a.value["to"] + 1 and b.value["expected_version"] != a.value["version"]:
            offence("chain broken", f"{b.value['to']} was written from version {b.value['expected_version']}, but "
                    f"{a.value['to']} was written at version {a.value['version']}", [ev(a), ev(b)])

    # 5: every observation (version, value): one value per version, values strictly increasing
    # with the version (every change is one increment), version 0 is value 0 (absent).
    obs: list[tuple[Operation, int, Any]] = []
    for op in ops:
        o = _kv_observation(op)
        if o is None:
            continue
        version, value = o
        if not _kv_int(version) or not (value is None or _kv_int(value)):
            offence("malformed", "the register held something other than a counter", [ev(op)])
            continue
        obs.append((op, version, value))
    by_version: dict[int, tuple[Operation, int]] = {}
    for op, version, value in obs:
        if value is None:
            continue
        if version == 0 and value != 0:
            offence("non-monotonic", f"the register read {value} at version 0 (absent)", [ev(op)])
        first = by_version.setdefault(version, (op, value))
        if first[1] != value:
            offence("non-monotonic", f"version {version} read as two values, {first[1]} and {value}", [ev(first[0]), ev(op)])
    versions = sorted(by_version.items())
    for (v1, (op1, x1)), (v2, (op2, x2)) in zip(versions, versions[1:]):
        if x2 <= x1:
            offence("non-monotonic", f"the value did not increase with the version: {x1} at version {v1}, {x2} at version {v2}",
                    [ev(op1), ev(op2)])
    # 6: each client, in the order of its completions, never sees the register go back.
    last: dict[str, tuple[Operation, int, Any]] = {}
    for op, version, value in sorted(obs, key=lambda t: t[0].end_ns or 0):
        prev = last.get(op.process)
        if prev is not None and (version < prev[1] or (value is not None and prev[2] is not None
                                                        and value < prev[2])):
            offence("non-monotonic", f"{op.process} saw the register go back: version {prev[1]} value {prev[2]}, then version "
                    f"{version} value {value}", [ev(prev[0]), ev(op)])
        last[op.process] = (op, version, value)
    # 7: real time. An operation invoked after another completed never sees an older version.
    by_end = sorted(obs, key=lambda t: t[0].end_ns or 0)
    seen: tuple[Operation, int] | None = None
    i = 0
    for op, version, value in sorted(obs, key=lambda t: t[0].start_ns):
        while i < len(by_end) and (by_end[i][0].end_ns or 0) < op.start_ns:
            if seen is None or by_end[i][1] > seen[1]:
                seen = (by_end[i][0], by_end[i][1])
            i += 1
        if seen is not None and version < seen[1]:
            offence("stale read", f"stale: {op.process} saw version {version} after an operation that had completed saw version "
                    f"{seen[1]}", [ev(seen[0]), ev(op)])

    # 8: the final read counts the increments: at least every acknowledged one, at most those plus
    # every one whose outcome is unknown.
    finals = [op for op in ops if op.f == KV_FINAL and op.type == OK and _kv_int((op.value or {}).get("value"))]
    figures: dict[str, Any] = {"acknowledged": len(acked), "lost_races": len(failed), "unknown": len(unknown),
                               "reads": sum(1 for op in ops if op.f == KV_READ and op.type == OK)}
    final = finals[-1] if finals else None
    if final is not None:
        before = [op for op in acked if op.end_ns is not None and op.end_ns <= final.start_ns]
        maybe = len(cas) - len(failed) - len(before)    # unknown, open, or acknowledged after it began
        value = final.value["value"]
        lo, hi = len(before), len(before) + maybe
        top = max((op.value["to"] for op in before), default=0)
        figures.update(final_value=value, final_version=final.value.get("version"), bounds=[lo, hi])
        if value < lo or value < top:
            offence("lost", f"lost: {lo} acknowledged increments (the highest wrote {top}) but the register ends at {value}",
                    [ev(final)] + [ev(op) for op in before if op.value["to"] > value][:4])
        if value > hi:
            offence("applied twice", f"applied twice: the register ends at {value}, but only {lo} increments were acknowledged and "
                    f"{maybe} had an unknown outcome", [ev(final)])
    # 9: every node's replayed log: the register within the same bounds, one increment per write
    # it applied, and no request id applied twice.
    lo, hi = len(acked), len(cas) - len(failed)
    top = max((op.value["to"] for op in acked), default=0)
    nodes = 0
    for node, st in sorted(states.items()):
        if "kv_applied" not in st and "kv" not in st:
            if acked and "jobs" in st:
                offence("lost", f"lost: {node}'s committed log has no key-value store, {len(acked)} increments acknowledged",
                        [], node=node)
            continue
        if st.get("missing"):
            continue    # its log has a gap no snapshot bridges: its state is partial
        nodes += 1
        entry = next((e for e in st.get("kv", []) if tuple(e[:3]) == reg), None)
        try:
            held = int(entry[3]) if entry is not None else 0
        except ValueError:
            offence("malformed", f"{node}'s register holds {entry[3]!r}, not a counter", [], node=node)
            continue
        if held < lo or held < top or held > hi:
            offence("lost" if held < max(lo, top) else "applied twice", f"{node}'s committed log ends with the register at {held}, outside [{max(lo, top)}, {hi}] "
                    f"({lo} acknowledged increments, {hi - lo} unknown)", [], node=node)
        if st.get("kv_complete"):
            applied = next((e[3] for e in st.get("kv_applied", []) if tuple(e[:3]) == reg), 0)
            if applied != held:
                offence("applied twice", f"{node}'s log applied {applied} writes to the register, which holds {held}: a write "
                        "applied without incrementing", [], node=node)
        for r in st.get("kv_reapplied", []):
            if tuple(r[:2]) == reg[:2]:
                offence("applied twice", f"{node}'s log applied request {r[2]} twice (again at index {r[3]})", [], node=node)
    figures["nodes_checked"] = nodes
    return bad, figures


def _kv_kinds(offending: list[dict[str, Any]]) -> str:
    """``2 lost, 1 stale read``: how many offences of each kind (lost and applied twice first)."""
    order = ("lost", "applied twice", "stale read", "non-monotonic", "chain broken", "malformed")
    counts = defaultdict(int)
    for o in offending:
        counts[o["kind"]] += 1
    return ", ".join(f"{counts[k]} {k}" for k in order if counts[k])


def kv_cas_linearizable(history: Sequence[Event]) -> CheckResult:
    """The KV clients' compare-and-set increments (``kv_clients.py``): none acknowledged is lost,
    none is applied twice, and every read is linearizable.

    The model, per register (job, run id, key): the register starts absent (value 0, version 0);
    the only writes are the clients' ``CAS(expected_version=v, value=x+1)``, where (x, v) is what
    the client last saw. A CAS applies only when the key is at version v, and each change takes a
    fresh, higher version from the store-wide counter, so the applied CASes form one chain
    0 -> 1 -> 2 ... with strictly increasing versions, and the value is the number applied. An
    ``ok`` CAS applied, a ``fail`` one certainly did not (it lost the race; its answer shows the
    key's version then), an ``info`` or unanswered one may or may not have. Offences:

    1. two acknowledged CASes expected the same version (applied twice, or a lost update);
    2. two acknowledged CASes claim the same new version, or 3. wrote the same value;
    4. sorted by the value written, acknowledged versions are not strictly increasing, a new
       version is not above its expected one, or the CAS that wrote x + 1 expected another
       version than the one the acknowledged CAS that wrote x made;
    5. over every observation (a read, an acknowledged CAS's new version and value, a lost CAS's
       current version and value): one version read as two values, a value that does not grow
       with the version, or a value other than 0 at version 0;
    6. a client sees the version or the value go down in the order of its completions;
    7. real time: an operation invoked after another completed sees an older version;
    8. the final read (``kv-final``, after the KV clients stopped and the cluster healed) holds F
       with ``acked <= F <= acked + unknown`` and F at least every acknowledged value, counting
       the CASes acknowledged before the final read began (lost: F too small; applied twice: F
       too large);
    9. each node's replayed committed log (``final-state``): the register within the same bounds,
       as many writes applied to it as its value (where the whole log was replayed), and no
       request id applied twice.

    A history without KV operations passes (nothing to check)."""
    ops = [op for op in pair_operations(history, KV_FS) if is_client(op.process)]
    if not ops:
        return CheckResult("kv-cas-linearizable", True, "no key-value operations in the history")
    by_reg: dict[KVRegister, list[Operation]] = defaultdict(list)
    for op in ops:
        by_reg[_kv_register(op)].append(op)
    states = final_states(history)
    offending: list[Any] = []
    figures: dict[str, Any] = {}
    for reg, reg_ops in sorted(by_reg.items()):
        bad, figs = _check_kv_register(reg, reg_ops, states)
        offending.extend(bad)
        figures["/".join(reg)] = figs
    acked = sum(f["acknowledged"] for f in figures.values())
    parts = []
    for reg_name, f in figures.items():
        final = (f"final value {f['final_value']} within [{f['bounds'][0]}, {f['bounds'][1]}]"
                 if "final_value" in f else "no final read: increments not counted")
        parts.append(f"{reg_name}: {f['acknowledged']} acknowledged CASes ({f['lost_races']} lost races, "
                     f"{f['unknown']} unknown), {f['reads']} reads, {final}, {f['nodes_checked']} nodes' logs agree")
    result = _result("kv-cas-linearizable", offending,
                     f"{len(by_reg)} register{'s' if len(by_reg) != 1 else ''}, {acked} acknowledged "
                     f"compare-and-sets, none lost or applied twice; " + "; ".join(parts),
                     "{n} key-value offences: " + _kv_kinds(offending)
                     + (f"; first: {offending[0]['problem']}" if offending else ""))
    result.figures = figures
    return result


CHEAP: dict[str, Callable[[Sequence[Event]], CheckResult]] = {
    "no-split-brain": no_split_brain,
    "monotonic-quorum-ids": monotonic_quorum_ids,
    "jobs-isolated": jobs_isolated,
}


def check_all(history: Sequence[Event], recovery_bound_s: float = DEFAULT_RECOVERY_BOUND_S,
              survivor_wait_bound_s: float = DEFAULT_SURVIVOR_WAIT_BOUND_S) -> list[CheckResult]:
    """Every checker, in report order."""
    return [
        no_split_brain(history),
        monotonic_quorum_ids(history),
        acknowledged_committed(history),
        jobs_isolated(history),
        one_leader_per_term(history),
        recovery_after_heal(history, recovery_bound_s),
        survivor_wait(history, survivor_wait_bound_s),
        durable_after_restart_all(history),
        logs_agree(history),
    ] + ([kv_cas_linearizable(history)] if has_kv(history) else [])


def check_cheap(history: Sequence[Event]) -> list[CheckResult]:
    """The invariants cheap enough to check after every step of a property test."""
    return [fn(history) for fn in CHEAP.values()] + ([kv_cas_linearizable(history)] if has_kv(history) else [])

