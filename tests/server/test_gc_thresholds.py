"""A node process serves with the garbage collector's serving thresholds (``gc_thresholds``;
docs/design/gc-thresholds.md): its start-up line reports what ``gc.get_threshold()`` says in it."""

from __future__ import annotations

import re

import pytest

from lighthouse_cluster.server.gc_thresholds import SERVING_THRESHOLDS
from support.waiting import wait_for

pytestmark = pytest.mark.integration

SERVING_LINE = re.compile(r"serving torchft\.LighthouseService on .*gc thresholds (\d+)/(\d+)/(\d+)\)")


def test_a_node_process_runs_with_the_serving_gc_thresholds(make_cluster) -> None:
    cluster = make_cluster(nodes=1, min_replicas=1)
    log = cluster.members[0].log_path

    def serving_line() -> re.Match[str] | None:
        return SERVING_LINE.search(log.read_text(errors="replace")) if log.exists() else None

    match = wait_for("the node's start-up line", serving_line, 30)
    assert tuple(int(g) for g in match.groups()) == SERVING_THRESHOLDS != (700, 10, 10)
