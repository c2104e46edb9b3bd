"""The layout rules of docs/architecture.md, enforced: key names live in one
module, and each package imports only what the architecture allows."""

from __future__ import annotations

import ast
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PACKAGE = ROOT / "balancer"

#: What each room of the package may import from balancer (docs/architecture.md), from the ground floor up.
ALLOWED: dict[str, set[str]] = {
    "errors": set(),
    "urls": {"errors"},
    "settings": {"errors", "urls"},
    "toml_text": {"errors"},
    "httpguard": set(),
    "client": set(),
    "supervisor": set(),
    "estimates": set(),
    "costs": {"errors"},
    "admission": {"errors", "estimates", "costs"},
    "storage": {"errors", "urls", "settings"},
    "backends": {"urls", "settings"},
    "quotas": {"errors", "toml_text", "costs", "admission", "storage"},
    "backlog": {"errors", "estimates", "costs", "admission", "storage"},
    "snapshot": {"errors", "urls", "settings", "admission", "storage"},
    "services": {"settings", "admission", "storage", "quotas", "backlog", "snapshot"},
    "sources": {"errors", "urls", "settings", "toml_text", "estimates", "costs", "admission", "storage", "backlog",
                "services"},
    "health": {"costs", "admission", "sources"},
    "calls": {"errors", "settings", "estimates", "costs", "admission", "storage", "backends", "backlog", "services",
              "health"},
    "dispatch": {"settings", "estimates", "costs", "admission", "storage", "quotas", "backlog", "snapshot",
                 "services", "sources", "calls"},
    "views": {"httpguard", "estimates", "costs", "admission", "storage", "quotas", "backlog", "snapshot", "services", "sources",
              "health", "dispatch"},
    "pipeline": {"settings", "admission", "quotas", "backlog", "sources", "calls", "dispatch"},
    "router": {"errors", "httpguard", "estimates", "admission"},
    "web": {"errors", "urls", "httpguard", "costs", "admission", "storage", "quotas", "backlog", "services",
            "sources", "health", "views", "pipeline"},
    "devtools": {"errors", "urls", "settings", "supervisor", "estimates", "admission", "storage", "backlog",
                 "services", "dispatch", "views"},
    "bench": {"errors", "settings", "client", "supervisor", "estimates", "costs", "admission", "storage", "backlog",
              "services", "sources", "dispatch", "views", "router", "web", "devtools"},
    "cli": {"errors", "urls", "settings", "httpguard", "supervisor", "costs", "admission", "storage", "backends",
            "quotas", "backlog", "snapshot", "services", "sources", "health", "dispatch", "views", "pipeline",
            "router", "web", "devtools", "bench"},
}


def test_the_rooms_stand_in_floors() -> None:
    """Each room imports only rooms listed before it: no two rooms import each other, even through a third."""
    order = list(ALLOWED)
    above = {name: sorted(p for p in allowed if order.index(p) >= order.index(name)) for name, allowed in ALLOWED.items()}
    assert not any(above.values()), {name: rooms for name, rooms in above.items() if rooms}


def part_of(path: Path) -> str:
    rel = path.relative_to(PACKAGE).parts
    return rel[0].removesuffix(".py") if rel[0] not in ("__init__.py", "__main__.py") else "cli"


def imported_parts(path: Path) -> set[str]:
    tree = ast.parse(path.read_text())
    parts = set()
    for node in ast.walk(tree):
        names = []
        if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names = [node.module] + [f"{node.module}.{a.name}" for a in node.names]
        elif isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        for name in names:
            bits = name.split(".")
            if bits[0] == "balancer" and len(bits) > 1:
                parts.add(bits[1])
    return parts


@pytest.mark.parametrize("path", sorted(PACKAGE.rglob("*.py")), ids=lambda p: str(p.relative_to(ROOT)))
def test_each_package_imports_only_what_the_architecture_allows(path: Path) -> None:
    part = part_of(path)
    allowed = ALLOWED[part] | {part}
    wrong = {p for p in imported_parts(path) if p in ALLOWED and p not in allowed}
    assert not wrong, f"{path.relative_to(ROOT)} ({part}) imports {sorted(wrong)}"


def code_files() -> list[Path]:
    """Every file of code in the repository: balancer's modules and scripts, celeryconfig.py and the tests."""
    return [*PACKAGE.rglob("*.py"), *PACKAGE.rglob("*.lua"), ROOT / "celeryconfig.py", *ROOT.glob("tests/**/*.py")]


KEY_SPELLINGS = re.compile(r"""["'](:meta|:models|:leases|:model:|:inflight:|:dispatch:)|"\{" \+ [\w.]*namespace""")


