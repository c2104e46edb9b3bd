"""``balancer quota ...``: change per-model limits at runtime.

A change lands in PostgreSQL (with an audit row) and in the live Redis copy
in one step, and applies to the very next admission; no restart.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import TYPE_CHECKING

import click

from balancer.admission.quota import MAX_CONCURRENCY
from balancer.cli import print_table
from balancer.cli.import_export import echo_changes, read_declared, write_text
from balancer.cli.startwait import migrated
from balancer.errors import QuotaError
from balancer.quotas.file import format_quota_file, parse_quota_file

if TYPE_CHECKING:
    from balancer.services import Services

POSITIVE = click.IntRange(min=1)


@click.group()
def quota() -> None:
    """List and change per-model quotas."""


@quota.command("list")
@click.option("--json", "as_json", is_flag=True, help="Machine-readable output.")
def quota_list(as_json: bool) -> None:
    """Limits from PostgreSQL with the live state from Redis, a row per model.

    \b
    in flight    calls holding a slot / max_concurrent_requests
    tokens now   tokens in the bucket / its capacity: burst_tokens less 250 ms
                 of refill kept for calls in transit (docs/admission.md)
    reqs now     requests in the request bucket (RPM models)
    deficit      the model's weighted round-robin credit, in tokens: among the
                 models that could take a task, one whose credit covers the
                 task's estimate takes it (docs/admission.md, WDRR)
    p50/p90/p99  latency from finished calls, or the prior, marked (prior)"""
    svc = migrated()
    stored = svc.quotas.all()
    live = svc.core.live() if svc.core.is_loaded() else {}
    rows = []
    for q in stored:
        state = live.get(q.name)
        latency = None if state is None else state.latency_estimate(svc.settings.expected_latency_s)
        rows.append(
            {
                **q.as_dict(),
                "burst_tokens": q.burst,
                "live": None
                if state is None
                else {
                    "in_flight": state.in_flight,
                    "tokens_available": round(state.tokens_available, 1),
                    "token_capacity": round(state.token_capacity, 1),  # full: the burst less the tokens in transit
                    "requests_available": None
                    if state.requests_available is None
                    else round(state.requests_available, 2),
                    "deficit": state.deficit,
                    "paused_ms": state.paused_ms,
                    "external_tpm": state.external_tpm,
                    # The limits in force: the quota's, or lower where the model learned so, or slow start's open slots (and why).
                    "in_force": {
                        "max_concurrent_requests": state.cap_now,
                        "max_tokens_per_minute": state.limits.max_tokens_per_minute,
                        "max_requests_per_minute": state.limits.max_requests_per_minute,
                    },
                    "learned": state.limits_reason,
                },
                # p50/p90/p99 in seconds, learned from finished calls; "samples": 0 means the prior.
                "latency_s": None
                if latency is None
                else {
                    "p50": round(latency.p50_ms / 1000, 2),
                    "p90": round(latency.p90_ms / 1000, 2),
                    "p99": round(latency.p99_ms / 1000, 2),
                    "samples": round(latency.samples, 1),
                },
            }
        )
    if as_json:
        click.echo(json.dumps(rows, indent=2))
        return
    if not rows:
        click.echo("no models yet: add one with `balancer quota set NAME --create --concurrency N --tpm N`, "
                   "or a file of them with `balancer quota import FILE` (examples/quotas.toml)")
        return
    from rich.table import Table

    from balancer.admission.values import TRANSIT_MS

    table = Table(title="quotas" + ("" if live else " (live state restored on next admission)"),
                  caption="tokens now: in the bucket / when full, the burst less the tokens in transit "
                          f"({TRANSIT_MS} ms of TPM, at most half the burst)")
    table.add_column("model", no_wrap=True)
    learned = any(learned_text(row["live"] or {}) for row in rows)  # the column only when a model learned
    for col in ("on", "weight", "accounting", "in flight", "TPM", "tokens now", "RPM", "reqs now", "deficit",
                "p50 / p90 / p99 s", *(["learned: in force"] if learned else [])):
        table.add_column(col, justify="right", no_wrap=col == "TPM")  # "30,000 window cap" on one line
    for row in rows:
        lv = row["live"] or {}
        table.add_row(
            row["name"],
            "yes" if row["enabled"] else "no",
            str(row["weight"]),
            row["token_accounting"],
            f"{lv.get('in_flight', '-')}/{row['max_concurrent_requests']}",
            f"{row['max_tokens_per_minute']:,}" + (" window cap" if row["window_cap"] else ""),
            f"{lv['tokens_available']:,.0f}/{lv['token_capacity']:,.0f}" if lv else f"-/{row['burst_tokens']:,}",
            f"{row['max_requests_per_minute']:,}" if row["max_requests_per_minute"] else "-",
            "-" if lv.get("requests_available") is None else f"{lv['requests_available']:,.1f}",
            str(lv.get("deficit", "-")),
            latency_cell(row["latency_s"]),
            *([learned_text(lv)] if learned else []),
        )
    print_table(table, 120)


def learned_text(live: dict) -> str:
    """The limits in force where learning changed them, and why ('' where it did not).

    >>> learned_text({"in_force": {"max_concurrent_requests": 4, "max_tokens_per_minute": 60000,
    ...               "max_requests_per_minute": 42}, "learned": "requests lowered by 429s at 12:03 UTC, recovering"})
    'cap 4, TPM 60,000, RPM 42: requests lowered by 429s at 12:03 UTC, recovering'
    """
    if not live.get("learned"):
        return ""
    f = live["in_force"]
    return (f"cap {f['max_concurrent_requests']}, TPM {f['max_tokens_per_minute']:,}, "
            f"RPM {f['max_requests_per_minute'] or '-'}: {live['learned']}")


def latency_cell(latency: dict | None) -> str:
    """``1.2 / 3.4 / 9.1`` from the learned sketch, or the prior marked as such.

    >>> latency_cell({"p50": 1.2, "p90": 3.4, "p99": 9.1, "samples": 0})
    '1.2 / 3.4 / 9.1 (prior)'
    """
    if latency is None:
        return "-"
    text = f"{latency['p50']:g} / {latency['p90']:g} / {latency['p99']:g}"
    return text + (" (prior)" if not latency["samples"] else "")


@quota.command("set")
@click.argument("model")
@click.option("--tpm", type=POSITIVE, help="max_tokens_per_minute")
@click.option("--rpm", type=POSITIVE, help="max_requests_per_minute")
@click.option("--concurrency", type=click.IntRange(1, MAX_CONCURRENCY), help="max_concurrent_requests")
@click.option("--weight", type=POSITIVE, help="WDRR weight (share when models compete)")
@click.option("--burst", type=POSITIVE, help="burst_tokens (token bucket capacity)")
@click.option("--burst-requests", type=POSITIVE, help="burst_requests (request bucket capacity; RPM x window / 60 for 1 s or 10 s windows)")
@click.option("--accounting", type=click.Choice(["reserve", "settle"]),
              help="token_accounting: reserve (prompt + max_tokens, no refund) or settle (to actual usage)")
@click.option("--expected-latency", type=float, metavar="SECONDS",
              help="expected_latency_s: the latency prior (median) until the model's own calls are measured")
@click.option("--on-disconnect", type=click.Choice(["continue", "stop", "finish"]),
              help="on_disconnect: what the backend does with a cancelled call: continue it and charge it "
                   "(its slot stays held) or stop (its slot is freed at once); finish: the old name of continue")
@click.option("--price-input", type=float, metavar="PRICE",
              help="price_per_million_input: what a million prompt tokens cost, in the quota file's currency")
@click.option("--price-output", type=float, metavar="PRICE",
              help="price_per_million_output: what a million completion tokens cost")
@click.option("--currency", metavar="CODE",
              help="currency: the prices' currency, three capital letters (one for every model, as in a quota file)")
@click.option("--enable/--disable", "enabled", default=None, help="Take new work or not.")
@click.option("--learn/--no-learn", "learn", default=None,
              help="learn: lower the effective limits on 429s and adopt x-ratelimit-limit-* headers (or not)")
@click.option("--slow-start/--no-slow-start", "slow_start", default=None,
              help="slow_start (with learn): open a new or changed quota's slots gradually until a 429 or the cap (or not)")
@click.option("--window-cap/--no-window-cap", "window_cap", default=None,
              help="window_cap: no 60 s window admits more than the TPM (and RPM), instead of the burst on top (or not)")
@click.option("--create", is_flag=True, help="Add the model if it does not exist.")
@click.option("--by", help="Who made the change (default: the OS user).")
def quota_set(
    model: str,
    tpm: int | None,
    rpm: int | None,
    concurrency: int | None,
    weight: int | None,
    burst: int | None,
    burst_requests: int | None,
    accounting: str | None,
    expected_latency: float | None,
    on_disconnect: str | None,
    price_input: float | None,
    price_output: float | None,
    currency: str | None,
    enabled: bool | None,
    learn: bool | None,
    slow_start: bool | None,
    window_cap: bool | None,
    create: bool,
    by: str | None,
) -> None:
    """Change one model's limits (or add it with --create)."""
    changes = {
        "max_tokens_per_minute": tpm,
        "max_requests_per_minute": rpm,
        "max_concurrent_requests": concurrency,
        "weight": weight,
        "burst_tokens": burst,
        "burst_requests": burst_requests,
        "token_accounting": accounting,
        "expected_latency_s": expected_latency,
        "on_disconnect": on_disconnect,
        "price_per_million_input": price_input,
        "price_per_million_output": price_output,
        "currency": currency,
        "enabled": enabled,
        "learn": learn,
        "slow_start": slow_start,
        "window_cap": window_cap,
    }
    changes = {k: v for k, v in changes.items() if v is not None}
    if not changes and not create:
        raise QuotaError(
            "nothing to change: give at least one of --tpm --rpm --concurrency --weight --burst --burst-requests "
            "--accounting --expected-latency --on-disconnect --price-input --price-output --currency --enable/--disable "
            "--learn/--no-learn "
            "--slow-start/--no-slow-start --window-cap/--no-window-cap"
        )
    from balancer.admission.quota import change_text, check_model_name

    check_model_name(model)
    svc = migrated()
    # A limit given, even unchanged, resets what the live model learned and owes (a price alone does not:
    # it is for spend, not admission).
    reset = bool(changes.keys() - {"price_per_million_input", "price_per_million_output", "currency"})
    old, new = svc.quotas.set(model, changes, create=create, by=by, reset=reset)
    cleared = "; what it learned (limits, limit headers) and any token debt cleared" if reset and old else ""
    click.echo(f"{model}: {change_text(old, new)}{cleared}")


