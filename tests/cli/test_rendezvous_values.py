"""How `lighthouse-cluster rendezvous show` writes a value in its table: one line a terminal shows
as it is. A run's keys hold what its trainers wrote (torch's pickled state: control bytes), so a
raw value could move the cursor or set colours on the reader's terminal."""

from __future__ import annotations

from lighthouse_cluster.cli.kv import SHOWN_VALUE_CHARS, _value_text


def test_control_characters_and_bytes_that_are_not_utf8_are_written_as_escapes() -> None:
    assert _value_text(b"\x80\x04binary") == "\\x80\\x04binary"
    assert _value_text(b"\x1b[31mred\x1b[0m\nnext") == "\\x1b[31mred\\x1b[0m\\nnext"
    assert _value_text("10.0.0.12 caf\u00e9".encode()) == "10.0.0.12 caf\u00e9"  # printable text as it is
    assert all(c.isprintable() for c in _value_text(bytes(range(256))))


def test_a_long_value_is_cut_with_its_size() -> None:
    shown = _value_text(b"x" * (SHOWN_VALUE_CHARS + 10))
    assert shown == "x" * SHOWN_VALUE_CHARS + f"... ({SHOWN_VALUE_CHARS + 10} bytes)"
