"""What ``quota import/export`` and ``source import/export`` share: FILE (``-``: stdin) read as
UTF-8 text and parsed, the set written to FILE (``-`` or none: stdout) through a temporary file, and what an
import changed (or, with ``--dry-run``, would change) told; each failure as one line."""

from __future__ import annotations

import sys
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import TYPE_CHECKING, TypeVar

import click

from balancer.errors import BalancerError, printable

if TYPE_CHECKING:
    from balancer.storage.declared import ImportSummary


def read_text(file: Path, error: type[BalancerError] = BalancerError) -> str:
    """FILE's text, or stdin's for ``-``; ``error`` if it cannot be read or is not UTF-8."""
    name = printable(str(file))
    try:
        return sys.stdin.read() if str(file) == "-" else file.read_bytes().decode("utf-8")
    except OSError as exc:
        raise error(f"cannot read {name}: {exc.strerror or exc}") from None
    except UnicodeDecodeError as exc:
        raise error(f"{name}: not UTF-8 text (byte {exc.start})") from None


T = TypeVar("T")


def read_declared(file: Path, parse: Callable[[str], list[T]], error: type[BalancerError] = BalancerError
                  ) -> tuple[str, list[T]]:
    """FILE's name as shown, and what ``parse`` reads in its text; each failure ``error``, naming FILE."""
    name = printable(str(file))
    text = read_text(file, error)
    try:
        return name, parse(text)
    except BalancerError as exc:
        raise error(f"{name}: {exc}") from None


def write_text(file: Path | None, text: str, error: type[BalancerError] = BalancerError) -> None:
    """``text`` to stdout (no FILE, or ``-``), or to FILE whole: written beside it, then moved over it."""
    if file is None or str(file) == "-":
        click.echo(text, nl=False)
        return
    tmp = file.with_name(file.name + ".tmp")
    try:
        tmp.write_text(text)
        tmp.replace(file)
    except OSError as exc:
        raise error(f"cannot write {printable(str(file))}: {exc.strerror or exc}") from None
    click.echo(f"wrote {printable(str(file))}")


def echo_changes(changes: ImportSummary, listed: str, name: str, dry_run: bool, replace: bool = True,
                 updates: Mapping[str, str] | None = None) -> None:
    """What an import of ``listed`` (e.g. "3 model(s)") from the file ``name`` changed, or would change;
    a dry run names what each update changes (``updates``, by name, when the caller knows) and says when
    the import itself, without ``replace``, would be refused."""
    counts = (f"{len(changes.created)} created, {len(changes.updated)} updated, "
              f"{len(changes.removed)} removed, {len(changes.unchanged)} unchanged")
    if dry_run:
        for verb, names in (("create", changes.created), ("update", changes.updated), ("remove", changes.removed)):
            for each in names:
                detail = (updates or {}).get(each) if verb == "update" else None
                click.echo(f"would {verb} {each}" + (f": {detail}" if detail else ""))
        click.echo(f"dry run, nothing changed: {listed} in {name}: {counts}")
        if changes.removed and not replace:
            click.echo(f"without --replace this import is refused: it would remove {len(changes.removed)}")
        return
    click.echo(f"imported {listed}: {counts}")