def warn_stranded(svc: Services) -> None:
    """Say so when pending tasks are left that no model may take (their models were removed,
    or they were retried since): they wait, untouched, until one of their models is added again."""
    from balancer.backlog.reads import stranded_pending

    stranded = stranded_pending(svc.engine, [q.name for q in svc.quotas.all()])
    if stranded:
        click.echo(f"warning: {stranded} pending task(s) may only run on models that no longer exist; "
                   "they wait until one of those models is added again", err=True)


@quota.command("remove")
@click.argument("model")
@click.option("--force", is_flag=True,
              help="Remove it even with calls in flight or pending tasks only it may take (those are failed).")
@click.option("--by", help="Who made the change (default: the OS user).")
def quota_remove(model: str, force: bool, by: str | None) -> None:
    """Delete one model's quota.

    Refused while the model has calls in flight or pending tasks that no other
    model may take, unless --force: then those tasks are failed, with the reason,
    and the calls in flight keep their slots until they end."""
    from sqlalchemy.engine import Connection

    from balancer.backlog.removal import fail_pinned, model_occupancy

    svc = migrated()
    failed = 0

    def check(conn: Connection) -> None:
        nonlocal failed
        in_flight, pinned = model_occupancy(conn, model)
        live = svc.core.live().get(model)  # router calls are in Redis only
        in_flight = max(in_flight, live.in_flight if live else 0)
        if (in_flight or pinned) and not force:
            raise QuotaError(f"{model} has {in_flight} call(s) in flight or bound to it (ready, queued or running) "
                             f"and {pinned} pending task(s) that only it may take; "
                             "remove it with --force to fail those tasks")
        if pinned:
            failed = fail_pinned(conn, model, f"model {model} was removed (quota remove --force)")

    svc.quotas.remove(model, by=by, check=check)
    click.echo(f"{model}: removed" + (f"; {failed} pending task(s) only it could take failed" if failed else ""))
    warn_stranded(svc)


