"""``mesh top``: the frame drawn from a status document, rendered to text without a terminal."""

from __future__ import annotations

import io
import time
from collections import Counter
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from threading import Thread
from typing import Any

import pytest
from rich.console import Console, RenderableType

from mesh.manager.metrics import QueueStat
from mesh.manager.observe import Observer
from mesh.top import StatusUnavailable, fetch_status, render, run_top, shard_line, status_url
from mesh.wire import StatusReply

from .builders import tally_of
from .samples import DESCRIPTOR, SAMPLES

NOW = 1_764_500_000.0
URL = "http://127.0.0.1:8090/"


def text_of(renderable: RenderableType) -> str:
    console = Console(record=True, width=120, file=io.StringIO())
    console.print(renderable)
    return console.export_text()


def document(**changes: Any) -> dict[str, Any]:
    """A status document shaped like ``Observer.document()``."""
    doc: dict[str, Any] = {
        "manager_id": "manager-1",
        "namespace": "mesh",
        "uptime_s": 3725.0,
        "management_ui": "http://127.0.0.1:15672",
        "pools": [
            {
                "pool_id": "rag-eu",
                "descriptor_epoch": 3,
                "active_epoch": 3,
                "expires_at": NOW + 1800,
                "capabilities": ["rag.answer", "rag.search"],
                "agents": {"Ready": 2, "Busy": 1},
                "stage": "PAUSE_BATCH",
            },
            {
                "pool_id": "rag-us",
                "descriptor_epoch": 2,
                "active_epoch": 3,
                "expires_at": NOW - 90,
                "capabilities": ["rag.search"],
                "agents": {},
            },
        ],
        "agents": [
            {"agent_id": "rag-eu-1", "deployment": "rag-eu", "state": "Ready"},
            {"agent_id": "rag-eu-2", "deployment": "rag-eu", "state": "Ready"},
            {"agent_id": "rag-eu-3", "deployment": "rag-eu", "state": "Busy"},
            {"agent_id": "calc-1", "deployment": "calc", "state": "Draining"},
        ],
        "capabilities": [
            {"capability": "calc.add", "in_flight": 0, "capacity": 0, "agents": 1},
            {"capability": "rag.search", "in_flight": 9, "capacity": 10, "agents": 3},
        ],
        "queues": [
            {"name": f"mesh.agent.q{i}.tasks", "messages": i, "oldest_age_s": None}
            for i in range(12)
        ]
        + [{"name": "mesh.agent.rag-eu-3.tasks", "messages": 250, "oldest_age_s": 42.0}],
        "reservations": [],
        "recent_refusals": [
            {
                "at": NOW - 4,
                "admission_id": "adm-77",
                "outcome": "deferred",
                "reason": "CAPACITY",
                "detail": "rag-eu/model_slots: 16 of 16 used",
            },
            {
                "at": NOW - 65,
                "admission_id": "adm-70",
                "outcome": "rejected",
                "reason": "NO_ELIGIBLE_POOL",
                "detail": "rag-us: region_allowed",
            },
        ],
        "history": [],
        "counters": {"admission.admitted": 120, "admission.rejected": 3, "admission.deferred": 9},
        "served_at": NOW - 1,
    }
    doc.update(changes)
    return doc


def lines_with(text: str, word: str) -> list[str]:
    return [line for line in text.splitlines() if word in line]


def row(text: str, first: str) -> str:
    """The one line of ``text`` whose first cell is ``first``."""
    (line,) = [line for line in text.splitlines() if line.split()[:1] == [first]]
    return line


def test_the_header_names_the_manager_its_uptime_counters_and_no_pressure_stage_yet() -> None:
    text = text_of(render(document(), url=URL, now=NOW))

    header = text.splitlines()[0]
    assert "manager manager-1" in header and "namespace mesh" in header
    assert "up 1h02m" in header
    assert "pressure -" in header
    assert "admitted 120 · rejected 3 · deferred 9" in header
    assert "http://127.0.0.1:8090/api/status" in text