def test_no_key_name_is_spelled_outside_the_keys_module() -> None:
    offenders = []
    for path in code_files():
        if path.name == "keys.py" or path == Path(__file__):
            continue
        for number, line in enumerate(path.read_text().splitlines(), 1):
            if KEY_SPELLINGS.search(line) and not line.lstrip().startswith("--"):
                offenders.append(f"{path.relative_to(ROOT)}:{number}: {line.strip()}")
    assert not offenders, "\n".join(offenders)


def test_no_script_spells_a_field_list_of_the_model_hash() -> None:
    """The model hash's fields are declared in admission/fields.py and reach the
    scripts through its generated prelude: no script names one as a string
    (an HSET or HMGET list of its own), so a field added there reaches every script."""
    from balancer.admission.fields import LUA_PRELUDE, MODEL_FIELDS

    assert all(f"'{name}'" in LUA_PRELUDE for name in MODEL_FIELDS)
    offenders = [f"{path.name}: {name}" for path in sorted((PACKAGE / "admission" / "lua").glob("*.lua"))
                 for name in MODEL_FIELDS if re.search(rf"""['"]{name}['"]""", path.read_text())]
    assert not offenders


def test_importing_celeryconfig_starts_nothing_and_connects_nowhere(tmp_path: Path) -> None:
    """With no BALANCER_* set, `import celeryconfig` must not start the embedded
    stack (a child process) nor open a socket. The child checks itself."""
    probe = r"""
import os, socket, sys
opened = []
real_connect = socket.socket.connect
def connect(self, *a, **k):
    opened.append(a)
    return real_connect(self, *a, **k)
socket.socket.connect = connect
import subprocess
started = []
real_popen_init = subprocess.Popen.__init__
def popen_init(self, *a, **k):
    started.append(a)
    return real_popen_init(self, *a, **k)
subprocess.Popen.__init__ = popen_init
import celeryconfig
from balancer.pipeline.app import app
assert not opened, opened
assert not started, started
assert not os.path.exists(".balancer"), "embedded stack directory created"
print("broker", app.conf.broker_url)
"""
    env = {k: v for k, v in __import__("os").environ.items() if not k.startswith("BALANCER_")}
    proc = subprocess.run([sys.executable, "-c", probe], cwd=tmp_path, env=env, capture_output=True, text=True,
                          timeout=60)
    assert proc.returncode == 0, proc.stderr
    assert "broker" in proc.stdout


def module_name(path: Path) -> str:
    rel = path.relative_to(ROOT).with_suffix("")
    parts = rel.parts[:-1] if rel.name == "__init__" else rel.parts
    return ".".join(parts)


def imported_modules(path: Path, known: set[str]) -> set[str]:
    """The balancer modules ``path`` imports: at the top, lazily, or for type checking only."""
    tree = ast.parse(path.read_text())
    found = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            for alias in node.names:
                sub = f"{node.module}.{alias.name}"
                found.add(sub if sub in known else node.module)
        elif isinstance(node, ast.Import):
            found.update(a.name for a in node.names)
    return {name for name in found if name in known}


def test_no_module_imports_itself_back() -> None:
    """No import cycle between balancer's modules (docs/architecture.md). A
    package's ``__init__`` re-exporting its own submodules is not a cycle."""
    paths = {module_name(p): p for p in PACKAGE.rglob("*.py")}
    graph = {name: {m for m in imported_modules(path, set(paths)) if not m.startswith(name + ".")}
             for name, path in paths.items()}

    def reaches(start: str, goal: str) -> bool:
        seen, stack = set(), list(graph[start])
        while stack:
            node = stack.pop()
            if node == goal:
                return True
            if node not in seen:
                seen.add(node)
                stack.extend(graph[node])
        return False

    cycles = sorted({tuple(sorted((a, b))) for a in graph for b in graph[a] if reaches(b, a)})
    assert not cycles, cycles


#: At most this many lines in one product module (one concept per module): Python, and the Lua
#: scripts and their library (admission/lua, concatenated by core.LIBRARY, one concept a file).
MAX_MODULE_LINES = 400
#: Modules still over it, each with what it waits for; the list may only shrink.
OVER_THE_LIMIT: dict[str, str] = {}


def test_no_module_is_over_the_limit() -> None:
    sizes = {str(p.relative_to(ROOT)): len(p.read_text().splitlines()) for p in [*PACKAGE.rglob("*.py"), *PACKAGE.rglob("*.lua")]
             if "migrations" not in p.parts}
    over = {path for path, n in sizes.items() if n > MAX_MODULE_LINES}
    assert over <= set(OVER_THE_LIMIT), {p: sizes[p] for p in over - set(OVER_THE_LIMIT)}
    assert all(sizes[p] > MAX_MODULE_LINES for p in OVER_THE_LIMIT), "a listed module is back under the limit: drop it"
