"""``mesh log`` filters: time parsing, the journal query, and the live feed's bindings."""

from __future__ import annotations

import itertools
from datetime import UTC, datetime
from pathlib import Path

import orjson
import pytest

from mesh.cli import LogFilter, build_parser, cmd_log, parse_duration, parse_when
from mesh.manager.journal import SqliteJournal
from mesh.wire.events import OrchestrationEvent

from .samples import EVENT_DETAIL_SAMPLES

NOW = 1_764_500_000.0  # 2025-11-30T10:53:20Z


# ---- durations and timestamps ----------------------------------------------------------------


@pytest.mark.parametrize(
    ("text", "seconds"),
    [
        ("30s", 30.0),
        ("10m", 600.0),
        ("2h", 7200.0),
        ("1d", 86400.0),
        ("1w", 604800.0),
        ("250ms", 0.25),
        ("1h30m", 5400.0),
        ("1.5h", 5400.0),
        (" 2H ", 7200.0),
    ],
)
def test_a_duration_is_a_number_and_a_unit_or_a_sum_of_them(text: str, seconds: float) -> None:
    assert parse_duration(text) == pytest.approx(seconds)


@pytest.mark.parametrize("text", ["", "10", "10x", "m", "1h 30m", "-5m", "10m ago", "1e3s"])
def test_anything_else_is_not_a_duration(text: str) -> None:
    with pytest.raises(ValueError, match="not a duration"):
        parse_duration(text)


def test_a_relative_time_is_that_long_before_now() -> None:
    assert parse_when("10m", now=NOW) == NOW - 600
    assert parse_when("30s", now=NOW) == NOW - 30


def test_an_iso_timestamp_with_an_offset_is_that_instant() -> None:
    assert parse_when("2025-11-30T10:53:20Z", now=0) == NOW
    assert parse_when("2025-11-30T11:53:20+01:00", now=0) == NOW
    assert parse_when("2025-11-30T10:53:20.500+00:00", now=0) == NOW + 0.5


def test_an_iso_timestamp_without_an_offset_is_local_time_as_the_log_prints_it() -> None:
    assert (
        parse_when("2025-11-30 10:53:20", now=0) == datetime(2025, 11, 30, 10, 53, 20).timestamp()
    )
    assert parse_when("2025-11-30", now=0) == datetime(2025, 11, 30).timestamp()


def test_a_clock_time_is_today_in_local_time() -> None:
    today = datetime.fromtimestamp(NOW).date()

    assert (
        parse_when("9:05", now=NOW)
        == datetime(today.year, today.month, today.day, 9, 5).timestamp()
    )
    assert parse_when("13:05:30", now=NOW) == (
        datetime(today.year, today.month, today.day, 13, 5, 30).timestamp()
    )


@pytest.mark.parametrize("text", ["yesterday", "10", "2025-13-01", "25:00", "10 minutes"])
def test_a_bad_time_names_both_forms_it_could_have_been(text: str) -> None:
    with pytest.raises(ValueError, match=r"neither a duration .* nor an ISO-8601 timestamp"):
        parse_when(text, now=NOW)


# ---- the journal query -----------------------------------------------------------------------


def _event(
    at: float, kind: str, agent_id: str = "", capability: str | None = None
) -> OrchestrationEvent:
    detail = EVENT_DETAIL_SAMPLES[kind]
    return OrchestrationEvent(
        at=at, kind=kind, agent_id=agent_id, capability=capability, detail=detail
    )


EVENTS = [
    _event(NOW - 3600, "manager_started"),
    _event(NOW - 3000, "registered", "calc-1", None),
    _event(NOW - 2900, "ready", "calc-1", None),
    _event(NOW - 2800, "capability_available", "calc-1", "calc.add"),
    _event(NOW - 1200, "acquired", "calc-1", "calc.add"),
    _event(NOW - 1100, "acquired", "text-1", "text.stats"),
    _event(NOW - 600, "admission"),
    _event(NOW - 500, "released", "calc-1", "calc.add"),
    _event(NOW - 60, "lost", "text-1", None),
    _event(NOW - 30, "acquired", "calc-1", "calc.add"),
    _event(NOW - 10, "admission"),
]