def test_a_pressure_stage_is_shown_when_the_document_has_one() -> None:
    assert "pressure shed-batch" in text_of(
        render(document(pressure={"stage": "shed-batch"}), url=URL, now=NOW)
    )
    assert "pressure 2" in text_of(render(document(pressure=2), url=URL, now=NOW))


def test_each_pool_shows_its_shedding_stage() -> None:
    text = text_of(render(document(), url=URL, now=NOW))
    assert "PAUSE_BATCH" in row(text, "rag-eu")
    assert "PAUSE_BATCH" not in row(text, "rag-us")


def test_pools_show_epochs_expiry_capabilities_and_agents_per_state() -> None:
    text = text_of(render(document(), url=URL, now=NOW))

    eu = row(text, "rag-eu")
    assert eu.split()[:5] == ["rag-eu", "3", "3", "in", "30m00s"]
    assert "rag.answer, rag.search" in eu and "Ready 2 · Busy 1" in eu
    us = row(text, "rag-us")
    assert us.split()[:3] == ["rag-us", "2", "3"]  # a stale descriptor epoch
    assert "expired 1m30s ago" in us


def test_agents_are_counted_per_lifecycle_state_in_lifecycle_order() -> None:
    text = text_of(render(document(), url=URL, now=NOW))

    header = next(line for line in text.splitlines() if "Spawning" in line)
    assert header.split() == [
        "Spawning", "Registering", "Ready", "Busy", "Draining", "Terminated", "total",
    ]  # fmt: skip
    counts = text.splitlines()[text.splitlines().index(header) + 2]
    assert counts.split() == ["0", "0", "2", "1", "1", "0", "4"]


def test_capacity_shows_in_flight_against_capacity_per_capability() -> None:
    text = text_of(render(document(), url=URL, now=NOW))

    rag = row(text, "rag.search")
    assert rag.split()[:3] == ["rag.search", "9", "10"] and "90%" in rag
    assert row(text, "calc.add").split() == ["calc.add", "0", "0", "-", "1"]


def test_only_the_deepest_queues_are_shown_deepest_first() -> None:
    text = text_of(render(document(), url=URL, now=NOW))

    shown = [line.split()[0] for line in lines_with(text, "mesh.agent.")]
    assert shown[0] == "mesh.agent.rag-eu-3.tasks"
    assert shown == ["mesh.agent.rag-eu-3.tasks"] + [
        f"mesh.agent.q{i}.tasks" for i in range(11, 4, -1)
    ]
    assert "42.0s" in lines_with(text, "rag-eu-3.tasks")[0]


def test_recent_refusals_show_their_age_and_reason_code() -> None:
    text = text_of(render(document(), url=URL, now=NOW))

    (first,) = lines_with(text, "adm-77")
    assert first.split()[:4] == ["4.0s", "adm-77", "deferred", "CAPACITY"]
    (second,) = lines_with(text, "adm-70")
    assert "1m05s" in second and "NO_ELIGIBLE_POOL" in second and "region_allowed" in second


@pytest.mark.parametrize("width", [80, 120])
def test_a_long_refusal_detail_is_cut_not_the_reason_code(width: int) -> None:
    long = {
        "at": NOW - 1,
        "admission_id": "adm-80",
        "outcome": "rejected",
        "reason": "NO_ELIGIBLE_POOL",
        "detail": ", ".join(f"pool-{i}: region_allowed" for i in range(40)),
    }
    console = Console(record=True, width=width, file=io.StringIO())
    console.print(render(document(recent_refusals=[long]), url=URL, now=NOW))

    line = row(console.export_text(), "1.0s")
    assert line.split()[:4] == ["1.0s", "adm-80", "rejected", "NO_ELIGIBLE_POOL"]
    assert "pool-0: region_allowed" in line and line.rstrip().endswith("…")
    assert len(line.rstrip()) <= width


