"""What quotas and sources share: the audit table's shape and its rows (``storage/audit.py``),
and a set declared in TOML, stored and audited (``storage/declared.py``), on hand-made cases."""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import pytest
import sqlalchemy as sa
from sqlalchemy.engine import Connection

from balancer.storage import audit
from balancer.storage.declared import ImportSummary, import_set, plan

# -- plan: pure ------------------------------------------------------------------------------


@pytest.mark.parametrize(("current", "wanted", "whole", "expected"), [
    ({}, {}, True, ImportSummary()),
    ({}, {"b": 1, "a": 1}, False, ImportSummary(created=["a", "b"])),
    ({"a": 1, "b": 2}, {}, True, ImportSummary(removed=["a", "b"])),
    ({"a": 1, "b": 2}, {}, False, ImportSummary()),
    ({"a": 1, "b": 2, "c": 3}, {"a": 1, "b": 9, "d": 4}, True,
     ImportSummary(created=["d"], updated=["b"], removed=["c"], unchanged=["a"])),
    ({"a": 1, "b": 2, "c": 3}, {"a": 1, "b": 9, "d": 4}, False,
     ImportSummary(created=["d"], updated=["b"], unchanged=["a"])),
    ({"a": None}, {"a": None}, True, ImportSummary(unchanged=["a"])),  # a value that is falsy is still there
])
def test_plan_says_name_by_name_what_an_import_does(current: dict[str, Any], wanted: dict[str, Any], whole: bool,
                                                      expected: ImportSummary) -> None:
    assert plan(current, wanted, whole=whole) == expected


def test_plan_reads_its_inputs_only() -> None:
    current, wanted = {"a": 1, "b": 2}, {"b": 3}
    plan(current, wanted, whole=True)
    assert (current, wanted) == ({"a": 1, "b": 2}, {"b": 3})


# -- the audit table and an import, on a kind made for the test -------------------------------

metadata = sa.MetaData()
things = sa.Table("things", metadata, sa.Column("name", sa.Text, primary_key=True), sa.Column("size", sa.Integer))
thing_changes = audit.audit_table("thing_changes", "thing", metadata)


@dataclass(frozen=True)
class Thing:
    name: str
    size: int

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


class Things:
    """A kind with a rule of its own (no size over 100) and a setting on every one listed."""

    table, changes, created = things, thing_changes, "add"
    lock = sa.text("LOCK TABLE things IN SHARE ROW EXCLUSIVE MODE")

    def __init__(self) -> None:
        self.settled: list[str] = []

    def read(self, conn: Connection) -> dict[str, Thing]:
        return {r.name: Thing(r.name, r.size) for r in conn.execute(sa.select(things))}

    def refuse(self, conn: Connection, summary: ImportSummary, current: Mapping[str, Thing],
               wanted: Mapping[str, Thing]) -> None:
        if any(t.size > 100 for t in wanted.values()):
            raise ValueError("too big")

    def write(self, conn: Connection, old: Thing | None, new: Thing | None, *, by: str) -> dict[str, Any]:
        if new is None and old is not None:
            conn.execute(sa.delete(things).where(things.c.name == old.name))
            return {"why": "not listed"}
        if new is not None and old is None:
            conn.execute(sa.insert(things).values(**new.as_dict()))
            return {}
        if new is not None:
            conn.execute(sa.update(things).where(things.c.name == new.name).values(size=new.size))
        return {}

    def settle(self, conn: Connection, old: Thing | None, new: Thing, *, by: str) -> None:
        self.settled.append(new.name)


@pytest.fixture
def engine(database_url: str) -> Iterator[sa.Engine]:
    engine = sa.create_engine(database_url)
    metadata.create_all(engine)
    yield engine
    engine.dispose()


def history(engine: sa.Engine) -> list[tuple[str, str, str, Any, Any]]:
    with engine.connect() as conn:
        return [(r["thing"], r["changed_by"], r["action"], r["old_value"], r["new_value"])
                for r in audit.history(conn, thing_changes)]


def stored(engine: sa.Engine) -> dict[str, Thing]:
    with engine.connect() as conn:
        return Things().read(conn)


def test_the_audit_table_has_the_shape_of_quota_changes_with_its_own_subject() -> None:
    from balancer.storage.schema import quota_changes, source_changes

    def shape(table: sa.Table) -> list[tuple[str, str, bool, bool]]:
        return [(c.name, repr(c.type), c.nullable, c.primary_key) for c in table.columns]

    assert [c.name for c in thing_changes.columns] == ["id", "thing", "changed_at", "changed_by", "action",
                                                       "old_value", "new_value"]
    assert audit.subject_of(thing_changes) is thing_changes.c.thing
    renamed = [("model", *rest[1:]) if rest[0] == "thing" else rest for rest in shape(thing_changes)]
    assert renamed == shape(quota_changes)
    assert [(("source", *s[1:]) if s[0] == "model" else s) for s in shape(quota_changes)] == shape(source_changes)


