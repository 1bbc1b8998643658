"""The README and the docs site: links that resolve, generated parts that match the code, a strict build.

No model and no server: these read files and run `mkdocs build --strict` and `scripts/gendocs.py`.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from skippy_cache.server.settings import CONFIG_ENV, OPTIONS

ROOT = Path(__file__).resolve().parents[2]
README = ROOT / "README.md"
#: The README says what, how to start, how fast and where to read more; the rest is in docs/.
README_MAX_LINES = 250
PAGES = sorted(p.relative_to(ROOT / "docs").as_posix() for p in (ROOT / "docs").rglob("*.md"))

_LINK = re.compile(r"!?\[[^\]]*\]\(([^)\s]+)(?:\s+\"[^\"]*\")?\)")
_HTML_LINK = re.compile(r"""(?:href|src)=["']([^"']+)["']""")
_FENCE = re.compile(r"^(```|~~~).*?^\1", re.DOTALL | re.MULTILINE)


def github_slug(heading: str) -> str:
    """The anchor GitHub gives a Markdown heading: lowercase, punctuation dropped, spaces to hyphens."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def anchors(markdown: str) -> set[str]:
    text = _FENCE.sub("", markdown)
    return {github_slug(m.group(1)) for m in re.finditer(r"^#{1,6}\s+(.+?)\s*#*\s*$", text, re.MULTILINE)}


def relative_links(markdown: str) -> list[str]:
    text = _FENCE.sub("", markdown)
    found = _LINK.findall(text) + _HTML_LINK.findall(text)
    return [link for link in found if not re.match(r"^[a-z][a-z0-9+.-]*:", link)]  # http:, mailto:, ...


def test_readme_relative_links_resolve() -> None:
    text = README.read_text()
    links = relative_links(text)
    assert links, "the README links into the docs"
    broken = []
    for link in links:
        target, _, anchor = link.partition("#")
        path = (README.parent / target).resolve() if target else README
        if not path.exists():
            broken.append(f"{link}: no such file")
        elif anchor and path.suffix == ".md" and anchor not in anchors(path.read_text()):
            broken.append(f"{link}: no heading #{anchor} in {path.relative_to(ROOT)}")
    assert not broken, "README links that break on GitHub:\n" + "\n".join(broken)


def test_readme_stays_short() -> None:
    lines = README.read_text().count("\n")
    assert lines <= README_MAX_LINES, f"README.md has {lines} lines; move detail into docs/"


def test_github_slug_matches_githubs_rule() -> None:
    assert github_slug("Enabling the shared tier") == "enabling-the-shared-tier"
    assert github_slug("What exact mode costs?") == "what-exact-mode-costs"
    assert github_slug("`skippy-cache bench`: options") == "skippy-cache-bench-options"


def test_generated_parts_match_what_they_document() -> None:
    done = subprocess.run([sys.executable, str(ROOT / "scripts" / "gendocs.py"), "--check"],
                          capture_output=True, text=True, cwd=ROOT)
    assert done.returncode == 0, done.stderr


def test_every_setting_is_documented_and_nothing_else() -> None:
    page = (ROOT / "docs" / "serving" / "settings.md").read_text()
    documented = set(re.findall(r"^\| `(--[a-z-]+)", page, re.MULTILINE))
    in_code = {option.flag for option in OPTIONS} | {"--config"}
    assert documented == in_code, (
        f"in code, not in docs/serving/settings.md: {sorted(in_code - documented)}; "
        f"in the docs, not in code: {sorted(documented - in_code)} (run make docs)"
    )
    for option in OPTIONS:
        assert f"`{option.env}`" in page, option.env
    assert f"`{CONFIG_ENV}`" in page


def test_site_builds_with_no_warning(tmp_path: Path) -> None:
    """`mkdocs build --strict`: a broken link, a missing page or a page left out of the nav fails it."""
    env = {**os.environ, "NO_MKDOCS_2_WARNING": "1"}
    command = [sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(tmp_path / "site")]
    done = subprocess.run(command, capture_output=True, text=True, cwd=ROOT, env=env)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "WARNING" not in done.stderr, done.stderr
    assert (tmp_path / "site" / "index.html").exists()


@pytest.mark.parametrize("page", PAGES)
def test_no_page_is_a_placeholder(page: str) -> None:
    text = (ROOT / "docs" / page).read_text()
    assert len(text.splitlines()) > 5 and "TODO" not in text, f"docs/{page} is a placeholder"
