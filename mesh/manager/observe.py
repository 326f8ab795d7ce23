"""What the manager shows operators: metrics, history, the status document, queue polling.

:class:`Observer` is the one object :class:`~mesh.manager.service.ManagerService` talks to
about observability. It owns the :class:`~mesh.manager.metrics.ManagerMetrics`, the
:class:`~mesh.manager.web.StatusHistory`, the pools' signals for scaling
(:class:`~mesh.manager.pool_signals.PoolSignalSource`) and, when a port is configured, the
:class:`~mesh.manager.web.ManagerWeb` server. The service calls it at four points: every
admission decision (``admitted``), every dead-lettered message, every tick (``tick``: a
ledger-usage snapshot, a history sample, and every ``queue_poll_interval_s`` the queue
depths from the RabbitMQ management API), and on ``/api/status`` (``document``).

Reading the management API is best effort: a failure is logged once per outage and counted
(``queue_poll_failed``); the previous depths are dropped rather than shown stale.
"""

from __future__ import annotations

import base64
import logging
import time
from collections import Counter
from collections.abc import Callable, Mapping, Sequence
from typing import Any
from urllib.parse import quote, unquote, urlsplit, urlunsplit

import aiohttp

from mesh import constants as c
from mesh.core.capacity import LiveCapacity
from mesh.core.line import PoolLine
from mesh.core.pressure import PoolPressure
from mesh.core.tally import FleetTally
from mesh.manager.metrics import ManagerMetrics, MeshView, QueueStat
from mesh.manager.pool_signals import PoolSignalSource
from mesh.manager.web import ManagerWeb, Sample, StatusHistory, management_queue_url
from mesh.topology import names
from mesh.topology.specs import PolicySpec
from mesh.transport.addresses import first_url
from mesh.wire.admission import AdmissionDecision, CapabilityDescriptor, TaskRequirements
from mesh.wire.models import Heartbeat
from mesh.wire.status import AgentStatus

log = logging.getLogger(__name__)


def split_management_url(url: str) -> tuple[str, dict[str, str]]:
    """``http://user:pass@host:15672`` → (``http://host:15672``, its Authorization header)."""
    parts = urlsplit(url)
    auth = {}
    if parts.username is not None:
        token = f"{unquote(parts.username)}:{unquote(parts.password or '')}".encode()
        auth["Authorization"] = "Basic " + base64.b64encode(token).decode()
    host = parts.hostname or "127.0.0.1"
    netloc = f"{host}:{parts.port}" if parts.port else host
    return urlunsplit((parts.scheme or "http", netloc, parts.path.rstrip("/"), "", "")), auth


def vhost_of(amqp_url: str) -> str:
    """The virtual host an AMQP URL names (``/`` when it names none)."""
    path = urlsplit(first_url(amqp_url)).path  # several addresses share one vhost
    return unquote(path[1:]) if len(path) > 1 else "/"


