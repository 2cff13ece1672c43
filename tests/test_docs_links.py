"""Every relative link of README.md and docs/ lands: the file exists and, with #anchor, the heading or <a id> does."""

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
LINK = re.compile(r"(?<!!)\[[^\]]*\]\(([^)\s]+)\)|!\[[^\]]*\]\(([^)\s]+)\)")


def anchors(page: Path) -> set[str]:
    """GitHub's heading anchors (lower case, punctuation dropped, spaces to dashes, repeats numbered) and <a id>s."""
    text = re.sub(r"```.*?```", "", page.read_text(), flags=re.S)
    found, seen = set(re.findall(r'<a id="([^"]+)"', text)), {}
    for heading in re.findall(r"^#+\s+(.*?)\s*$", text, flags=re.M):
        slug = re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")
        found.add(slug if slug not in seen else f"{slug}-{seen[slug]}")
        seen[slug] = seen.get(slug, 0) + 1
    return found


def links(page: Path) -> list[str]:
    text = re.sub(r"```.*?```", "", page.read_text(), flags=re.S)
    return [a or b for a, b in LINK.findall(text)]


@pytest.mark.parametrize("page", PAGES, ids=[p.name for p in PAGES])
def test_every_relative_link_and_anchor_lands(page):
    broken = []
    for link in links(page):
        if re.match(r"[a-z]+:", link):  # https:, mailto: (not checked offline)
            continue
        path, _, anchor = link.partition("#")
        target = (page.parent / path).resolve() if path else page
        if not target.exists():
            broken.append(f"{link} (no such file)")
        elif anchor and target.suffix == ".md" and anchor not in anchors(target):
            broken.append(f"{link} (no such anchor in {target.name})")
    assert not broken, f"{page.name}: " + ", ".join(broken)


def test_the_anchor_rule_is_githubs():
    page = ROOT / "docs" / "benchmarks.md"
    assert "learning-ours-vs-stable-baselines3-the-papers-sac" in anchors(page)
