"""The README stays a short front page, and user-facing text stays free of where and when it was written.

The README is read first and kept short (at most 250 lines: the rest lives in docs/, built by
`python3 dev.py docs`); every file it links to exists, every docs page it links to is in the
site's navigation, and every `miles-async VERB` it names is a verb of the real parser. The user
text (README, docs pages, recipe comments) never speaks of the machine it was written on or of the
project's development history.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
README = ROOT / "README.md"
MAX_LINES = 250

# What a user reading the docs on their own machine cannot make sense of.
STALE = re.compile(
    r"\bthis (?:2-core |cpu |shared )*machine\b|\bmeasured here\b|\bruns here\b|\bon this cpu\b"
    r"|\b(?:this|previous|last|earlier) session\b|\bissue \d+\b|\bshared/DESIGN\.md\b",
    re.IGNORECASE,
)


def _links(text: str) -> list[str]:
    return [target for target in re.findall(r"\]\(([^)\s]+)\)", text) if "://" not in target]


def test_the_readme_is_short() -> None:
    lines = README.read_text().splitlines()
    assert len(lines) <= MAX_LINES, f"README.md has {len(lines)} lines (at most {MAX_LINES}): move text into docs/"


def test_every_readme_link_resolves_and_its_pages_are_in_the_site() -> None:
    nav = (ROOT / "mkdocs.yml").read_text()
    links = _links(README.read_text())
    assert links, "README.md links nowhere: it should point into docs/"
    for target in links:
        path = target.split("#", 1)[0]
        assert (ROOT / path).exists(), f"README.md links to {target}, which does not exist"
        if path.startswith("docs/") and path.endswith(".md"):
            assert path.removeprefix("docs/") in nav, f"README.md links to {path}, which mkdocs.yml's nav lacks"


def test_the_readme_names_only_real_verbs() -> None:
    from miles_async.launch import cli
    from miles_async.launch.reference import _subparsers

    verbs = {name for name, _ in _subparsers(cli.build_parser())}
    named = set(re.findall(r"`miles-async ([a-z][\w-]*)", README.read_text()))
    assert named, "README.md names no miles-async verb"
    assert named <= verbs, f"README.md names verbs the command line lacks: {sorted(named - verbs)}"


def _user_text() -> list[Path]:
    pages = sorted((ROOT / "docs").rglob("*.md"))
    return [README, ROOT / "CHANGELOG.md", *pages, *sorted((ROOT / "recipes").glob("*.toml"))]


@pytest.mark.parametrize("path", _user_text(), ids=lambda p: str(p.relative_to(ROOT)))
def test_user_text_does_not_speak_of_its_machine_or_history(path: Path) -> None:
    found = [(number, line.strip()) for number, line in enumerate(path.read_text().splitlines(), 1)
             if STALE.search(line)]
    assert not found, f"{path.relative_to(ROOT)}: " + "; ".join(f"line {n}: {line!r}" for n, line in found)
