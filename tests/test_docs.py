"""The repository explains itself: the README is an entry point, docs/ holds the rest, and
every link between them lands on a file and a heading that exist."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
DOCUMENTS = [
    REPO / "README.md",
    *sorted((REPO / "docs").glob("*.md")),
    REPO / "deploy" / "README.md",
]
README_MAX_BYTES = 12 * 1024
LINK = re.compile(r"\]\(([^)\s]+)\)")
HEADING = re.compile(r"^#+ (.*)$", re.M)
FENCED = re.compile(r"```.*?```", re.S)


def slug(heading: str) -> str:
    """A heading's anchor as GitHub makes it: lower case, punctuation dropped, spaces to -."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def anchors(document: Path) -> set[str]:
    return {slug(h) for h in HEADING.findall(FENCED.sub("", document.read_text()))}


def test_the_readme_is_an_entry_point_with_the_two_commands():
    readme = (REPO / "README.md").read_text()
    assert len(readme.encode()) <= README_MAX_BYTES
    assert "./run up" in readme and "./run test" in readme
    assert "(docs/README.md)" in readme


@pytest.mark.parametrize("document", DOCUMENTS, ids=lambda p: str(p.relative_to(REPO)))
def test_no_document_points_outside_the_repository(document: Path):
    text = document.read_text()
    for target in LINK.findall(text):
        if target.startswith(("http://", "https://")):
            continue
        path = target.partition("#")[0]
        dest = (document.parent / path).resolve() if path else document
        assert dest.is_relative_to(REPO), target


@pytest.mark.parametrize("document", DOCUMENTS, ids=lambda p: str(p.relative_to(REPO)))
def test_every_link_lands_on_a_file_and_a_heading(document: Path):
    broken = []
    for target in LINK.findall(document.read_text()):
        if target.startswith(("http://", "https://")):
            continue
        path, _, fragment = target.partition("#")
        dest = (document.parent / path).resolve() if path else document
        if not dest.exists():
            broken.append(f"{target}: no such file")
        elif fragment and dest.suffix == ".md" and fragment not in anchors(dest):
            broken.append(f"{target}: no such heading")
    assert broken == []


def test_every_docs_document_is_in_the_map():
    mapped = set(LINK.findall((REPO / "docs" / "README.md").read_text()))
    for document in (REPO / "docs").glob("*.md"):
        if document.name != "README.md":
            assert document.name in mapped, document.name
