"""A replicated log as the code before jobs (schema 3, commit 68f4df6) wrote it, and the state it
reached, for the rolling-upgrade tests of schema 4 (``tests/core/test_job_state_machine.py``).

``commands()`` builds the log's commands with names both versions have: terms, fast and stale
commits, a fenced one, a refused ``TermStart``, lease confirmations, the member table, members
whole (``pb``) and field by field, and one command of an unknown kind. ``GOLDEN_LOG`` is how the
code of 68f4df6 encoded them at version 3 (the payloads of its Raft log), ``GOLDEN_MID`` and
``GOLDEN_FINAL`` the snapshots its state machine wrote after entry ``MID_INDEX`` and at the end.
Regenerate (only if the commands change) by running this file with the old code first on the path:

    git archive 68f4df6 lighthouse_cluster | tar -x -C /tmp/old
    PYTHONPATH=/tmp/old:. python3 tests/support/schema3_log.py
"""

from __future__ import annotations

import msgpack

from lighthouse_cluster.core import codec
from lighthouse_cluster.core.codec import CommitQuorum, ConfirmLeadership, EnableSchema, SetMembers, TermStart
from lighthouse_cluster.core.quorum import Member, Quorum
from lighthouse_cluster.core.torchft_wire import member_from_bytes
from lighthouse_cluster.proto import torchft_pb2 as pb

MID_INDEX = 6
UNKNOWN_AT = 9   # where the entry of an unknown kind sits in the log


def whole(rid: str, step: int) -> Member:
    """A member as a schema-3 leader stores it: the requester's serialized QuorumMember."""
    return member_from_bytes(pb.QuorumMember(replica_id=rid, address=f"tcp://{rid}", store_address=f"{rid}:29500",
                                             step=step, world_size=2).SerializeToString())


def fields(rid: str, step: int) -> Member:
    """A member known field by field (one that came through a schema-2 writer)."""
    return Member(replica_id=rid, address=f"tcp://{rid}", step=step, world_size=1)


def q(qid: int, *members: Member) -> Quorum:
    return Quorum(quorum_id=qid, participants=tuple(members), created_ms=1_700_000_000_000 + qid)


def commands() -> list[codec.Command]:
    return [
        TermStart(1, "n1", 1000),
        CommitQuorum(0, q(1, whole("a", 0), whole("b", 0)), 1, "n1"),
        ConfirmLeadership(1, "n1", 100),
        CommitQuorum(1, q(1, whole("a", 5), whole("b", 5)), 1, "n1"),        # same id, same members
        CommitQuorum(1, q(2, whole("a", 6), whole("b", 6), fields("c", 0)), 1, "n1"),
        CommitQuorum(1, q(2, whole("a", 6)), 1, "n1"),                        # stale
        SetMembers(0, (("n1", "h:1", "h:2"), ("n2", "h:3", "h:4"), ("n3", "h:5", "h:6"))),
        TermStart(2, "n2", 2000),
        CommitQuorum(2, q(3, whole("a", 7)), 1, "n1"),                        # fenced
        CommitQuorum(2, q(3, whole("a", 7), fields("c", 7)), 2, "n2"),
        TermStart(2, "n3", 2500),                                            # refused
        ConfirmLeadership(2, "n2", 250),
        EnableSchema(3),
    ]


def encode_at_3(cmds: list[codec.Command]) -> list[bytes]:
    """The payloads, every command written at version 3, with the unknown kind at ``UNKNOWN_AT``."""
    log = [codec.encode_command(c, version=3) for c in cmds]
    log.insert(UNKNOWN_AT, msgpack.packb({"v": 3, "k": "from-the-future", "x": 1}))
    return log


