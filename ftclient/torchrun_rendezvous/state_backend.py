"""``LighthouseRendezvousBackend``: torch's ``RendezvousBackend`` on the cluster's replicated
key-value store. The rendezvous state (the bytes torch's handler pickles) is one key of the
run's namespace, ``STATE_KEY``; its fencing token is the key's version, so ``set_state`` is a
compare-and-set on the version (0: "no state yet"), applied exactly once even when its answer is
lost in a leader change (the client resends it with the same request id).

The stored value is ``STATE_HEADER``, torch's bytes and a one-line summary of the round (its
number, complete or not, closed or not, participants, waiting nodes) that the nodes read instead
of unpickling anything (``lighthouse_cluster/core/rendezvous_state.py`` has the format and why it
trails the pickle). The summary is made here by unpickling the bytes this process's own handler
has just pickled, never bytes read from the cluster; a state that does not unpickle to torch's
state goes without a summary. A value without the header (written by something else into the
key) is refused as a ``RendezvousStateError`` naming the key, before torch unpickles anything. The cluster's refusals and a cluster that does not answer within
the client's timeout are ``RendezvousConnectionError`` / ``RendezvousStateError`` with the
cluster's one-line message; nothing is written then.
"""

from __future__ import annotations

import pickle
from typing import Any

from torch.distributed.elastic.rendezvous.api import RendezvousConnectionError, RendezvousStateError
from torch.distributed.elastic.rendezvous.dynamic_rendezvous import RendezvousBackend

from ftclient.torchrun_rendezvous.settings import BACKEND_NAME
from lighthouse_cluster.client.kv_client import Entry, KVClient, KVError, KVUnavailable
from lighthouse_cluster.core.rendezvous_state import (STATE_HEADER, STATE_KEY, RoundSummary, decode_state, encode_state,
                                                     summary_line)

__all__ = ["STATE_HEADER", "STATE_KEY", "LighthouseRendezvousBackend", "summarize"]


def summarize(state: bytes) -> RoundSummary | None:
    """The round summary of ``state``, bytes torch's handler in this process has just pickled
    (trusted: they never came from the cluster); None when they are not torch's state."""
    try:
        s = pickle.loads(state)
        summary = RoundSummary(round=int(s.round), complete=bool(s.complete), closed=bool(s.closed),
                               participants=len(s.participants), waiting=len(s.wait_list))
        summary_line(summary)  # ValueError when a field does not fit the line
        return summary
    except Exception:  # noqa: BLE001 - no summary is a valid state too ("unknown" on the nodes)
        return None


class LighthouseRendezvousBackend(RendezvousBackend):
    """The rendezvous state of one run (``kv``'s namespace); see the module docstring."""

    def __init__(self, kv: KVClient) -> None:
        self._kv = kv

    @property
    def name(self) -> str:
        return BACKEND_NAME

    def _where(self) -> str:
        return f"rendezvous state {self._kv.job}/{self._kv.run_id} key {STATE_KEY!r}"

    def _refused(self, what: str, e: KVError) -> Exception:
        if isinstance(e, KVUnavailable):
            return RendezvousConnectionError(f"{self._where()}: {what}: {e}")
        return RendezvousStateError(f"{self._where()}: {what} refused: {e}")

    def _decode(self, entry: Entry) -> tuple[bytes, int]:
        decoded = decode_state(entry.value)
        if decoded is None:
            raise RendezvousStateError(
                f"{self._where()} holds {len(entry.value)} bytes that are not a rendezvous state written by the "
                f"{BACKEND_NAME} backend (header {STATE_HEADER[:-1].decode()!r} missing); use another --rdzv-id, "
                f"or remove it: lighthouse-cluster rendezvous remove {self._kv.job} {self._kv.run_id}")
        return decoded[0], entry.version

    def get_state(self) -> tuple[bytes, Any] | None:
        try:
            entry = self._kv.get(STATE_KEY)
        except KVError as e:
            raise self._refused("read", e) from None
        return None if entry is None else self._decode(entry)

    def set_state(self, state: bytes, token: Any | None = None) -> tuple[bytes, Any, bool] | None:
        if token is not None and not (isinstance(token, int) and token > 0):
            # Not a token of this backend: it cannot match; answer what is there.
            current = self.get_state()
            return None if current is None else (*current, False)
        try:
            result = self._kv.compare_and_set(STATE_KEY, encode_state(state, summarize(state)),
                                              expected_version=token or 0)
        except KVError as e:
            raise self._refused(f"write of {len(state)} bytes", e) from None
        if result.applied and result.entry is not None:
            return state, result.entry.version, True
        if result.entry is None:
            # Applied by an earlier attempt and changed since, or lost to a removal: read again.
            current = self.get_state()
            return None if current is None else (*current, False)
        return (*self._decode(result.entry), False)
