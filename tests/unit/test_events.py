"""The orchestration events' details: every kind an emitter uses has a model, the emitters
write what their kind's model allows, the model refuses what it does not, and what a journal
stored is read back whatever it holds.

The committed JSON Schemas of the details are checked in ``test_schemas.py``.
"""

from __future__ import annotations

import ast
import asyncio
import sqlite3
import typing
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from pydantic import ValidationError

import mesh
from mesh import constants as c
from mesh.cli import build_parser, cmd_log
from mesh.core import ConnectionLost, ConnectionRestored, PoolSettings, ScaleObserved
from mesh.core.events import AppendLog, LogEntry
from mesh.core.lifecycle import Trigger
from mesh.core.pressure import Stage
from mesh.errors import MessageRejected
from mesh.manager.admission import AdmissionPolicy
from mesh.manager.commands import _to_wire
from mesh.manager.journal import SqliteJournal
from mesh.manager.service import ManagerService
from mesh.manager.settings import ManagerSettings
from mesh.producer import MeshClient
from mesh.testing import FakeClock, InMemoryBroker, InMemoryTransport
from mesh.topology import BindingSpec, Declarations
from mesh.transport import Delivery
from mesh.wire import (
    EVENT_DETAILS,
    DescriptorAccepted,
    OrchestrationEvent,
    PoolEpoch,
    Reason,
    decode,
    encode,
)
from mesh.wire.events import PressureStage

from .builders import Command, Pool, announcements, capability, log_entries
from .samples import DESCRIPTOR, EVENT_DETAIL_SAMPLES, REQUIREMENTS, T0
from .test_scaling import POLICY

MESH_DIR = Path(mesh.__file__).parent
# The pool core: its entry point and the rooms it hands events to.
POOL_CORE = [
    MESH_DIR / "core" / f"{name}.py"
    for name in ("pool", "registry", "registration", "heartbeats", "liveness", "leases", "drains")
]
EMITTERS = {"LogEntry": ("mesh.core", "mesh.core.events"), "OrchestrationEvent": ("mesh.wire",)}
"""The classes an event is built with, and the modules each is imported from."""


# ---- every kind an emitter uses has a model ----------------------------------------------


def _emitter_names(tree: ast.Module) -> set[str]:
    """Which of :data:`EMITTERS` this module imports (the ledger keeps rows of its own)."""
    names = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module is not None:
            for alias in node.names:
                modules = EMITTERS.get(alias.name, ())
                if any(node.module == m or node.module.startswith(m + ".") for m in modules):
                    names.add(alias.asname or alias.name)
    return names


def _called_name(call: ast.Call) -> str | None:
    func = call.func
    return func.id if isinstance(func, ast.Name) else getattr(func, "attr", None)


def _literal(node: ast.expr, where: str) -> str:
    """A kind spelt as a string or as a constant of :mod:`mesh.constants`."""
    if isinstance(node, ast.Constant) and isinstance(node.value, str):
        return node.value
    if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name):
        value = getattr(c, node.attr, None)
        if isinstance(value, str):
            return value
    raise AssertionError(f"{where}: a kind this test cannot read: {ast.unparse(node)}")


