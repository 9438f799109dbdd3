"""ftclient.job_selection: which job a trainer's lighthouse calls name -- the ``job`` argument,
``LIGHTHOUSE_JOB``, a ``?job=NAME`` query on the lighthouse URL(s), or none (the default job,
no metadata) -- and the lighthouse client built on it (no server: ``connect=False``)."""

from __future__ import annotations

import logging

import pytest

from ftclient.job_selection import (
    JOB_ENV,
    JOB_HEADER,
    JobSelection,
    select_job,
    split_job_query,
)
from ftclient.lighthouse_client import JobNotFoundError, LighthouseClient, parse_endpoints
from lighthouse_cluster.core import jobs as core_jobs

A, B = "http://a:29510", "http://b:29511"


def test_the_header_and_default_are_the_clusters() -> None:
    assert JOB_HEADER == core_jobs.JOB_HEADER == "x-lighthouse-job"
    assert JobSelection().name == core_jobs.DEFAULT_JOB == "default"


@pytest.mark.parametrize(("value", "entries", "job"), [
    (f"{A},{B}", [A, B], None),
    (f"{A},{B}?job=x", [A, B], "x"),  # one URL names the job of the whole list
    (f"{A}?job=x,{B}", [A, B], "x"),
    (f"{A}?job=x, {B}?job=x", [A, B], "x"),  # the same job twice
    ([f"{A}?job=team-a.v2", "b:1"], [A, "b:1"], "team-a.v2"),
    (f"{A}/?job=x", [f"{A}/"], "x"),
])
def test_split_job_query(value: str | list[str], entries: list[str], job: str | None) -> None:
    assert split_job_query(value) == (entries, job)


@pytest.mark.parametrize(("value", "message"), [
    (f"{A}?job=x,{B}?job=y", r"name different jobs .*'x'.*'y'"),
    (f"{A}?job=", "job name ''"),
    (f"{A}?job=bad name", "job name 'bad name'"),
    (f"{A}?jobs=x", r"only query understood is \?job=NAME"),
    (f"{A}?job=x&job=x", r"only query understood is \?job=NAME \(once\)"),
    (f"{A}?job=x&lr=1", "only query understood"),
    (f"{A}?x", r"the query must be \?job=NAME|only query understood"),
])
def test_a_bad_or_conflicting_url_job_is_a_clear_error(value: str, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        split_job_query(value)
    with pytest.raises(ValueError, match=message):
        LighthouseClient(value, connect=False)


def test_parse_endpoints_drops_the_job_query() -> None:
    assert parse_endpoints(f"{A}?job=x,{B}") == ["a:29510", "b:29511"]
    assert parse_endpoints("a:1?job=x") == ["a:1"]


def test_precedence_argument_then_environment_then_url_then_none(caplog: pytest.LogCaptureFixture) -> None:
    url = f"{A},{B}?job=from-url"
    assert select_job("arg", url, {JOB_ENV: "env"}) == JobSelection("arg", "the job argument")
    assert select_job(None, url, {JOB_ENV: "env"}) == JobSelection("env", JOB_ENV)
    assert select_job(None, url, {}) == JobSelection("from-url", "the lighthouse URL")
    assert select_job(None, f"{A},{B}", {}) == JobSelection()
    assert select_job(None, None, {}) == JobSelection()
    # Empty values name nothing; surrounding spaces of the variable are dropped.
    assert select_job("", url, {JOB_ENV: "  "}) == JobSelection("from-url", "the lighthouse URL")
    assert select_job(None, None, {JOB_ENV: " env "}).name == "env"
    # Overriding the URL's job says so.
    with caplog.at_level(logging.WARNING, logger="ftclient.job_selection"):
        select_job(None, url, {JOB_ENV: "env"})
    assert "job 'env' (from LIGHTHOUSE_JOB) overrides job 'from-url' named in the lighthouse URL" in caplog.text
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="ftclient.job_selection"):
        select_job("from-url", url, {})  # the same job: nothing to say
    assert caplog.text == ""


def test_invalid_names_name_their_source() -> None:
    with pytest.raises(ValueError, match="the job argument: job name 'a b'"):
        select_job("a b", None, {})
    with pytest.raises(ValueError, match=r"LIGHTHOUSE_JOB='-x': job name '-x'"):
        select_job(None, None, {JOB_ENV: "-x"})
    with pytest.raises(ValueError, match="job name"):
        select_job(None, None, {JOB_ENV: "x" * 64})
    # A conflict among the URLs is an error even when a higher source names the job.
    with pytest.raises(ValueError, match="name different jobs"):
        select_job("arg", f"{A}?job=x,{B}?job=y", {})


def test_the_default_job_sends_no_metadata() -> None:
    assert JobSelection().metadata == ()
    assert JobSelection("default", "the job argument").metadata == ()  # explicitly the default job
    assert JobSelection("x", JOB_ENV).metadata == ((JOB_HEADER, "x"),)
    assert select_job(None, f"{A}?job=default", {}).is_default


def test_the_lighthouse_client_selects_its_job(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(JOB_ENV, raising=False)
    plain = LighthouseClient(f"{A},{B}", connect=False)
    assert plain.job == JobSelection() and plain.call_metadata is None  # exactly the calls before jobs
    assert plain.endpoints == ["a:29510", "b:29511"]
    via_url = LighthouseClient(f"{A},{B}?job=x", connect=False)
    assert via_url.job.name == "x" and via_url.call_metadata == ((JOB_HEADER, "x"),)
    assert via_url.endpoints == ["a:29510", "b:29511"]
    monkeypatch.setenv(JOB_ENV, "y")
    assert LighthouseClient(f"{A}?job=x", connect=False).job == JobSelection("y", JOB_ENV)
    assert LighthouseClient(f"{A}?job=x", connect=False, job="z").job.name == "z"
    monkeypatch.setenv("TORCHFT_LIGHTHOUSE", f"{B}?job=x")
    monkeypatch.delenv(JOB_ENV)
    from_env = LighthouseClient(connect=False)
    assert from_env.job.name == "x" and from_env.endpoints == ["b:29511"]


def test_job_not_found_error_names_the_job_and_the_cluster() -> None:
    e = JobNotFoundError("train-7", "http://a:1, http://b:2", "no job 'train-7' on this cluster")
    assert e.job == "train-7" and e.code is not None and e.code.name == "NOT_FOUND"
    assert "no job 'train-7' on the lighthouse cluster at http://a:1, http://b:2" in str(e)
    assert "lighthouse-cluster jobs add train-7" in str(e) and "LIGHTHOUSE_JOB" in str(e)
