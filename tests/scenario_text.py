"""A bench scenario's TOML for a test: a standard small workload around the models it names."""

from __future__ import annotations


def scenario_text(name: str, models: str, *, seed: int = 1, time_scale: float = 1.0, tasks: int = 1) -> str:
    """The scenario ``name`` with ``models`` (its ``[[models]]`` tables, as TOML) and a workload of
    ``tasks`` short prompts on any model."""
    return f"""name = "{name}"
seed = {seed}
time_scale = {time_scale}
[workload]
tasks = {tasks}
prompt_tokens = {{ median = 300, p99 = 1500, min = 20, max = 3000 }}
output_tokens = {{ median = 150, p99 = 500, min = 16, max = 512 }}
pinned_fraction = 0.0
priorities = [0]
sources = ["s"]
{models}"""
