"""tests/durations_file.py's ``--overlap``: what the other worker ran while a test ran (issue 51: a test slow
only inside the full suite is found by what was beside it)."""

from __future__ import annotations

from durations_file import by_file, overlapping


def test_the_tests_of_the_other_worker_that_overlapped_a_test_are_listed_longest_first() -> None:
    table = {
        "a.py::slow": [40.0, 80.0, 100.0, 140.0, "gw0"],
        "a.py::quick": [1.0, 1.0, 140.0, 141.0, "gw0"],
        "b.py::long": [30.0, 30.0, 90.0, 120.0, "gw1"],
        "b.py::late": [25.0, 25.0, 120.0, 145.0, "gw1"],
        "b.py::before": [5.0, 5.0, 80.0, 85.0, "gw1"],
    }
    found = overlapping(table, "a.py::")
    assert found[0] == ("a.py::slow", [("b.py::long", 20.0), ("b.py::late", 20.0)])
    assert found[1:] == [("a.py::quick", [("b.py::late", 1.0)])]
    assert overlapping({"old.py::t": [1.0, 2.0]}, "old") == []  # a file written before the spans: none
    assert by_file(table)[0][:2] == ("b.py", 60.0)


def test_a_file_costs_its_tests_wall_less_their_waits_for_core_slots() -> None:
    table = {
        "a.py::waited": [40.0, 10.0, 0.0, 40.0, "gw0", 30.0],
        "a.py::old": [5.0, 5.0, 40.0, 45.0, "gw0"],  # written before the waits were kept: all its own
        "b.py::t": [20.0, 20.0, 0.0, 20.0, "gw1", 0.0],
    }
    rows = {row[0]: row for row in by_file(table)}
    assert rows["a.py"][1] == 45.0 and rows["a.py"][4] == 15.0
    assert rows["b.py"][4] == 20.0
