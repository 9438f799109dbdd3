"""The relations between the shared timeouts that their comments promise."""

from __future__ import annotations

from lighthouse_cluster.core import defaults


def test_the_client_waits_longer_than_the_leader_it_asks() -> None:
    # transfer-leader: the leader answers "did not move" after its hand-over wait; the client's
    # call must still be open to hear it.
    assert defaults.HANDOVER_TIMEOUT_S < defaults.TRANSFER_TIMEOUT_S
    # An admin change's commit wait fits in the client's default per-call timeout.
    assert defaults.ADMIN_COMMIT_TIMEOUT_S <= defaults.CLIENT_TIMEOUT_S


def test_up_waits_for_its_leader_longer_than_it_must_hold() -> None:
    assert defaults.UP_LEADER_STABLE_S < defaults.UP_LEADER_TIMEOUT_S