def test_an_empty_mesh_says_what_is_missing_instead_of_drawing_nothing() -> None:
    empty = document(pools=[], agents=[], capabilities=[], queues=[], recent_refusals=[])

    text = text_of(render(empty, url=URL, now=NOW))

    assert "(no pools" in text
    assert "(no capability registered)" in text
    assert "--management-url" in text
    assert "(none)" in text


def test_a_document_missing_fields_still_draws() -> None:
    text = text_of(render({"manager_id": "old"}, url=URL, now=NOW))

    assert "manager old" in text and "pressure -" in text and "up -" in text


def test_an_unreachable_manager_is_a_clear_message_in_the_frame() -> None:
    text = text_of(render(None, url=URL, now=NOW, error="cannot reach x: refused"))

    assert text.strip() == "manager unreachable: cannot reach x: refused; retrying"


def test_after_an_outage_the_last_status_is_kept_under_the_message() -> None:
    text = text_of(render(document(), url=URL, now=NOW + 29, error="cannot reach x"))

    assert text.splitlines()[0].startswith("manager unreachable: cannot reach x; retrying")
    assert "showing the status of 30.0s ago" in text.splitlines()[0]
    assert "manager manager-1" in text


def test_the_real_status_document_draws() -> None:
    """The renderer and ``Observer.document()`` agree on the document's shape."""
    status = SAMPLES[StatusReply]
    assert isinstance(status, StatusReply)
    observer = Observer(
        manager_id="manager-7",
        namespace="mesh",
        vhost="/",
        tally=lambda: tally_of(status.agents),
        agent_rows=lambda offset, limit: status.agents[offset : offset + limit],
        descriptors=lambda: {"rag-eu": DESCRIPTOR},
        active_epochs=lambda: {"rag-eu": 3},
        active_generation=7,
        counters=Counter({"admission.admitted": 5, "admission.deferred": 1}),
        started_at=time.monotonic() - 10,
    )
    observer.view.queues = [QueueStat("mesh.agent.calc-7f9c.tasks", 12, 3.5)]
    observer.history.refusal(NOW - 2, "adm-9", "deferred", "CAPACITY", "no slot")

    text = text_of(render(observer.document(), url=URL, now=NOW))

    assert "manager manager-7" in text and "admitted 5" in text and "deferred 1" in text
    assert row(text, "rag-eu").split()[:3] == ["rag-eu", "3", "3"]
    assert "Busy 1" in row(text, "calc")
    assert row(text, "calc.add").split()[:3] == ["calc.add", "1", "4"]
    assert row(text, "mesh.agent.calc-7f9c.tasks").split()[1] == "12"
    assert row(text, "2.0s").split()[:4] == ["2.0s", "adm-9", "deferred", "CAPACITY"]


# ---- fetching and the loop ------------------------------------------------------------------


@pytest.mark.parametrize(
    ("base", "url"),
    [
        ("http://127.0.0.1:8090/", "http://127.0.0.1:8090/api/status"),
        ("http://127.0.0.1:8090", "http://127.0.0.1:8090/api/status"),
        ("http://mesh.example/manager/", "http://mesh.example/manager/api/status"),
        ("http://h:1/api/status", "http://h:1/api/status"),
    ],
)
def test_the_status_url_is_found_from_the_manager_url(base: str, url: str) -> None:
    assert status_url(base) == url


class _Server:
    def __init__(self, body: bytes, status: int = 200) -> None:
        outer = self

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self) -> None:
                outer.paths.append(self.path)
                self.send_response(status)
                self.send_header("Content-Type", "application/json")
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, *_: Any) -> None:
                pass

        self.paths: list[str] = []
        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}/"
        self.thread = Thread(target=self.httpd.serve_forever, args=(0.01,), daemon=True)

    def __enter__(self) -> _Server:
        self.thread.start()
        return self

    def __exit__(self, *_: object) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()


