"""core/jobs.py: what a valid job is (names, every setting's bounds, ports, the config map's
limits), the CLI parsers, and the spec's helpers; every refusal a ``JobError`` naming the value."""

from __future__ import annotations

from dataclasses import replace

import pytest

from lighthouse_cluster.core import jobs
from lighthouse_cluster.core.jobs import (
    ALL_NODES,
    DEFAULT_JOB,
    JobError,
    JobSettings,
    JobSpec,
    check_job_name,
    parse_config_items,
    parse_ports,
    port_conflict,
    reserved_port_clash,
    spec_from_wire,
    spec_to_wire,
)


def spec(name: str = "train", **kwargs) -> JobSpec:
    return JobSpec(name=name, settings=kwargs.pop("settings", JobSettings()), **kwargs)


# -- names -------------------------------------------------------------------------------------------


@pytest.mark.parametrize("name", ["a", "A", "0", "job-1", "llama_70b.v2", "x" * 63, "9lives", "a-"])
def test_valid_job_names(name: str) -> None:
    assert check_job_name(name) == name
    assert spec(name).check().name == name


@pytest.mark.parametrize("name", ["", "-a", "_a", ".a", "x" * 64, "a b", "a/b", "a:b", "é", "a\n", "job*"])
def test_invalid_job_names_are_refused_with_the_name(name: str) -> None:
    with pytest.raises(JobError, match="must be 1-63 letters, digits") as e:
        check_job_name(name)
    assert repr(name) in str(e.value)
    with pytest.raises(JobError):
        spec(name).check()


@pytest.mark.parametrize("name", [None, 7, b"job"])
def test_a_job_name_that_is_not_a_string_is_a_job_error(name) -> None:
    with pytest.raises(JobError):
        check_job_name(name)


# -- settings: each one's bounds ----------------------------------------------------------------------

BOUNDS = [  # (setting, lowest valid, highest valid)
    ("min_replicas", 1, jobs.MAX_REPLICAS_LIMIT),
    ("join_timeout_ms", 1, jobs.MAX_TIMEOUT_MS),
    ("quorum_tick_ms", 1, 60_000),
    ("heartbeat_timeout_ms", 1, jobs.MAX_TIMEOUT_MS),
    ("quorum_lease_ms", 0, jobs.MAX_LEASE_MS),
    ("max_replicas", 1, jobs.MAX_REPLICAS_LIMIT),
    ("max_member_bytes", 64, jobs.MAX_MEMBER_BYTES_LIMIT),
]


def test_the_bounds_table_covers_every_setting() -> None:
    assert sorted(b[0] for b in BOUNDS) == sorted(jobs.SETTING_NAMES)


def _with(setting: str, value: int) -> JobSettings:
    # min_replicas may not exceed max_replicas: keep the other one out of the way.
    other = {"min_replicas": {"max_replicas": jobs.MAX_REPLICAS_LIMIT}, "max_replicas": {"min_replicas": 1}}
    return JobSettings(**{**other.get(setting, {}), setting: value})


@pytest.mark.parametrize("setting, lo, hi", BOUNDS)
def test_each_setting_accepts_its_bounds(setting: str, lo: int, hi: int) -> None:
    assert getattr(_with(setting, lo).check(), setting) == lo
    assert getattr(_with(setting, hi).check(), setting) == hi


@pytest.mark.parametrize("setting, lo, hi", BOUNDS)
def test_each_setting_refuses_values_outside_its_bounds(setting: str, lo: int, hi: int) -> None:
    for bad in (lo - 1, hi + 1):
        with pytest.raises(JobError) as e:
            _with(setting, bad).check()
        assert str(e.value) == f"{setting} must be between {lo} and {hi}, got {bad}"


@pytest.mark.parametrize("setting", jobs.SETTING_NAMES)
@pytest.mark.parametrize("bad", [True, 1.5, "10", None])
def test_each_setting_must_be_an_integer(setting: str, bad) -> None:
    with pytest.raises(JobError, match=f"{setting} must be an integer, got {bad!r}"):
        JobSettings(**{setting: bad}).check()


def test_min_replicas_above_max_replicas_is_refused() -> None:
    with pytest.raises(JobError, match="min_replicas 9 is above max_replicas 8"):
        JobSettings(min_replicas=9, max_replicas=8).check()
    assert JobSettings(min_replicas=8, max_replicas=8).check()