class Observer:
    """Metrics, history and the status page of one manager."""

    def __init__(
        self,
        *,
        manager_id: str,
        namespace: str,
        vhost: str,
        tally: Callable[[], FleetTally],
        agent_rows: Callable[[int, int], list[AgentStatus]],
        descriptors: Callable[[], Mapping[str, CapabilityDescriptor]],
        active_epochs: Callable[[], Mapping[str, int]],
        active_generation: int,
        counters: Counter[str],
        started_at: float,
        offers: Callable[[str], bool] = lambda _: False,
        pressure: Callable[[], Mapping[str, PoolPressure]] = dict,
        management_url: str | None = None,
        queue_poll_interval_s: float = 5.0,
        shards: Callable[[], Mapping[int, int]] = dict,
        shard_owners: Callable[[], tuple[int, list[tuple[int, str, int]]] | None] = lambda: None,
        live: Callable[[], LiveCapacity] = LiveCapacity,
        lines: Callable[[], Mapping[str, PoolLine]] = dict,
        desired_replicas: Callable[[str], int | None] = lambda _: None,
    ) -> None:
        self.manager_id = manager_id
        self.namespace = namespace
        self.vhost = vhost
        self.counters = counters
        self.started_at = started_at
        self.shard_owners = shard_owners  # (count, [(shard, owner, fence)]) with shards
        self.history = StatusHistory()
        self.view = MeshView(
            tally=tally,
            agent_rows=agent_rows,
            offers=offers,
            descriptors=descriptors,
            active_epochs=active_epochs,
            active_generation=lambda: active_generation,
            now=time.time,
            pressure=pressure,
            manager_id=manager_id,
            shards=shards,
            shard_transfers=lambda: {
                change: counters[f"shards_{change}"]
                for change in ("taken", "given_back", "lost")
                if counters[f"shards_{change}"]
            },
            live_writes=lambda: {
                outcome: counters[name]
                for outcome, name in (("written", "live_writes"), ("fenced", "live_writes_fenced"))
                if counters[name]
            },
        )
        self.metrics = ManagerMetrics(self.view)
        self.pool_signals = PoolSignalSource(
            self.view, namespace, live=live, lines=lines, desired=desired_replicas
        )
        self.management_url = management_url
        self.queue_poll_interval_s = queue_poll_interval_s
        self._api: str | None = None
        self._auth: dict[str, str] = {}
        if management_url:
            self._api, self._auth = split_management_url(management_url)
        self._session: aiohttp.ClientSession | None = None
        self._polled_at = float("-inf")
        self._poll_failing = False
        self.web: ManagerWeb | None = None

    # ---- lifecycle --------------------------------------------------------------------------
    async def serve(self, host: str, port: int) -> str:
        """Start the HTTP server; its URL."""
        self.web = ManagerWeb(
            self.metrics, self.document, host=host, port=port, pools=self.pool_signals.signals
        )
        await self.web.start()
        return self.web.url

    async def close(self) -> None:
        if self.web is not None:
            await self.web.close()
            self.web = None
        if self._session is not None:
            await self._session.close()
            self._session = None

    async def close_agent_connections(
        self, agent_id: str, incarnation: str, reason: str
    ) -> int | None:
        """Close the connections of one lost incarnation of an agent through the management
        API: named ``agent:<agent_id>`` (the name agents give theirs) and tagged with that
        incarnation (client property ``mesh_incarnation``), or untagged (an agent that does
        not tag its connection cannot be told from its successor; it is closed as before).
        How many were closed, or ``None`` without the API or when it fails (logged)."""
        if self._api is None:
            return None
        name = f"agent:{agent_id}"
        tag = c.CLIENT_PROPERTY_INCARNATION
        url = f"{self._api}/api/connections"
        try:
            session = self._client_session()
            params = {"columns": f"name,client_properties.connection_name,client_properties.{tag}"}
            async with session.get(url, params=params) as response:
                response.raise_for_status()
                rows = await response.json()
            names = [
                str(row["name"])
                for row in rows
                if (props := row.get("client_properties") or {}).get("connection_name") == name
                and props.get(tag, incarnation) == incarnation
            ]
            for connection in names:
                headers = {"X-Reason": f"mesh: agent {agent_id} lost: {reason}"[:200]}
                async with session.delete(
                    f"{url}/{quote(connection, safe='')}", headers=headers
                ) as response:
                    if response.status not in (204, 404):  # 404: closed meanwhile
                        response.raise_for_status()
        except (aiohttp.ClientError, TimeoutError, ValueError, KeyError) as exc:
            log.warning(
                "cannot close a lost agent's connections",
                extra={"agent_id": agent_id, "error": str(exc)},
            )
            return None
        return len(names)

    @property
    def has_management_api(self) -> bool:
        return self._api is not None

    async def apply_policy(self, policy: PolicySpec) -> bool:
        """Set ``policy`` on the vhost through the management API (idempotent: a PUT);
        ``False`` without the API or when it fails (logged and counted)."""
        if self._api is None:
            return False
        url = f"{self._api}/api/policies/{quote(self.vhost, safe='')}/{quote(policy.name, safe='')}"
        try:
            async with self._client_session().put(url, json=policy.to_api()) as response:
                if response.status not in (201, 204):
                    body = (await response.text())[:300]
                    raise aiohttp.ClientError(f"HTTP {response.status}: {body}")
        except (aiohttp.ClientError, TimeoutError) as exc:
            self.counters["policy_failed"] += 1
            log.warning(
                "cannot set a queue policy",
                extra={"policy": policy.name, "url": url, "error": str(exc)},
            )
            return False
        self.counters["policy_applied"] += 1
        return True

    def _client_session(self) -> aiohttp.ClientSession:
        if self._session is None:
            self._session = aiohttp.ClientSession(
                headers=self._auth, timeout=aiohttp.ClientTimeout(total=3)
            )
        return self._session

    # ---- events -----------------------------------------------------------------------------
    def admitted(
        self,
        at: float,
        requirements: TaskRequirements | None,
        decision: AdmissionDecision,
        eligibility: Mapping[str, object] | None,
    ) -> None:
        self.metrics.admission(requirements, decision, eligibility)
        self.pool_signals.decided(at, decision, eligibility)
        if decision.outcome != "admitted":
            reason = decision.reason.value if decision.reason else decision.outcome
            self.history.refusal(
                at, decision.admission_id, decision.outcome, reason, decision.detail or ""
            )

    def dead_lettered(self, reason: str) -> None:
        self.metrics.dead_lettered.labels(reason).inc()

    def heartbeat_rejected(self, reason: str) -> None:
        self.metrics.heartbeats_rejected.labels(reason).inc()

    def heartbeats(self, heartbeats: Sequence[Heartbeat], now: float) -> None:
        """The lag of each heartbeat of a batch, counted in one call."""
        self.metrics.heartbeat_lag.observe_many([max(0.0, now - hb.sent_at) for hb in heartbeats])

    async def tick(self, usage: dict[tuple[str, str], tuple[int, int]] | None) -> None:
        """Once per manager tick: the ledger usage snapshot, queues when due, a sample."""
        if usage is not None:
            self.view.usage = usage
        if (
            self._api is not None
            and time.monotonic() - self._polled_at >= self.queue_poll_interval_s
        ):
            self._polled_at = time.monotonic()
            self.view.queues = await self._poll_queues()
        self.history.sample(
            Sample(
                at=time.time(),
                admitted=self.counters["admission.admitted"],
                refused=self.counters["admission.rejected"] + self.counters["admission.deferred"],
                queue_messages=sum(q.messages for q in self.view.queues),
                agents_ready=self.view.tally().taking_work,
            )
        )

    async def _poll_queues(self) -> list[QueueStat]:
        assert self._api is not None
        url = f"{self._api}/api/queues/{quote(self.vhost, safe='')}"
        params = {"columns": "name,messages,head_message_timestamp"}
        try:
            async with self._client_session().get(url, params=params) as response:
                response.raise_for_status()
                rows = await response.json()
        except (aiohttp.ClientError, TimeoutError, ValueError) as exc:
            self.counters["queue_poll_failed"] += 1
            if not self._poll_failing:
                log.warning("cannot read queue depths", extra={"url": url, "error": str(exc)})
            self._poll_failing = True
            return []
        self._poll_failing = False
        return queue_stats(rows, f"{self.namespace}.", time.time())

    # ---- the status document ----------------------------------------------------------------
    def document(self, agents_offset: int = 0, agents_limit: int = 200) -> dict[str, Any]:
        """Everything ``/api/status`` shows (and the page draws): figures from running
        aggregates, and one page of agent rows (``agents_total`` says how many there are)."""
        view = self.view
        tally = view.tally()
        agents = view.agent_rows(agents_offset, agents_limit)
        descriptors = view.descriptors()
        epochs = view.active_epochs()
        ui = self._api  # the management UI lives where its API does
        pools: dict[str, dict[str, Any]] = {}
        for pool_id, descriptor in sorted(descriptors.items()):
            pools[pool_id] = {
                "pool_id": pool_id,
                "descriptor_epoch": descriptor.descriptor_epoch,
                "active_epoch": epochs.get(pool_id),
                "expires_at": descriptor.expires_at,
                "capabilities": sorted({c.name for c in descriptor.capabilities}),
                "agents": {},
            }
        for deployment, states in tally.pools().items():
            pool = pools.setdefault(
                deployment,
                {
                    "pool_id": deployment,
                    "descriptor_epoch": None,
                    "active_epoch": None,
                    "expires_at": None,
                    "capabilities": [],
                    "agents": {},
                },
            )
            pool["agents"] = states
        pressure = view.pressure()
        for pool_id, pool in pools.items():
            p = pressure.get(pool_id)
            pool["stage"] = p.stage.name if p is not None else None
            pool["stage_since"] = p.since if p is not None else None
        worst = max((p.stage for p in pressure.values()), default=None)
        owners = self.shard_owners()
        return {
            "manager_id": self.manager_id,
            "namespace": self.namespace,
            # Several managers: who holds which shard (this page shows this manager's agents).
            "shards": None
            if owners is None
            else {
                "count": owners[0],
                "owners": [{"shard": s, "owner": o, "fence": f} for s, o, f in owners[1]],
            },
            "uptime_s": time.monotonic() - self.started_at,
            "management_ui": ui,
            "pressure": {"stage": worst.name if worst is not None else None},
            "pools": list(pools.values()),
            "agents_total": tally.agents,
            "agents_by_state": dict(sorted(tally.by_state.items())),
            "agents_offset": agents_offset,
            "agents": [
                {
                    "agent_id": a.agent_id,
                    "deployment": a.deployment,
                    "state": a.state,
                    "in_flight": a.in_flight,
                    "capacity": sum(c.max_concurrency for c in a.capabilities),
                    "capabilities": [c.name for c in a.capabilities],
                    "last_heartbeat_age_s": a.last_heartbeat_age_s,
                    "task_queue": names.agent_task_queue(self.namespace, a.agent_id),
                    "task_queue_url": management_queue_url(
                        ui, self.vhost, names.agent_task_queue(self.namespace, a.agent_id)
                    ),
                }
                for a in agents
            ],
            "capabilities": [
                {
                    "capability": name,
                    "in_flight": load.in_flight,
                    "capacity": load.capacity,
                    "agents": load.agents,
                }
                for name, load in sorted(tally.loads.items())
            ],
            "queues": [
                {
                    "name": q.name,
                    "messages": q.messages,
                    "oldest_age_s": q.oldest_age_s,
                    "url": management_queue_url(ui, self.vhost, q.name),
                }
                for q in view.queues
            ],
            "reservations": [
                {"pool": pool, "resource": resource, "used": used, "capacity": capacity}
                for (pool, resource), (used, capacity) in sorted(view.usage.items())
            ],
            "recent_refusals": list(self.history.refusals),
            "history": [
                {
                    "at": s.at,
                    "admitted": s.admitted,
                    "refused": s.refused,
                    "queue_messages": s.queue_messages,
                    "agents_ready": s.agents_ready,
                }
                for s in self.history.samples
            ],
            "counters": dict(sorted(self.counters.items())),
        }


def queue_stats(rows: Sequence[Mapping[str, Any]], prefix: str, now: float) -> list[QueueStat]:
    """The namespace's queues from a management API ``/api/queues`` answer."""
    stats = []
    for row in rows:
        name = row.get("name")
        if not isinstance(name, str) or not name.startswith(prefix):
            continue
        messages = row.get("messages")
        head = row.get("head_message_timestamp")
        age = max(0.0, now - float(head)) if isinstance(head, int | float) else None
        stats.append(QueueStat(name, int(messages) if isinstance(messages, int) else 0, age))
    return sorted(stats, key=lambda q: q.name)
