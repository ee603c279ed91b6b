"""The docs: the site builds with ``mkdocs build --strict`` (a broken link or anchor between
pages fails it), README stays short and runs CI's test command, and every relative link in
README.md and docs/*.md points at a file that exists."""
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
DOCS = sorted((ROOT / "docs").glob("*.md"))
LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)")
FENCE = re.compile(r"^```.*?^```", re.S | re.M)


def links(path: Path):
    """The link targets of a markdown file, outside fenced code."""
    return LINK.findall(FENCE.sub("", path.read_text()))


def github_slug(heading: str) -> str:
    """The anchor GitHub gives a heading (what README's links into bench/RESULTS.md use)."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def anchors(path: Path) -> set:
    text = FENCE.sub("", path.read_text())
    return {github_slug(h) for h in re.findall(r"^#{1,6}\s+(.*)$", text, re.M)}


def test_site_builds_strict_with_a_page_per_doc(tmp_path):
    pytest.importorskip("mkdocs")
    pytest.importorskip("mkdocstrings")
    site = tmp_path / "site"
    run = subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "-f",
                          str(ROOT / "mkdocs.yml"), "-d", str(site)],
                         cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-6000:]
    for doc in DOCS:
        page = site / "index.html" if doc.stem == "index" else site / doc.stem / "index.html"
        assert page.is_file(), f"no page built for {doc.name}"


def test_every_doc_is_in_the_nav():
    nav = (ROOT / "mkdocs.yml").read_text()
    missing = [d.name for d in DOCS if not re.search(rf":\s*{re.escape(d.name)}\s*$", nav, re.M)]
    assert not missing, f"docs/ pages not in mkdocs.yml's nav: {missing}"


def test_readme_is_short():
    size = (ROOT / "README.md").stat().st_size
    assert size <= 8192, f"README.md is {size} bytes; move detail into docs/"


@pytest.mark.parametrize("doc", [ROOT / "README.md", *DOCS], ids=lambda p: p.name)
def test_relative_links_resolve(doc):
    bad = []
    for target in links(doc):
        if re.match(r"^[a-z][a-z0-9+.-]*:", target):  # https:, mailto:
            continue
        path, _, anchor = target.partition("#")
        dest = (doc.parent / path).resolve() if path else doc
        if not dest.exists() or ROOT not in (dest, *dest.parents):
            bad.append(target)
        elif anchor and dest.suffix == ".md" and anchor not in anchors(dest):
            bad.append(target)
    assert not bad, f"{doc.relative_to(ROOT)}: links to nothing: {bad}"


def test_readme_test_command_is_ci_command():
    readme = (ROOT / "README.md").read_text()
    block = re.search(r"Set up and run the tests.*?```bash\n(.*?)\n```", readme, re.S)
    assert block, "README has no 'Set up and run the tests' command block"
    ci = [line for line in (ROOT / ".ci" / "run").read_text().splitlines()
          if line.startswith("python3 -m venv")]
    assert ci == [block.group(1)], (ci, block.group(1))