def test_updated_applies_and_checks_changes() -> None:
    s = JobSettings()
    assert s.updated({"min_replicas": 3, "quorum_lease_ms": 0}) == replace(s, min_replicas=3, quorum_lease_ms=0)
    assert s.updated({}) == s
    with pytest.raises(JobError, match="quorum_tick_ms must be between 1 and 60000, got 0"):
        s.updated({"quorum_tick_ms": 0})


def test_updated_refuses_an_unknown_setting_and_lists_the_known_ones() -> None:
    with pytest.raises(JobError) as e:
        JobSettings().updated({"min_replica": 2, "zzz": 1})
    assert str(e.value).startswith("unknown job setting 'min_replica' (known: ")
    for name in jobs.SETTING_NAMES:
        assert name in str(e.value)


# -- the spec: default job, ports, config ----------------------------------------------------------------


@pytest.mark.parametrize("bad, message", [
    (JobSpec("train"), "job 'train' has no settings"),
    (JobSpec(DEFAULT_JOB, settings=JobSettings()), "the default job's settings are the nodes' flags"),
    (JobSpec(DEFAULT_JOB, ports=((ALL_NODES, 29600),)), "the default job is served on the node's client port"),
])
def test_only_the_default_job_has_no_settings_and_it_takes_no_ports(bad: JobSpec, message: str) -> None:
    with pytest.raises(JobError, match=message):
        bad.check()


def test_the_default_job_may_carry_config() -> None:
    assert JobSpec(DEFAULT_JOB, config=(("lr", "0.1"),)).check().config_map == {"lr": "0.1"}


@pytest.mark.parametrize("ports", [
    (),
    ((ALL_NODES, 29600),),
    ((ALL_NODES, 1), ("n1", 65535)),
    (("n1", 29601), ("n2", 29602), ("n3", 29601)),          # one port on several nodes is fine
    tuple((f"n{i}", 30000 + i) for i in range(jobs.MAX_PORTS)),
])
def test_valid_ports(ports) -> None:
    assert spec(ports=ports).check().ports == ports


@pytest.mark.parametrize("ports, message", [
    (((ALL_NODES, 0),), "port 0 is outside 1-65535"),
    (((ALL_NODES, 65536),), "port 65536 is outside 1-65535"),
    ((("n1", -1),), "port -1 is outside 1-65535"),
    ((("n1", True),), "port True is outside 1-65535"),
    ((("n1", "29600"),), "port '29600' is outside 1-65535"),
    (((ALL_NODES, 29600), (ALL_NODES, 29601)), "two ports given for every node"),
    ((("n1", 29600), ("n1", 29601)), "two ports given for node n1"),
    ((("", 29600),), "port entry =29600: '' is not a node id"),
    ((("n 1", 29600),), "'n 1' is not a node id"),
    ((("**", 29600),), "'\\*\\*' is not a node id"),
    ((("n1\n", 29600),), "'n1\\\\n' is not a node id"),
    (tuple((f"n{i}", 30000 + i) for i in range(jobs.MAX_PORTS + 1)), f"at most {jobs.MAX_PORTS} port entries"),
])
def test_invalid_ports_are_refused(ports, message: str) -> None:
    with pytest.raises(JobError, match=message):
        spec(ports=ports).check()


def test_port_for_prefers_the_nodes_own_entry_over_every_node() -> None:
    s = spec(ports=((ALL_NODES, 29600), ("n2", 29602)))
    assert [s.port_for(n) for n in ("n1", "n2", "n3")] == [29600, 29602, 29600]
    only_own = spec(ports=(("n2", 29602),))
    assert [only_own.port_for(n) for n in ("n1", "n2")] == [None, 29602]
    assert spec().port_for("n1") is None
    # Order of the entries does not matter.
    assert spec(ports=(("n2", 29602), (ALL_NODES, 29600))).port_for("n2") == 29602


def config_of(n: int, value: str = "v") -> tuple[tuple[str, str], ...]:
    return tuple(sorted((f"k{i:03d}", value) for i in range(n)))


