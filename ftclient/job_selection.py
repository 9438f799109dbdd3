"""Which job a trainer's lighthouse calls belong to (issue 17), as a pure rule.

A lighthouse cluster serves many *jobs* (named quorum namespaces); a call names its job with the
gRPC metadata ``x-lighthouse-job: NAME`` (``lighthouse_cluster.core.jobs.JOB_HEADER``). This
module owns the rule that picks the name, and nothing else (no I/O; pass ``environ`` in tests):

1. the ``job=`` argument (``ftclient.Manager(..., job=...)``, ``LighthouseClient(..., job=...)``);
2. else the environment variable ``LIGHTHOUSE_JOB``;
3. else a ``?job=NAME`` query on the lighthouse URL(s) (``TORCHFT_LIGHTHOUSE`` or
   ``lighthouse_addr``);
4. else none: the ``default`` job, exactly as before jobs existed (no metadata is sent, so the
   calls also work with torchft's own lighthouse and with clusters older than jobs).

The URL rule: the job belongs to the whole endpoint list, not to one endpoint (every node serves
every job). Any URL of the comma-separated list may carry ``?job=NAME``
(``http://a:29510,http://b:29510?job=x`` and ``http://a:29510?job=x,http://b:29510?job=x`` both
select ``x``); URLs naming different jobs are an error, as is any other query key or an empty
name. A higher source naming another job than the URL's wins, with a warning naming both.
An empty argument or ``LIGHTHOUSE_JOB=""`` names nothing. Naming ``default`` selects the default
job explicitly (and sends no metadata). Names follow the cluster's rule
(``lighthouse_cluster.core.jobs.check_job_name``): 1-63 letters, digits, ``.``, ``_``, ``-``.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from urllib.parse import parse_qsl

from lighthouse_cluster.core.jobs import DEFAULT_JOB, JOB_HEADER, JobError, check_job_name

__all__ = ["DEFAULT_JOB", "JOB_ENV", "JOB_HEADER", "JOB_QUERY", "JobSelection", "select_job", "split_job_query"]

log = logging.getLogger(__name__)

JOB_ENV = "LIGHTHOUSE_JOB"
JOB_QUERY = "job"

ARGUMENT = "the job argument"
ENVIRONMENT = JOB_ENV
URL = "the lighthouse URL"
NONE = "none"


@dataclass(frozen=True)
class JobSelection:
    """The job a client's calls name, and where the name came from (``source``)."""

    name: str = DEFAULT_JOB
    source: str = NONE

    @property
    def is_default(self) -> bool:
        return self.name == DEFAULT_JOB

    @property
    def metadata(self) -> tuple[tuple[str, str], ...]:
        """The gRPC metadata of every Quorum, Heartbeat and Watch call: none for the default job."""
        return () if self.is_default else ((JOB_HEADER, self.name),)

    def describe(self) -> str:
        return f"job {self.name!r}" + ("" if self.source == NONE else f" (from {self.source})")


def _checked(name: str, source: str) -> str:
    try:
        return check_job_name(name)
    except JobError as e:
        raise ValueError(f"{source}: {e}") from None


def split_job_query(value: str | Sequence[str]) -> tuple[list[str], str | None]:
    """``"http://a:1,http://b:2?job=x"`` (or a list of such strings) -> ``(["http://a:1",
    "http://b:2"], "x")``: the entries without their query, and the job the queries name (None:
    none). ``ValueError`` for URLs naming different jobs, an unknown query key, an empty or
    invalid name."""
    parts = value.split(",") if isinstance(value, str) else [p for v in value for p in v.split(",")]
    entries: list[str] = []
    named: dict[str, str] = {}  # job -> the first URL naming it
    for raw in parts:
        entry, sep, query = raw.strip().partition("?")
        entries.append(entry)
        if not sep:
            continue
        try:
            pairs = parse_qsl(query, keep_blank_values=True, strict_parsing=True)
        except ValueError:
            raise ValueError(f"lighthouse URL {raw.strip()!r}: the query must be ?{JOB_QUERY}=NAME") from None
        keys = [k for k, _ in pairs]
        if keys != [JOB_QUERY]:
            raise ValueError(f"lighthouse URL {raw.strip()!r}: the only query understood is ?{JOB_QUERY}=NAME "
                             f"(once), got {query!r}")
        job = _checked(pairs[0][1], f"lighthouse URL {raw.strip()!r}")
        named.setdefault(job, raw.strip())
    if len(named) > 1:
        which = "; ".join(f"{url} names {job!r}" for job, url in named.items())
        raise ValueError(f"the lighthouse URLs name different jobs ({which}): a trainer belongs to one job; "
                         f"name it once (?{JOB_QUERY}=NAME on any URL, or {JOB_ENV})")
    return entries, next(iter(named), None)


def select_job(job: str | None, urls: str | Sequence[str] | None = None,
               environ: Mapping[str, str] | None = None) -> JobSelection:
    """The job of a client given the ``job`` argument, the lighthouse ``urls`` and the
    environment, by the rule of the module docstring."""
    env = os.environ if environ is None else environ
    url_job = split_job_query(urls)[1] if urls else None
    chosen: JobSelection | None = None
    if job:
        chosen = JobSelection(_checked(job, ARGUMENT), ARGUMENT)
    elif env.get(JOB_ENV, "").strip():
        chosen = JobSelection(_checked(env[JOB_ENV].strip(), f"{JOB_ENV}={env[JOB_ENV]!r}"), ENVIRONMENT)
    if chosen is None:
        return JobSelection(url_job, URL) if url_job is not None else JobSelection()
    if url_job is not None and url_job != chosen.name:
        log.warning("%s overrides job %r named in the lighthouse URL", chosen.describe(), url_job)
    return chosen
