"""The console's routes (Starlette): pages, their live fragments, and the two POST actions.

Pages render from the sampler's newest sample (:mod:`balancer.web.sampler`),
so they cost no scan of the backlog; the task search and a task's page read
PostgreSQL through :mod:`balancer.backlog.operations` (newest first, with a
limit and a time limit); failed tasks grouped by error come with the sample. Every
change is a POST with a CSRF token; retry and cancel are first a dry run
(a GET that lists what would change) and then a confirmed POST, audited in
``task_operations``; a quota change goes through ``QuotaStore.set``, as
``balancer quota set`` does (validation, audit, live effect).
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import AsyncIterator, Iterable
from typing import Any
from urllib.parse import parse_qsl, urlencode

import jinja2
import psycopg2.errors
import sqlalchemy.exc
from starlette.applications import Starlette
from starlette.concurrency import run_in_threadpool
from starlette.requests import Request
from starlette.responses import HTMLResponse, JSONResponse, RedirectResponse, Response
from starlette.routing import Mount, Route
from starlette.staticfiles import StaticFiles

from balancer.backlog import operations
from balancer.backlog.statuses import TASK_STATUSES
from balancer.errors import BalancerError, QuotaError
from balancer.httpguard import MAX_BODY_BYTES, ASGIApp, BodyLimit, HostGuard
from balancer.quotas.store import LiveNotUpdated
from balancer.services import Services
from balancer.storage.audit import default_actor
from balancer.web import charts, formatting, forms
from balancer.web.sampler import Sample, Sampler, per_minute
from balancer.web.security import CSRF_COOKIE, Csrf, SecurityHeaders, TokenGuard

log = logging.getLogger(__name__)

#: Rows a task search shows.
SEARCH_LIMIT = 100
#: A task search that reads longer is cancelled (a filter few tasks match may read the whole table).
SEARCH_TIMEOUT_MS = 100
#: Ids a dry run lists before "...".
PREVIEW_IDS = 50
#: Quota audit rows shown, newest first.
AUDIT_ROWS = 50
#: How often the pages' live parts poll their fragment (ms).
POLL_MS = 2000


def environment() -> jinja2.Environment:
    """The templates, from the package; autoescaping on for every template."""
    env = jinja2.Environment(loader=jinja2.PackageLoader("balancer.web", "templates"), autoescape=True,
                             undefined=jinja2.StrictUndefined, trim_blocks=True, lstrip_blocks=True)
    env.filters.update(formatting.FILTERS)
    return env


class Console:
    """The state behind the routes: services, the sampler, templates and the CSRF secret."""

    def __init__(self, services: Services, sampler: Sampler, csrf: Csrf | None = None) -> None:
        self.services, self.sampler = services, sampler
        self.csrf = csrf or Csrf()
        self.templates = environment()

    # -- rendering -------------------------------------------------------------------
    def page(self, request: Request, name: str, status: int = 200, **context: Any) -> HTMLResponse:
        nonce = Csrf.cookie_nonce(request.cookies)
        fresh = nonce is None
        nonce = nonce or Csrf.new_nonce()
        html = self.templates.get_template(name).render(
            csrf=self.csrf.token(nonce), poll_ms=POLL_MS, sampler_error=self.sampler.error, path=request.url.path,
            **context)
        response = HTMLResponse(html, status_code=status)
        if fresh:
            response.set_cookie(CSRF_COOKIE, nonce, httponly=True, samesite="strict", path="/")
        return response

    def fragment(self, name: str, **context: Any) -> HTMLResponse:
        return HTMLResponse(self.templates.get_template(name).render(**context))

    # -- what the pages show ---------------------------------------------------------
    def models_context(self) -> dict[str, Any]:
        sample = self.sampler.latest()
        rates = self.sampler.rates()

        def rate(field: str, *counters: str):  # noqa: ANN202
            return lambda s, prev: {r.name: per_minute(s, prev, r.name, *counters) if prev else 0.0 for r in s.rows}

        lines = {
            "in_flight": self.sampler.series(lambda s, prev: {r.name: float(r.in_flight) for r in s.rows}),
            "tokens": self.sampler.series(rate("tokens", "tokens_estimated")),
            "requests": self.sampler.series(rate("requests", "solved", "transient", "failed")),
        }
        models = []
        for r in sample.rows:
            tokens_pm, requests_pm = rates.get(r.name, (0.0, 0.0))
            models.append({
                "row": r, "tokens_pm": tokens_pm, "requests_pm": requests_pm,
                "spark": {k: charts.sparkline(v.get(r.name, [])) for k, v in lines.items()},
            })
        return {"sample": sample, "models": models, "history_s": self._history_s()}

    def drain_context(self) -> dict[str, Any]:
        sample = self.sampler.latest()
        history = self.sampler.history() or [sample]
        start = history[0].at
        blocked = sample.health.blocked is not None  # no projection to draw: nothing can run
        chart = charts.burn_down([(s.at - start, s.left) for s in history], None if blocked else sample.eta_s,
                                 band=(None, None) if blocked else (sample.eta_low_s, sample.eta_high_s))
        return {"sample": sample, "chart": chart, "history_s": self._history_s()}

    def sources_context(self) -> dict[str, Any]:
        sample = self.sampler.latest()
        other = sample.sources_other
        in_flight = sum(s.in_flight for s in sample.sources) + (other.in_flight if other else 0)
        return {"sample": sample, "sources": sample.sources, "in_flight": in_flight}

    def _history_s(self) -> float:
        history = self.sampler.history()
        return history[-1].at - history[0].at if len(history) > 1 else 0.0

    def actor(self, request: Request) -> str:
        """Who acts, for the audit: the basic-auth user (``bearer`` for a bearer token), else the OS user."""
        return f"web:{getattr(request.state, 'user', None) or default_actor()}"


def create_app(services: Services, *, token: str | None = None, sample_interval: float = 2.0,
               sampler: Sampler | None = None, bound: str = "127.0.0.1",
               allow_hosts: Iterable[str] = ()) -> tuple[Starlette, ASGIApp]:
    """The console (a Starlette app, its sampler started and stopped with it) and,
    with its guards (Host and Origin against ``bound`` and ``allow_hosts``, token,
    body size, headers) in front, what uvicorn serves."""
    console = Console(services, sampler or Sampler(services, sample_interval))

    def models(request: Request) -> Response:
        return console.page(request, "models.html", **console.models_context())

    def models_fragment(request: Request) -> Response:
        return console.fragment("_models.html", **console.models_context())

    def drain(request: Request) -> Response:
        return console.page(request, "drain.html", **console.drain_context())

    def drain_fragment(request: Request) -> Response:
        return console.fragment("_drain.html", **console.drain_context())

    def sources(request: Request) -> Response:
        return console.page(request, "sources.html", **console.sources_context())

    def sources_fragment(request: Request) -> Response:
        return console.fragment("_sources.html", **console.sources_context())

    def summary(request: Request) -> Response:
        sample = console.sampler.latest()
        return JSONResponse({"at": sample.at, **sample.counts, "eta_s": sample.eta_s,
                             "eta_low_s": sample.eta_low_s, "eta_high_s": sample.eta_high_s,
                             "waiting_on_budget": sample.waiting, "models": [r.as_dict() for r in sample.rows]})

    def task_search(request: Request) -> Response:
        params = dict(request.query_params)
        try:
            flt = forms.task_filter(params)
            rows = operations.list_tasks(services.engine, flt, limit=SEARCH_LIMIT, timeout_ms=SEARCH_TIMEOUT_MS)
            error = None
        except BalancerError as exc:
            rows, error = [], str(exc)
        except sqlalchemy.exc.OperationalError as exc:
            if not isinstance(exc.orig, psycopg2.errors.QueryCanceled):
                raise
            rows, error = [], (f"the search did not finish in {SEARCH_TIMEOUT_MS} ms: few tasks match it in a large "
                               "backlog; narrow it with a status, a source or a time range")
        groups = console.sampler.latest().error_groups
        return console.page(request, "tasks.html", status=400 if error else 200, rows=rows, groups=groups,
                            params=params, error=error, query=urlencode({k: v for k, v in params.items() if v}),
                            statuses=TASK_STATUSES, limit=SEARCH_LIMIT)

    def task_detail(request: Request) -> Response:
        task_id = request.path_params["task_id"]
        row = operations.get_task(services.engine, task_id) if task_id < 2**63 else None
        if row is None:
            return console.page(request, "error.html", status=404, error=f"no task {task_id}")
        return console.page(request, "task.html", task=row._mapping)

    def preview(request: Request) -> Response:
        action = request.path_params["action"]
        try:
            flt = forms.task_filter(dict(request.query_params))
            ids = _act(action)(services.engine, flt, by=console.actor(request), apply=False)
        except BalancerError as exc:
            return console.page(request, "error.html", status=400, error=str(exc))
        return console.page(request, "confirm.html", action=action, ids=ids[:PREVIEW_IDS], count=len(ids),
                            hidden=forms.filter_params(flt))

    async def apply(request: Request) -> Response:
        action = request.path_params["action"]
        form = await _form(request)
        if not console.csrf.valid(Csrf.cookie_nonce(request.cookies), form.get("csrf")):
            return console.page(request, "error.html", status=403, error="the form's CSRF token is missing or stale: "
                                "reload the page and try again")
        try:
            flt = forms.task_filter(form)
            ids = await run_in_threadpool(_act(action), services.engine, flt, by=console.actor(request), apply=True)
        except BalancerError as exc:
            return console.page(request, "error.html", status=400, error=str(exc))
        if ids and action == "retry":
            await run_in_threadpool(_ask_for_dispatch)
        return console.page(request, "done.html", action=action, ids=ids[:PREVIEW_IDS], count=len(ids),
                            back="/tasks?" + urlencode(forms.filter_params(flt)))

    def quota_page(request: Request, status: int = 200, error: str | None = None, notice: str | None = None) -> Response:
        stored = services.quotas.all()
        history = services.quotas.history()[-AUDIT_ROWS:][::-1]
        return console.page(request, "quotas.html", status=status, quotas=stored, history=history, error=error,
                            notice=notice, fields=forms.QUOTA_FIELDS)

    async def quota_set(request: Request) -> Response:
        model = request.path_params["model"]
        form = await _form(request)
        if not console.csrf.valid(Csrf.cookie_nonce(request.cookies), form.get("csrf")):
            return await run_in_threadpool(quota_page, request, 403, "the form's CSRF token is missing or stale: "
                                           "reload the page and try again")
        try:
            changes = forms.quota_changes(form)
            old, new = await run_in_threadpool(services.quotas.set, model, changes, by=console.actor(request))
        except LiveNotUpdated as exc:
            return await run_in_threadpool(quota_page, request, 200, None, f"{model}: {exc}")
        except QuotaError as exc:
            return await run_in_threadpool(quota_page, request, 400, f"{model}: {exc}")
        notice = f"{model}: unchanged" if old == new else f"{model}: updated"
        return RedirectResponse("/quotas?" + urlencode({"notice": notice}), status_code=303)

    def quotas_notice(request: Request) -> Response:
        return quota_page(request, notice=request.query_params.get("notice"))

    async def healthz(request: Request) -> Response:
        return JSONResponse({"ok": True})

    routes = [
        Route("/", lambda request: RedirectResponse("/models", status_code=303)),
        Route("/models", models), Route("/fragments/models", models_fragment),
        Route("/drain", drain), Route("/fragments/drain", drain_fragment),
        Route("/sources", sources), Route("/fragments/sources", sources_fragment),
        Route("/api/summary", summary),
        Route("/tasks", task_search),
        Route("/tasks/{task_id:int}", task_detail),
        Route("/tasks/{action:str}", preview, methods=["GET"]),
        Route("/tasks/{action:str}", apply, methods=["POST"]),
        Route("/quotas", quotas_notice, methods=["GET"]),
        Route("/quotas/{model:str}", quota_set, methods=["POST"]),
        Route("/healthz", healthz),
        Mount("/static", StaticFiles(packages=[("balancer.web", "static")]), name="static"),
    ]

    @contextlib.asynccontextmanager
    async def lifespan(app: Starlette) -> AsyncIterator[None]:
        console.sampler.start()
        try:
            yield
        finally:
            await run_in_threadpool(console.sampler.stop)

    async def not_found(request: Request, exc: Exception) -> Response:
        # Any unknown address (and a missing task) is a page with the navigation, not Starlette's bare text.
        return console.page(request, "error.html", status=404, error=f"no page at {request.url.path}")

    app = Starlette(routes=routes, lifespan=lifespan, exception_handlers={404: not_found})
    app.state.console = console
    guarded: ASGIApp = SecurityHeaders(BodyLimit(app, MAX_BODY_BYTES))
    if token:
        guarded = TokenGuard(guarded, token)
    return app, HostGuard(guarded, bound, allow_hosts)


def _act(action: str) -> Any:
    if action == "retry":
        return operations.retry_failed_or_cancelled
    if action == "cancel":
        return operations.cancel_pending
    raise BalancerError(f"unknown action {action!r}: retry or cancel")


async def _form(request: Request) -> dict[str, str]:
    """An ``application/x-www-form-urlencoded`` body (the router's body limit caps it) as a dict."""
    body = await request.body()
    return dict(parse_qsl(body.decode("utf-8", "replace"), keep_blank_values=True))


def _ask_for_dispatch() -> None:
    """Ask the dispatcher to take retried tasks now (best effort, as ``balancer tasks retry`` does)."""
    try:
        from balancer.pipeline.tasks import trigger_dispatch

        trigger_dispatch()
    except Exception as exc:  # noqa: BLE001 - the tasks are pending; the dispatcher's next tick takes them
        log.warning("could not ask for a dispatch now (%s); the next tick takes the retried tasks", type(exc).__name__)


__all__ = ["Console", "Sample", "create_app"]