def test_fetch_reads_the_status_document_over_http() -> None:
    with _Server(b'{"manager_id": "m"}') as server:
        assert fetch_status(server.url) == {"manager_id": "m"}
    assert server.paths == ["/api/status"]


@pytest.mark.parametrize(
    ("body", "status", "message"),
    [
        (b"<html>", 200, "did not answer JSON"),
        (b"[1, 2]", 200, "did not answer a JSON object"),
        (b"{}", 404, "answered HTTP 404"),
    ],
)
def test_a_bad_answer_is_one_sentence(body: bytes, status: int, message: str) -> None:
    with _Server(body, status) as server, pytest.raises(StatusUnavailable, match=message):
        fetch_status(server.url)


def test_a_peer_that_does_not_speak_http_is_one_sentence() -> None:
    import socket

    with socket.socket() as listener:
        listener.bind(("127.0.0.1", 0))
        listener.listen()
        port = listener.getsockname()[1]

        def greet_and_hang_up() -> None:
            conn, _ = listener.accept()
            conn.sendall(b"AMQP\x00\x00\x09\x01")
            conn.close()

        Thread(target=greet_and_hang_up, daemon=True).start()
        with pytest.raises(StatusUnavailable, match=f"cannot reach http://127.0.0.1:{port}/"):
            fetch_status(f"http://127.0.0.1:{port}/")


def test_a_url_without_a_scheme_is_refused_before_any_request() -> None:
    with pytest.raises(StatusUnavailable, match="is not an http:// or https:// URL"):
        fetch_status("127.0.0.1:8090")


def test_once_prints_one_frame_and_exits_0_when_the_manager_answers() -> None:
    out = io.StringIO()
    code = run_top(
        URL,
        once=True,
        console=Console(file=out, width=120),
        fetch=lambda _: document(),
        clock=lambda: NOW,
    )

    assert code == 0
    assert "manager manager-1" in out.getvalue()


def test_once_against_an_unreachable_manager_prints_why_and_exits_1() -> None:
    out = io.StringIO()
    code = run_top(
        "http://127.0.0.1:1/", once=True, console=Console(file=out, width=200), clock=lambda: NOW
    )

    assert code == 1
    assert "manager unreachable: cannot reach http://127.0.0.1:1/api/status" in out.getvalue()
    assert "retrying" not in out.getvalue()


def test_the_loop_keeps_retrying_while_the_manager_is_away() -> None:
    answers: list[Any] = [StatusUnavailable("down"), document(), StatusUnavailable("down again")]
    frames: list[str] = []

    def fetch(_: str) -> dict[str, Any]:
        answer = answers.pop(0)
        if isinstance(answer, Exception):
            raise answer
        return dict(answer)

    def sleep(_: float) -> None:
        frames.append(console.export_text())
        if not answers:
            raise KeyboardInterrupt

    console = Console(record=True, file=io.StringIO(), width=120, force_terminal=False)
    with pytest.raises(KeyboardInterrupt):
        run_top(URL, console=console, fetch=fetch, clock=lambda: NOW, sleep=sleep)

    assert len(frames) == 3  # down, up, down again: it never gave up
    last = console.export_text()  # the frame left on screen when it stopped
    assert "manager unreachable: down again; retrying" in last
    assert "manager manager-1" in last  # with the last status it could read


def test_the_header_names_each_shards_holder_and_the_shards_nobody_holds() -> None:
    shards = {
        "count": 6,
        "owners": [
            {"shard": 3, "owner": "m0", "fence": 2},
            {"shard": 0, "owner": "m0", "fence": 1},
            {"shard": 1, "owner": "m1", "fence": 1},
        ],
    }
    assert shard_line(shards, "m1") == "shards 6: m0 0,3 · m1 (this one) 1 · 3 not held"
    assert shard_line({"count": 2, "owners": []}, "m0") == "shards 2: 2 not held"