# -- as 68f4df6 wrote them -----------------------------------------------------------------------------
GOLDEN_LOG: list[str] = [
    '85a16baa7465726d5f7374617274a47465726d01a46e6f6465a26e31a174cd03e8a17603',
    (
        '86a16bad636f6d6d69745f71756f72756da665787065637400a17183a2696401a1709282a172a161a27062c4170a0161'
        '12077463703a2f2f611a07613a3239353030280282a172a162a27062c4170a016212077463703a2f2f621a07623a3239'
        '3530302802a163cf0000018bcfe56801a47465726d01a46e6f6465a26e31a17603'
    ),
    '85a16ba7636f6e6669726da47465726d01a46e6f6465a26e31a56c6561736564a17603',
    (
        '86a16bad636f6d6d69745f71756f72756da665787065637401a17183a2696401a1709282a172a161a27062c4190a0161'
        '12077463703a2f2f611a07613a32393530302005280282a172a162a27062c4190a016212077463703a2f2f621a07623a'
        '323935303020052802a163cf0000018bcfe56801a47465726d01a46e6f6465a26e31a17603'
    ),
    (
        '86a16bad636f6d6d69745f71756f72756da665787065637401a17183a2696402a1709382a172a161a27062c4190a0161'
        '12077463703a2f2f611a07613a32393530302006280282a172a162a27062c4190a016212077463703a2f2f621a07623a'
        '32393530302006280288a172a163a161a77463703a2f2f63a173a0a2737400a17701a2736fc2a164a0a2636600a163cf'
        '0000018bcfe56802a47465726d01a46e6f6465a26e31a17603'
    ),
    (
        '86a16bad636f6d6d69745f71756f72756da665787065637401a17183a2696402a1709182a172a161a27062c4190a0161'
        '12077463703a2f2f611a07613a323935303020062802a163cf0000018bcfe56802a47465726d01a46e6f6465a26e31a1'
        '7603'
    ),
    (
        '84a16bab7365745f6d656d62657273a665787065637400a16d9393a26e31a3683a31a3683a3293a26e32a3683a33a368'
        '3a3493a26e33a3683a35a3683a36a17603'
    ),
    '85a16baa7465726d5f7374617274a47465726d02a46e6f6465a26e32a174cd07d0a17603',
    (
        '86a16bad636f6d6d69745f71756f72756da665787065637402a17183a2696403a1709182a172a161a27062c4190a0161'
        '12077463703a2f2f611a07613a323935303020072802a163cf0000018bcfe56803a47465726d01a46e6f6465a26e31a1'
        '7603'
    ),
    '83a17603a16baf66726f6d2d7468652d667574757265a17801',
    (
        '86a16bad636f6d6d69745f71756f72756da665787065637402a17183a2696403a1709282a172a161a27062c4190a0161'
        '12077463703a2f2f611a07613a32393530302007280288a172a163a161a77463703a2f2f63a173a0a2737407a17701a2'
        '736fc2a164a0a2636600a163cf0000018bcfe56803a47465726d02a46e6f6465a26e32a17603'
    ),
    '85a16baa7465726d5f7374617274a47465726d02a46e6f6465a26e33a174cd09c4a17603',
    '85a16ba7636f6e6669726da47465726d02a46e6f6465a26e32a56c65617365ccfaa17603',
    '83a16bad656e61626c655f736368656d61a776657273696f6e03a17603',
]
GOLDEN_MID = (
    '8aa671756f72756d83a2696402a1709382a172a161a27062c4190a016112077463703a2f2f611a07613a323935303020'
    '06280282a172a162a27062c4190a016212077463703a2f2f621a07623a32393530302006280288a172a163a161a77463'
    '703a2f2f63a173a0a2737400a17701a2736fc2a164a0a2636600a163cf0000018bcfe56802a7686973746f7279939401'
    '92a161a162cf0000018bcfe5680101940192a161a162cf0000018bcfe5680101940293a161a162a163cf0000018bcfe5'
    '680201a66c65616465729301a26e31cd03e8a6736368656d6103a76170706c69656407a872656a656374656401a76d65'
    '6d626572739393a26e31a3683a31a3683a3293a26e32a3683a33a3683a3493a26e33a3683a35a3683a36a96d656d6265'
    '72735f7601a86c656173655f6d7364a17603'
)
GOLDEN_FINAL = (
    '8ba671756f72756d83a2696403a1709282a172a161a27062c4190a016112077463703a2f2f611a07613a323935303020'
    '07280288a172a163a161a77463703a2f2f63a173a0a2737407a17701a2736fc2a164a0a2636600a163cf0000018bcfe5'
    '6803a7686973746f727994940192a161a162cf0000018bcfe5680101940192a161a162cf0000018bcfe5680101940293'
    'a161a162a163cf0000018bcfe5680201940392a161a163cf0000018bcfe5680302a66c65616465729302a26e32cd07d0'
    'a6736368656d6103a76170706c6965640ea872656a656374656402ab72656a65637465645f747301a76d656d62657273'
    '9393a26e31a3683a31a3683a3293a26e32a3683a33a3683a3493a26e33a3683a35a3683a36a96d656d626572735f7601'
    'a86c656173655f6d73ccfaa17603'
)


def _generate() -> None:
    from lighthouse_cluster.core.state_machine import QuorumStateMachine

    log = encode_at_3(commands())
    sm = QuorumStateMachine()
    mid = b""
    for i, p in enumerate(log):
        sm.apply_bytes(p)
        if i == MID_INDEX:
            mid = sm.to_snapshot()
    print("GOLDEN_LOG: list[str] = [")
    for p in log:
        print(f"    {p.hex()!r},")
    print("]")
    print(f"GOLDEN_MID = {mid.hex()!r}")
    print(f"GOLDEN_FINAL = {sm.to_snapshot().hex()!r}")


if __name__ == "__main__":
    _generate()
