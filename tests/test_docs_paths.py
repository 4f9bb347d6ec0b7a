"""Every file the docs and the code's own words name exists, and every link between the docs lands.

A reader sent to `tests/solve/test_ilp.py` or `docs/offload.md#what-it-costs-time` should find it. The
README, docs/*.md and the text of every module under autoplan/, tests/, benchmarks/ and examples/
(docstrings and comments: where the code sends its reader) name repository paths; a file renamed or
moved leaves them behind, and nothing else notices. These tests read every such path and every relative
Markdown link (with its `#anchor`, a heading of the page it names, slugged as GitHub does) and fail on
the first that leads nowhere, listing all of them.
"""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PAGES = (ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md")))
MODULES = tuple(sorted(path for folder in ("autoplan", "tests", "benchmarks", "examples")
                       for path in (ROOT / folder).rglob("*.py")))

# A path from the repository's root: `autoplan/solve/ilp.py`, `docs/offload.md`, `tests/hf/`. Not preceded
# by a path character, so `src/autoplan/x.py` or `../docs/x.md` is not read as one; `tests/<stage>/...`
# (a pattern, not a path) stops at `<` and is not one either.
_ROOTED = re.compile(r"(?<![\w./-])((?:autoplan|tests|benchmarks|examples|docs)/[\w./-]*(?:\.(?:py|md|json|toml|csv|txt)|/))(?![\w-])")
# A top-level document by its bare name (`README.md`, `BENCHMARKS.md`): found beside the text, at the root or in docs/.
_TOP_DOCUMENT = re.compile(r"(?<![\w./-])([A-Z][A-Z_-]*\.md)\b")
_LINK = re.compile(r"\]\(([^)\s]+)\)")
_HEADING = re.compile(r"^#{1,6} (.+)$")


def named_paths(text: str) -> set[str]:
    return set(_ROOTED.findall(text))


def missing_paths(source: Path) -> list[str]:
    """The paths `source` names that are not files or folders of the repository."""
    text = source.read_text()
    missing = [path for path in sorted(named_paths(text)) if not (ROOT / path).exists()]
    places = (source.parent, ROOT, ROOT / "docs")
    missing += [name for name in sorted(set(_TOP_DOCUMENT.findall(text)))
                if not any((place / name).exists() for place in places)]
    return missing


def test_every_named_path_exists():
    missing = [f"{source.relative_to(ROOT)}: {path}" for source in (*PAGES, *MODULES) for path in missing_paths(source)]
    assert not missing, "paths named that do not exist:\n" + "\n".join(missing)


def test_the_pages_name_paths():
    # the test above passes on text it cannot read; these are paths the README names today
    assert {"docs/command-line.md", "tests/verify/test_real.py", "benchmarks/floors.py"} <= named_paths((ROOT / "README.md").read_text())
    assert named_paths("see `src/autoplan/x.py`, tests/<stage>/test_<module>.py and (autoplan/solve/)") == {"autoplan/solve/"}


def slug(heading: str) -> str:
    """GitHub's anchor for a heading: link text kept, backticks and punctuation dropped, spaces as hyphens."""
    text = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", heading).replace("`", "").strip().lower()
    return re.sub(r"[^\w\- ]", "", text).replace(" ", "-")


def anchors(page: Path) -> set[str]:
    """The anchors of a page's headings; a repeated heading's later ones get -1, -2, ... as on GitHub."""
    found: set[str] = set()
    seen: dict[str, int] = {}
    in_code = False
    for line in page.read_text().splitlines():
        if line.startswith("```"):
            in_code = not in_code  # a `# comment` in a code block is no heading
            continue
        heading = None if in_code else _HEADING.match(line)
        if heading:
            anchor = slug(heading.group(1))
            found.add(f"{anchor}-{seen[anchor]}" if anchor in seen else anchor)
            seen[anchor] = seen.get(anchor, 0) + 1
    return found


def broken_links(page: Path) -> list[str]:
    """The relative links of a Markdown page whose file, or whose anchor in it, does not exist."""
    broken = []
    for link in _LINK.findall(page.read_text()):
        if re.match(r"[a-z]+:", link):
            continue  # https:, mailto:: not this repository's
        path, _, anchor = link.partition("#")
        target = (page.parent / path).resolve() if path else page
        if not target.exists() or (anchor and target.suffix == ".md" and anchor not in anchors(target)):
            broken.append(link)
    return broken


def test_every_link_lands():
    broken = [f"{page.relative_to(ROOT)}: {link}" for page in PAGES for link in broken_links(page)]
    assert not broken, "links to no file or no heading:\n" + "\n".join(broken)


def test_anchors_are_githubs():
    # headings the docs link today: backticks, a comma and an apostrophe, a colon, parentheses and `=`
    assert slug("`autoplan verify`") == "autoplan-verify"
    assert slug("How a real step is measured, and why it is not the simulation's tracker") == (
        "how-a-real-step-is-measured-and-why-it-is-not-the-simulations-tracker")
    assert slug("The loss head: a fused linear cross-entropy (`fuse_loss=True`, the default)") == (
        "the-loss-head-a-fused-linear-cross-entropy-fuse_losstrue-the-default")
    assert "exit-codes" in anchors(ROOT / "docs" / "command-line.md")
    assert broken_links(ROOT / "README.md") == [] and "docs/command-line.md#exit-codes" in (ROOT / "README.md").read_text()
