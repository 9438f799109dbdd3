"""Summaries of ``py-spy record --format raw`` profiles (collapsed stacks: ``frame;frame;... count``).

``top_functions`` gives the functions with the most samples on top of the stack ("self") and on
the stack at all ("total"), which is what the findings in the results quote.
"""

from __future__ import annotations

from collections import Counter
from pathlib import Path


def _frame_name(frame: str) -> str:
    # py-spy frames look like "function (path/to/file.py:123)"; keep function and file:line.
    frame = frame.strip()
    if " (" in frame and frame.endswith(")"):
        fn, loc = frame[:-1].split(" (", 1)
        parts = loc.split("/")
        return f"{fn} ({'/'.join(parts[-2:])})"
    return frame


def top_functions(path: Path, limit: int = 15) -> dict:
    self_c: Counter[str] = Counter()
    total_c: Counter[str] = Counter()
    samples = 0
    for line in Path(path).read_text(errors="replace").splitlines():
        if not line.strip():
            continue
        stack, _, count = line.rpartition(" ")
        try:
            n = int(count)
        except ValueError:
            continue
        frames = [_frame_name(f) for f in stack.split(";") if f]
        if not frames:
            continue
        samples += n
        self_c[frames[-1]] += n
        for f in set(frames):
            total_c[f] += n
    pct = (lambda c: round(100.0 * c / samples, 1)) if samples else (lambda c: 0.0)
    return {"samples": samples,
            "self": [(f, pct(c)) for f, c in self_c.most_common(limit)],
            "total": [(f, pct(c)) for f, c in total_c.most_common(limit)]}


def render(path: Path, limit: int = 15) -> str:
    t = top_functions(path, limit)
    lines = [f"{path.name}: {t['samples']} samples", "  self:"]
    lines += [f"    {p:5.1f}%  {f}" for f, p in t["self"]]
    lines += ["  total (on stack):"]
    lines += [f"    {p:5.1f}%  {f}" for f, p in t["total"]]
    return "\n".join(lines)
