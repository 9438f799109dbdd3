"""Run one node as variant A, B, C or C2 (see the package docstring).

``python -m benchmarks.raft_process.variant VARIANT [--no-stall-tolerance] PYTHON -m lighthouse_cluster serve ...``:
the node's own command line (what ``LocalCluster.command`` builds) behind this prefix
(``LocalCluster.launch_prefix``); the variant's change is made in this process, then the
unchanged ``lighthouse-cluster`` command runs in it.
"""

from __future__ import annotations

import sys

VARIANTS = ("A", "B", "C", "C2")


def prefix(variant: str, stall_tolerance: bool = True) -> list[str]:
    """The ``launch_prefix`` for ``variant``."""
    if variant not in VARIANTS:
        raise ValueError(f"unknown variant {variant!r}")
    return [sys.executable, "-m", "benchmarks.raft_process.variant", variant,
            *([] if stall_tolerance else ["--no-stall-tolerance"])]


def split_argv(argv: list[str]) -> tuple[str, bool, list[str]]:
    """(variant, stall tolerance on, the lighthouse-cluster arguments) from this command's argv."""
    variant, rest = argv[0], argv[1:]
    stall = True
    if rest and rest[0] == "--no-stall-tolerance":
        stall, rest = False, rest[1:]
    if variant not in VARIANTS:
        raise SystemExit(f"unknown variant {variant!r}; one of {', '.join(VARIANTS)}")
    try:
        at = rest.index("lighthouse_cluster")
    except ValueError:
        raise SystemExit("expected PYTHON -m lighthouse_cluster ARGS after the variant") from None
    return variant, stall, rest[at + 1:]


def main() -> None:
    variant, stall, args = split_argv(sys.argv[1:])
    from benchmarks.raft_process import tweaks
    from lighthouse_cluster.server import node

    if variant in ("C", "C2"):
        from benchmarks.raft_process import remote

        remote.RAFT_NICE = tweaks.RAFT_NICE if variant == "C2" else 0
        remote.STALL_TOLERANCE = stall
        node.RaftNode = remote.RemoteRaftNode  # type: ignore[misc,assignment]
    else:
        if not stall:
            tweaks.stall_tolerance_off()
        node.RaftNode = tweaks.raft_node_class(tweaks.RAFT_NICE if variant == "B" else None)  # type: ignore[misc]
    from lighthouse_cluster.cli.commands import main as cli_main

    sys.argv = ["lighthouse-cluster", *args]
    cli_main()


if __name__ == "__main__":
    main()
