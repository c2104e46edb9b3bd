"""The product as a user installs it: a wheel in a fresh venv, run from outside the checkout.

The venv gets balancer only from the wheel. Its third-party dependencies come
from the test environment through a ``.pth`` line (so the test does not
download them again); a directory added by a ``.pth`` line has its own ``.pth``
files ignored, so the checkout's editable install cannot leak in, and the test
checks that ``balancer`` is imported from the new venv.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import sysconfig
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]

pytestmark = pytest.mark.e2e


@pytest.fixture(scope="module")
def installed(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """bin/ of a fresh venv holding the wheel built from a copy of the source tree."""
    work = tmp_path_factory.mktemp("wheel")
    source = work / "src"
    shutil.copytree(ROOT, source, ignore=shutil.ignore_patterns(".git", ".venv", "build", "*.egg-info", "__pycache__",
                                                                ".hypothesis", ".balancer", "bench-out"))
    subprocess.run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "-w", str(work / "dist"), str(source)],
                   check=True, capture_output=True, timeout=300)
    (wheel,) = (work / "dist").glob("balancer-*.whl")
    venv = work / "venv"
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True, timeout=120)
    site = next((venv / "lib").glob("python3*/site-packages"))
    (site / "zz_test_dependencies.pth").write_text(sysconfig.get_paths()["purelib"] + "\n")
    subprocess.run([str(venv / "bin" / "python"), "-m", "pip", "install", "-q", "--no-deps", str(wheel)],
                   env=clean_env(), check=True, capture_output=True, timeout=300)  # with PYTHONPATH: "already satisfied"
    shutil.rmtree(source)  # nothing of the checkout is left to lean on
    return venv / "bin"


def clean_env() -> dict[str, str]:
    """This environment without PYTHONPATH: a checkout on it would be imported ahead of the wheel."""
    return {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}


def user_env(service_urls: tuple[str, str]) -> dict[str, str]:
    env = {k: v for k, v in clean_env().items() if not k.startswith("BALANCER_")}
    env.update(BALANCER_REDIS_URL=service_urls[0], BALANCER_DATABASE_URL=service_urls[1])
    return env


def test_the_wheel_is_what_runs(installed: Path, tmp_path: Path) -> None:
    where = subprocess.run([str(installed / "python"), "-c", "import balancer, celeryconfig; print(balancer.__file__)"],
                           cwd=tmp_path, env=clean_env(), capture_output=True, text=True, check=True).stdout.strip()
    assert where.startswith(str(installed.parent)), where
    help_text = subprocess.run([str(installed / "balancer"), "--help"], cwd=tmp_path, env=clean_env(), capture_output=True,
                               text=True)
    assert help_text.returncode == 0 and "bench" in help_text.stdout and "demo" in help_text.stdout


def test_the_web_console_ships_its_templates_and_assets(installed: Path, tmp_path: Path) -> None:
    """Every template and asset of balancer/web is package data in the wheel: the pages render
    and the static files load from the installed package, with no checkout to lean on."""
    probe = """
from importlib.resources import files
from balancer.web.app import environment
web = files("balancer.web")
names = sorted(p.name for p in (web / "templates").iterdir())
env = environment()
for name in names:
    env.get_template(name)
print(len(names), (web / "static" / "app.js").read_text().count("data-poll"), len((web / "static" / "style.css").read_text()))
"""
    proc = subprocess.run([str(installed / "python"), "-c", probe], cwd=tmp_path, env=clean_env(), capture_output=True,
                          text=True)
    assert proc.returncode == 0, proc.stderr
    templates, polls, css = map(int, proc.stdout.split())
    assert templates == len(list((ROOT / "balancer" / "web" / "templates").glob("*.html"))) and polls >= 1 and css > 500


def test_demo_from_the_wheel(installed: Path, tmp_path: Path, service_urls: tuple[str, str]) -> None:
    proc = subprocess.run([str(installed / "balancer"), "demo", "--tasks", "30", "--json"], cwd=tmp_path,
                          env=user_env(service_urls), capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    summary = json.loads(proc.stdout.strip().splitlines()[-1])
    assert summary["tasks"] == summary["solved"] == 30 and summary["violations"] == 0


def test_bench_short_from_the_wheel(installed: Path, tmp_path: Path, service_urls: tuple[str, str]) -> None:
    """What CI runs of the benchmark: `balancer bench short`, both sides, a complete report."""
    out = tmp_path / "report"
    proc = subprocess.run([str(installed / "balancer"), "bench", "short", "--out", str(out)], cwd=tmp_path,
                          env=user_env(service_urls), capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    report = json.loads((out / "report.json").read_text())
    assert {"makespan_s", "speedup", "utilization", "rate_limited", "violations"} <= set(report)
    assert set(report["makespan_s"]) == {"pipeline", "baseline", "bound", "pinned_floor"}
    assert report["violations"] == 0 and report["rate_limited"] == 0
    assert 0 < report["utilization"] <= report["utilization_vs_floor"] <= 1
    # No run can beat the realized floor: it is what the simulator will charge the pinned tasks.
    assert report["makespan_s"]["pipeline"] >= report["makespan_s"]["pinned_floor"]
    assert report["pipeline"]["counts"]["solved"] == report["tasks"]
    assert report["baseline"]["counts"]["unsolved"] == 0
    for name in ("tokens.png", "requests.png", "in_flight.png"):
        assert (out / name).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and (out / name).stat().st_size > 5000
    markdown = (out / "report.md").read_text()
    assert "| makespan (s) |" in markdown and "Speedup" in markdown and "![tokens.png]" in markdown


def test_bench_names_a_missing_scenario_in_one_line(installed: Path, tmp_path: Path) -> None:
    proc = subprocess.run([str(installed / "balancer"), "bench", "no-such-scenario"], cwd=tmp_path,
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2
    assert proc.stderr.startswith("error: no scenario 'no-such-scenario'") and "short" in proc.stderr
    assert "Traceback" not in proc.stderr
