"""``mesh top``: a refreshing terminal view of one manager, drawn from its ``/api/status``.

Theory of operation
-------------------
:func:`render` is a pure function from the status document (the JSON dict the manager serves,
:meth:`mesh.manager.observe.Observer.document`) and the time to a rich renderable: a header
(manager, uptime, pressure stage, admission counters), then pools, agents per lifecycle state,
in-flight against capacity per capability, the deepest queues, and the latest refusals with
their reason codes. It reads the document defensively — a field the manager does not send
(yet) shows as ``-`` — so an older or newer manager still draws. Tests render it to text with
``rich.console.Console(record=True)``; no terminal needed.

:func:`fetch_status` is the one HTTP call; :func:`run_top` the loop around both: fetch, draw,
sleep. A manager that cannot be reached is a message in the frame (above the last frame that
could be drawn, if any), and the loop keeps trying; ``once`` draws one frame and reports
whether the manager answered.
"""

from __future__ import annotations

import http.client
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Mapping, Sequence
from typing import Any
from urllib.parse import urljoin, urlsplit

import orjson
from rich import box
from rich.console import Console, Group, RenderableType
from rich.live import Live
from rich.table import Table
from rich.text import Text

from mesh.core.lifecycle import AgentState
from mesh.errors import MeshError

LIFECYCLE: tuple[str, ...] = tuple(state.value for state in AgentState)
TOP_QUEUES = 8
RECENT_REFUSALS = 8


class StatusUnavailable(MeshError):
    """The manager's ``/api/status`` could not be read (not running, no HTTP port, bad reply)."""


# ---- fetching -------------------------------------------------------------------------------


def status_url(base: str) -> str:
    """The ``/api/status`` address of a manager URL (``http://host:8090/`` or the full path)."""
    if urlsplit(base).path.rstrip("/").endswith("/api/status"):
        return base
    return urljoin(base if base.endswith("/") else base + "/", "api/status")


def fetch_status(url: str, timeout_s: float = 3.0) -> dict[str, Any]:
    """``GET /api/status``; raises :class:`StatusUnavailable` with a one-line reason."""
    target = status_url(url)
    if urlsplit(target).scheme not in ("http", "https"):
        raise StatusUnavailable(f"{url!r} is not an http:// or https:// URL")
    try:
        with urllib.request.urlopen(target, timeout=timeout_s) as response:
            body = response.read()
    except urllib.error.HTTPError as exc:
        raise StatusUnavailable(f"{target} answered HTTP {exc.code} {exc.reason}") from None
    except urllib.error.URLError as exc:
        raise StatusUnavailable(f"cannot reach {target}: {exc.reason}") from None
    except (OSError, http.client.HTTPException) as exc:
        raise StatusUnavailable(f"cannot reach {target}: {exc!r}") from None
    try:
        document = orjson.loads(body)
    except orjson.JSONDecodeError as exc:
        raise StatusUnavailable(f"{target} did not answer JSON: {exc}") from None
    if not isinstance(document, dict):
        raise StatusUnavailable(f"{target} did not answer a JSON object")
    return document


# ---- rendering ------------------------------------------------------------------------------


def render(
    document: Mapping[str, Any] | None,
    *,
    url: str,
    now: float,
    error: str | None = None,
    retrying: bool = True,
) -> RenderableType:
    """One frame. ``document`` is the last status document (``None``: none yet); ``error``
    says why the latest fetch failed (the frame then says so above the older document, and
    that it keeps trying if ``retrying``)."""
    parts: list[RenderableType] = []
    if error is not None:
        since = ""
        if document is not None and isinstance(document.get("served_at"), int | float):
            since = f" — showing the status of {_age(now - document['served_at'])} ago"
        again = "; retrying" if retrying else ""
        parts.append(Text(f"manager unreachable: {error}{again}{since}", style="bold red"))
    if document is None:
        if error is None:
            parts.append(Text(f"waiting for {status_url(url)} …"))
        return Group(*parts)
    parts += [
        _header(document, url),
        _pools(document, now),
        _states(document),
        _capabilities(document),
        _queues(document),
        _refusals(document, now),
    ]
    return Group(*parts)


def _header(doc: Mapping[str, Any], url: str) -> Text:
    counters = doc.get("counters") or {}
    uptime = doc.get("uptime_s")
    head = Text()
    head.append(f"manager {doc.get('manager_id', '-')}", style="bold")
    head.append(f" · namespace {doc.get('namespace', '-')}")
    head.append(f" · up {_age(uptime) if isinstance(uptime, int | float) else '-'}")
    head.append(" · pressure ")
    head.append(pressure_stage(doc), style="bold")
    head.append(
        f" · admitted {counters.get('admission.admitted', 0)}"
        f" · rejected {counters.get('admission.rejected', 0)}"
        f" · deferred {counters.get('admission.deferred', 0)}"
    )
    shards = doc.get("shards")
    if isinstance(shards, Mapping):
        head.append(f"\n{shard_line(shards, doc.get('manager_id'))}")
    head.append(f"\n{status_url(url)}", style="dim")
    return head


