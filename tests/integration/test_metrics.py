"""``/metrics`` scraped during a real run on the broker: the families move as events happen.

A manager with its HTTP port open, two sample agents (calc and textstats) and a producer.
Each step scrapes ``/metrics`` (parsed with prometheus-client's own parser) and checks the
series an operator would look at: agents by capability and state, admissions by decision and
reason code, the eligibility rule that filtered a pool, reservation utilisation, dead letters,
heartbeat lag — and that a drained agent's series disappear.
"""

from __future__ import annotations

import asyncio
import dataclasses
import time
import urllib.request
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import pytest
from prometheus_client.parser import text_string_to_metric_families

from mesh.agent import AgentRuntime, AgentSettings
from mesh.manager.service import ManagerService
from mesh.producer import MeshClient
from mesh.samples import SAMPLES
from mesh.topology import Topology
from mesh.topology.names import rpc_key
from mesh.wire import AdmissionReason, CapabilityRange

from .harness import eventually, start_manager
from .test_admission import settings_for
from .test_grant_enforcement import CALC, CALC_REQUIREMENTS

Series = dict[tuple[str, tuple[tuple[str, str], ...]], float]


async def scrape(url: str) -> Series:
    """Every sample of ``/metrics``: (name, sorted labels) -> value."""
    loop = asyncio.get_running_loop()
    text = await loop.run_in_executor(
        None, lambda: urllib.request.urlopen(url + "metrics", timeout=5).read().decode()
    )
    series: Series = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            series[(sample.name, tuple(sorted(sample.labels.items())))] = sample.value
    return series


def value(series: Series, name: str, **labels: str) -> float:
    return series.get((name, tuple(sorted(labels.items()))), 0.0)


def names_with(series: Series, name: str, **labels: str) -> list[dict[str, str]]:
    """Label sets of every ``name`` sample that carries ``labels``."""
    wanted = set(labels.items())
    return [dict(ls) for (n, ls), _ in series.items() if n == name and wanted <= set(ls)]


def runtime(amqp_url: str, namespace: str, key: str, agent_id: str) -> AgentRuntime:
    agent = SAMPLES[key](agent_id, heartbeat_interval_s=5.0)
    return AgentRuntime(agent, AgentSettings(amqp_url=amqp_url, namespace=namespace))


@pytest.fixture
async def observed_manager(
    amqp_url: str, namespace: str, tmp_path: Path, management_api: Any
) -> AsyncIterator[ManagerService]:
    parts = urlsplit(management_api.base_url)
    user, password = urlsplit(amqp_url).username or "guest", urlsplit(amqp_url).password or "guest"
    settings = dataclasses.replace(
        settings_for(amqp_url, namespace, tmp_path),
        http_port=0,
        http_host="127.0.0.1",
        tick_interval_s=0.2,
        management_url=f"{parts.scheme}://{user}:{password}@{parts.netloc}",
        queue_poll_interval_s=0.5,
    )
    service = await start_manager(settings)
    yield service
    await service.stop()


