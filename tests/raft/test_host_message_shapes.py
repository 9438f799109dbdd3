"""``pysyncobj_internals.MESSAGE_SHAPES``: the keys of pysyncobj's messages that the extensions
read or write are checked against pysyncobj's source at import; a changed source is named."""

from __future__ import annotations

import inspect

import pysyncobj.syncobj
import pytest

from lighthouse_cluster.raft import pysyncobj_internals as internals

SOURCE = inspect.getsource(pysyncobj.syncobj)


def test_the_installed_pysyncobj_has_every_declared_key() -> None:
    assert internals.message_shape_problems() == []
    internals.check_message_shapes()


def test_a_renamed_key_or_message_type_is_named() -> None:
    renamed = SOURCE.replace("'last_log_term'", "'lastLogTerm'").replace("'timeout_now'", "'timeoutNow'")
    assert internals.message_shape_problems(renamed) == ["request_vote.last_log_term", "timeout_now"]
    with pytest.raises(ImportError, match=r"request_vote\.last_log_term, timeout_now; run: pip install"):
        internals.check_message_shapes(renamed)


def test_every_key_the_extensions_build_into_a_request_vote_is_declared() -> None:
    built = {"type", "term", "last_log_index", "last_log_term"}  # fast_election: handover, depose, step-down
    assert built - {"type"} <= set(internals.MESSAGE_SHAPES["request_vote"])
