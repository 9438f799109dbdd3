"""Which job a trainer's lighthouse calls belong to, as a pure rule.

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
name (the URL rule is ``lighthouse_cluster.client.discovery.split_job_query``, which parses
every endpoint list). A higher source naming another job than the URL's wins, with a warning naming both.
An empty argument or ``LIGHTHOUSE_JOB=""`` names nothing. Naming ``default`` selects the default
job explicitly (and sends no metadata). Names follow the cluster's rule
(``lighthouse_cluster.core.jobs.check_job_name``): 1-63 letters, digits, ``.``, ``_``, ``-``.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from lighthouse_cluster.client.discovery import JOB_ENV, JOB_QUERY, split_job_query
from lighthouse_cluster.core.jobs import DEFAULT_JOB, JOB_HEADER, JobError, check_job_name

__all__ = ["DEFAULT_JOB", "JOB_ENV", "JOB_HEADER", "JOB_QUERY", "JobSelection", "select_job", "split_job_query"]

log = logging.getLogger(__name__)

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