def shard_line(shards: Mapping[str, Any], me: Any) -> str:
    """Several managers: ``shards 6: m0 0,3 · m1 (this one) 1,4 · m2 2,5``; the agents shown
    are this manager's."""
    held: dict[str, list[int]] = {}
    for row in shards.get("owners") or []:
        held.setdefault(str(row.get("owner")), []).append(int(row.get("shard", -1)))
    parts = [
        f"{owner}{' (this one)' if owner == me else ''} {','.join(map(str, sorted(s)))}"
        for owner, s in sorted(held.items())
    ]
    free = int(shards.get("count") or 0) - sum(map(len, held.values()))
    if free > 0:
        parts.append(f"{free} not held")
    return f"shards {shards.get('count')}: " + " · ".join(parts)


def pressure_stage(doc: Mapping[str, Any]) -> str:
    """The load-shedding stage, if the document has one (``pressure`` as a string, or a
    mapping with ``stage``); ``-`` otherwise."""
    pressure = doc.get("pressure")
    if isinstance(pressure, Mapping):
        pressure = pressure.get("stage")
    return "-" if pressure is None or pressure == "" else str(pressure)


def _table(
    title: str, *columns: str, right: Sequence[str] = (), squeeze: str | None = None
) -> Table:
    """A table; ``squeeze`` names the one column that gives way when the frame is narrow
    (every other column keeps its text on one line; its cells should be :func:`_cut`)."""
    table = Table(
        title=title,
        title_justify="left",
        title_style="bold",
        box=box.SIMPLE_HEAD,
        show_edge=False,
        expand=False,
    )
    for column in columns:
        table.add_column(
            column,
            justify="right" if column in right else "left",
            no_wrap=squeeze is not None and column != squeeze,
            ratio=1 if column == squeeze else None,
        )
    return table


def _pools(doc: Mapping[str, Any], now: float) -> Table:
    table = _table("pools", "POOL", "EPOCH", "ACTIVE", "EXPIRES", "STAGE", "CAPABILITIES", "AGENTS")
    for pool in _rows(doc, "pools"):
        epoch, active = pool.get("descriptor_epoch"), pool.get("active_epoch")
        stale = epoch is not None and epoch != active
        agents = pool.get("agents") or {}
        table.add_row(
            str(pool.get("pool_id", "-")),
            Text(_dash(epoch), style="red" if stale else ""),
            _dash(active),
            _expires(pool.get("expires_at"), now),
            Text(
                _dash(pool.get("stage")),
                style="" if pool.get("stage") in (None, "NORMAL") else "yellow",
            ),
            ", ".join(pool.get("capabilities") or []) or "-",
            " · ".join(f"{state} {agents[state]}" for state in _ordered(agents)) or "-",
        )
    _empty(table, "(no pools: no descriptor published, no agent registered)")
    return table


def _states(doc: Mapping[str, Any]) -> Table:
    by_state = doc.get("agents_by_state")
    counts: dict[str, int] = {}
    if isinstance(by_state, Mapping):  # every agent, from the manager's running tally
        counts = {str(state): int(_number(n)) for state, n in by_state.items()}
    else:  # an older manager: count the rows it sent
        for agent in _rows(doc, "agents"):
            state = str(agent.get("state", "?"))
            counts[state] = counts.get(state, 0) + 1
    states = [*LIFECYCLE, *sorted(set(counts) - set(LIFECYCLE))]
    table = _table("agents by state", *states, "total", right=(*states, "total"))
    table.add_row(*(str(counts.get(s, 0)) for s in states), str(sum(counts.values())))
    return table


def _capabilities(doc: Mapping[str, Any]) -> Table:
    table = _table(
        "capacity by capability",
        "CAPABILITY",
        "IN-FLIGHT",
        "CAPACITY",
        "USE",
        "AGENTS",
        right=("IN-FLIGHT", "CAPACITY", "AGENTS"),
    )
    for cap in _rows(doc, "capabilities"):
        in_flight, capacity = cap.get("in_flight", 0), cap.get("capacity", 0)
        table.add_row(
            str(cap.get("capability", "-")),
            str(in_flight),
            str(capacity),
            _bar(in_flight, capacity),
            str(cap.get("agents", 0)),
        )
    _empty(table, "(no capability registered)")
    return table


