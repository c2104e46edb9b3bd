"""The documentation holds to the code: the README stays a front door whose commands exist, every relative
link in README.md and docs/ reaches a file, docs/configuration.md is what balancer/settings.py generates,
docs/architecture.md names every package under balancer/ and no other, and every repository path and module a
page names exists (issue 42)."""

from __future__ import annotations

import importlib
import re
import subprocess
import sys
from pathlib import Path

import pytest

from balancer.devtools import settings_doc
from tests.project.test_layout import ALLOWED, code_files

ROOT = Path(__file__).resolve().parents[2]
README = ROOT / "README.md"
DOCS = sorted((ROOT / "docs").glob("*.md"))

FENCE = re.compile(r"^```(?P<lang>[\w-]*)\n(?P<body>.*?)^```", re.S | re.M)
LINK = re.compile(r"!?\[[^\]]*\]\((?P<target>[^)\s]+)(?:\s+\"[^\"]*\")?\)")
WORD = re.compile(r"^[a-z][a-z-]*$")


def without_code(text: str) -> str:
    """Markdown with its fenced code blocks and inline code spans taken out (links there are not links)."""
    return re.sub(r"`[^`\n]*`", "", FENCE.sub("", text))


def relative_links(page: Path) -> list[str]:
    """Every link and image of a page that points at a file of this repository (no scheme, not an anchor alone)."""
    targets = [m["target"] for m in LINK.finditer(without_code(page.read_text()))]
    return [t for t in targets if not re.match(r"^[a-z][a-z0-9+.-]*:", t) and not t.startswith("#")]


def readme_commands() -> list[tuple[str, ...]]:
    """The `balancer ...` commands in README.md's shell blocks, as their command words (up to the first argument
    that is not a plain lowercase word: a file name, an option, a value)."""
    found: list[tuple[str, ...]] = []
    for block in FENCE.finditer(README.read_text()):
        if block["lang"] not in ("bash", "sh", "shell", "console"):
            continue
        for line in block["body"].splitlines():
            for segment in re.split(r"&&|\|\||;|\|", line):
                tokens = segment.split()
                if not tokens or tokens[0] != "balancer":
                    continue
                words: list[str] = []
                for token in tokens[1:]:
                    if not WORD.match(token):
                        break
                    words.append(token)
                found.append(tuple(words))
    return found


def test_the_readme_is_at_most_150_lines() -> None:
    """Issue 42, deliverable 2: the README is a front door; the rest lives in docs/."""
    lines = README.read_text().splitlines()
    assert len(lines) <= 150, f"README.md has {len(lines)} lines"


def test_the_benchmarks_page_is_one_page_of_current_results() -> None:
    """Issue 42: docs/benchmarks.md holds the current figures (at most 15 KB); the history is elsewhere."""
    size = len((ROOT / "docs" / "benchmarks.md").read_bytes())
    assert size <= 15_000, f"docs/benchmarks.md is {size:,} bytes: move what is history to docs/benchmark-history.md"


def test_the_readme_names_the_test_command_ci_runs() -> None:
    """Issue 42, deliverable 4: .ci/run runs the README's default test command as written there: the
    first line starting with `pytest` after the marker, a plain `pytest` (the fast default set)."""
    text = README.read_text()
    assert "<!-- ci: test command -->" in text
    after = text.split("<!-- ci: test command -->", 1)[1].splitlines()
    command = next(line for line in after if line.startswith("pytest"))
    assert command.split("#")[0].strip() == "pytest"
    assert "<!-- ci: test command -->" in (ROOT / ".ci" / "run").read_text()


def test_every_balancer_command_in_the_readme_exists() -> None:
    """Issue 42, checks: every `balancer ...` command the README shows runs (`--help` exits 0)."""
    commands = sorted(set(readme_commands()))
    assert ("demo",) in commands, commands  # the set-up command is found, so the parse is not vacuous
    for words in commands:
        done = subprocess.run([sys.executable, "-m", "balancer", *words, "--help"], cwd=ROOT,
                              capture_output=True, text=True, timeout=60)
        assert done.returncode == 0, f"balancer {' '.join(words)} --help: {done.stderr.strip()}"


@pytest.mark.parametrize("page", [README, *DOCS], ids=lambda p: str(p.relative_to(ROOT)))
def test_every_relative_link_points_to_a_file(page: Path) -> None:
    """Issue 42: a moved or renamed page, image or module breaks no link of README.md or docs/*.md."""
    missing = [t for t in relative_links(page) if not (page.parent / t.split("#")[0]).exists()]
    assert not missing, f"{page.relative_to(ROOT)} links to missing files: {missing}"