@pytest.mark.parametrize("config", [
    (),
    (("lr", "0.1"),),
    (("a/b.c-d_e", ""),),                                        # every key character; empty value
    (("k" * jobs.MAX_CONFIG_KEY_CHARS, "x"),),
    (("big", "é" * (jobs.MAX_CONFIG_VALUE_BYTES // 2)),),         # the limit is in UTF-8 bytes
    config_of(jobs.MAX_CONFIG_KEYS),
    config_of(15, "v" * 4000),                                   # 15 x (4 + 4000) bytes: under 64 KiB
])
def test_valid_config(config) -> None:
    assert spec(config=config).check().config == config


@pytest.mark.parametrize("config, message", [
    (config_of(jobs.MAX_CONFIG_KEYS + 1), f"at most {jobs.MAX_CONFIG_KEYS} keys, got {jobs.MAX_CONFIG_KEYS + 1}"),
    ((("b", "1"), ("a", "2")), "config keys must be unique and sorted"),
    ((("a", "1"), ("a", "2")), "config keys must be unique and sorted"),
    ((("", "1"),), "config key '' must be 1-128 letters"),
    ((("-a", "1"),), "config key '-a' must be"),
    ((("a b", "1"),), "config key 'a b' must be"),
    ((("k" * (jobs.MAX_CONFIG_KEY_CHARS + 1), "1"),), "must be 1-128"),
    ((("a", 1),), "config value of 'a' must be a string"),
    ((("a", "x" * (jobs.MAX_CONFIG_VALUE_BYTES + 1)),), "config value of 'a' is 4097 bytes; the limit is 4096"),
    ((("a", "é" * (jobs.MAX_CONFIG_VALUE_BYTES // 2 + 1)),), "is 4098 bytes; the limit is 4096"),
    (config_of(17, "v" * 4000), "the job's config is 68068 bytes; the limit is 65536"),
    ((("a\n", "1"),), "config key 'a\\\\n' must be"),          # '$' would match before a final newline
])
def test_invalid_config_is_refused(config, message: str) -> None:
    with pytest.raises(JobError, match=message):
        spec(config=config).check()


def test_with_config_sets_unsets_and_keeps_the_keys_sorted() -> None:
    s = spec(config=(("a", "1"), ("m", "2")))
    t = s.with_config({"z": "3", "b": "4"}, unset=["a"])
    assert t.config == (("b", "4"), ("m", "2"), ("z", "3")) and s.config == (("a", "1"), ("m", "2"))
    assert s.with_config({"a": "new"}).config_map == {"a": "new", "m": "2"}
    # Unset and set of one key in one change: unset first, then set.
    assert s.with_config({"a": "back"}, unset=["a"]).config_map == {"a": "back", "m": "2"}


def test_with_config_refuses_to_unset_a_missing_key() -> None:
    with pytest.raises(JobError, match="job 'train' has no config key 'nope'"):
        spec(config=(("a", "1"),)).with_config(unset=["nope"])


def test_with_config_checks_the_result() -> None:
    with pytest.raises(JobError, match="config key 'bad key' must be"):
        spec().with_config({"bad key": "1"})
    with pytest.raises(JobError, match="at most 64 keys"):
        spec(config=config_of(jobs.MAX_CONFIG_KEYS)).with_config({"zzz": "1"})


# -- the CLI's parsers ----------------------------------------------------------------------------------


@pytest.mark.parametrize("items, expected", [
    ([], ()),
    (["29600"], ((ALL_NODES, 29600),)),
    (["n1=29601"], (("n1", 29601),)),
    (["n2=29602", "29600", "n1=29601"], ((ALL_NODES, 29600), ("n1", 29601), ("n2", 29602))),   # sorted
])
def test_parse_ports(items, expected) -> None:
    assert parse_ports(items) == expected


@pytest.mark.parametrize("items, message", [
    (["abc"], "port 'abc' is not PORT or NODE=PORT"),
    (["n1=abc"], "port 'n1=abc' is not PORT or NODE=PORT"),
    (["n1="], "port 'n1=' is not PORT or NODE=PORT"),
    (["0"], "port 0 is outside 1-65535"),
    (["n1=70000"], "port 70000 is outside 1-65535"),
    (["=29600"], "'' is not a node id"),
    (["29600", "29601"], "two ports given for every node"),
    (["n1=29600", "n1=29601"], "two ports given for node n1"),
])
def test_parse_ports_refuses_bad_entries(items, message: str) -> None:
    with pytest.raises(JobError, match=message):
        parse_ports(items)


@pytest.mark.parametrize("items, expected", [
    ([], {}),
    (["lr=0.1"], {"lr": "0.1"}),
    (["empty="], {"empty": ""}),
    (["url=http://h/?a=b"], {"url": "http://h/?a=b"}),     # the value may contain '='
    (["a=1", "a=2"], {"a": "2"}),                          # the last one wins
])
def test_parse_config_items(items, expected) -> None:
    assert parse_config_items(items) == expected


@pytest.mark.parametrize("item", ["novalue", "=value", ""])
def test_parse_config_items_refuses_what_is_not_key_value(item: str) -> None:
    with pytest.raises(JobError, match=f"config {item!r} is not KEY=VALUE"):
        parse_config_items([item])


# -- the msgpack form ------------------------------------------------------------------------------------


@pytest.mark.parametrize("s", [
    JobSpec(DEFAULT_JOB),
    JobSpec(DEFAULT_JOB, config=(("a", "1"),)),
    spec(settings=JobSettings(min_replicas=3, join_timeout_ms=5, quorum_tick_ms=7, heartbeat_timeout_ms=9,
                              quorum_lease_ms=0, max_replicas=11, max_member_bytes=64),
         ports=((ALL_NODES, 29600), ("n2", 29602)), config=(("a", "1"), ("b", "é=2"))),
])
def test_spec_wire_round_trip(s: JobSpec) -> None:
    assert spec_from_wire(spec_to_wire(s)) == s


def test_a_spec_from_a_newer_writer_reads_known_keys_and_defaults_for_missing_settings() -> None:
    wire = {"n": "train", "s": {"min": 2, "future": 1}, "p": [["*", 29600]], "x": "new top-level key"}
    assert spec_from_wire(wire) == JobSpec("train", settings=JobSettings(min_replicas=2), ports=((ALL_NODES, 29600),))


# -- ports of two jobs ------------------------------------------------------------------------------

def _spec(name: str, *ports: tuple[str, int]) -> JobSpec:
    return JobSpec(name=name, settings=JobSettings(), ports=tuple(sorted(ports)))


@pytest.mark.parametrize("mine, theirs, clash", [
    ((("*", 29600),), (("*", 29600),), "port 29600 on every node is job 'b''s already"),
    ((("*", 29600),), (("*", 29601),), None),
    ((("n1", 29600),), (("*", 29600),), "port 29600 on node n1 is job 'b''s already"),
    # b serves 29600 everywhere but on n1, where it has its own port: a's 29600 on n1 is free.
    ((("n1", 29600),), (("*", 29600), ("n1", 29700)), None),
    ((("n1", 29600), ("n2", 29601)), (("n2", 29601),), "port 29601 on node n2 is job 'b''s already"),
    ((("n1", 29600),), (("n2", 29600),), None),
    ((), (("*", 29600),), None),
])
def test_two_jobs_never_share_a_port_on_one_node(mine: tuple, theirs: tuple, clash: str | None) -> None:
    assert port_conflict(_spec("a", *mine), [_spec("b", *theirs), _spec("a", ("*", 29600))]) == clash


RESERVED = {"n1": {7001: "Raft port", 8001: "client port", 9001: "HTTP port"},
            "n2": {7002: "Raft port", 8002: "client port"}}


@pytest.mark.parametrize("ports, clash", [
    ((("n1", 8001),), "port 8001 on node n1 is n1's client port; give the job a port of its own"),
    ((("*", 7002),), "port 7002 on node n2 is n2's Raft port; give the job a port of its own"),
    ((("n1", 9001),), "port 9001 on node n1 is n1's HTTP port; give the job a port of its own"),
    # Another node's port on this node's host is free: nodes are one host each.
    ((("n1", 8002),), None),
    # n2 has a port of its own, so the ``*`` port (n1's client port) applies to n1 only.
    ((("*", 7002), ("n2", 29600)), None),
    ((("*", 29600),), None),
    ((), None),
    # A node the configuration does not know (joined later) reserves nothing.
    ((("n9", 8001),), None),
])
def test_a_job_never_gets_a_port_a_node_has_for_itself(ports: tuple, clash: str | None) -> None:
    assert reserved_port_clash(_spec("a", *ports), RESERVED) == clash


def test_the_state_machine_refuses_a_job_whose_port_another_job_has() -> None:
    from lighthouse_cluster.core.codec import PutJob
    from lighthouse_cluster.core.state_machine import QuorumStateMachine

    m = QuorumStateMachine()
    assert m.apply(PutJob(spec=_spec("b", ("*", 29600)), expected_version=0)).applied
    got = m.apply(PutJob(spec=_spec("a", ("n2", 29600)), expected_version=0))
    assert not got.applied and got.reason == "port 29600 on node n2 is job 'b''s already"
    assert m.job("a") is None
    # Its own port again (a change of its settings) is no clash.
    assert m.apply(PutJob(spec=_spec("b", ("*", 29600), ("n1", 29700)), expected_version=1)).applied