@pytest.fixture
def journal() -> SqliteJournal:
    store = SqliteJournal(":memory:")
    store.append_many(EVENTS)
    return store


def _kinds(events: list[OrchestrationEvent]) -> list[tuple[str, str]]:
    return [(e.kind, e.agent_id) for e in events]


def test_the_query_combines_every_filter_and_returns_the_newest_matches_oldest_first(
    journal: SqliteJournal,
) -> None:
    found = journal.query(
        agent_id="calc-1",
        capability="calc.add",
        kinds=["acquired", "released"],
        since=NOW - 1500,
        until=NOW - 30,  # half-open: the acquire at NOW - 30 is out
    )

    assert [e.at for e in found] == [NOW - 1200, NOW - 500]
    assert all(e.seq is not None for e in found)


def test_the_limit_keeps_the_newest_matches(journal: SqliteJournal) -> None:
    assert [e.at for e in journal.query(kinds=["acquired"], limit=2)] == [NOW - 1100, NOW - 30]
    assert len(journal.query(limit=None)) == len(EVENTS)


def test_an_empty_agent_id_selects_the_entries_about_no_agent(journal: SqliteJournal) -> None:
    assert _kinds(journal.query(agent_id="")) == [
        ("manager_started", ""),
        ("admission", ""),
        ("admission", ""),
    ]


def test_tail_is_unchanged_for_its_callers(journal: SqliteJournal) -> None:
    assert journal.tail(3) == journal.query(limit=3)
    assert _kinds(journal.tail(2, agent_id="text-1")) == [
        ("acquired", "text-1"),
        ("lost", "text-1"),
    ]
    assert journal.tail(50, agent_id="") == journal.query(limit=50)  # "" meant "any" to tail


def test_the_journal_query_and_the_live_feed_filter_agree(journal: SqliteJournal) -> None:
    agents = [None, "", "calc-1", "text-1"]
    capabilities = [None, "calc.add"]
    kind_sets: list[tuple[str, ...]] = [(), ("acquired",), ("admission", "lost")]
    windows = [(None, None), (NOW - 1200, None), (None, NOW - 500), (NOW - 1200, NOW - 30)]
    for agent, capability, kinds, (since, until) in itertools.product(
        agents, capabilities, kind_sets, windows
    ):
        flt = LogFilter(agent, capability, kinds, since, until)
        expected = [e.at for e in EVENTS if flt.matches(e)]
        assert [e.at for e in flt.query(journal, None)] == expected, flt


def test_the_query_is_parameterised(journal: SqliteJournal) -> None:
    assert journal.query(agent_id="calc-1' OR '1'='1") == []
    assert journal.query(kinds=["x') OR ('1'='1"]) == []


def test_a_query_by_agent_walks_the_agent_index(tmp_path: Path) -> None:
    store = SqliteJournal(tmp_path / "journal.sqlite3")
    plan = store._db.execute(
        "EXPLAIN QUERY PLAN SELECT seq FROM orchestration_log WHERE agent_id = ?"
        " AND kind IN (?) ORDER BY seq DESC LIMIT ?",
        ("calc-1", "acquired", 5),
    ).fetchall()
    store.close()

    assert any("orchestration_log_agent" in str(row) for row in plan), plan


# ---- the live feed's bindings ----------------------------------------------------------------


@pytest.mark.parametrize(
    ("flt", "keys"),
    [
        (LogFilter(), ("log.#",)),
        (LogFilter(agent_id="calc-1"), ("log.calc-1.#",)),
        (LogFilter(agent_id=""), ("log.-.#",)),
        (LogFilter(kinds=("lost", "admission")), ("log.*.lost", "log.*.admission")),
        (LogFilter(agent_id="calc-1", kinds=("lost",)), ("log.calc-1.lost",)),
        (LogFilter(agent_id="", kinds=("admission",)), ("log.-.admission",)),
        (LogFilter(capability="calc.add", since=NOW), ("log.#",)),  # not in the key
        (LogFilter(agent_id="a.b", kinds=("lost",)), ("log.*.lost",)),  # not one word
        (LogFilter(agent_id="calc-1", kinds=("lost", "#")), ("log.calc-1.#",)),
    ],
)
def test_the_live_feed_binds_the_narrowest_keys_the_routing_key_allows(
    flt: LogFilter, keys: tuple[str, ...]
) -> None:
    assert flt.binding_keys() == keys