def test_an_import_applies_each_change_with_one_audit_row_and_reports_them(engine: sa.Engine) -> None:
    with engine.begin() as conn:
        first = import_set(conn, Things(), [Thing("a", 1), Thing("b", 2)], by="ops", whole=True)
    assert first == ImportSummary(created=["a", "b"])
    kind = Things()
    with engine.begin() as conn:
        second = import_set(conn, kind, [Thing("b", 3), Thing("a", 1), Thing("c", 4)], by="eve", whole=False)
    assert second == ImportSummary(created=["c"], updated=["b"], unchanged=["a"])
    assert kind.settled == ["a", "b", "c"]  # every one listed, changed or not
    with engine.begin() as conn:
        third = import_set(conn, Things(), [Thing("c", 4)], by="ops", whole=True)
    assert third == ImportSummary(removed=["a", "b"], unchanged=["c"])
    assert stored(engine) == {"c": Thing("c", 4)}
    assert history(engine) == [
        ("a", "ops", "add", None, {"name": "a", "size": 1}),
        ("b", "ops", "add", None, {"name": "b", "size": 2}),
        ("b", "eve", "update", {"name": "b", "size": 2}, {"name": "b", "size": 3}),
        ("c", "eve", "add", None, {"name": "c", "size": 4}),
        ("a", "ops", "remove", {"name": "a", "size": 1}, {"why": "not listed"}),
        ("b", "ops", "remove", {"name": "b", "size": 3}, {"why": "not listed"}),
    ]
    with engine.connect() as conn:
        assert [r["action"] for r in audit.history(conn, thing_changes, "b")] == ["add", "update", "remove"]
        added = audit.last(conn, thing_changes, "b", "add")
        assert added is not None and added.new_value == {"name": "b", "size": 2}
        assert audit.last(conn, thing_changes, "c", "remove") is None
        last = {r.thing: r.action for r in conn.execute(audit.last_per_subject(thing_changes))}
        updates = conn.execute(audit.last_per_subject(thing_changes, thing_changes.c.action != "remove")).all()
    assert last == {"a": "remove", "b": "remove", "c": "add"}
    assert {r.thing: r.changed_by for r in updates} == {"a": "ops", "b": "eve", "c": "eve"}


def test_a_dry_run_or_a_refused_import_writes_nothing(engine: sa.Engine) -> None:
    with engine.begin() as conn:
        import_set(conn, Things(), [Thing("a", 1)], by="ops", whole=True)
    before = history(engine), stored(engine)
    with engine.begin() as conn:
        summary = import_set(conn, Things(), [Thing("b", 2)], by="ops", whole=True, dry_run=True)
    assert summary == ImportSummary(created=["b"], removed=["a"])
    with pytest.raises(ValueError, match="too big"), engine.begin() as conn:
        import_set(conn, Things(), [Thing("a", 2), Thing("z", 101)], by="ops", whole=True)
    assert (history(engine), stored(engine)) == before


def test_record_writes_who_changed_what_old_and_new_in_the_callers_transaction(engine: sa.Engine) -> None:
    with engine.begin() as conn:
        audit.record(conn, thing_changes, "a", by="ops", action="resize", old={"size": 1}, new={"size": 2})
        audit.record(conn, thing_changes, "a", by="ops", action="note")
    with pytest.raises(RuntimeError), engine.begin() as conn:
        audit.record(conn, thing_changes, "a", by="eve", action="resize")
        raise RuntimeError  # rolled back with the caller's transaction
    assert history(engine) == [("a", "ops", "resize", {"size": 1}, {"size": 2}), ("a", "ops", "note", None, None)]
    with engine.connect() as conn:
        row = audit.history(conn, thing_changes)[0]
    assert row["changed_at"] is not None and row["changed_at"].tzinfo is not None


def test_default_actor_is_a_name() -> None:
    assert audit.default_actor().strip()


def test_read_declared_names_the_file_in_each_failure(tmp_path: Path) -> None:
    from balancer.cli.import_export import read_declared
    from balancer.errors import BalancerError, QuotaError

    def parse(text: str) -> list[str]:
        if "bad" in text:
            raise BalancerError("line 2: bad")
        return text.split()

    good, bad, latin = tmp_path / "good.toml", tmp_path / "bad.toml", tmp_path / "latin.toml"
    good.write_text("a b")
    bad.write_text("a\nbad")
    latin.write_bytes(b"caf\xe9")
    assert read_declared(good, parse) == (str(good), ["a", "b"])
    with pytest.raises(QuotaError, match=r"bad\.toml: line 2: bad$"):
        read_declared(bad, parse, QuotaError)
    with pytest.raises(BalancerError, match=r"latin\.toml: not UTF-8 text \(byte 3\)"):
        read_declared(latin, parse)
    with pytest.raises(BalancerError, match="cannot read"):
        read_declared(tmp_path / "missing.toml", parse)
