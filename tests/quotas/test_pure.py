"""Pure logic, no servers: settings, the quota value, the quota file."""

from __future__ import annotations

import doctest

import pytest
from hypothesis import given
from hypothesis import strategies as st

import balancer.admission.quota
import balancer.quotas.file
import balancer.settings
from balancer.admission.quota import MAX_CONCURRENCY, MAX_LIMIT, Quota
from balancer.errors import ConfigError, QuotaError
from balancer.quotas.file import format_quota_file, parse_quota_file
from balancer.settings import Settings
from balancer.urls import mask_url, normalize_database_url


@pytest.mark.parametrize("module", [balancer.settings, balancer.admission.quota, balancer.quotas.file])
def test_doctests(module: object) -> None:
    assert doctest.testmod(module).failed == 0  # type: ignore[arg-type]


@pytest.mark.parametrize(
    "url, expected",
    [
        ("postgresql://u:p@h:5432/db", "postgresql+psycopg2://u:p@h:5432/db"),
        ("postgres://h/db", "postgresql+psycopg2://h/db"),
        ("postgresql+psycopg2://h/db?options=-csearch_path%3Dx", "postgresql+psycopg2://h/db?options=-csearch_path%3Dx"),
    ],
)
def test_plain_postgresql_url_uses_psycopg2(url: str, expected: str) -> None:
    assert normalize_database_url(url) == expected
    import sqlalchemy as sa

    assert sa.create_engine(normalize_database_url(url)).dialect.driver == "psycopg2"


def test_bad_urls_are_config_errors_with_masked_password(monkeypatch: pytest.MonkeyPatch) -> None:
    with pytest.raises(ConfigError) as err:
        normalize_database_url("mysql://root:hunter2@h/db")
    assert "hunter2" not in str(err.value) and "***" in str(err.value)
    monkeypatch.setenv("BALANCER_REDIS_URL", "http://x:hunter2@h")
    with pytest.raises(ConfigError) as err:
        Settings.from_env()
    assert "hunter2" not in str(err.value) and "BALANCER_REDIS_URL" in str(err.value)


def test_unknown_backend_kind(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("BALANCER_BACKEND_KIND", "carrier-pigeon")
    with pytest.raises(ConfigError, match="BALANCER_BACKEND_KIND"):
        Settings.from_env()


def test_every_balancer_variable_the_code_names_is_a_declared_setting() -> None:
    """Every ``BALANCER_*`` name in the package's code (and celeryconfig.py) is in
    ``ENVIRONMENT``, the list derived from the Settings fields: no setting is read
    that the list (and so the README check, docker-compose's check) does not know."""
    import re
    from pathlib import Path

    from balancer.settings import ENVIRONMENT

    root = Path(__file__).resolve().parents[2]
    sources = [*sorted((root / "balancer").rglob("*.py")), root / "celeryconfig.py"]
    named = {name for path in sources for name in re.findall(r"\bBALANCER_[A-Z0-9_]*[A-Z0-9]\b", path.read_text())}
    assert "BALANCER_END_GAME" in named and "BALANCER_MAX_HEDGES" in ENVIRONMENT  # the scan sees the code
    assert named - set(ENVIRONMENT) == set()


def test_every_declared_setting_is_read_from_its_variable(monkeypatch: pytest.MonkeyPatch) -> None:
    """A value that is no valid setting, in each variable of ``ENVIRONMENT`` in turn,
    is either taken as it is (a text setting) or refused, naming that variable."""
    from dataclasses import fields

    from balancer.settings import ENVIRONMENT, variable

    assert set(ENVIRONMENT) == {variable(f.name) for f in fields(Settings)}
    default = Settings.from_env()
    for f in fields(Settings):
        with monkeypatch.context() as env:
            env.setenv(variable(f.name), "no~such~value")
            try:
                value = getattr(Settings.from_env(), f.name)
            except ConfigError as exc:
                assert variable(f.name) in str(exc)
            else:
                assert value != getattr(default, f.name) and "no~such~value" in str(value), f.name


def test_mask_url_without_password_is_unchanged() -> None:
    assert mask_url("redis://127.0.0.1:6379/0") == "redis://127.0.0.1:6379/0"


@pytest.mark.parametrize("field", ["weight", "max_concurrent_requests", "max_tokens_per_minute", "burst_tokens"])
@pytest.mark.parametrize("value", [0, -1, 1.5, "3", True, MAX_LIMIT + 1])
def test_quota_rejects_bad_numbers(field: str, value: object) -> None:
    base = {"name": "m", "max_concurrent_requests": 1, "max_tokens_per_minute": 1}
    with pytest.raises(QuotaError):
        Quota(**{**base, field: value})


def test_on_disconnect_reads_its_old_name_finish_as_continue() -> None:
    assert Quota("m", 1, 10, on_disconnect="finish").on_disconnect == "continue"
    text = '[models.m]\nmax_concurrent_requests = 1\nmax_tokens_per_minute = 10\non_disconnect = "finish"\n'
    assert parse_quota_file(text)[0].on_disconnect == "continue"
    with pytest.raises(QuotaError, match="continue, stop"):
        Quota("m", 1, 10, on_disconnect="sometimes")


def test_burst_defaults_to_one_minute_of_tpm() -> None:
    assert Quota("m", 1, 4_000).burst == 4_000
    assert Quota("m", 1, 4_000, burst_tokens=10).burst == 10


quotas = st.lists(
    st.builds(
        Quota,
        name=st.from_regex(r"[A-Za-z0-9][A-Za-z0-9._-]{0,20}", fullmatch=True),
        max_concurrent_requests=st.integers(1, MAX_CONCURRENCY),
        max_tokens_per_minute=st.integers(1, MAX_LIMIT),
        weight=st.integers(1, 100),
        max_requests_per_minute=st.none() | st.integers(1, MAX_LIMIT),
        burst_tokens=st.none() | st.integers(1, MAX_LIMIT),
        enabled=st.booleans(),
    ),
    unique_by=lambda q: q.name,
)


@given(quotas)
def test_quota_file_round_trips(qs: list[Quota]) -> None:
    assert parse_quota_file(format_quota_file(qs)) == sorted(qs, key=lambda q: q.name)


@given(st.text(max_size=300))
def test_quota_file_parser_never_crashes(text: str) -> None:
    """Any input either parses or raises QuotaError: never another exception."""
    try:
        parse_quota_file(text)
    except QuotaError:
        pass


@given(st.lists(st.sampled_from([
    "[models.a]", "[models.\"b.c\"]", "max_concurrent_requests = 2", "max_tokens_per_minute = 10",
    "weight = 0", "weight = 'x'", "burst_tokens = -1", "enabled = 3", "x = 1", "[other]", "models = 1", "= 2",
])))
def test_quota_file_parser_fuzz_structured(lines: list[str]) -> None:
    try:
        parse_quota_file("\n".join(lines))
    except QuotaError as exc:
        assert str(exc)