# ---- the command -----------------------------------------------------------------------------


def _log(*argv: str) -> int:
    return cmd_log(build_parser().parse_args(["log", *argv]))


@pytest.fixture
def journal_file(tmp_path: Path) -> Path:
    path = tmp_path / "journal.sqlite3"
    store = SqliteJournal(path)
    store.append_many(e.model_copy(update={"at": e.at - NOW + 1e9}) for e in EVENTS)
    store.close()
    return path


def test_mesh_log_prints_json_lines_of_the_filtered_entries(
    journal_file: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    code = _log("--journal", str(journal_file), "--kind", "acquired", "--kind", "lost",
                "--agent", "text-1", "--json")  # fmt: skip

    out = capsys.readouterr().out.splitlines()
    assert code == 0
    assert [(d["kind"], d["agent_id"]) for d in map(orjson.loads, out)] == [
        ("acquired", "text-1"),
        ("lost", "text-1"),
    ]
    assert OrchestrationEvent.model_validate_json(out[0]).seq == 6


def test_mesh_log_limit_zero_means_every_entry(
    journal_file: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert _log("--journal", str(journal_file), "--limit", "0") == 0
    assert len(capsys.readouterr().out.splitlines()) == len(EVENTS)
    assert _log("--journal", str(journal_file), "-n", "2", "--capability", "calc.add") == 0
    assert len(capsys.readouterr().out.splitlines()) == 2


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (("--since", "10x"), "mesh log: --since: '10x' is neither a duration"),
        (("--until", "tomorrow"), "mesh log: --until: 'tomorrow' is neither a duration"),
        (("--since", "5m", "--until", "1h"), "mesh log: --since 5m is not before --until 1h"),
        (("-f", "--until", "1m"), "mesh log: --until is already past"),
    ],
)
def test_a_bad_time_is_one_line_on_stderr_and_exit_code_2(
    journal_file: Path, capsys: pytest.CaptureFixture[str], argv: tuple[str, ...], message: str
) -> None:
    code = _log("--journal", str(journal_file), *argv)

    err = capsys.readouterr().err
    assert code == 2
    assert err.startswith(message) and err.count("\n") == 1, err
    assert "Traceback" not in err


def test_a_negative_limit_is_refused_by_the_parser(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exit_:
        build_parser().parse_args(["log", "--limit", "-1"])
    assert exit_.value.code == 2
    assert "'-1' is negative" in capsys.readouterr().err


def test_the_timestamps_the_cli_accepts_round_trip_what_json_output_carries() -> None:
    at = datetime(2025, 11, 30, 10, 53, 20, 250_000, tzinfo=UTC)
    assert parse_when(at.isoformat(), now=0) == at.timestamp()


def test_mesh_log_finds_the_demos_journal_when_the_default_has_none(
    journal_file: Path,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    monkeypatch.delenv("MESH_JOURNAL", raising=False)
    monkeypatch.chdir(tmp_path)
    demo = tmp_path / ".mesh" / "demo" / "orchestration.sqlite3"
    demo.parent.mkdir(parents=True)
    journal_file.rename(demo)

    code = _log("--kind", "lost", "--json")

    captured = capsys.readouterr()
    assert code == 0 and "mesh demo's journal" in captured.err
    assert [orjson.loads(line)["kind"] for line in captured.out.splitlines()] == ["lost"]
    assert _log("--journal", "elsewhere.sqlite3") == 1  # a path given is never swapped


def test_a_kind_the_journal_never_held_is_said_not_silently_matched(
    journal_file: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert _log("--journal", str(journal_file), "--kind", "nonsense") == 1
    assert "no entry of kind 'nonsense'" in capsys.readouterr().err
    # A kind the journal holds, filtered down to nothing by the rest, is a normal empty answer.
    assert _log("--journal", str(journal_file), "--kind", "lost", "--agent", "nobody") == 0
    assert capsys.readouterr().err == ""
