"""Links between the docs resolve: every relative markdown link `[text](path#anchor)` in README.md,
docs/*.md and the READMEs under tasks/ and benchmarks/ and infra/ names a file that exists and, with
an #anchor, a heading of that file (GitHub's anchor for it); every section reference written as
`<path>README.md "Section"` (or a bare `README "Section"`: README.md) in params.yaml and in those
files names a heading that starts with that text. Fast: reads text files only."""
from __future__ import annotations

import re
from pathlib import Path

import pytest

from flows.params_doc import slug
from tests.conftest import REPO

pytestmark = pytest.mark.quick  # make test-fast

DOCS = sorted({*REPO.glob("*.md"), *REPO.glob("docs/*.md"), *REPO.glob("tasks/**/README.md"),
               *REPO.glob("benchmarks/**/README.md"), *REPO.glob("infra/**/README.md")})
FENCE = re.compile(r"^(```|~~~).*?^\1", re.S | re.M)
CODE_SPAN = re.compile(r"`[^`\n]*`")
LINK = re.compile(r"!?\[[^\]\n]*\]\(([^()\s]+)(?:\s+\"[^\"]*\")?\)")
#: `tasks/train/README.md, "Launchers"`, `README "Parameters"`, `README, 'Parameters'`
SECTION_REF = re.compile(r"((?:[\w.-]+/)*README(?:\.md)?)\)?[,:]?\s+(?:section\s+)?[\"“']([^\"”'\n]+)[\"”']")


def prose(text: str) -> str:
    """Markdown without code blocks and code spans (links there are examples, not links)."""
    return CODE_SPAN.sub("", FENCE.sub("", text))


def headings(path: Path) -> list[str]:
    """The text of each heading of a markdown file, links reduced to their text."""
    found = []
    for line in FENCE.sub("", path.read_text()).splitlines():
        if m := re.match(r"^#{1,6}\s+(.*?)\s*#*\s*$", line):
            found.append(re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", m.group(1)))
    return found


def anchors(path: Path) -> set[str]:
    """GitHub's anchors for the headings of `path` (a repeated one gets -1, -2, ...)."""
    seen: dict[str, int] = {}
    result = set()
    for heading in headings(path):
        base = slug(heading)
        n = seen.get(base, 0)
        result.add(base if n == 0 else f"{base}-{n}")
        seen[base] = n + 1
    return result


def broken_links(doc: Path) -> list[str]:
    problems = []
    for target in LINK.findall(prose(doc.read_text())):
        if re.match(r"^[a-z][a-z0-9+.-]*:", target, re.I):  # https:, mailto:
            continue
        file_part, _, anchor = target.partition("#")
        dest = (doc.parent / file_part).resolve() if file_part else doc
        where = f"{doc.relative_to(REPO)}: ({target})"
        if not dest.exists():
            problems.append(f"{where}: {file_part} does not exist")
        elif anchor and dest.is_file() and dest.suffix == ".md" and anchor not in anchors(dest):
            problems.append(f"{where}: no heading with anchor #{anchor} in {dest.relative_to(REPO)}")
    return problems


def plain(heading: str) -> str:
    return heading.replace("`", "").replace("*", "")


def broken_section_refs(path: Path) -> list[str]:
    """`README "X"` references in `path` whose README has no heading starting with X."""
    text = path.read_text()
    problems = []
    for ref, section in SECTION_REF.findall(prose(text) if path.suffix == ".md" else text):
        readme = REPO / (ref if ref.endswith(".md") else f"{ref}.md")
        if not readme.is_file():
            readme = (path.parent / ref).resolve()
        where = f"{path.relative_to(REPO)}: {ref} \"{section}\""
        if not readme.is_file():
            problems.append(f"{where}: {ref} does not exist")
        elif not any(plain(h).startswith(plain(section)) for h in headings(readme)):
            problems.append(f"{where}: {readme.relative_to(REPO)} has no heading starting with it")
    return problems


def test_the_docs_are_found() -> None:
    names = {p.relative_to(REPO).as_posix() for p in DOCS}
    assert {"README.md", "docs/parameters.md", "tasks/train/README.md"} <= names


def test_relative_links_resolve_to_files_and_headings() -> None:
    problems = [p for doc in DOCS for p in broken_links(doc)]
    assert not problems, "broken links (fix the path, or the #anchor: GitHub's is the heading in lower " \
                         "case, punctuation dropped, spaces as '-'):\n" + "\n".join(problems)


@pytest.mark.parametrize("path", ["params.yaml", *(p.relative_to(REPO).as_posix() for p in DOCS)])
def test_section_references_name_existing_headings(path: str) -> None:
    problems = broken_section_refs(REPO / path)
    assert not problems, "references to a README section that does not exist:\n" + "\n".join(problems)


def test_the_checks_catch_a_broken_link_an_anchor_and_a_section(tmp_path: Path, monkeypatch) -> None:
    monkeypatch.setattr(f"{__name__}.REPO", tmp_path)
    (tmp_path / "docs").mkdir()
    (tmp_path / "README.md").write_text("# Top\n\n## The `stages` [klein]\n\n```\n[x](nowhere.md)\n```\n")
    doc = tmp_path / "docs" / "a.md"
    doc.write_text("[ok](../README.md#the-stages-klein) [gone](../b.md) [bad](../README.md#stages) "
                   "[here](#top) `[code](x.md)` [web](https://example.com/x.md)\n")
    found = broken_links(doc)
    assert len(found) == 3 and "../b.md does not exist" in found[0]
    assert "no heading with anchor #stages in README.md" in found[1]
    assert "no heading with anchor #top in docs/a.md" in found[2]
    params = tmp_path / "params.yaml"
    params.write_text('a: 1  # README "The stages"\nb: 2  # README, "Parameters"\nc: 3 # docs/README.md "X"\n')
    refs = broken_section_refs(params)
    assert len(refs) == 2 and '"Parameters"' in refs[0] and "docs/README.md does not exist" in refs[1]


def test_slugs_are_github_s() -> None:
    assert slug("Methods (`method`): one loop, they differ in what they train and save") == \
        "methods-method-one-loop-they-differ-in-what-they-train-and-save"
    assert slug("Model families: SD3/3.5, FLUX.1 and FLUX.2 [klein]") == "model-families-sd335-flux1-and-flux2-klein"
    assert slug("`ingest.sources[]` (type: `folder`)") == "ingestsources-type-folder"
    assert slug("`class_images.launch`") == "class_imageslaunch"