@quota.command("import")
@click.argument("file", type=click.Path(dir_okay=False, path_type=Path))
@click.option("--replace", "--yes", "replace", is_flag=True,
              help="Allow the import to remove the models FILE does not list.")
@click.option("--dry-run", is_flag=True, help="Print what the import would change, and change nothing.")
@click.option("--by", help="Who made the change (default: the OS user).")
def quota_import(file: Path, replace: bool, dry_run: bool, by: str | None) -> None:
    """Make the quota set equal to FILE (TOML; see `quota export`).

    Removing models needs --replace; an empty FILE is refused."""
    name, quotas = read_declared(file, parse_quota_file, QuotaError)
    if not quotas:
        raise QuotaError(f"{name} lists no models: refusing to remove every model (use `quota remove MODEL`)")
    from balancer.admission.quota import change_text

    svc = migrated()
    before = {q.name: q for q in svc.quotas.all()}
    summary = svc.quotas.replace_all(quotas, by=by, allow_removal=replace, dry_run=dry_run)
    updates = {q.name: change_text(before[q.name], q).removeprefix("updated: ") for q in quotas if q.name in before}
    echo_changes(summary, f"{len(quotas)} model(s)", name, dry_run, replace, updates)
    if summary.removed and not dry_run:
        warn_stranded(svc)


@quota.command("export")
@click.argument("file", required=False, type=click.Path(dir_okay=False, path_type=Path))
def quota_export(file: Path | None) -> None:
    """Write the whole quota set as TOML to FILE (default: stdout)."""
    write_text(file, format_quota_file(migrated().quotas.all()), QuotaError)
