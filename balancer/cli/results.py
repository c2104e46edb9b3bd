"""``balancer results export``: ended tasks out as JSONL or CSV, from a resumable cursor.

The cursor printed is always that of the last row written and flushed: a page
is written whole before the cursor moves past it, and a Ctrl-C (SIGINT, or a SIGTERM) that
comes while a page is being written takes effect once that page is flushed,
so resuming from the printed cursor skips no row. CSV cells that a
spreadsheet would read as a formula (text starting with ``=``, ``+``, ``-``,
``@``, a tab or a carriage return) are written with a leading ``'``.
"""

from __future__ import annotations

import csv
import json
import signal
import sys
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from types import FrameType
from typing import IO, Any

import click

from balancer.errors import BalancerError, printable


@click.group()
def results() -> None:
    """Answers out, for any other consumer (see also the SQL view balancer_results)."""


#: What a spreadsheet reads as the start of a formula (or a cell it would split).
FORMULA_START = ("=", "+", "-", "@", "\t", "\r")


def _json(value: Any) -> Any:
    """A JSONL field: times as ISO 8601, the rest (metadata, a JSON object, included) as it is."""
    return value.isoformat() if hasattr(value, "isoformat") else value


def _text(value: Any) -> Any:
    """A CSV cell's value: JSON (metadata) as its text."""
    return json.dumps(value, ensure_ascii=False) if isinstance(value, dict | list) else _json(value)


def csv_cell(value: Any) -> Any:
    """A CSV cell that no spreadsheet runs as a formula: text starting with one of
    :data:`FORMULA_START` gets a leading ``'`` (numbers are left as they are).

    >>> csv_cell("=HYPERLINK(1)"), csv_cell("-3"), csv_cell(-3), csv_cell("a=b")
    ("'=HYPERLINK(1)", "'-3", -3, 'a=b')
    """
    value = _text(value)
    return "'" + value if isinstance(value, str) and value.startswith(FORMULA_START) else value


class _Interrupts:
    """SIGINT (or SIGTERM) while a page is being written waits for the page's end (and
    its flush); at any other moment it interrupts at once."""

    def __init__(self) -> None:
        self.writing = False
        self.pending = False

    def __call__(self, signum: int, frame: FrameType | None) -> None:
        if self.writing:
            self.pending = True
        else:
            raise KeyboardInterrupt

    @contextmanager
    def page(self) -> Iterator[None]:
        self.writing = True
        try:
            yield
        finally:
            self.writing = False
        if self.pending:
            raise KeyboardInterrupt


@contextmanager
def _deferred_interrupts() -> Iterator[_Interrupts]:
    interrupts = _Interrupts()
    if threading.current_thread() is not threading.main_thread():  # (a signal handler is the main thread's)
        yield interrupts
        return
    previous = {signum: signal.signal(signum, interrupts) for signum in (signal.SIGINT, signal.SIGTERM)}
    try:
        yield interrupts
    finally:
        for signum, handler in previous.items():
            signal.signal(signum, handler)


@results.command("export")
@click.option("--source", help="Only this source's tasks.")
@click.option("--since", "since", help="Resume after this cursor (printed by the previous export).")
@click.option("--format", "fmt", type=click.Choice(["jsonl", "csv"]), default="jsonl", show_default=True,
              help="One JSON object per line, or CSV with a header row.")
@click.option("--follow", is_flag=True, help="Keep going: write tasks as they end, until Ctrl-C.")
@click.option("--out", type=click.Path(dir_okay=False, path_type=Path), help="Append to FILE (default: stdout).")
@click.option("--poll", default=1.0, show_default=True, type=click.FloatRange(0.05, 60), help="Seconds between polls with --follow.")
@click.option("--prompt", "with_prompt", is_flag=True, help="Also write each task's prompt (a column after key).")
def results_export(source: str | None, since: str | None, fmt: str, follow: bool, out: Path | None, poll: float,
                   with_prompt: bool) -> None:
    """Solved and failed tasks with key, source, metadata, answer, model, tokens and times,
    and what each task's calls cost (calls sent, billed tokens, cost at the prices of each call's start).

    On stderr: what the exported tasks' calls cost by model and source, then,
    last, `cursor: XID-ID` (the last row written and flushed, also after a
    Ctrl-C): pass it to --since to resume with no gap and no repeat. CSV cells
    starting with = + - @ (or a tab or CR) get a leading ' (no spreadsheet formula)."""
    from balancer.backlog.results import START, columns, page, parse_cursor
    from balancer.cli.pipeline import _migrated
    from balancer.costs.cost import Charged, money, price_list, spend, spend_text

    after = parse_cursor(since or START)
    written_columns = columns(with_prompt)
    services = _migrated()
    engine = services.engine
    currency = price_list(services.quotas.all())[1]
    # (source, model, currency or None when unpriced) -> [prompt, completion, cost]: the export's spend
    charged: dict[tuple[str, str, str | None, bool], list[float]] = {}
    try:
        sink: IO[str] = open(out, "a", encoding="utf-8", newline="") if out else sys.stdout  # noqa: SIM115
    except OSError as exc:
        raise BalancerError(f"cannot write {printable(str(out))}: {exc.strerror or exc}") from None
    writer = csv.writer(sink) if fmt == "csv" else None
    if writer is not None and (out is None or sink.tell() == 0):
        writer.writerow(written_columns)
    written = 0
    try:
        with _deferred_interrupts() as interrupts:
            while True:
                rows, end = page(engine, after, source=source, with_prompt=with_prompt)
                with interrupts.page():  # a Ctrl-C meanwhile waits for the page to be written and flushed
                    for row in rows:
                        for model, prompt_tokens, completion_tokens, _, cost, paid_in in row["usage"]:
                            summed = charged.setdefault((row["source"], model, paid_in, cost is not None), [0, 0, 0.0])
                            summed[0] += prompt_tokens
                            summed[1] += completion_tokens
                            summed[2] += cost or 0.0
                        if writer is not None:
                            writer.writerow([csv_cell(row[c]) for c in written_columns])
                        else:
                            sink.write(json.dumps({c: _json(row[c]) for c in written_columns}, ensure_ascii=False) + "\n")
                    if rows:
                        sink.flush()
                    written += len(rows)
                    after = end  # only now: the page's rows are written and flushed
                if rows:
                    if follow:
                        click.echo(f"cursor: {after}", err=True)
                    continue
                if not follow:
                    break
                time.sleep(poll)
    except KeyboardInterrupt:
        pass
    finally:
        if out:
            sink.close()
    click.echo(f"exported {written} task(s)", err=True)
    if not written and source is not None and not since:
        from balancer.backlog.operations import TaskFilter, names_no_task_has

        for note in names_no_task_has(engine, TaskFilter(source=source)):
            click.echo(f"note: {note}", err=True)
    if charged:
        spent = spend([Charged(src, model, int(p), int(c), cost if priced else None, paid_in)
                       for (src, model, paid_in, priced), (p, c, cost) in sorted(charged.items(), key=str)], currency)
        by_source = ", ".join(f"{src} {money(amount, currency)}" for src, amount in sorted(spent.by_source.items()))
        click.echo(f"exported tasks' calls, {spend_text(spent)}" + (f"; by source: {by_source}" if by_source else ""),
                   err=True)
    click.echo(f"cursor: {after}", err=True)


