"""The Raft port's cipher (``raft/message_cipher.py``): Fernet exactly as pysyncobj's, AES-256-GCM
between nodes of this version, both read by every node; and the journal's commit index saved only
when it changes. Pure: no process, no socket."""

from __future__ import annotations

import pytest
from cryptography.fernet import InvalidToken
from pysyncobj.encryptor import getEncryptor

from lighthouse_cluster.raft.message_cipher import GCM_FORMAT, MessageCipher
from lighthouse_cluster.raft.durable_journal import DurableJournal

SECRET = "a-cluster-secret-0f3c"
DATA = b"\x80\x04 a pickled, compressed append_entries"


def test_fernet_is_pysyncobjs_both_ways() -> None:
    """Until the cluster enables the new schema, an older node (pysyncobj's own Fernet, from the
    same secret) reads what this node sends, and this node reads what it sends."""
    ours, theirs = MessageCipher(SECRET), getEncryptor(SECRET)
    token = ours.encrypt_at_time(DATA, 1234)
    assert theirs.extract_timestamp(token) == 1234 and theirs.decrypt(token) == DATA
    token = theirs.encrypt_at_time(DATA, 99)
    assert ours.extract_timestamp(token) == 99 and ours.decrypt(token) == DATA
    assert (ours.sent_fernet, ours.sent_gcm) == (1, 0)


def test_aes_gcm_between_two_nodes_of_this_version() -> None:
    sender, receiver = MessageCipher(SECRET, send_gcm=lambda: True), MessageCipher(SECRET)
    tokens = [sender.encrypt_at_time(DATA, t) for t in (7, 7, 8)]
    assert all(t[0] == GCM_FORMAT for t in tokens) and len(set(tokens)) == 3  # a fresh nonce each
    assert len(tokens[0]) < len(getEncryptor(SECRET).encrypt_at_time(DATA, 7))  # and smaller than Fernet
    for t, ts in zip(tokens, (7, 7, 8)):
        assert receiver.extract_timestamp(t) == ts and receiver.decrypt(t) == DATA
    assert receiver.decrypt(tokens[1]) == DATA  # decrypt alone (not right after extract_timestamp)
    assert sender.extract_timestamp(tokens[2]) == 8 and sender.decrypt(tokens[2]) == DATA  # its own
    assert (sender.sent_gcm, sender.sent_fernet) == (3, 0)
    # Once the switch is on, Fernet tokens from a node still switching are read as before.
    assert receiver.decrypt(getEncryptor(SECRET).encrypt_at_time(DATA, 9)) == DATA


def test_the_switch_is_read_per_message() -> None:
    on = [False]
    cipher = MessageCipher(SECRET, send_gcm=lambda: on[0])
    assert cipher.encrypt_at_time(DATA, 1)[0] != GCM_FORMAT
    on[0] = True
    assert cipher.encrypt_at_time(DATA, 1)[0] == GCM_FORMAT


@pytest.mark.parametrize("damage", ["flip a ciphertext bit", "flip a header bit", "truncate", "other secret",
                                    "replace the timestamp"])
def test_a_damaged_or_foreign_aes_gcm_token_is_refused_as_a_bad_fernet_token_is(damage: str) -> None:
    sender = MessageCipher("another-secret" if damage == "other secret" else SECRET, send_gcm=lambda: True)
    token = bytearray(sender.encrypt_at_time(DATA, 5))
    if damage == "flip a ciphertext bit":
        token[-20] ^= 1
    elif damage == "flip a header bit":
        token[12] ^= 1  # inside the key id
    elif damage == "truncate":
        token = token[:30]
    elif damage == "replace the timestamp":
        token[1:9] = (6).to_bytes(8, "big")
    receiver = MessageCipher(SECRET)
    with pytest.raises(InvalidToken):
        receiver.extract_timestamp(bytes(token))
    with pytest.raises(InvalidToken):
        receiver.decrypt(bytes(token))


def test_keys_of_refused_tokens_are_not_kept() -> None:
    receiver, forger = MessageCipher(SECRET), MessageCipher("not-the-secret", send_gcm=lambda: True)
    for k in range(300):
        forged = bytearray(forger.encrypt_at_time(DATA, k))
        forged[9:25] = k.to_bytes(16, "big")  # a new key id each time
        with pytest.raises(InvalidToken):
            receiver.extract_timestamp(bytes(forged))
    assert len(receiver._peers) == 0
    senders = [MessageCipher(SECRET, send_gcm=lambda: True) for _ in range(3)]
    for s in senders:
        receiver.decrypt(s.encrypt_at_time(DATA, 1))
    assert len(receiver._peers) == 3


def test_the_commit_index_is_saved_only_when_it_changes(tmp_path) -> None:
    journal = DurableJournal(str(tmp_path / "raft.journal"), sync=False)
    meta = tmp_path / "raft.journal.meta"
    journal.setRaftCommitIndex(5)
    journal.onOneSecondTimer()
    written = meta.stat().st_ino, meta.read_bytes()
    journal.setRaftCommitIndex(5)   # what a follower does on every heartbeat
    journal.onOneSecondTimer()
    assert (meta.stat().st_ino, meta.read_bytes()) == written  # not rewritten
    journal.setRaftCommitIndex(6)
    journal.onOneSecondTimer()
    assert meta.stat().st_ino != written[0] and journal.getRaftCommitIndex() == 6
    journal._destroy()
