"""The node's open-file limit: its soft limit raised to the hard one when the node starts.

A node holds a socket per trainer connection (torchft's client keeps one per replica group on the
node it calls), one per quorum member's manager server while it leads (``manager_connections.py``),
its peers' Raft and gRPC links, its journal. A soft limit of 1024, which many shells, container
runtimes and service managers still give, runs out near a thousand replica groups, and the Raft
transport then cannot open a socket or write its journal (EMFILE in the tick thread, then
elections: docs/design/new-leader-large-quorum.md). Go programs get their soft limit raised to the
hard one by the runtime; the node does the same, and says so. The hard limit is the
administrator's (systemd ``LimitNOFILE=``, ``docker run --ulimit nofile=``, Kubernetes' container
runtime) and is never exceeded. Pure except for the two ``resource`` calls, which are arguments.
"""

from __future__ import annotations

import logging
from typing import Callable

log = logging.getLogger(__name__)

# Never ask for more than this, even with an unlimited hard limit (macOS refuses RLIM_INFINITY).
MAX_OPEN_FILES = 1 << 20
# Below this the node warns: about half of it is trainers' connections.
LOW_OPEN_FILES = 8192


def wanted_soft_limit(soft: int, hard: int, infinity: int) -> int:
    """The soft limit to set: the hard limit (at most ``MAX_OPEN_FILES``), never below ``soft``."""
    ceiling = MAX_OPEN_FILES if hard == infinity else min(hard, MAX_OPEN_FILES)
    if soft == infinity:
        return soft
    return max(soft, ceiling)


def raise_open_file_limit(get: Callable[[], tuple[int, int]] | None = None,
                          set_: Callable[[int, int], None] | None = None) -> int:
    """Raise this process's soft ``RLIMIT_NOFILE`` to its hard limit; return the soft limit in force."""
    import resource

    get = get or (lambda: resource.getrlimit(resource.RLIMIT_NOFILE))
    set_ = set_ or (lambda soft, hard: resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard)))
    soft, hard = get()
    target = wanted_soft_limit(soft, hard, resource.RLIM_INFINITY)
    if target != soft:
        try:
            set_(target, hard)
            log.info("open-file limit raised from %d to %d (the hard limit)", soft, target)
            soft = target
        except (ValueError, OSError) as e:
            log.warning("cannot raise the open-file limit from %d to %d: %s", soft, target, e)
    if soft != resource.RLIM_INFINITY and soft < LOW_OPEN_FILES:
        log.warning("open-file limit %d: a node serving more than about %d replica groups will run out of "
                    "sockets; raise the hard limit (systemd LimitNOFILE=, docker --ulimit nofile=, ulimit -Hn)",
                    soft, soft // 2)
    return soft
