"""docker-compose.yml, checked without Docker (no engine runs on this machine)."""

from __future__ import annotations

import importlib
import re
import shlex
from pathlib import Path

import click
import yaml

from balancer.cli import cli
from balancer.devtools.sim.config import default_models
from balancer.settings import ENVIRONMENT

COMPOSE = yaml.safe_load((Path(__file__).parent.parent / "docker-compose.yml").read_text())
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
            assert word in command.commands, f"balancer has no command {word!r}"
            command = command.commands[word]
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
            for word in argv[1:]:
                if word.startswith("--"):
                    assert word.split("=")[0] in options, f"{name}: unknown option {word}"
        elif argv[0] == "celery":
            app_path = argv[argv.index("-A") + 1]
            module = importlib.import_module(app_path)
            assert hasattr(module, "app")
            assert argv[argv.index("-A") + 2] == "flower"
            importlib.import_module("flower")
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
    referenced = set(re.findall(r"BALANCER_[A-Z_]+", (Path(__file__).parent.parent / "docker-compose.yml").read_text()))
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
