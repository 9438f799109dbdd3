"""Every relative link in the repository's Markdown resolves (issue #13 item 7).

For each Markdown file in the repository (README.md, docs/, deploy/, benchmarks/, jepsen_like/,
examples/, ...; hidden and build directories are left out), every inline link and image
(``[text](target)``, ``![alt](target)``), reference definition (``[id]: target``) and HTML
``href``/``src`` outside code is checked: the target file or directory must exist, and a
``#anchor`` (in the same file or in another Markdown file) must be a heading's id as GitHub makes
it (lowercase, punctuation other than ``-`` and ``_`` dropped, each space a ``-``, the second
heading with the same id gets ``-1``, the third ``-2``, ...) or an explicit ``<a name=..>``/``id=..``.
External links (``http(s):``, ``mailto:``) are not fetched. Fast: reads files, starts nothing.
"""

from __future__ import annotations

import re
import unicodedata
from pathlib import Path
from urllib.parse import unquote

import pytest

ROOT = Path(__file__).resolve().parents[2]
SKIP_DIRS = {"node_modules", "build", "dist", "__pycache__", "jepsen-runs", "bench-runs", "data"}

FENCE = re.compile(r"^\s*(`{3,}|~{3,})")
ATX = re.compile(r"^ {0,3}(#{1,6})(?:[ \t]+(.*?))?(?:[ \t]+#+)?[ \t]*$")
SETEXT = re.compile(r"^ {0,3}(=+|-+)[ \t]*$")
CODE_SPAN = re.compile(r"(`+)(.+?)\1")
INLINE_LINK = re.compile(r"!?\[((?:[^\[\]]|\[[^\[\]]*\])*)\]\(\s*(<[^>]*>|[^()\s]+(?:\([^()\s]*\)[^()\s]*)*)"
                         r"(?:\s+(?:\"[^\"]*\"|'[^']*'|\([^)]*\)))?\s*\)")
REF_DEF = re.compile(r"^ {0,3}\[([^\]]+)\]:\s*(<[^>]*>|\S+)")
HTML_ATTR = re.compile(r"""<(?:a|img)\b[^>]*?\b(?:href|src)\s*=\s*["']([^"']+)["']""", re.I)
HTML_ID = re.compile(r"""<[a-z][^>]*?\b(?:id|name)\s*=\s*["']([^"']+)["']""", re.I)
EXTERNAL = re.compile(r"^[a-z][a-z0-9+.-]*:", re.I)     # http:, https:, mailto:, ...


def markdown_files() -> list[Path]:
    out = []
    for p in sorted(ROOT.rglob("*.md")):
        parts = p.relative_to(ROOT).parts
        if any(d.startswith(".") or d in SKIP_DIRS or d.endswith(".egg-info") for d in parts[:-1]):
            continue
        out.append(p)
    return out


def prose_lines(text: str) -> list[tuple[int, str]]:
    """(line number, line) for every line outside fenced code blocks."""
    out, fence = [], None
    for n, line in enumerate(text.splitlines(), 1):
        m = FENCE.match(line)
        if fence is None and m:
            fence = m.group(1)[0] * len(m.group(1))
        elif fence is not None:
            if m and m.group(1)[0] == fence[0] and len(m.group(1)) >= len(fence) and not line.strip()[len(m.group(1)):].strip():
                fence = None
        else:
            out.append((n, line))
    return out


def heading_text(raw: str) -> str:
    """A heading's text as GitHub renders it: code, emphasis and link syntax gone."""
    text = CODE_SPAN.sub(lambda m: m.group(2).strip(), raw)
    text = re.sub(r"!?\[([^\]]*)\]\([^)]*\)", r"\1", text)     # [text](url) -> text
    text = re.sub(r"<[^>]+>", "", text)                          # inline HTML tags
    text = re.sub(r"(\*+|(?<!\w)_+|_+(?!\w))", "", text)         # emphasis markers, not snake_case
    return text.strip()


def slug(text: str) -> str:
    """GitHub's heading id (github-slugger): lowercase; keep letters, marks, digits, connector
    punctuation (``_``), ``-`` and spaces; every space becomes ``-``."""
    kept = []
    for ch in text.lower():
        cat = unicodedata.category(ch)
        if ch in " -" or cat[0] in "LMN" or cat == "Pc":
            kept.append(ch)
    return "".join(kept).replace(" ", "-")


def anchors(text: str) -> set[str]:
    """Every id a reader can link to in this Markdown: headings (duplicates -1, -2, ...), HTML ids."""
    seen: dict[str, int] = {}
    out: set[str] = set()

    def add(raw: str) -> None:
        base = slug(heading_text(raw))
        s = base
        while s in seen:                       # github-slugger: foo, foo-1, foo-2, ...
            seen[base] += 1
            s = f"{base}-{seen[base]}"
        seen[s] = 0
        out.add(s)

    prev = ""
    for _, line in prose_lines(text):
        m = ATX.match(line)
        if m:
            add(m.group(2) or "")
            prev = ""
            continue
        if SETEXT.match(line) and prev.strip() and not re.match(r"^\s*([-*+>|#]|\d+[.)])", prev):
            add(prev.strip())
            prev = ""
            continue
        out.update(HTML_ID.findall(line))
        prev = line
    return out