async def test_metrics_follow_agents_admissions_refusals_and_drains(
    amqp_url: str, namespace: str, observed_manager: ManagerService, topology: Topology
) -> None:
    web = observed_manager.observer.web
    assert web is not None
    url = web.url
    calc = runtime(amqp_url, namespace, "calc", "calc-metrics")
    text = runtime(amqp_url, namespace, "textstats", "text-metrics")
    client = await MeshClient.connect(amqp_url, namespace=namespace, name="metrics-producer")
    try:
        await calc.start()
        await text.start()
        ready = {"capability": "math.evaluate", "state": "Ready"}
        text_ready = {"capability": "text.stats", "state": "Ready"}

        async def both_ready() -> bool:
            s = await scrape(url)
            return (
                value(s, "mesh_agents", **ready) == 1 and value(s, "mesh_agents", **text_ready) == 1
            )

        await eventually(both_ready, what="both agents Ready in /metrics")
        series = await scrape(url)
        assert value(series, "mesh_capacity", capability="math.evaluate") == 4
        assert value(series, "mesh_in_flight", capability="math.evaluate") == 0

        # A descriptor, then an admission the pool can take, then one it cannot.
        await client.publish_descriptor(CALC)
        before = await scrape(url)
        assert value(before, "mesh_eligible_pools", capability="math.evaluate") == 1
        granted = await client.admit(CALC_REQUIREMENTS, admission_id="adm-metrics-ok")
        assert granted.outcome == "admitted"
        elsewhere = CALC_REQUIREMENTS.model_copy(update={"regions": ["ap-south-1"]})
        refused = await client.admit(elsewhere, admission_id="adm-metrics-refused")
        assert refused.reason is AdmissionReason.NO_ELIGIBLE_POOL

        labels = {"capability": "math.evaluate", "service_class": CALC_REQUIREMENTS.service_class}
        after = await scrape(url)
        ok = dict(labels, decision="admitted", reason="none")
        no = dict(labels, decision="rejected", reason="NO_ELIGIBLE_POOL")
        assert (
            value(after, "mesh_admissions_total", **ok)
            == value(before, "mesh_admissions_total", **ok) + 1
        )
        assert (
            value(after, "mesh_admissions_total", **no)
            == value(before, "mesh_admissions_total", **no) + 1
        )
        region = {"capability": "math.evaluate", "rule": "region_allowed"}
        assert value(after, "mesh_match_failures_total", **region) == 1

        async def slot_reserved() -> bool:
            s = await scrape(url)
            return value(s, "mesh_reservation_utilisation", pool="calc", resource="model_slots") > 0

        await eventually(slot_reserved, what="the ledger's usage in /metrics")

        # An unknown capability is counted, without minting a series for it.
        unknown = CALC_REQUIREMENTS.model_copy(
            update={"capability": CapabilityRange(name="no.such.thing", version_spec=">=1")}
        )
        await client.admit(unknown, admission_id="adm-metrics-unknown")
        series = await scrape(url)
        assert not names_with(series, "mesh_admissions_total", capability="no.such.thing")
        assert names_with(series, "mesh_admissions_total", capability="(unknown)")

        # Garbage on the rpc queue is dead-lettered with its reason and counted.
        await client.transport.publish(topology.control_exchange, rpc_key("admit"), b"{not json")

        async def dead_lettered() -> bool:
            s = await scrape(url)
            return value(s, "mesh_dead_lettered_messages_total", reason="MALFORMED_JSON") == 1

        await eventually(dead_lettered, what="the dead letter counted in /metrics")

        # Queue depth and the age of the oldest message come from the management API (its
        # statistics refresh every few seconds): the dead letter waits in its queue. RabbitMQ
        # reports no head-message timestamp for quorum queues (the dead-letter queue is one),
        # so the age is shown on a classic queue: an agent's control queue nobody consumes.
        dead_letter_queue = topology.dead_letter_queue
        idle = topology.agent_control_queue("idle-agent")
        await client.transport.declare(topology.agent_queues("idle-agent", 2))
        await client.transport.publish(
            topology.agents_exchange, "idle-agent", b"{}", persistent=True
        )

        async def depth_and_age_seen() -> bool:
            s = await scrape(url)
            age = value(s, "mesh_queue_oldest_message_age_seconds", queue=idle)
            return (
                value(s, "mesh_queue_messages", queue=dead_letter_queue) >= 1
                and bool(names_with(s, "mesh_queue_oldest_message_age_seconds", queue=idle))
                and 0 < age < 600  # a real age: the message has waited, and not for ages
            )

        await eventually(depth_and_age_seen, what="queue depth and age", timeout_s=30)
        series = await scrape(url)
        queues = {labels["queue"] for labels in names_with(series, "mesh_queue_messages")}
        assert f"{namespace}.manager.rpc" in queues
        assert all(q.startswith(f"{namespace}.") for q in queues)  # only this mesh's queues

        # Settlement: a completed phase reports its actual cost (here half the estimated
        # tokens, finished after its deadline); a release without actuals is a cancellation.
        timed = CALC_REQUIREMENTS.model_copy(update={"deadline": time.time() + 60})
        late = await client.admit(timed, admission_id="adm-metrics-late")
        assert late.grant is not None and granted.grant is not None
        assert timed.deadline is not None
        done = await client.release_admission(
            late.grant,
            actual_tokens=timed.estimated_tokens // 2,
            actual_duration_s=timed.estimated_duration_s * 4,
            finished_at=timed.deadline + 5,
        )
        cancelled = await client.release_admission(granted.grant)
        assert done.released and cancelled.released
        series = await scrape(url)
        tokens = dict(labels, measure="tokens")
        assert value(series, "mesh_cost_estimate_ratio_count", **tokens) == 1
        assert value(series, "mesh_cost_estimate_ratio_sum", **tokens) == pytest.approx(2.0)
        if timed.estimated_duration_s:
            duration = dict(labels, measure="duration")
            assert value(series, "mesh_cost_estimate_ratio_sum", **duration) == pytest.approx(0.25)
        assert value(series, "mesh_deadline_misses_total", **labels) == 1
        assert value(series, "mesh_settlements_total", **labels, how="completed") == 1
        assert value(series, "mesh_settlements_total", **labels, how="cancelled") == 1
        assert value(series, "mesh_admission_release_seconds_count") == 2

        # Heartbeats arrive and their lag is observed.
        async def heartbeats_seen() -> bool:
            return value(await scrape(url), "mesh_heartbeat_lag_seconds_count") > 0

        await eventually(heartbeats_seen, what="heartbeat lag observed", timeout_s=15)

        # Drain the only textstats agent: its capability's series disappear.
        await client.drain(text.agent_id, reason="metrics test")

        async def text_gone() -> bool:
            return not names_with(await scrape(url), "mesh_agents", capability="text.stats")

        await eventually(text_gone, what="the drained agent's series gone from /metrics")
        series = await scrape(url)
        assert value(series, "mesh_agents", **ready) == 1  # the other one is untouched
        assert not names_with(series, "mesh_capacity", capability="text.stats")
    finally:
        await client.close()
        await text.stop()
        await calc.stop()
