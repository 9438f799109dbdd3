"""Run only by tests/project/test_test_rules.py (not collected: the name does not start with
test_): one test under the opt-in ``torchtitan_full`` marker, one not."""

import pytest


@pytest.mark.torchtitan_full
def test_in_the_full_matrix() -> None:
    pass


def test_in_every_run() -> None:
    pass