#: A repository path or a dotted module of balancer's in an inline code span: `balancer/estimates/capacity.py`,
#: `tests/pipeline_harness.Pipeline`, `balancer.views.eta.end_tail`.
CODE_PATH = re.compile(r"`(?P<path>(?:balancer|tests|examples|docs|\.ci)/[\w./-]+)`")
CODE_MODULE = re.compile(r"`(?P<module>balancer(?:\.\w+)+)`")


def names_something(path: str) -> bool:
    """A repository path exists as written, or as a module (``tests/pipeline_harness.Pipeline``: its .py)."""
    return (ROOT / path).exists() or (ROOT / (path.rsplit(".", 1)[0] + ".py")).exists()


def names_a_module(dotted: str) -> bool:
    """``balancer.a.b.name`` is a module of balancer, or a name one of them defines (imported, then looked up)."""
    parts = dotted.split(".")
    for cut in range(len(parts), 0, -1):
        try:
            found: object = importlib.import_module(".".join(parts[:cut]))
        except ImportError:
            continue
        for name in parts[cut:]:
            if not hasattr(found, name):
                return False
            found = getattr(found, name)
        return True
    return False


@pytest.mark.parametrize("page", [README, *DOCS], ids=lambda p: str(p.relative_to(ROOT)))
def test_every_path_and_module_a_page_names_exists(page: Path) -> None:
    """Issue 42: a module moved to its room leaves no stale path in the docs (docs/scenarios.md named
    `balancer/capacity.py` and `balancer/sim/audit.py` after both had moved; docs/admission.md a function
    `balancer.backlog.spend.spent_by_source_since` that is `charges`)."""
    text = page.read_text()
    stale = [m["path"] for m in CODE_PATH.finditer(text) if not names_something(m["path"])]
    stale += [m["module"] for m in CODE_MODULE.finditer(text) if not names_a_module(m["module"])]
    assert not stale, f"{page.relative_to(ROOT)} names what does not exist: {stale}"


#: A repository file named in a comment or docstring of the code: ``balancer/devtools/scenario.py``.
FILE_IN_CODE = re.compile(r"\b(?P<path>(?:balancer|tests|docs|examples)/[\w/-]+\.(?:py|md|toml|lua))\b")


def test_every_file_the_code_names_exists() -> None:
    """Issue 42: the code's comments (and scripts') name files where they are now (two docstrings named `balancer/capacity.py`
    and `balancer/scenario.py`, both moved)."""
    sources = [p for p in code_files() if p != Path(__file__).resolve()]  # this module quotes the stale names
    stale = sorted({f"{p.relative_to(ROOT)}: {m['path']}" for p in sources
                    for m in FILE_IN_CODE.finditer(p.read_text()) if not (ROOT / m["path"]).exists()})
    assert not stale, f"files named in the code that do not exist: {stale}"


def anchors(page: Path) -> set[str]:
    """The anchors GitHub makes of a page's headings: lowercased, punctuation but `-` and `_` dropped, spaces to
    hyphens, a repeated heading numbered."""
    found: set[str] = set()
    seen: dict[str, int] = {}
    for heading in re.finditer(r"^#{1,6}\s+(.*?)\s*#*$", FENCE.sub("", page.read_text()), re.M):
        slug = re.sub(r"[^\w\- ]", "", heading[1].strip().lower()).replace(" ", "-")
        found.add(slug if slug not in seen else f"{slug}-{seen[slug]}")
        seen[slug] = seen.get(slug, 0) + 1
    return found


@pytest.mark.parametrize("page", [README, *DOCS], ids=lambda p: str(p.relative_to(ROOT)))
def test_every_anchor_of_a_link_to_a_page_is_one_of_its_headings(page: Path) -> None:
    """A renamed heading breaks no `page.md#heading` link of README.md or docs/*.md."""
    targets = [m["target"] for m in LINK.finditer(without_code(page.read_text()))]
    broken = []
    for target in targets:
        path, _, anchor = target.partition("#")
        if not anchor or re.match(r"^[a-z][a-z0-9+.-]*:", target):
            continue
        linked = page.parent / path if path else page
        if linked.suffix == ".md" and linked.exists() and anchor not in anchors(linked):
            broken.append(target)
    assert not broken, f"{page.relative_to(ROOT)} links to headings that do not exist: {broken}"


def test_anchors_are_githubs() -> None:
    page = ROOT / "docs" / "admission.md"
    assert "how-providers-count-and-token_accounting" in anchors(page)
    assert "sources-a-fair-share-of-the-window" in anchors(page)


