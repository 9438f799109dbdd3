"""Run only by tests/project/test_test_rules.py (not collected: the name does not start with
test_): a test in an xdist group that run_lock.SERIAL_RESOURCES does not list, which must fail the
run at collection."""

import pytest


@pytest.mark.xdist_group("made-up")
def test_in_an_unlisted_group() -> None:
    pass
