"""``mesh explain`` over RabbitMQ: the record of a decision, exactly as it was decided.

A manager gets one descriptor per pool, each built so that a different eligibility rule filters
it. After one admission (granted) and one refusal, ``explain`` — through ``MeshClient`` and
through the ``mesh`` command — must show every pool with the rule the decision recorded, and
re-running :func:`~mesh.core.eligibility.check_eligibility` on the recorded inputs (the
descriptors as published, the record's ``now``, epochs and generation) must give the same
verdicts. A manager restarted on the same ledger explains the same decisions.
"""

from __future__ import annotations

import asyncio
import sys
import time
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import orjson
from unit.samples import DESCRIPTOR

from mesh.core.eligibility import RULE_NAMES, EligibilityResult, check_eligibility
from mesh.manager.service import ManagerService
from mesh.producer import MeshClient
from mesh.transport import AmqpTransport
from mesh.wire import (
    AdmissionReason,
    CapabilityDescriptor,
    CapabilityRange,
    DescriptorAccepted,
    ExplainReply,
    HealthEvidence,
    PoolTool,
    TaskRequirements,
    TenantIsolation,
)

from .harness import live_member, start_manager
from .test_admission import RAG_AGENT, REQUIREMENTS, fresh, settings_for

ROLLOUT_EPOCH = 5


def pools(now: float) -> dict[str, tuple[CapabilityDescriptor, str | None]]:
    """Pool -> (its descriptor, the rule that must filter it for ``REQUIREMENTS``)."""
    cases: list[tuple[str, str | None, dict[str, Any]]] = [
        ("rag-eu", None, {}),
        (
            "rag-answer",
            "capability_offered",
            {"capabilities": [CapabilityRange(name="rag.answer", version_spec="==1.*")]},
        ),
        ("rag-schema2", "schema_compatible", {"task_schema_range": ">=2,<3"}),
        (
            "rag-notools",
            "tools_allowed",
            {"tools": [PoolTool(name="code.exec", version="1.0.0", permits=2)]},
        ),
        ("rag-public", "classification_allowed", {"data_classifications": ["public"]}),
        (
            "rag-dedicated",
            "tenant_isolation",
            {"tenant_isolation": TenantIsolation(mode="dedicated", tenants=["another-tenant"])},
        ),
        ("rag-us", "region_allowed", {"regions": ["us-east-1"]}),
        ("rag-rollout", "epoch_current", {"descriptor_epoch": 4}),
        ("rag-gen6", "generation_current", {"policy_generation": 6}),
        ("rag-expiring", "not_expired", {"expires_at": now + 1.0}),
        ("rag-sick", "healthy", {"health": HealthEvidence(status="unhealthy", checked_at=now)}),
    ]
    return {pool_id: (fresh(pool_id=pool_id, **changes), rule) for pool_id, rule, changes in cases}


async def mesh_cli(amqp_url: str, namespace: str, *args: str) -> tuple[int, str, str]:
    """The ``mesh`` command in a subprocess (without blocking the manager on this loop)."""
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "mesh", "--amqp-url", amqp_url, "--namespace", namespace, *args,
        stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE,
    )  # fmt: skip
    out, err = await asyncio.wait_for(proc.communicate(), 60)
    assert proc.returncode is not None
    return proc.returncode, out.decode(), err.decode()


def replay(
    record: dict[str, object],
    requirements: TaskRequirements,
    tenant: str,
    published: dict[str, CapabilityDescriptor],
) -> EligibilityResult:
    """Eligibility re-run on a record's inputs: its ``now``, its epochs and its generation."""
    recorded = EligibilityResult.from_record(record)
    return check_eligibility(
        requirements,
        tenant,
        published,
        active_epochs={
            v.pool_id: v.active_epoch for v in recorded.verdicts if v.active_epoch is not None
        },
        active_generation=recorded.active_generation,
        now=recorded.now,
    )


def pool_lines(text: str) -> dict[str, str]:
    """The rows of the pool table in ``mesh explain``'s text, by pool ID."""
    rows = text.split("VERDICT\n", 1)[1].split("\n\n", 1)[0]
    return {line.split()[0]: line for line in rows.splitlines()}