class _Kinds:
    """The kinds one module passes as ``kind=`` to an emitter, read from its source."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.tree = ast.parse(path.read_text("utf-8"))
        self.parents = {
            child: node for node in ast.walk(self.tree) for child in ast.iter_child_nodes(node)
        }

    def __iter__(self) -> Iterator[str]:
        emitters = _emitter_names(self.tree)
        for node in ast.walk(self.tree):
            if isinstance(node, ast.Call) and _called_name(node) in emitters:
                where = f"{self.path.relative_to(MESH_DIR.parent)}:{node.lineno}"
                kind = next((k.value for k in node.keywords if k.arg == "kind"), None)
                assert kind is not None, f"{where}: an event built without kind=..."
                if isinstance(kind, ast.Attribute) and kind.attr == "kind":
                    continue  # a conversion (LogEntry -> OrchestrationEvent): not a new kind
                yield from self._resolve(kind, node, where)

    def _resolve(self, node: ast.expr, at: ast.AST, where: str) -> Iterator[str]:
        if isinstance(node, ast.Subscript) and isinstance(node.value, ast.Name):
            # A lookup table, such as the lifecycle's trigger -> kind: every value.
            table = self._module_value(node.value.id, where)
            assert isinstance(table, ast.Dict), f"{where}: {node.value.id} is not a dict literal"
            yield from (_literal(v, where) for v in table.values)
        elif isinstance(node, ast.Name):
            # A parameter of the enclosing function: what each of its callers passes.
            yield from self._passed_to(node.id, at, where)
        else:
            yield _literal(node, where)

    def _module_value(self, name: str, where: str) -> ast.expr:
        for node in self.tree.body:
            targets = node.targets if isinstance(node, ast.Assign) else []
            if any(isinstance(t, ast.Name) and t.id == name for t in targets):
                assert isinstance(node, ast.Assign)
                return node.value
        raise AssertionError(f"{where}: {name} is not assigned at module level")

    def _passed_to(self, param: str, at: ast.AST, where: str) -> Iterator[str]:
        func = at
        while not isinstance(func, ast.FunctionDef | ast.AsyncFunctionDef):
            func = self.parents[func]
        params = [a.arg for a in func.args.args]
        assert param in params, f"{where}: {param} is neither a literal nor a parameter"
        calls = [
            node
            for node in ast.walk(self.tree)
            if isinstance(node, ast.Call) and _called_name(node) == func.name
        ]
        assert calls, f"{where}: {func.name} is never called here"
        for call in calls:
            bound = params[1:] if params[0] in ("self", "cls") else params
            passed = dict(zip(bound, call.args, strict=False))
            passed.update((k.arg, k.value) for k in call.keywords if k.arg is not None)
            yield _literal(passed[param], f"{where} (called at line {call.lineno})")


def emitted_kinds() -> set[str]:
    return {kind for path in sorted(MESH_DIR.rglob("*.py")) for kind in _Kinds(path)}


def test_every_kind_an_emitter_uses_has_a_model_and_every_model_an_emitter() -> None:
    assert emitted_kinds() == set(EVENT_DETAILS)


def test_the_pressure_stages_an_event_names_are_the_boards() -> None:
    assert typing.get_args(PressureStage) == tuple(s.name for s in Stage)


# ---- the pool core's emitters write what their kinds' models allow ----------------------


def _kinds_of(commands: list[Command]) -> set[str]:
    """The kinds of the entries journaled or announced, each made into the event the manager
    would journal or publish (which checks its detail)."""
    entries = [*log_entries(commands), *(a.entry for a in announcements(commands))]
    return {_to_wire(entry).kind for entry in entries}


def test_the_pool_core_emits_each_of_its_kinds_as_its_model_says() -> None:
    pool = Pool(settings=PoolSettings(scaling=(POLICY,)))
    pool.core.handle(ScaleObserved("pool", 1), pool.clock.now())
    reports = [c.FEATURE_WORK_REPORTS]
    seen = _kinds_of(pool.register("calc-1", capability(max_concurrency=1), features=reports))
    seen |= _kinds_of(pool.register("calc-1", incarnation="inc-2"))  # the live one stays
    seen |= _kinds_of(pool.register("fast-1", heartbeat_interval_s=1.0))  # too short: refused
    seen |= _kinds_of(pool.register("calc-2", capability(version="1.1.0")))  # two versions now
    acquired = pool.acquire_commands(agent_id="calc-1")
    seen |= _kinds_of(acquired)
    seen |= _kinds_of(pool.release(next(e.detail["lease_id"] for e in log_entries(acquired))))
    seen |= _kinds_of(pool.heartbeat("calc-1", pool_in_flight={"calc.add": 1}))  # busy
    seen |= _kinds_of(pool.heartbeat("calc-1"))  # released, no lease
    agent = pool.core.agents["calc-1"]
    seen |= _kinds_of(
        pool.core.registry.transition(agent, Trigger.ACCEPT, pool.clock.now(), "again")
    )
    seen |= _kinds_of(pool.drain("calc-1"))
    seen |= _kinds_of(pool.heartbeat("calc-1", draining=True))  # confirmed, then terminated
    pool.tick()
    pool.clock.advance(10)
    seen |= _kinds_of(pool.tick())  # no tick for 10 s: a stall
    pool.core.handle(ConnectionLost(), pool.clock.now())
    seen |= _kinds_of(pool.core.handle(ConnectionRestored(), pool.clock.now()))
    pool.register("calc-3", capability(version="1.1.0", max_concurrency=1))
    pool.lease(agent_id="calc-2")
    pool.lease(agent_id="calc-3")
    pool.acquire()  # a capacity miss: a scale-up follows
    seen |= _kinds_of(pool.run_for(40, heartbeats=["calc-2"]))  # calc-3 goes silent

    assert seen == {kind for path in POOL_CORE for kind in _Kinds(path)}  # every kind it emits


# ---- the model refuses what the kind does not allow -------------------------------------


def _event(kind: str, detail: dict[str, Any]) -> dict[str, Any]:
    return {"type": OrchestrationEvent.TYPE, "at": T0, "kind": kind, "detail": detail}


@pytest.mark.parametrize("kind", sorted(EVENT_DETAILS))
def test_every_kinds_sample_detail_is_built_and_decoded(kind: str) -> None:
    event = OrchestrationEvent.model_validate(_event(kind, EVENT_DETAIL_SAMPLES[kind]))

    assert decode(encode(event)) == event
    assert event.detail == EVENT_DETAIL_SAMPLES[kind]  # kept as written: a plain dict


def test_the_descriptor_active_detail_is_a_pool_epoch() -> None:
    assert EVENT_DETAILS[c.EVENT_DESCRIPTOR_ACTIVE] is PoolEpoch


def test_an_unknown_kind_is_refused_by_name() -> None:
    with pytest.raises(ValidationError) as built:
        OrchestrationEvent(at=T0, kind="teleported")
    with pytest.raises(MessageRejected) as decoded:
        decode(encode(OrchestrationEvent.model_construct(at=T0, kind="teleported")))

    [error] = built.value.errors()
    assert (error["type"], error["loc"]) == ("unknown_event_kind", ("kind",))
    assert decoded.value.reason == Reason.SCHEMA_VIOLATION
    assert "kind: unknown event kind 'teleported'" in decoded.value.detail


# (kind, detail, where the error is, its pydantic type)
WRONG_DETAILS: list[tuple[str, dict[str, Any], tuple[str | int, ...], str]] = [
    ("acquired", {}, ("detail", "lease_id"), "missing"),
    ("registered", {"lease_id": "lease-1"}, ("detail", "lease_id"), "extra_forbidden"),
    (
        "grant_revoked",
        {**EVENT_DETAIL_SAMPLES["grant_revoked"], "fence": "41"},
        ("detail", "fence"),
        "int_type",
    ),
    (
        "grant_revoked",
        {**EVENT_DETAIL_SAMPLES["grant_revoked"], "fence": 0},
        ("detail", "fence"),
        "greater_than_equal",
    ),
    (
        "pressure_stage",
        {**EVENT_DETAIL_SAMPLES["pressure_stage"], "to": "PANIC"},
        ("detail", "to"),
        "literal_error",
    ),
    ("version_drift", {"versions": ["1.2.0"]}, ("detail", "versions"), "too_short"),
    ("scale", {"deployment": "calc", "replicas": True}, ("detail", "replicas"), "int_type"),
]


@pytest.mark.parametrize(
    ("kind", "detail", "loc", "error_type"),
    WRONG_DETAILS,
    ids=[f"{kind}:{'.'.join(map(str, loc))}:{t}" for kind, _, loc, t in WRONG_DETAILS],
)
def test_a_detail_its_kind_does_not_allow_is_refused_where_it_is_wrong(
    kind: str, detail: dict[str, Any], loc: tuple[str | int, ...], error_type: str
) -> None:
    with pytest.raises(ValidationError) as built:
        OrchestrationEvent.model_validate(_event(kind, detail))

    assert [(e["loc"], e["type"]) for e in built.value.errors()] == [(loc, error_type)]


def test_an_unknown_detail_key_on_the_wire_is_an_unknown_field() -> None:
    body = _event("acquired", {"lease_id": "lease-1", "x_privileged": True})

    with pytest.raises(MessageRejected) as rejected:
        decode(encode(OrchestrationEvent.model_construct(**body)))

    assert rejected.value.reason == Reason.UNKNOWN_FIELD
    assert "detail.x_privileged" in rejected.value.detail


# ---- what a journal stored is read back -----------------------------------------------


def _stored_elsewhere(path: Path) -> None:
    """Rows another version of the manager wrote: a kind and a key this one does not know."""
    SqliteJournal(path).close()
    with sqlite3.connect(path) as db:
        db.executemany(
            "INSERT INTO orchestration_log (at, kind, agent_id, detail) VALUES (?, ?, ?, ?)",
            [
                (T0, "teleported", "calc-1", '{"to": "mars"}'),
                (T0 + 1, "acquired", "calc-1", '{"lease": "lease-1", "slot": 2}'),
            ],
        )
    db.close()


def test_the_journal_reads_back_rows_whose_kind_or_detail_this_version_does_not_know(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path = tmp_path / "journal.sqlite3"
    _stored_elsewhere(path)
    journal = SqliteJournal(path)
    try:
        rows = journal.query(limit=None)
    finally:
        journal.close()

    assert [(e.seq, e.kind, e.detail) for e in rows] == [
        (1, "teleported", {"to": "mars"}),
        (2, "acquired", {"lease": "lease-1", "slot": 2}),
    ]
    assert cmd_log(build_parser().parse_args(["log", "--journal", str(path)])) == 0
    shown = capsys.readouterr().out.splitlines()
    assert [line.split()[2] for line in shown] == ["teleported", "acquired"]


def test_reading_as_stored_still_checks_the_envelope() -> None:
    with pytest.raises(ValidationError):
        OrchestrationEvent.as_stored({"at": -1.0, "kind": "teleported", "detail": {}})


# ---- the manager's emitters write what their kinds' models allow -----------------------


async def _until(condition: Callable[[], bool], what: str) -> None:
    for _ in range(500):
        if condition():
            return
        await asyncio.sleep(0.01)
    raise AssertionError(f"never: {what}")


async def test_the_managers_admission_and_rollout_events_are_valid_where_they_are_read() -> None:
    clock = FakeClock(wall=T0)
    broker = InMemoryBroker()
    policy = AdmissionPolicy(active_generation=DESCRIPTOR.policy_generation, grant_ttl_s=60)
    manager = ManagerService(
        ManagerSettings(
            namespace="ev",
            tick_interval_s=0.02,
            ledger_url="sqlite::memory:",
            operator_user="operator",
            admission=policy,
            admission_capacity="descriptor",  # no live agents needed
        ),
        transport=InMemoryTransport(broker, "manager"),
        journal=SqliteJournal(":memory:"),
        clock=clock,
    )
    await manager.start()
    feed = InMemoryTransport(broker, "feed")
    published: list[OrchestrationEvent] = []

    async def heard(delivery: Delivery) -> None:
        event = decode(delivery.body)  # as every consumer of the events exchange decodes it
        assert isinstance(event, OrchestrationEvent)
        published.append(event)

    queue = "ev.feed"
    await feed.declare_reply_queue(queue)
    binding = BindingSpec(queue, manager.topology.events_exchange, "#")
    await feed.declare(Declarations(bindings=(binding,)))
    await feed.consume(queue, heard, no_ack=True)
    client = await MeshClient.connect(
        namespace="ev", transport=InMemoryTransport(broker, "op"), user_id="operator"
    )
    try:
        assert isinstance(await client.publish_descriptor(DESCRIPTOR), DescriptorAccepted)
        shadow = DESCRIPTOR.model_copy(update={"descriptor_epoch": 4})
        assert isinstance(await client.shadow_descriptor("rag-eu", shadow), DescriptorAccepted)
        released = await client.admit(REQUIREMENTS, admission_id="adm-released")
        assert released.grant is not None, released
        assert (await client.release_admission(released.grant)).released
        await client.admit(REQUIREMENTS, admission_id="adm-revoked")
        assert (await client.revoke_admission("adm-revoked", "credential leaked")).released
        elsewhere = REQUIREMENTS.model_copy(update={"regions": ["us-east-1"]})
        rejected = await client.admit(elsewhere, admission_id="adm-rejected")
        assert rejected.outcome == "rejected", rejected
        await client.admit(REQUIREMENTS, admission_id="adm-expired")
        clock.advance(policy.grant_ttl_s + 1)
        assert manager.journal is not None
        journal = manager.journal
        await _until(
            lambda: "admission_expired" in {e.kind for e in journal.query(limit=None)},
            "the grant expired",
        )
        await _until(lambda: sum(e.kind == "grant_revoked" for e in published) == 3, "revoked")

        journaled = {e.kind for e in journal.query(limit=None)}
        assert journaled >= {
            "manager_started",
            "descriptor",
            "descriptor_shadow",
            "admission",
            "admission_revoked",
            "admission_expired",
        }
        assert {e.kind for e in published} >= {
            c.EVENT_DESCRIPTOR_ACTIVE,
            c.EVENT_GRANT_REVOKED,
            "admission",  # the refusal only
        }
        assert manager.counters["handler_errors"] == 0
    finally:
        await client.close()
        await feed.close()
        await manager.stop()
        await broker.close()


async def test_an_entry_that_does_not_fit_its_kind_is_journaled_counted_and_kept_off_the_feed() -> (
    None
):
    """An emitter bug (a detail its kind's schema refuses) must not fail the commands after it
    — the reply a requester waits for among them: the entry is journaled as written, counted
    (``events_unfit``) and not published; a good entry beside it is."""
    broker = InMemoryBroker()
    manager = ManagerService(
        ManagerSettings(namespace="ev", tick_interval_s=0.02, ledger_url="sqlite::memory:"),
        transport=InMemoryTransport(broker, "manager"),
        journal=SqliteJournal(":memory:"),
        clock=FakeClock(wall=T0),
    )
    await manager.start()
    feed = InMemoryTransport(broker, "feed")
    heard: list[OrchestrationEvent] = []

    async def on_event(delivery: Delivery) -> None:
        event = decode(delivery.body)
        assert isinstance(event, OrchestrationEvent)
        heard.append(event)

    await feed.declare_reply_queue("ev.feed")
    binding = BindingSpec("ev.feed", manager.topology.events_exchange, "log.#")
    await feed.declare(Declarations(bindings=(binding,)))
    await feed.consume("ev.feed", on_event, no_ack=True)
    try:
        bad = LogEntry(at=T0, kind="scale", detail={"deployment": "calc", "replicas": "three"})
        good = LogEntry(at=T0, kind="scale", detail={"deployment": "calc", "replicas": 3})
        await manager.commands.execute([AppendLog(bad), AppendLog(good)])
        await _until(lambda: len(heard) >= 1, "the good entry published")

        assert manager.counters["events_unfit"] == 1
        assert manager.journal is not None
        scales = [e for e in manager.journal.query(limit=None) if e.kind == "scale"]
        assert [e.detail["replicas"] for e in scales] == ["three", 3]  # both journaled
        assert [e.detail["replicas"] for e in heard if e.kind == "scale"] == [3]
    finally:
        await feed.close()
        await manager.stop()
        await broker.close()
