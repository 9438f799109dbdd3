"""Run only by tests/project/test_test_rules.py (not collected: the name does not start with test_)."""

import pytest


def test_needs_a_tool_that_is_missing() -> None:
    pytest.skip("sometool is not installed")


def test_needs_a_gpu() -> None:
    pytest.skip("needs a CUDA GPU")


def test_runs() -> None:
    assert True
