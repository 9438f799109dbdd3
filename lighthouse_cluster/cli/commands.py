"""The `lighthouse-cluster` command: serve a node, run a local cluster, show cluster status.

A thin shell: each group of commands lives in a module of its own and attaches to ``app.main``:
``serve`` (a node), ``up`` (a local cluster), ``cluster`` (status, health, members,
transfer-leader), ``jobs``, ``kv`` (`rendezvous`: the runs' rendezvous state), ``snapshot`` and ``checkout_bench`` (`bench`); the options they share are
``options``'s and the timeouts ``core.defaults``'s. Every failure a user can cause ends with exit
status 2 (bad input) or 1 (cluster problem) and a one-line reason.
"""

from __future__ import annotations

# Importing a command module registers its commands on ``main``.
import lighthouse_cluster.cli.checkout_bench  # noqa: F401  (`bench`; no module named .bench ships)
import lighthouse_cluster.cli.cluster  # noqa: F401
import lighthouse_cluster.cli.jobs  # noqa: F401
import lighthouse_cluster.cli.kv  # noqa: F401  (`rendezvous`)
import lighthouse_cluster.cli.snapshot  # noqa: F401
import lighthouse_cluster.cli.up  # noqa: F401
from lighthouse_cluster.cli.app import OneLineErrors, main
from lighthouse_cluster.cli.options import DECLARED_JOBS, ENV, ClientOptions, client_options
from lighthouse_cluster.cli.serve import serve

__all__ = ["ClientOptions", "DECLARED_JOBS", "ENV", "OneLineErrors", "client_options", "main", "serve"]

if __name__ == "__main__":
    main()