def links(text: str) -> list[tuple[int, str]]:
    """(line number, target) for every link outside code."""
    out = []
    for n, line in prose_lines(text):
        line = CODE_SPAN.sub("", line)
        for m in INLINE_LINK.finditer(line):
            out.append((n, m.group(2)))
        m = REF_DEF.match(line)
        if m:
            out.append((n, m.group(2)))
        out.extend((n, t) for t in HTML_ATTR.findall(line))
    return [(n, t[1:-1] if t.startswith("<") and t.endswith(">") else t) for n, t in out]


def broken_links(path: Path, root: Path = ROOT) -> list[str]:
    text = path.read_text(encoding="utf-8")
    problems = []
    for n, target in links(text):
        if EXTERNAL.match(target) or target.startswith("//"):
            continue
        file_part, _, anchor = target.partition("#")
        file_part = unquote(file_part)
        where = f"{path.relative_to(root)}:{n}: {target}"
        if file_part.startswith("/"):
            dest = root / file_part.lstrip("/")
        else:
            dest = (path.parent / file_part) if file_part else path
        if not dest.exists():
            problems.append(f"{where}: {dest.relative_to(root) if dest.is_relative_to(root) else dest} does not exist")
            continue
        if anchor and dest.is_file() and dest.suffix.lower() == ".md":
            if unquote(anchor) not in anchors(dest.read_text(encoding="utf-8")):
                problems.append(f"{where}: no heading with id #{anchor} in {dest.relative_to(root)}")
    return problems


# -- the checker itself ------------------------------------------------------------------------------


@pytest.mark.parametrize("heading, expected", [
    ("Using it with torchft", "using-it-with-torchft"),
    ("Start here: a local cluster in ten minutes", "start-here-a-local-cluster-in-ten-minutes"),
    ("Semi-synchronous training: LocalSGD and DiLoCo", "semi-synchronous-training-localsgd-and-diloco"),
    ("`lighthouse-cluster up`'s flags", "lighthouse-cluster-ups-flags"),
    ("BUG-2: a deposed leader's TermStart (fixed)", "bug-2-a-deposed-leaders-termstart-fixed"),
    ("F7 — gRPC cancels calls", "f7--grpc-cancels-calls"),
    ("snake_case and *emphasis*", "snake_case-and-emphasis"),
    ("[A link](x.md) in a heading", "a-link-in-a-heading"),
    ("1.5x / 2.0x, N=8", "15x--20x-n8"),
])
def test_slug_matches_github(heading: str, expected: str) -> None:
    assert slug(heading_text(heading)) == expected


def test_duplicate_headings_code_blocks_and_setext() -> None:
    text = ("# Top\n## Setup\n### Setup\n## Setup\n```bash\n# 1. not a heading\n```\n"
            "Other title\n-----------\n<a name=\"custom\"></a>\n")
    assert anchors(text) == {"top", "setup", "setup-1", "setup-2", "other-title", "custom"}


def test_checker_finds_broken_links(tmp_path: Path) -> None:
    (tmp_path / "docs").mkdir()
    (tmp_path / "docs" / "a.md").write_text("# A\n## Part two\n")
    (tmp_path / "pic.png").write_bytes(b"")
    readme = tmp_path / "README.md"
    readme.write_text(
        "# Title\n## Section\n"
        "[ok](docs/a.md#part-two) [ok](#section) ![ok](pic.png \"t\") [ok](docs/) [ext](https://x.invalid/#nope)\n"
        "[gone](docs/b.md) [bad anchor](docs/a.md#part-three) [bad local](#pointing-trainers-at-it)\n"
        "`[in code](nowhere.md)`\n```\n[in a fence](nowhere.md)\n```\n"
        "[ref]: docs/missing.md\n<img src=\"nope.png\">\n")
    problems = broken_links(readme, root=tmp_path)
    assert [p.split(": ")[1] for p in problems] == [
        "docs/b.md", "docs/a.md#part-three", "#pointing-trainers-at-it", "docs/missing.md", "nope.png"], problems


# -- the repository ----------------------------------------------------------------------------------


def test_the_docs_are_found() -> None:
    found = {p.relative_to(ROOT).as_posix() for p in markdown_files()}
    assert {"README.md", "deploy/README.md", "benchmarks/README.md", "jepsen_like/README.md", "docs/ftclient.md",
            "docs/operations.md", "docs/how-it-works.md", "docs/fault-injection-and-benchmarks.md",
            "docs/design/README.md", "docs/design/leader-lease.md"} <= found
    assert not any(f.startswith(".") for f in found)


@pytest.mark.parametrize("path", markdown_files(), ids=lambda p: p.relative_to(ROOT).as_posix())
def test_every_relative_link_resolves(path: Path) -> None:
    problems = broken_links(path)
    assert not problems, "\n".join(problems)
