"""The bundled scenarios, shipped as package data: ``balancer bench NAME`` finds them here.

>>> "short" in bundled()
True
"""

from __future__ import annotations

from importlib import resources
from pathlib import Path

from balancer.errors import BalancerError


def bundled() -> list[str]:
    """Names of the scenarios shipped with the package, sorted."""
    folder = resources.files(__name__)
    return sorted(p.name[: -len(".toml")] for p in folder.iterdir() if p.name.endswith(".toml"))


def locate(spec: str) -> tuple[str, str]:
    """(file name, TOML text) for a bundled scenario's NAME or a path to a TOML file.

    A path wins when a file of that name exists, so a local ``short.toml`` is
    never shadowed by the bundled one.
    """
    path = Path(spec)
    if path.is_file():
        try:
            return path.name, path.read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError) as exc:
            raise BalancerError(f"cannot read scenario {spec}: {exc}") from None
    name = path.name[: -len(".toml")] if path.name.endswith(".toml") else path.name
    if path.parent == Path(".") and name in bundled():
        text = (resources.files(__name__) / f"{name}.toml").read_text(encoding="utf-8")
        return f"{name}.toml", text
    raise BalancerError(f"no scenario {spec!r}: give a TOML file or one of {', '.join(bundled())}")
