"""docker-compose.yml, checked without Docker (no engine runs on this machine)."""

from __future__ import annotations

import re
import shlex
from pathlib import Path

import click
import yaml

from balancer.cli import cli
from balancer.devtools.sim.config import default_models
from balancer.settings import ENVIRONMENT

COMPOSE = yaml.safe_load((Path(__file__).parents[2] / "docker-compose.yml").read_text())
SERVICES = COMPOSE["services"]
#: Variables that are not balancer settings, and who reads them.
OTHER_VARIABLES = {
    "MODEL": "worker",
    "FLOWER_USER": "flower",
    "FLOWER_PASSWORD": "flower",
    "POSTGRES_USER": "postgres",
    "POSTGRES_PASSWORD": "postgres",
    "POSTGRES_DB": "postgres",
}


def argv_of(service: dict) -> list[str] | None:
    command = service.get("command")
    if command is None:
        return None
    if command[:2] == ["sh", "-c"]:
        inner = shlex.split(command[2].replace("$$", "$"))
        return inner[1:] if inner[0] == "exec" else inner
    return list(command)


def resolve_click(argv: list[str]) -> click.Command:
    command: click.Command = cli
    for word in argv:
        if word.startswith("-"):
            break
        if isinstance(command, click.Group):
            found = command.get_command(click.Context(command), word)
            assert found is not None, f"balancer has no command {word!r}"
            command = found
    return command


def test_every_command_names_a_real_entry_point(env: dict[str, str]) -> None:
    checked = 0
    for name, service in SERVICES.items():
        argv = argv_of(service)
        if argv is None or "image" in service and not service.get("build"):
            continue  # third-party images (redis, postgres) bring their own entry points
        if argv[0] == "balancer":
            command = resolve_click(argv[1:])
            assert not isinstance(command, click.Group), f"{name}: {argv} stops at a group"
            options = {opt for p in command.params for opt in getattr(p, "opts", [])}
            passes_on = bool(command.context_settings.get("allow_extra_args"))  # `balancer flower` passes on Flower's own
            for word in argv[1:]:
                if word.startswith("--") and not passes_on:
                    assert word.split("=")[0] in options, f"{name}: unknown option {word}"
        else:
            raise AssertionError(f"{name}: unexpected command {argv}")
        checked += 1
    assert checked >= 6


def test_every_environment_variable_is_read() -> None:
    for name, service in SERVICES.items():
        for variable in (service.get("environment") or {}):
            if variable.startswith("BALANCER_"):
                assert variable in ENVIRONMENT, f"{name} sets {variable}, which no setting reads"
            else:
                assert OTHER_VARIABLES.get(variable) == name, f"{name} sets unexpected {variable}"
    referenced = set(re.findall(r"BALANCER_[A-Z_]+", (Path(__file__).parents[2] / "docker-compose.yml").read_text()))
    assert referenced <= set(ENVIRONMENT)


def test_every_consumed_queue_is_produced(env: dict[str, str]) -> None:
    from balancer.pipeline.app import app

    produced = {app.conf.task_default_queue} | {f"model.{m.name}" for m in default_models()}
    consumed = set()
    for _name, service in SERVICES.items():
        argv = argv_of(service) or []
        if argv[:2] == ["balancer", "worker"]:
            model = service["environment"]["MODEL"].split(":-")[-1].rstrip("}")
            consumed.add(f"model.{model}")
        if argv[:2] == ["balancer", "dispatcher"]:
            consumed.add("control")
    assert consumed and consumed <= produced


def test_services_have_healthchecks_volumes_and_auth() -> None:
    for name in ("redis", "postgres"):
        assert "healthcheck" in SERVICES[name] and SERVICES[name].get("volumes")
    assert SERVICES["migrate"]["restart"] == "no"
    flower = " ".join(SERVICES["flower"]["command"])
    assert "--basic-auth" in flower and "FLOWER_PASSWORD" in flower
    assert SERVICES["flower"]["ports"] == ["127.0.0.1:5555:5555"]
    for name in ("dispatcher", "worker", "beat"):
        assert SERVICES[name]["depends_on"]["migrate"]["condition"] == "service_completed_successfully"