def test_the_link_check_sees_links_and_skips_code() -> None:
    page = ROOT / "docs" / "how-it-works.md"
    links = relative_links(page)
    assert "admission.md" in links and all(" " not in t for t in links)
    assert "nowhere" not in without_code("a `[x](nowhere.md)` b\n```\n[y](nowhere.md)\n```\n")


def test_the_configuration_reference_is_generated_from_the_settings() -> None:
    """Issue 42, deliverable 2: docs/configuration.md cannot drift from balancer/settings.py.
    Regenerate it with `python -m balancer.devtools.settings_doc > docs/configuration.md`."""
    page = (ROOT / "docs" / "configuration.md").read_text()
    assert page == settings_doc.render(), (
        "docs/configuration.md is stale: run `python -m balancer.devtools.settings_doc > docs/configuration.md`")


def test_the_metrics_reference_is_generated_from_the_collector() -> None:
    """docs/metrics.md cannot drift from what a scrape serves (an operator's probe found
    balancer_source_changed in no doc, and 20 other families named nowhere but the code)."""
    from balancer.devtools import metrics_doc

    page = (ROOT / "docs" / "metrics.md").read_text()
    assert page == metrics_doc.render(), (
        "docs/metrics.md is stale: run `python -m balancer.devtools.metrics_doc > docs/metrics.md`")
    assert "balancer_source_changed" in page and "balancer_drain_left_out_tasks" in page


def test_the_configuration_reference_names_every_setting() -> None:
    from balancer.settings import ENVIRONMENT

    page = settings_doc.render()
    assert all(f"| `{name}` |" in page for name in ENVIRONMENT)


def architecture_rows() -> dict[str, tuple[str, str]]:
    """docs/architecture.md's package table: each row's package or module name -> (its job, what it may import)."""
    page = (ROOT / "docs" / "architecture.md").read_text()
    section = page.split("## Packages and what each may import", 1)[1].split("\n## ", 1)[0]
    rows: dict[str, tuple[str, str]] = {}
    for line in section.splitlines():
        cells = [cell.strip() for cell in line.strip().strip("|").split(" | ")]
        if len(cells) == 3 and cells[0].startswith("`"):
            rows[cells[0].strip("`").rstrip("/")] = (cells[1], cells[2])
    return rows


def packages_under_balancer() -> set[str]:
    """The packages (folders with an __init__.py) and modules directly under balancer/."""
    package = ROOT / "balancer"
    names = {p.name for p in package.iterdir() if p.is_dir() and (p / "__init__.py").exists()}
    names |= {p.stem for p in package.glob("*.py") if p.name not in ("__init__.py", "__main__.py")}
    return names


def test_the_architecture_table_names_every_package_and_no_other() -> None:
    """Issue 42, deliverable 1's check: docs/architecture.md matches the tree, one row per package or module."""
    rows = architecture_rows()
    assert rows, "no package table found in docs/architecture.md"
    missing = packages_under_balancer() - set(rows)
    extra = set(rows) - packages_under_balancer()
    assert not missing, f"docs/architecture.md does not name {sorted(missing)}"
    assert not extra, f"docs/architecture.md names {sorted(extra)}, which are not under balancer/"


def test_the_architecture_table_shows_the_import_rules_the_layout_test_enforces() -> None:
    for name, (job, may_import) in architecture_rows().items():
        assert len(job.split()) < 30, f"{name}: its job is {len(job.split())} words (keep a cell under 30)"
        shown = set() if may_import == "nothing" else {part.strip(" `") for part in may_import.split(",")}
        assert shown == ALLOWED[name], f"{name} may import {sorted(ALLOWED[name])} (tests/project/test_layout.py), not {sorted(shown)}"


def test_a_package_docstring_that_lists_its_modules_lists_every_one() -> None:
    """Issue 42, deliverable 5: balancer/pipeline/__init__.py listed 17 of its 26 modules. A package whose docstring
    lists its modules (``* ``name`` — ...``) lists each module it has, and none it has not."""
    checked = 0
    for init in sorted((ROOT / "balancer").glob("*/__init__.py")):
        listed = set(re.findall(r"^\* ``(\w+)``", init.read_text(), re.M))
        if not listed:
            continue
        checked += 1
        modules = {p.stem for p in init.parent.glob("*.py") if p.name != "__init__.py"}
        assert listed == modules, f"{init.relative_to(ROOT)}: missing {sorted(modules - listed)}, extra {sorted(listed - modules)}"
    assert checked, "no package lists its modules"
