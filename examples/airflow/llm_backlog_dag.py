"""Airflow DAGs for the prompt backlog, on balancer.

``llm_backlog_router``: the existing DAG's shape, but each mapped worker asks
the router for a model per call instead of sending fixed batches of 10, and
the number of workers follows the router's advice instead of a fixed 20.

``llm_backlog_pipeline``: hand the whole backlog to the Celery pipeline.

Set the Airflow Variables ``balancer_router_url``, ``models_backend_url``
and, if the router is not on loopback, ``balancer_router_token``. The SQL
assumes the users' own ``tasks`` table (id, prompt, status, answer).
"""

from __future__ import annotations

import pendulum
from airflow.decorators import dag, task
from airflow.models import Variable
from airflow.providers.postgres.hooks.postgres import PostgresHook
from router_tasks import hand_to_pipeline, solve_with_router


def _unsolved(limit: int = 10_000) -> list[tuple[int, str]]:
    hook = PostgresHook(postgres_conn_id="backlog")
    return hook.get_records("SELECT id, prompt FROM tasks WHERE status = 'unsolved' ORDER BY id LIMIT %s", (limit,))


@dag(schedule="@hourly", start_date=pendulum.datetime(2026, 1, 1), catchup=False, max_active_runs=1)
def llm_backlog_router():
    @task
    def split() -> list[list[tuple[int, str]]]:
        from balancer.client import RouterClient

        rows = _unsolved()
        with RouterClient(Variable.get("balancer_router_url"), token=Variable.get("balancer_router_token", None)) as c:
            workers = max(1, c.advice()["suggested_parallelism"])
        return [rows[i::workers] for i in range(workers) if rows[i::workers]]

    @task(execution_timeout=pendulum.duration(hours=2))
    def solve(rows: list[tuple[int, str]]) -> int:
        results = solve_with_router(
            [prompt for _, prompt in rows], Variable.get("balancer_router_url"), Variable.get("models_backend_url"),
            token=Variable.get("balancer_router_token", None), parallelism=1,
        )
        hook = PostgresHook(postgres_conn_id="backlog")
        for (task_id, _), result in zip(rows, results, strict=True):
            hook.run("UPDATE tasks SET answer = %s, status = 'solved' WHERE id = %s", parameters=(result["answer"], task_id))
        return len(results)

    solve.expand(rows=split())


@dag(schedule="@hourly", start_date=pendulum.datetime(2026, 1, 1), catchup=False, max_active_runs=1)
def llm_backlog_pipeline():
    @task
    def submit() -> str:
        return hand_to_pipeline([prompt for _, prompt in _unsolved()])

    submit()


llm_backlog_router()
llm_backlog_pipeline()
