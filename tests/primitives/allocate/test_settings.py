"""A stage's ``allocation`` argument parsed into settings, and the refusals (one line each)."""

from __future__ import annotations

import pytest

from slimkit.primitives.allocate import LEVEL_LADDERS, GlobalSettings, SearchSettings, parse_allocation


def test_the_forms_parse():
    assert parse_allocation("uniform") == "uniform"
    assert parse_allocation("global") == GlobalSettings()
    assert parse_allocation({"global": {"max_fraction": 0.5}}).max_fraction == 0.5
    search = parse_allocation({"search": {"budget_s": 30, "levels": [0, 0.25, 0.5]}})
    assert isinstance(search, SearchSettings) and search.ladder() == (0, 0.25, 0.5)
    assert parse_allocation({"search": None}).ladder() == LEVEL_LADDERS["tenths"]
    assert LEVEL_LADDERS["tenths"][:3] == (0.0, 0.1, 0.2) and len(LEVEL_LADDERS["twentieths"]) == 20


@pytest.mark.parametrize(
    ("value", "fragment"),
    [
        ("evolution", "unknown allocation 'evolution'"),
        ({"search": {"budget_s": 0}}, "search.budget_s: must be > 0 seconds"),
        ({"search": {"levels": "halves"}}, "search.levels: unknown level ladder 'halves'"),
        ({"search": {"levels": [0.1, 0.2]}}, "must start at 0 and increase"),
        ({"search": {"levels": [0, 1.0]}}, "levels must be below 1"),
        ({"global": {"ratio": 0.2}}, "global: unknown field 'ratio'"),
        ({"global": {}, "search": {}}, "give one of uniform"),
    ],
)
def test_bad_allocations_are_refused_in_one_line(value, fragment):
    with pytest.raises(ValueError) as refused:
        parse_allocation(value)
    assert fragment in str(refused.value) and "\n" not in str(refused.value)
