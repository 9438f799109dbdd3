"""The node's open-file limit (``server/open_files.py``): raised to the hard limit at start.

At N=4096 a node ran out of file descriptors (docs/design/new-leader-large-quorum.md), and then Raft
could open neither a socket nor its journal. A soft limit of 1024 (many shells and container
runtimes) runs out near a thousand trainers' connections; the node raises it to the hard limit, as
Go's runtime does for Go servers. """

from __future__ import annotations

import logging
import resource

import pytest

from lighthouse_cluster.local.cluster import free_ports
from lighthouse_cluster.server.open_files import MAX_OPEN_FILES, raise_open_file_limit, wanted_soft_limit
from test_cluster import leader_status, metric_samples

INF = resource.RLIM_INFINITY


def test_the_soft_limit_goes_up_to_the_hard_one_and_never_down() -> None:
    assert wanted_soft_limit(1024, 524288, INF) == 524288
    assert wanted_soft_limit(1024, INF, INF) == MAX_OPEN_FILES  # unlimited hard limit: a sane ceiling
    assert wanted_soft_limit(1024, 1024, INF) == 1024  # nothing to raise
    assert wanted_soft_limit(2 * MAX_OPEN_FILES, 4 * MAX_OPEN_FILES, INF) == 2 * MAX_OPEN_FILES  # never lowered
    assert wanted_soft_limit(INF, INF, INF) == INF


def test_raising_sets_the_hard_limit_and_says_so_or_warns(caplog: pytest.LogCaptureFixture) -> None:
    calls: list[tuple[int, int]] = []
    with caplog.at_level(logging.INFO, logger="lighthouse_cluster.server.open_files"):
        assert raise_open_file_limit(lambda: (1024, 65536), lambda s, h: calls.append((s, h))) == 65536
    assert calls == [(65536, 65536)]
    assert "open-file limit raised from 1024 to 65536 (the hard limit)" in caplog.text
    caplog.clear()

    def refused(soft: int, hard: int) -> None:
        raise ValueError("not allowed")

    with caplog.at_level(logging.INFO, logger="lighthouse_cluster.server.open_files"):
        assert raise_open_file_limit(lambda: (1024, 65536), refused) == 1024
    assert "cannot raise the open-file limit from 1024 to 65536: not allowed" in caplog.text
    assert "open-file limit 1024: a node serving more than about 512 replica groups will run out" in caplog.text


@pytest.mark.integration
def test_a_node_started_with_a_low_soft_limit_runs_with_the_hard_one(make_cluster) -> None:
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard != INF and hard <= 1024:
        pytest.skip(f"the hard open-file limit here is {hard}: nothing to raise to")
    resource.setrlimit(resource.RLIMIT_NOFILE, (1024, hard))  # inherited by the nodes
    try:
        cluster = make_cluster(min_replicas=1, http_ports=free_ports(3))
    finally:
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))
    leader, _ = leader_status(cluster, timeout=30)
    expected = MAX_OPEN_FILES if hard == INF else min(hard, MAX_OPEN_FILES)
    with open(f"/proc/{cluster.members[leader].process.pid}/limits") as f:
        line = next(line for line in f if line.startswith("Max open files"))
    assert line.split()[3] == str(expected), line
    assert f"open-file limit raised from 1024 to {expected}" in cluster.members[leader].log_path.read_text()
    assert [v for _, v in metric_samples(cluster, leader, "process_max_fds")] == [float(expected)]
    assert [v for _, v in metric_samples(cluster, leader, "process_open_fds")][0] > 0
