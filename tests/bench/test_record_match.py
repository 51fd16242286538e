"""Every committed whole-step GPU record against today's plan of its step
(benchmarks/record_match.py): docs/benchmarks.md's table is the records against the committed
plans, every record's step has a plan, and a changed figure is caught."""

from __future__ import annotations

import json

from benchmarks import record_match


def test_every_record_s_step_is_planned() -> None:
    plans = json.loads(record_match.PLANS.read_text())["plans"]
    steps = {record_match.step_key(rec) for _, rec in record_match.records()}
    assert len(record_match.records()) > 40  # every folder's whole steps
    assert steps == set(plans)


def test_the_page_s_table_is_the_records_against_the_plans() -> None:
    assert record_match.main([]) == 0


def test_a_changed_plan_is_caught() -> None:
    plans = json.loads(record_match.PLANS.read_text())["plans"]
    table = record_match.render(plans)
    key = next(iter(plans))
    changed = {**plans, key: {**plans[key], "reserved_mib": plans[key]["reserved_mib"] * 1.1}}
    assert record_match.render(changed) != table
    assert table in record_match.PAGE.read_text()
