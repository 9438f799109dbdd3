"""Shared fixtures: local clusters of real node processes that are always cleaned up."""

from __future__ import annotations

import contextlib
from typing import Any, Callable, Iterator

import pytest

from lighthouse_cluster.local.cluster import LocalCluster


@pytest.fixture
def make_cluster(tmp_path: Any) -> Iterator[Callable[..., LocalCluster]]:
    """Start ``LocalCluster(root=tmp_path/..., **kwargs)`` (as a context manager); every node
    process it started is killed when the test ends, whatever happened."""
    started: list[LocalCluster] = []
    with contextlib.ExitStack() as stack:

        def make(**kwargs: Any) -> LocalCluster:
            cluster = LocalCluster(root=tmp_path / f"cluster{len(started)}", **kwargs)
            started.append(cluster)
            # Registered before entering: a start that fails half-way still gets cleaned up.
            stack.callback(cluster.stop_all)
            return stack.enter_context(cluster)

        yield make
