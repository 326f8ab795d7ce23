"""The Grafana dashboard in deploy/grafana only queries metrics the manager really exports."""

from __future__ import annotations

import json
import re
from pathlib import Path

from prometheus_client.parser import text_string_to_metric_families

from mesh.manager.metrics import ManagerMetrics, MeshView, QueueStat
from mesh.wire import AdmissionDecision, AdmissionReason
from mesh.wire.status import AgentStatus, CapabilityStatus

from .builders import tally_of
from .samples import DESCRIPTOR

DASHBOARD = Path(__file__).parents[2] / "deploy" / "grafana" / "agent-mesh.json"
METRIC = re.compile(r"\bmesh_[a-z_]+\b")
SUFFIXES = ("", "_total", "_bucket", "_count", "_sum", "_created")


def exported() -> tuple[set[str], dict[str, set[str]]]:
    """Every sample name a busy manager exports, and the labels of each."""
    agent = AgentStatus(
        agent_id="a-1",
        deployment="calc",
        state="Ready",
        capabilities=[
            CapabilityStatus(
                name="math.evaluate",
                version="1.0.0",
                cost_class="A",
                in_flight=1,
                max_concurrency=4,
            )
        ],
        in_flight=1,
        last_heartbeat_age_s=0.5,
        registered_age_s=10,
    )
    view = MeshView(
        tally=lambda: tally_of([agent]),
        agent_rows=lambda offset, limit: [agent][offset : offset + limit],
        descriptors=lambda: {DESCRIPTOR.pool_id: DESCRIPTOR},
        active_epochs=lambda: {DESCRIPTOR.pool_id: DESCRIPTOR.descriptor_epoch},
        usage={("calc", "model_slots"): (1, 4), ("*", "tenant_tokens:acme"): (10, 100)},
        queues=[QueueStat("mesh.agent.a-1.tasks", 3, 1.5)],
    )
    metrics = ManagerMetrics(view)
    metrics.admission(
        None,
        AdmissionDecision(
            admission_id="x", outcome="rejected", reason=AdmissionReason.NO_ELIGIBLE_POOL
        ),
        {"pools": [{"pool_id": "calc", "rule": "region_allowed"}]},
    )
    metrics.dead_lettered.labels("MALFORMED_JSON").inc()
    metrics.heartbeat_lag.observe(0.01)
    metrics.release_latency.observe(0.002)
    estimate = {"capability": "math.evaluate", "service_class": "batch", "deadline": 10.0}
    metrics.settled(dict(estimate, estimated_tokens=100), 50, None, 20.0)
    names: set[str] = set()
    labels: dict[str, set[str]] = {}
    for family in text_string_to_metric_families(metrics.render().decode()):
        names.add(family.name)
        for sample in family.samples:
            names.add(sample.name)
            labels.setdefault(sample.name, set()).update(sample.labels)
    return names, labels


def expressions() -> list[str]:
    dashboard = json.loads(DASHBOARD.read_text())
    exprs = [t["expr"] for panel in dashboard["panels"] for t in panel["targets"]]
    exprs += [v["definition"] for v in dashboard["templating"]["list"] if "definition" in v]
    return exprs


def test_every_metric_the_dashboard_queries_is_exported() -> None:
    names, _ = exported()
    used = {name for expr in expressions() for name in METRIC.findall(expr)}
    assert used, "the dashboard queries no mesh_ metric at all"
    missing = sorted(name for name in used if name not in names)
    assert not missing, f"the dashboard queries metrics the manager does not export: {missing}"


def test_every_label_the_dashboard_groups_or_filters_by_exists_on_its_metric() -> None:
    _, labels = exported()
    for expr in expressions():
        for name in METRIC.findall(expr):
            for group in re.findall(r"by \(([^)]*)\)", expr):
                wanted = {label.strip() for label in group.split(",")} - {"le"}
                have = set().union(*(labels.get(name + s, set()) for s in SUFFIXES))
                if name.endswith("_bucket"):
                    continue  # `by (le)` only
                assert wanted <= have, f"{expr!r}: {name} has no label(s) {wanted - have}"
            for selector in re.findall(name + r"\{([^}]*)\}", expr):
                used = {m.group(1) for m in re.finditer(r"(\w+)\s*(?:=~|!=|=)", selector)}
                assert used <= labels.get(name, set()), f"{expr!r}: {name} lacks {used}"


def test_the_dashboard_is_importable_json_with_unique_panel_ids() -> None:
    dashboard = json.loads(DASHBOARD.read_text())
    ids = [panel["id"] for panel in dashboard["panels"]]
    assert len(ids) == len(set(ids)) and dashboard["uid"] == "agent-mesh"
    assert all(panel["datasource"]["uid"] == "${datasource}" for panel in dashboard["panels"])
