"""``NodeAdmin.hand_over``, the leadership hand-over behind `transfer-leader` and a leader's
SIGTERM, against a scripted Raft: no processes, no sockets.

Raft's TimeoutNow is refused while the target is even one entry behind, which a busy leader (a
commit every few ms) hits often; a stopping leader that gave up after one refusal kept
leadership until it died, and its trainers waited for an election instead of a hand-over.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field
from types import SimpleNamespace
from typing import Any, Callable

from lighthouse_cluster.server.admin import NodeAdmin
from lighthouse_cluster.server.config import PeerSpec

ME = PeerSpec("n1", "127.0.0.1:7001", "127.0.0.1:29510")
OTHER = PeerSpec("n2", "127.0.0.1:7002", "127.0.0.1:29511")


@dataclass
class ScriptedRaft:
    """Refuses the first ``refusals`` TimeoutNow requests (the target is behind), then sends one:
    the target wins the next term."""

    refusals: int
    term: int = 5
    led_term: int | None = 5
    sent: list[str | None] = field(default_factory=list)
    election_due: bool = False

    @property
    def is_leader(self) -> bool:
        return self.led_term == self.term

    def call_on_tick_thread(self, fn: Callable[[], Any], callback: Callable[[Any, Exception | None], None]) -> None:
        callback(fn(), None)

    def transfer_leadership(self, address: str | None = None,
                            callback: Callable[[str | None], None] | None = None) -> None:
        assert callback is not None
        if self.refusals > 0:
            self.refusals -= 1
            self.sent.append("refused")
            callback("REQUEST_DENIED")
            return
        self.sent.append("sent")
        callback(None)
        self.election_due = True  # the target wins the next term, after this request returned

    def leader(self) -> PeerSpec:
        if self.election_due:
            self.term, self.election_due = self.term + 1, False
        return OTHER if self.term > 5 else ME


def node_with(raft: ScriptedRaft) -> SimpleNamespace:
    node = SimpleNamespace(config=SimpleNamespace(node_id=ME.node_id), raft=raft, members=(ME, OTHER),
                           other_members=(OTHER,))
    node.coordinator = SimpleNamespace(term=raft.term, serving=True)
    node.leader_peer = raft.leader
    return node


def test_a_refused_hand_over_is_retried_until_the_target_is_caught_up() -> None:
    raft = ScriptedRaft(refusals=3)
    leader, term, why = asyncio.run(NodeAdmin(node_with(raft)).hand_over(None, 5.0))
    assert (leader, term, why) == ("n2", 6, "")
    assert raft.sent == ["refused", "refused", "refused", "sent"]


def test_a_target_that_never_catches_up_is_reported_at_the_deadline() -> None:
    raft = ScriptedRaft(refusals=10**6)
    leader, term, why = asyncio.run(NodeAdmin(node_with(raft)).hand_over(None, 0.2))
    assert (leader, term, why) == (None, 5, "REQUEST_DENIED")
    assert len(raft.sent) >= 3 and set(raft.sent) == {"refused"}
