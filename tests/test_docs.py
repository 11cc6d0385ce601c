"""The documentation holds together: pure file reading, no fixtures.

- README.md is at most 250 lines and starts with the title and the two commands for a fresh
  machine (`make demo`, `make test`);
- every relative link and image in README.md, docs/*.md and the folders' README.md files points
  at a file or folder that exists (anchors are not checked; http(s) and mailto links are skipped);
- no tracked text file points outside the repository at the reference notes (they are
  docs/paper-code.md now);
- every page in docs/ is linked from README.md.
"""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
README = ROOT / "README.md"
LINK = re.compile(r"!?\[[^\]]*\]\(([^)\s]+)(?:\s+\"[^\"]*\")?\)")
FENCE = re.compile(r"^(```|~~~).*?^\1", re.S | re.M)
INLINE_CODE = re.compile(r"`[^`\n]*`")


def markdown_files() -> list[Path]:
    folders = [p for p in ROOT.glob("*/README.md") if not p.parent.name.startswith(".")]
    return [README, *sorted((ROOT / "docs").glob("*.md")), *sorted(folders)]


def links(path: Path) -> list[str]:
    """The link targets in a markdown file, outside code blocks and inline code."""
    text = INLINE_CODE.sub("", FENCE.sub("", path.read_text()))
    return LINK.findall(text)


def test_readme_is_short_and_starts_with_the_two_commands():
    lines = README.read_text().splitlines()
    assert len(lines) <= 250, f"README.md has {len(lines)} lines"
    assert lines[0].startswith("# ")
    start = next(i for i, line in enumerate(lines) if line.strip())  # the title
    block = lines[start + 1 :]
    block = block[next(i for i, line in enumerate(block) if line.strip()) :]  # the first thing after it
    assert block[0] == "```bash", "the first thing after the title must be the commands' bash block"
    commands = block[1 : block.index("```", 1)]
    assert [c.split("#")[0].strip() for c in commands] == ["make demo", "make test"]


@pytest.mark.parametrize("page", markdown_files(), ids=lambda p: str(p.relative_to(ROOT)))
def test_relative_links_resolve(page):
    broken = []
    for target in links(page):
        if re.match(r"(https?|mailto):", target) or target.startswith("#"):
            continue
        path = target.split("#")[0]
        if not (page.parent / path).exists():
            broken.append(target)
    assert not broken, f"{page.relative_to(ROOT)}: links to missing files: {broken}"


def test_nothing_points_outside_the_repository():
    try:
        tracked = subprocess.run(
            ["git", "ls-files", "*.md", "*.py", "*.yaml", "*.sh"], cwd=ROOT, capture_output=True, text=True, check=True
        ).stdout.split()
    except (OSError, subprocess.CalledProcessError):
        pytest.skip("not a git checkout")
    # the notes the docs were written from, by path or by name (spelt so that this file does not match)
    outside = ("../" + "shared", "shared" + "/reference", "paper_" + "rl.md", "paper_" + "data_stages.md", "paper_" + "eval_radar")
    offenders = [
        name for name in tracked if (ROOT / name).is_file() and any(s in (ROOT / name).read_text(errors="replace") for s in outside)
    ]
    assert not offenders, f"files that point outside the repository (use docs/paper-code.md): {offenders}"


def test_every_docs_page_is_linked_from_the_readme():
    linked = {(ROOT / target.split("#")[0]).resolve() for target in links(README)}
    missing = [p.name for p in sorted((ROOT / "docs").glob("*.md")) if p.resolve() not in linked]
    assert not missing, f"docs pages the README does not link: {missing}"