# -- compose's services, run as plain processes ---------------------------------------

def interpolate(value: str, variables: dict[str, str]) -> str:
    """Compose's ``${VAR}``, ``${VAR:-default}`` and ``${VAR:?message}``; a
    ``:?`` variable missing here fails the test, as it would fail compose.
    ``$$`` is a literal ``$`` (left for the shell), as in compose.

    >>> interpolate("a-${X:-d}-${Y:?set Y} $${Z}", {"Y": "y"})
    'a-d-y ${Z}'
    """
    def one(match: re.Match[str]) -> str:
        name, op, arg = match.group(1), match.group(2), match.group(3)
        if name in variables:
            return variables[name]
        assert op != ":?", f"compose needs {name}: {arg}"
        return arg if op == ":-" else ""

    escaped = value.replace("$$", "\0")
    return re.sub(r"\$\{([A-Z_]+)(?:(:-|:\?)([^}]*))?\}", one, escaped).replace("\0", "$")


def test_compose_services_run_as_processes_and_drain_50_tasks(migrated: dict[str, str], tmp_path: Path) -> None:
    """Every balancer service of docker-compose.yml, started with its own command
    and environment as a plain process (there is no Docker here), drains 50
    tasks dropped in the inbox, then stops cleanly on SIGTERM.

    What changes from compose, and only that: service hosts become this test's
    Redis, PostgreSQL and simulator; volume paths become temp directories;
    listening addresses become 127.0.0.1 on free ports; the test's namespace
    isolates its keys; the simulator runs at time scale 0.02 so calls take
    milliseconds; and quotas are imported for three of its models, each with
    its own `worker` process (compose's worker service, scaled per model)."""
    import json
    import os
    import signal
    import subprocess
    import sys
    import time

    import httpx

    from balancer.backlog.reads import status_counts
    from balancer.devtools.embedded import free_port
    from balancer.services import Services
    from balancer.settings import Settings
    from balancer.supervisor import wait_for_http

    inbox, home = tmp_path / "inbox", tmp_path / "beat-home"
    inbox.mkdir()
    home.mkdir()
    sim_port = free_port()
    variables = {"POSTGRES_PASSWORD": "unused-here", "FLOWER_USER": "ops", "FLOWER_PASSWORD": "s3cret",
                 "BALANCER_BACKEND_URL": f"http://127.0.0.1:{sim_port}"}
    service_urls = {"BALANCER_REDIS_URL": migrated["BALANCER_REDIS_URL"],
                    "BALANCER_BROKER_URL": migrated["BALANCER_REDIS_URL"],
                    "BALANCER_DATABASE_URL": migrated["BALANCER_DATABASE_URL"]}
    volumes = {"/inbox": str(inbox), "/var/lib/balancer": str(home)}
    ports: dict[str, int] = {}

    def environment(name: str, extra: dict[str, str] | None = None) -> dict[str, str]:
        env = {k: interpolate(str(v), variables) for k, v in (SERVICES[name].get("environment") or {}).items()}
        env.update({k: service_urls[k] for k in env if k in service_urls})
        env = {k: volumes.get(v, v) for k, v in env.items()}
        path = os.path.dirname(sys.executable) + os.pathsep + os.environ.get("PATH", "")
        return {"PATH": path, "HOME": str(tmp_path), "BALANCER_NAMESPACE": migrated["BALANCER_NAMESPACE"],
                **env, **(extra or {})}

    def command(name: str) -> list[str]:
        argv = [interpolate(word, variables) for word in SERVICES[name]["command"]]
        port = ports.setdefault(name, sim_port if name == "sim" else free_port())
        argv = [w.replace("0.0.0.0", "127.0.0.1") for w in argv]  # noqa: S104 - replacing it, not binding
        argv = [re.sub(r"--port=\d+", f"--port={port}", w) for w in argv]
        if "--port" in argv:
            argv[argv.index("--port") + 1] = str(port)
        return [*argv, "--time-scale", "0.02"] if name == "sim" else argv

    running: list[tuple[str, subprocess.Popen]] = []

    def start(name: str, label: str, extra: dict[str, str] | None = None) -> subprocess.Popen:
        log = (tmp_path / f"{label}.log").open("w")
        proc = subprocess.Popen(command(name), env=environment(name, extra), stdout=log, stderr=subprocess.STDOUT,
                                stdin=subprocess.DEVNULL, start_new_session=True, cwd=tmp_path)
        running.append((label, proc))
        return proc

    def log_of(label: str) -> str:
        return (tmp_path / f"{label}.log").read_text(errors="replace")[-3000:]

    try:
        assert start("migrate", "migrate").wait(timeout=120) == 0, log_of("migrate")
        start("sim", "sim")
        wait_for_http(f"http://127.0.0.1:{sim_port}/models")
        models = default_models()[:3]
        svc = Services.connect(Settings.from_env())
        svc.quotas.replace_all([m.quota(time_scale=0.02) for m in models], by="test")
        start("dispatcher", "dispatcher")
        for m in models:
            start("worker", f"worker-{m.name}", {"MODEL": m.name})
        for name in ("beat", "flower", "metrics"):
            start(name, name)
        lines = [{"prompt": f"compose task {i} " + "word " * (i % 40), "max_tokens": 64} for i in range(50)]
        staged = inbox / "batch.tmp"
        staged.write_text("\n".join(json.dumps(line) for line in lines) + "\n")
        past = time.time() - 5
        os.utime(staged, (past, past))
        staged.rename(inbox / "batch.jsonl")
        deadline = time.monotonic() + 120
        while (counts := status_counts(svc.engine))["solved"] < 50:
            for label, proc in running[1:]:
                assert proc.poll() is None, f"{label} exited {proc.returncode}: {log_of(label)}"
            assert time.monotonic() < deadline, f"not drained: {counts}"
            time.sleep(0.25)
        assert counts["failed"] == 0 and sum(counts.values()) == 50
        def calls() -> tuple[float, int]:
            metrics = httpx.get(f"http://127.0.0.1:{ports['metrics']}/metrics", timeout=10).text
            solved = sum(float(line.split()[-1]) for line in metrics.splitlines()
                         if line.startswith('balancer_model_calls_total{') and 'outcome="solved"' in line)
            # A hedged task's losing call is cut off when the other answers; the backend
            # still finishes it (strict providers do) and logs a 200 with the client gone.
            answered = sum(1 for e in httpx.get(f"http://127.0.0.1:{sim_port}/log", timeout=10).json()["entries"]
                           if e["status"] == 200 and not e["client_gone"])
            return solved, answered

        # A hedge's other call may end after the drain: the backend logs its 200 a
        # moment before the worker's finish counts it, so read until both have it.
        settle_by = time.monotonic() + 15
        while (pair := calls())[0] != pair[1] and time.monotonic() < settle_by:
            time.sleep(0.25)
        solved, answered = pair
        assert solved == answered >= 50  # every call answered to balancer, hedges included, as the backend saw them
        flower = f"http://127.0.0.1:{ports['flower']}/api/workers"
        wait_for_http(flower)
        assert httpx.get(flower, timeout=10).status_code == 401
        assert httpx.get(flower, auth=("ops", "s3cret"), timeout=20).status_code == 200
    finally:
        for _label, proc in running:
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGTERM)
        codes = {label: proc.wait(timeout=60) for label, proc in running}
    # A deploy's SIGTERM: balancer's own processes stop cleanly with exit 0 (Celery's
    # warm shutdown; the exporter). uvicorn (sim) and tornado (flower) re-raise the
    # signal after their own shutdown, which compose also counts as a stop.
    unclean = {k: (c, log_of(k)[-500:]) for k, c in codes.items()
               if c != 0 and not (k in ("sim", "flower") and c == -signal.SIGTERM)}
    assert not unclean