async def test_explain_reproduces_the_filtering_of_a_recorded_decision_exactly(
    amqp_url: str, namespace: str, tmp_path: Path
) -> None:
    tenant = urlsplit(amqp_url).username or "guest"  # the authenticated producer
    settings = settings_for(amqp_url, namespace, tmp_path)
    manager: ManagerService | None = await start_manager(settings)
    client = await MeshClient.connect(amqp_url, namespace=namespace, name="explain-test")
    transport = await AmqpTransport.connect(amqp_url, name="rag-eu-agent")
    try:
        assert manager is not None and manager.admitter is not None
        await live_member(manager, transport, "rag-eu-1", "rag-eu", RAG_AGENT)
        cases = pools(time.time())
        published = {pool_id: descriptor for pool_id, (descriptor, _) in cases.items()}
        for descriptor in published.values():
            assert isinstance(await client.publish_descriptor(descriptor), DescriptorAccepted)
        # A rollout that has moved the pool's active epoch on before its descriptor arrived.
        # Nothing on the wire does this yet (the manager activates what it accepts), so the
        # test sets the state the epoch rule guards against.
        manager.admitter.set_active_epoch("rag-rollout", ROLLOUT_EPOCH)
        await asyncio.sleep(1.2)  # rag-expiring expires

        granted = await client.admit(REQUIREMENTS, admission_id="adm-explain")
        elsewhere = REQUIREMENTS.model_copy(update={"regions": ["ap-south-1"]})
        refused = await client.admit(elsewhere, admission_id="adm-explain-refused")
        assert granted.outcome == "admitted" and granted.grant is not None
        assert granted.grant.pool_id == "rag-eu"
        assert (refused.outcome, refused.reason) == ("rejected", AdmissionReason.NO_ELIGIBLE_POOL)

        reply = await client.explain("adm-explain")

        # Every pool, with the rule each was built to fail, in pool_id order — and every rule
        # but none filtered something.
        assert reply.found and reply.decision == granted
        record = reply.eligibility
        assert record is not None
        rules = {p["pool_id"]: p["rule"] for p in record["pools"]}
        assert rules == {pool_id: rule for pool_id, (_, rule) in cases.items()}
        assert [p["pool_id"] for p in record["pools"]] == sorted(cases)
        assert set(rules.values()) == {None, *RULE_NAMES}
        assert record["eligible"] == ["rag-eu"]
        rollout = next(p for p in record["pools"] if p["pool_id"] == "rag-rollout")
        assert (rollout["descriptor_epoch"], rollout["active_epoch"]) == (4, ROLLOUT_EPOCH)
        assert record["active_generation"] == DESCRIPTOR.policy_generation

        # What explain says is what the decision wrote into the ledger: the time it was
        # evaluated at, and the snapshot of the verdicts it names (stored once, by content).
        row = manager.admitter.ledger.decision("adm-explain")
        assert row is not None
        stored = orjson.loads(row.record)
        body = manager.admitter.ledger.eligibility(stored["eligibility_ref"])
        assert body is not None and "now" not in orjson.loads(body)
        assert {**orjson.loads(body), "now": stored["evaluated_at"]} == record

        # Replayed on the recorded inputs, eligibility gives the same verdicts, details included.
        assert replay(record, REQUIREMENTS, tenant, published).to_record() == record
        refused_reply = await client.explain("adm-explain-refused")
        refused_record = refused_reply.eligibility
        assert refused_record is not None and refused_reply.decision == refused
        assert replay(refused_record, elsewhere, tenant, published).to_record() == refused_record
        assert refused.detail == ", ".join(
            f"{p['pool_id']}: {p['rule']}" for p in refused_record["pools"]
        )
        assert refused_reply.reservation is None

        # The reservation behind the grant.
        held = reply.reservation
        assert held is not None
        assert (held["state"], held["fence"], held["pool_id"]) == (
            "ACTIVE",
            granted.grant.fence,
            "rag-eu",
        )
        assert held["expires_at"] == granted.grant.expires_at

        # The command: --json is the reply itself; the text names every pool's verdict.
        code, out, err = await mesh_cli(amqp_url, namespace, "explain", "adm-explain", "--json")
        assert code == 0, err
        assert ExplainReply.model_validate_json(out) == reply
        code, text, err = await mesh_cli(amqp_url, namespace, "explain", "adm-explain")
        assert code == 0, err
        rows = pool_lines(text)
        assert sorted(rows) == sorted(cases)
        for pool in record["pools"]:
            line = rows[pool["pool_id"]]
            assert line.split()[1:3] == [str(pool["descriptor_epoch"]), str(pool["active_epoch"])]
            verdict = f"{pool['rule']} — {pool['detail']}" if pool["rule"] else "eligible"
            assert line.endswith(verdict), line
        assert "6≠7" in rows["rag-gen6"]
        assert "outcome      admitted" in text
        assert f"reservation  ACTIVE · fence {granted.grant.fence} · pool rag-eu" in text
        assert "    expires    " in text and "(in " in text

        code, text, _ = await mesh_cli(amqp_url, namespace, "explain", "adm-explain-refused")
        assert code == 0
        assert "outcome      rejected NO_ELIGIBLE_POOL" in text
        assert "reservation  none" in text
        code, text, _ = await mesh_cli(amqp_url, namespace, "explain", "never-decided")
        assert code == 1 and "no admission 'never-decided'" in text

        # A manager restarted on the same ledger explains the same decisions.
        await manager.stop()
        manager = None
        manager = await start_manager(settings)
        again = await client.explain("adm-explain")
        assert again.decision == reply.decision
        assert again.eligibility == reply.eligibility
        assert again.reservation == reply.reservation
        refused_again = await client.explain("adm-explain-refused")
        assert refused_again.eligibility == refused_record
    finally:
        await client.close()
        await transport.close()
        if manager is not None:
            await manager.stop()
