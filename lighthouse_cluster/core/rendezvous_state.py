"""The stored form of torchrun's rendezvous state, and the round summary the nodes read of it.

torchrun's ``--rdzv-backend=lighthouse`` (``ftclient/torchrun_rendezvous/state_backend.py``)
keeps the state torch's handler pickles in one key of the run's namespace, ``STATE_KEY``. The
value is three parts::

    lighthouse-rendezvous-state/1\\n                       STATE_HEADER (unchanged since the first backend)
    <torch's pickled _RendezvousState>                   opaque to the nodes: never unpickled here
    lighthouse-rendezvous-summary/1 round=3 complete=1 closed=0 participants=4 waiting=0\\n

The last line, the summary, is what the agent that wrote the state knew of it (the agent
unpickles the bytes its own handler just pickled; see the backend). The nodes read only that
line, to show and count rendezvous rounds (``/metrics``, the dashboard, ``rendezvous list``):
client bytes are untrusted and the nodes never unpickle them.

Why a trailing line rather than a longer header. The backend of the first release checks that
the value starts with exactly ``STATE_HEADER`` and hands everything after it to torch's
``pickle.loads``, which ignores bytes past the end of the pickle (documented). A summary after
the pickle is therefore read by such an agent as before, and a value such an agent writes
(no summary) reads here as "unknown": both directions keep working in a mixed run. A changed
header line would have made the older agents refuse every newer value.

The summary is versioned: ``/1`` and space-separated ``name=decimal`` fields; a reader ignores
fields it does not know (new fields keep ``/1``; an incompatible change takes ``/2``, which this
reader treats as unknown). It is at most ``MAX_SUMMARY_BYTES`` long, and the parser looks at no
more than that many bytes at the value's end. Anything that does not parse (garbage, another
version, a value some other writer put in the key) is "unknown" (None), never an exception.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

STATE_KEY = "torchrun/state"
STATE_HEADER = b"lighthouse-rendezvous-state/1\n"
SUMMARY_MAGIC = b"lighthouse-rendezvous-summary/"
SUMMARY_VERSION = 1
MAX_SUMMARY_BYTES = 160
_MAX_DIGITS = 12
_FIELD = re.compile(rb"^([a-z_]{1,24})=([0-9]{1,%d})$" % _MAX_DIGITS)


@dataclass(frozen=True, slots=True)
class RoundSummary:
    """What the writing agent knew of the rendezvous: its round (torch counts from 0), whether
    that round is complete (its participants were admitted) or still gathering, whether the
    rendezvous is closed (the job ended), and how many nodes take part and wait for the next
    round."""

    round: int
    complete: bool
    closed: bool
    participants: int
    waiting: int

    @property
    def phase(self) -> str:
        """"closed", "complete" or "waiting" (for a round still gathering its participants)."""
        return "closed" if self.closed else "complete" if self.complete else "waiting"


def summary_line(s: RoundSummary) -> bytes:
    """The summary as the line stored after torch's bytes."""
    fields = {"round": s.round, "complete": int(s.complete), "closed": int(s.closed),
              "participants": s.participants, "waiting": s.waiting}
    if any(not 0 <= v < 10**_MAX_DIGITS for v in fields.values()):
        raise ValueError(f"rendezvous summary out of range: {s}")
    line = SUMMARY_MAGIC + b"%d " % SUMMARY_VERSION + b" ".join(b"%s=%d" % (k.encode(), v)
                                                                for k, v in fields.items()) + b"\n"
    assert len(line) <= MAX_SUMMARY_BYTES
    return line


def encode_state(state: bytes, summary: RoundSummary | None) -> bytes:
    """The stored value of torch's ``state`` (with its summary when the writer has one)."""
    return STATE_HEADER + state + (summary_line(summary) if summary is not None else b"")


def _parse_line(line: bytes) -> RoundSummary | None:
    head, _, rest = line.partition(b" ")
    if head != SUMMARY_MAGIC + b"%d" % SUMMARY_VERSION:
        return None
    fields: dict[bytes, int] = {}
    for part in rest.split(b" "):
        m = _FIELD.match(part)
        if m is None:
            return None
        fields[m.group(1)] = int(m.group(2))
    try:
        return RoundSummary(round=fields[b"round"], complete=fields[b"complete"] == 1, closed=fields[b"closed"] == 1,
                            participants=fields[b"participants"], waiting=fields[b"waiting"])
    except KeyError:
        return None


def _summary_start(value: bytes) -> tuple[int, RoundSummary] | None:
    """Where the summary line starts in ``value`` and what it says, or None."""
    if not value.endswith(b"\n"):
        return None
    lowest = max(len(STATE_HEADER), len(value) - MAX_SUMMARY_BYTES)
    start = value.rfind(SUMMARY_MAGIC, lowest)
    if start < 0 or b"\n" in value[start:-1]:
        return None
    summary = _parse_line(value[start:-1])
    return None if summary is None else (start, summary)


def is_state(value: bytes) -> bool:
    """Whether ``value`` is a rendezvous state written by the lighthouse backend (its header)."""
    return value.startswith(STATE_HEADER)


def decode_state(value: bytes) -> tuple[bytes, RoundSummary | None] | None:
    """(torch's bytes, the summary or None when there is none) of a stored value; None when the
    value is not a rendezvous state of the lighthouse backend (no header)."""
    if not is_state(value):
        return None
    found = _summary_start(value)
    if found is None:
        return value[len(STATE_HEADER):], None
    start, summary = found
    return value[len(STATE_HEADER):start], summary


def read_summary(value: bytes | None) -> RoundSummary | None:
    """The summary of a stored value; None ("unknown") for anything without a valid one. Never
    raises, whatever ``value`` holds."""
    if not isinstance(value, bytes) or not is_state(value):
        return None
    found = _summary_start(value)
    return None if found is None else found[1]


def completes_a_round(old: bytes | None, new: bytes) -> bool:
    """Whether a write that replaced ``old`` (None: absent) with ``new`` moved the run to a new
    completed round: ``new`` says its round is complete, and ``old`` did not say so of that
    same round (an unknown ``old`` counts as not)."""
    after = read_summary(new)
    if after is None or not after.complete:
        return False
    before = read_summary(old)
    return before is None or not before.complete or before.round != after.round
