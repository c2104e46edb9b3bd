"""docs/your-own-table.md, followed step by step from a fresh clone against the simulator: its shell
blocks run in order in the clone (``balancer`` is the clone's code: ``python -m balancer`` with the clone
first on the path; ``pip install`` is this environment's), its SQL block in a team database made for
the test, its file blocks saved under their names. The URLs of step 1 are this test's services, the
simulator's port a free one, and the simulator runs 50 times faster (``--time-scale 0.02``) so the
quick start's fifty questions take seconds; nothing else differs from the page."""

from __future__ import annotations

import os
import re
import shlex
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import sqlalchemy as sa

from balancer.devtools.embedded import free_port
from balancer.devtools.sim.config import default_models
from balancer.quotas.file import parse_quota_file
from tests.legacy import legacy_database

ROOT = Path(__file__).resolve().parents[2]
PAGE = "docs/your-own-table.md"
BLOCK = re.compile(r"(?:<!-- (?P<marker>[a-z]+): (?P<arg>\S+) -->\n)?```(?P<lang>\w+)\n(?P<body>.*?)```", re.S)

pytestmark = pytest.mark.timeout(420)


def test_the_example_quotas_name_simulator_models_within_their_limits() -> None:
    served = {m.name: m.quota() for m in default_models(10)}
    for quota in parse_quota_file((ROOT / "examples" / "quotas.toml").read_text()):
        sim = served[quota.name]  # a name the simulator serves (not a 404 on every call)
        assert quota.max_concurrent_requests <= sim.max_concurrent_requests
        assert quota.max_tokens_per_minute <= sim.max_tokens_per_minute and quota.burst <= sim.burst
        assert (quota.max_requests_per_minute or 0) <= (sim.max_requests_per_minute or 10**9)


def test_the_sims_print_quotas_is_a_quota_file_of_its_models() -> None:
    done = subprocess.run([sys.executable, "-m", "balancer", "sim", "--print-quotas", "--models", "3"],
                          capture_output=True, text=True, timeout=60, check=True)
    assert [q.name for q in parse_quota_file(done.stdout)] == ["model-0", "model-1", "model-2"]


def test_the_quick_start_answers_the_team_table(env: dict[str, str], service_urls, tmp_path: Path) -> None:  # noqa: ANN001
    clone = tmp_path / "clone"
    subprocess.run(["git", "clone", "--quiet", str(ROOT), str(clone)], check=True, timeout=120)
    page = (clone / PAGE).read_text()
    port = str(free_port())
    with legacy_database(service_urls[1]) as team_url:
        ours = {"BALANCER_REDIS_URL": env["BALANCER_REDIS_URL"], "BALANCER_DATABASE_URL": env["BALANCER_DATABASE_URL"],
                "BALANCER_BACKEND_URL": f"http://127.0.0.1:{port}", "TEAM_DATABASE_URL": team_url}
        shell_env = {**os.environ, "PYTHONPATH": str(clone), "BALANCER_HOME": str(tmp_path / "home"),
                     "BALANCER_DISPATCH_TICK": "0.5"}
        background: list[subprocess.Popen] = []
        steps = []
        try:
            for block in BLOCK.finditer(page):
                lang, body = block["lang"], block["body"]
                if block["marker"] == "file":
                    (clone / block["arg"]).write_text(body)
                    steps.append(f"file {block['arg']}")
                elif lang == "sql":
                    engine = sa.create_engine(shell_env[block["arg"]] if block["arg"] in shell_env else team_url)
                    with engine.begin() as conn:
                        conn.exec_driver_sql(body)
                    engine.dispose()
                    steps.append("sql")
                elif lang == "sh":
                    for line in filter(None, (raw.strip() for raw in body.splitlines())):
                        steps.append(line)
                        run_line(line, clone, shell_env, ours, port, background)
            assert steps[-1] == "balancer run", steps  # the page ends by running the pipeline
            team = sa.create_engine(team_url)
            deadline = time.monotonic() + 240
            while True:
                with team.connect() as conn:
                    solved = conn.exec_driver_sql("SELECT count(*) FROM questions WHERE status = 'solved' "
                                                  "AND answer IS NOT NULL").scalar()
                if solved == 50:
                    break
                for proc in background:
                    assert proc.poll() is None, f"{proc.args} exited {proc.returncode}"
                assert time.monotonic() < deadline, f"{solved} of 50 questions answered; steps: {steps}"
                time.sleep(0.5)
            team.dispose()
        finally:
            for proc in reversed(background):  # `balancer run` first (Ctrl-C's SIGINT), then the simulator
                proc.send_signal(signal.SIGINT)
                try:
                    proc.wait(timeout=60)
                except subprocess.TimeoutExpired:
                    proc.kill()
                    proc.wait()
    assert background[-1].returncode == 0  # `balancer run` stopped its processes and exited cleanly


def run_line(line: str, clone: Path, env: dict[str, str], ours: dict[str, str], port: str,
             background: list[subprocess.Popen]) -> None:
    """One line of a shell block, as a person would type it, with this test's URLs and port."""
    if line.startswith("export "):
        name, _, _ = line.removeprefix("export ").partition("=")
        env[name] = ours[name]  # step 1: this test's services
        return
    argv = shlex.split(line.replace("8900", port))
    if argv[:2] == ["pip", "install"]:
        return  # this environment has balancer's dependencies; the clone's code runs through PYTHONPATH
    assert argv[0] == "balancer", line
    runs_on = argv[-1] == "&" or argv[:2] == ["balancer", "run"]
    argv = [sys.executable, "-m", *[a for a in argv if a != "&"]]
    if argv[3:4] == ["sim"]:
        argv += ["--time-scale", "0.02"]
    if runs_on:  # the simulator, and `balancer run` (in the foreground on the page, until Ctrl-C)
        log = (clone / f"{argv[3]}.out").open("w")
        background.append(subprocess.Popen(argv, cwd=clone, env=env, stdout=log, stderr=subprocess.STDOUT))
        if argv[3] == "sim":
            wait_listening(int(port))
        return
    done = subprocess.run(argv, cwd=clone, env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, f"{line}: {done.stderr}"


def wait_listening(port: int) -> None:
    import socket

    deadline = time.monotonic() + 60
    while True:
        try:
            socket.create_connection(("127.0.0.1", port), timeout=1).close()
            return
        except OSError:
            assert time.monotonic() < deadline, "the simulator did not start"
            time.sleep(0.1)