def _queues(doc: Mapping[str, Any]) -> Table:
    table = _table(
        f"deepest queues (top {TOP_QUEUES})", "QUEUE", "MESSAGES", "OLDEST", right=("MESSAGES",)
    )
    queues = sorted(
        _rows(doc, "queues"), key=lambda q: (-_number(q.get("messages")), str(q.get("name")))
    )
    for queue in queues[:TOP_QUEUES]:
        oldest = queue.get("oldest_age_s")
        table.add_row(
            str(queue.get("name", "-")),
            _dash(queue.get("messages")),
            _age(oldest) if isinstance(oldest, int | float) else "-",
        )
    _empty(table, "(no queue depths: start the manager with --management-url)")
    return table


def _refusals(doc: Mapping[str, Any], now: float) -> Table:
    table = _table(
        "recent refusals",
        "AGO",
        "ADMISSION",
        "OUTCOME",
        "REASON",
        "DETAIL",
        right=("AGO",),
        squeeze="DETAIL",
    )
    for refusal in _rows(doc, "recent_refusals")[:RECENT_REFUSALS]:
        at = refusal.get("at")
        table.add_row(
            _age(now - at) if isinstance(at, int | float) else "-",
            str(refusal.get("admission_id", "-")),
            str(refusal.get("outcome", "-")),
            Text(str(refusal.get("reason", "-")), style="yellow"),
            _cut(str(refusal.get("detail", ""))),
        )
    _empty(table, "(none)")
    return table


def _cut(text: str) -> Text:
    """One line, cut with an ellipsis where the column ends."""
    return Text(text, no_wrap=True, overflow="ellipsis")


def _rows(doc: Mapping[str, Any], key: str) -> list[Mapping[str, Any]]:
    value = doc.get(key)
    if not isinstance(value, list):
        return []
    return [row for row in value if isinstance(row, Mapping)]


def _empty(table: Table, message: str) -> None:
    if table.row_count == 0:
        table.add_row(Text(message, style="dim"), *([""] * (len(table.columns) - 1)))


def _ordered(states: Mapping[str, Any]) -> list[str]:
    known = [s for s in LIFECYCLE if s in states]
    return known + sorted(set(states) - set(known))


def _bar(used: Any, capacity: Any, width: int = 20) -> Text:
    if not isinstance(capacity, int | float) or capacity <= 0:
        return Text("-")
    share = max(0.0, min(1.0, _number(used) / capacity))
    filled = round(share * width)
    style = "red" if share >= 0.9 else "yellow" if share >= 0.7 else "green"
    bar = Text("█" * filled, style=style)
    bar.append("·" * (width - filled), style="dim")
    bar.append(f" {share:4.0%}")
    return bar


def _expires(at: Any, now: float) -> Text:
    if not isinstance(at, int | float):
        return Text("-")
    if at <= now:
        return Text(f"expired {_age(now - at)} ago", style="red")
    return Text(f"in {_age(at - now)}")


def _number(value: Any) -> float:
    return float(value) if isinstance(value, int | float) else 0.0


def _dash(value: Any) -> str:
    return "-" if value is None else str(value)


def _age(seconds: float) -> str:
    """``4.2s``, ``12m05s``, ``3h07m``, ``2d04h``."""
    seconds = max(0.0, seconds)
    if seconds < 60:
        return f"{seconds:.1f}s"
    minutes, secs = divmod(int(seconds), 60)
    if minutes < 60:
        return f"{minutes}m{secs:02d}s"
    hours, minutes = divmod(minutes, 60)
    if hours < 24:
        return f"{hours}h{minutes:02d}m"
    days, hours = divmod(hours, 24)
    return f"{days}d{hours:02d}h"


# ---- the loop -------------------------------------------------------------------------------


def run_top(
    url: str,
    *,
    interval_s: float = 2.0,
    once: bool = False,
    console: Console | None = None,
    fetch: Callable[[str], dict[str, Any]] = fetch_status,
    clock: Callable[[], float] = time.time,
    sleep: Callable[[float], None] = time.sleep,
) -> int:
    """Draw the manager's status every ``interval_s`` until interrupted (``KeyboardInterrupt``
    propagates). With ``once``: one frame, and 0 if the manager answered, else 1."""
    console = console or Console()
    document: dict[str, Any] | None = None

    def poll() -> RenderableType:
        nonlocal document
        error = None
        try:
            document = fetch(url)
        except StatusUnavailable as exc:
            error = str(exc)
        return render(document, url=url, now=clock(), error=error, retrying=not once)

    if once:
        frame = poll()
        console.print(frame)
        return 0 if document is not None else 1
    with Live(
        Text(f"connecting to {status_url(url)} …"),
        console=console,
        screen=console.is_terminal,
        auto_refresh=False,
    ) as live:
        while True:
            live.update(poll(), refresh=True)
            sleep(interval_s)
