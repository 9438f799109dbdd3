"""How a node encrypts its Raft messages: AES-256-GCM once every member reads it, Fernet before.

pysyncobj encrypts each message of a cluster with a secret with Fernet (AES-128-CBC, then
HMAC-SHA256 over it, then base64) and, reading one, verifies the HMAC twice (``extract_timestamp``,
then ``decrypt``). A message sent after a pause, as an idle cluster's heartbeats, acknowledgements
and keep-alives all are, cost 260 us to encrypt and 280 us to read on this project's 2-core host:
most of an idle node's CPU (docs/design/raft-message-cipher.md). AES-256-GCM, one call each way
on a key made once, costs about 50 us.

The format (``GCM_FORMAT``): the byte 0x01, then pysyncobj's timestamp (8 bytes, big-endian: the
sender's ``int(monotonic())``, which the receiver checks never goes back on a connection), the
sender's key id (16 random bytes drawn at its start), the nonce (12 bytes: a per-process counter),
then the ciphertext and tag; everything before the ciphertext is authenticated with it. The key is
``HKDF-SHA256(secret key, salt=key id)``, the secret key being the one pysyncobj derives for Fernet
from the cluster secret (PBKDF2, its salt and iterations): each process encrypts under a key of its
own, so a counter is a safe nonce (never repeated under one key), and a restart draws a new key id.
A Fernet token is base64 text (its first byte is ``g``), so the first byte tells the formats apart.

Rolling upgrades: every node of this version reads both formats, and sends the new one only once
its state machine has applied something (a node that has not caught up yet does not know its
cluster) at ``CIPHER_SCHEMA_VERSION`` or later, a schema version a leader enables only once every
member reports that it reads it (``node._upgrade_schema``). Until then, and with an older member,
it sends Fernet, as pysyncobj did. ``RaftNode`` decides (``send_gcm``); ``RaftHost``
hands this object to pysyncobj's transport as its ``encryptor``.
"""

from __future__ import annotations

import base64
import itertools
import os
import struct
from collections import OrderedDict
from typing import Callable

from cryptography.exceptions import InvalidTag
from cryptography.fernet import Fernet, InvalidToken
from cryptography.hazmat.primitives import hashes
from cryptography.hazmat.primitives.ciphers.aead import AESGCM
from cryptography.hazmat.primitives.kdf.hkdf import HKDF
from cryptography.hazmat.primitives.kdf.pbkdf2 import PBKDF2HMAC

from lighthouse_cluster.raft.pysyncobj_internals import ENCRYPTOR_ITERATIONS, ENCRYPTOR_SALT

__all__ = ["GCM_FORMAT", "MessageCipher"]

GCM_FORMAT = 0x01
_HEADER = struct.Struct(">BQ16s12s")  # format, timestamp, key id, nonce
_INFO = b"lighthouse-cluster raft messages AES-256-GCM v1"
_MAX_PEER_KEYS = 256  # keys of other processes kept (a restart of a peer brings a new one)


def secret_key(secret: str | bytes) -> bytes:
    """The 32 bytes pysyncobj derives from the cluster secret for Fernet (``getEncryptor``)."""
    password = secret if isinstance(secret, bytes) else secret.encode()
    return PBKDF2HMAC(algorithm=hashes.SHA256(), length=32, salt=ENCRYPTOR_SALT,
                      iterations=ENCRYPTOR_ITERATIONS).derive(password)


def _gcm_key(key: bytes, key_id: bytes) -> AESGCM:
    return AESGCM(HKDF(algorithm=hashes.SHA256(), length=32, salt=key_id, info=_INFO).derive(key))


class MessageCipher:
    """pysyncobj's ``encryptor``: ``encrypt_at_time``, ``extract_timestamp``, ``decrypt``.

    Called on the tick thread only (pysyncobj's connections live there); ``send_gcm`` is read
    once per message sent."""

    def __init__(self, secret: str | bytes, send_gcm: Callable[[], bool] = lambda: False) -> None:
        key = secret_key(secret)
        self._fernet = Fernet(base64.urlsafe_b64encode(key))
        self._key = key
        self._key_id = os.urandom(16)
        self._own = _gcm_key(key, self._key_id)
        self._counter = itertools.count(1)
        self._peers: OrderedDict[bytes, AESGCM] = OrderedDict()
        self.send_gcm = send_gcm
        # The last token read by extract_timestamp and its plaintext: decrypt follows it at once.
        self._read: tuple[bytes, bytes] | None = None
        self.sent_gcm = 0
        self.sent_fernet = 0

    # -- sending ---------------------------------------------------------------------------------

    def encrypt_at_time(self, data: bytes, current_time: int) -> bytes:
        if not self.send_gcm():
            self.sent_fernet += 1
            return self._fernet.encrypt_at_time(data, current_time)
        self.sent_gcm += 1
        nonce = next(self._counter).to_bytes(12, "big")
        header = _HEADER.pack(GCM_FORMAT, current_time, self._key_id, nonce)
        return header + self._own.encrypt(nonce, data, header)

    # -- reading ---------------------------------------------------------------------------------

    def extract_timestamp(self, token: bytes) -> int:
        """The sender's timestamp of a token whose authenticity was verified (raises otherwise)."""
        if token[:1] != bytes((GCM_FORMAT,)):
            return self._fernet.extract_timestamp(token)
        plaintext, timestamp = self._open(token)
        self._read = (token, plaintext)
        return timestamp

    def decrypt(self, token: bytes) -> bytes:
        if token[:1] != bytes((GCM_FORMAT,)):
            return self._fernet.decrypt(token)
        read = self._read
        if read is not None and read[0] is token:
            self._read = None
            return read[1]
        return self._open(token)[0]

    def _open(self, token: bytes) -> tuple[bytes, int]:
        if len(token) < _HEADER.size + 16:
            raise InvalidToken
        _, timestamp, key_id, nonce = _HEADER.unpack_from(token)
        key, known = self._key_for(key_id)
        try:
            plaintext = key.decrypt(nonce, token[_HEADER.size:], token[:_HEADER.size])
        except InvalidTag as e:  # the same answer as a bad Fernet token
            raise InvalidToken from e
        if not known:  # kept once a message under it was authentic
            self._peers[key_id] = key
            while len(self._peers) > _MAX_PEER_KEYS:
                self._peers.popitem(last=False)
        return plaintext, timestamp

    def _key_for(self, key_id: bytes) -> tuple[AESGCM, bool]:
        """The key of the sender with ``key_id``, and whether it was known already."""
        if key_id == self._key_id:
            return self._own, True
        key = self._peers.get(key_id)
        if key is not None:
            self._peers.move_to_end(key_id)
            return key, True
        return _gcm_key(self._key, key_id), False
