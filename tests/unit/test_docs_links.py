"""The README and docs/ hold together: every relative link finds its file (and its heading, for
an ``#anchor`` into Markdown), docs/README.md indexes every page, the README stays short."""

from __future__ import annotations

import re
import tomllib
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
README_MAX_LINES = 200

FENCE = re.compile(r"^ {0,3}(`{3,}|~{3,}).*?^ {0,3}\1[^\n]*$", re.MULTILINE | re.DOTALL)
CODE_SPAN = re.compile(r"(`+)(?!`).+?(?<!`)\1(?!`)", re.DOTALL)
# [text](target) and ![alt](target), with an optional "title"; the target has no spaces.
LINK = re.compile(r"\[(?:[^\[\]]|\[[^\]]*\])*\]\(\s*<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)")
HEADING = re.compile(r"^ {0,3}#{1,6}[ \t]+(.+?)[ \t]*#*[ \t]*$", re.MULTILINE)
EXTERNAL = re.compile(r"^(?:[a-zA-Z][a-zA-Z0-9+.-]*:|//)")


def pages(root: Path = ROOT) -> list[Path]:
    """The README and every page under docs/."""
    return [root / "README.md", *sorted((root / "docs").rglob("*.md"))]


def _prose(text: str) -> str:
    """The text without code: a link written inside a code block or span is not a link."""
    return CODE_SPAN.sub("", FENCE.sub("", text))


def slug(heading: str) -> str:
    """A heading's anchor as GitHub makes it: the words lower-cased, punctuation dropped,
    spaces → hyphens (a link in the heading counts by its text)."""
    text = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", heading.strip()).lower()
    return re.sub(r"[^\w\- ]", "", text).replace(" ", "-")


def anchors(path: Path) -> set[str]:
    """Every anchor a Markdown file's headings make, repeats numbered as GitHub does."""
    seen: dict[str, int] = {}
    found = set()
    for heading in HEADING.findall(FENCE.sub("", path.read_text(encoding="utf-8"))):
        base = slug(heading)
        count = seen.get(base, 0)
        seen[base] = count + 1
        found.add(base if count == 0 else f"{base}-{count}")
    return found


def broken_links(path: Path) -> list[str]:
    """The relative links in ``path`` whose file, or whose heading in a Markdown file, is
    missing, each as ``target: why``."""
    broken = []
    for target in LINK.findall(_prose(path.read_text(encoding="utf-8"))):
        if EXTERNAL.match(target):
            continue
        file_part, _, anchor = target.partition("#")
        linked = (path.parent / file_part).resolve() if file_part else path
        if not linked.exists():
            broken.append(f"{target}: no file {linked}")
        elif anchor and linked.suffix == ".md" and anchor not in anchors(linked):
            broken.append(f"{target}: no heading #{anchor} in {linked.name}")
    return broken


@pytest.mark.parametrize("page", pages(), ids=lambda p: str(p.relative_to(ROOT)))
def test_every_relative_link_resolves(page: Path) -> None:
    assert broken_links(page) == []


def test_readme_is_short() -> None:
    lines = (ROOT / "README.md").read_text(encoding="utf-8").splitlines()
    assert len(lines) <= README_MAX_LINES, "the rest belongs in a page under docs/"


def test_the_index_links_every_page() -> None:
    index = ROOT / "docs" / "README.md"
    linked = {
        (index.parent / target.partition("#")[0]).resolve()
        for target in LINK.findall(_prose(index.read_text(encoding="utf-8")))
        if not EXTERNAL.match(target)
    }
    assert [p for p in pages()[1:] if p != index and p.resolve() not in linked] == []


def test_the_package_readme_is_the_readme() -> None:
    project = tomllib.loads((ROOT / "pyproject.toml").read_text(encoding="utf-8"))["project"]
    assert project["readme"] == "README.md"


def test_a_broken_link_or_anchor_is_reported(tmp_path: Path) -> None:
    (tmp_path / "docs").mkdir()
    (tmp_path / "docs" / "other.md").write_text(
        '# Other\n\n## `model="mesh"`: streamed, live\n\n## Notes\n\n## Notes\n'
    )
    (tmp_path / "README.md").write_text(
        "# Top\n\n"
        "[fine](docs/other.md) [fine too](docs/other.md#modelmesh-streamed-live)\n"
        "[second Notes](docs/other.md#notes-1) [here](#top) [web](https://example.com/x.md)\n"
        "[gone](docs/missing.md) [no heading](docs/other.md#nowhere) [no here](#bottom)\n"
        "`[in a span](nothing.md)`\n\n```\n[in a block](nothing.md)\n```\n"
    )
    assert broken_links(tmp_path / "README.md") == [
        f"docs/missing.md: no file {(tmp_path / 'docs' / 'missing.md').resolve()}",
        "docs/other.md#nowhere: no heading #nowhere in other.md",
        "#bottom: no heading #bottom in README.md",
    ]
    assert [p.name for p in pages(tmp_path)] == ["README.md", "other.md"]
