"""The skip policy: which skips are expected, and a switch that fails every other one.

A skip hides a test that did not run. Locally a skip for a missing tool or package is a
convenience (``pytest -ra`` lists each with its reason); in CI, where ``.ci/run`` installs every
tool, it would hide breakage. With ``LIGHTHOUSE_TESTS_STRICT=1`` (``.ci/run`` sets it; ``CI`` set
has the same effect) a skip whose reason matches none of ``EXPECTED`` fails the test, and a
module that skips at import fails its collection. The expected skips are listed at the end of
the run.
"""

from __future__ import annotations

import os
import re

# Skips that stay skips in CI: what this CI machine cannot have. Each entry: a regular
# expression searched in the skip's reason, and why it is allowed.
EXPECTED: tuple[tuple[str, str], ...] = (
    (r"\b(GPU|CUDA|NCCL)\b", "CI machines have no GPU; GPU tests run on a lent device"),
)


def strict() -> bool:
    return os.environ.get("LIGHTHOUSE_TESTS_STRICT", "") not in ("", "0") or bool(os.environ.get("CI"))


def expected(reason: str) -> bool:
    return any(re.search(pattern, reason) for pattern, _ in EXPECTED)
