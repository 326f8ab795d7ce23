"""One task, one trace, across three real processes: ``mesh manager``, ``mesh agent echo`` and
a producer script, each exporting its spans with the OpenTelemetry SDK as ``mesh`` sets it up
from the environment (``OTEL_TRACES_EXPORTER=mesh_jsonl``: one JSON line per span, in a file
per process that the test reads).

* A ``submit`` deferred once for ``CAPACITY`` (the pool's one slot held by a slow task), then
  admitted, is one trace: the caller's span, ``submit``, the requests it sent, the manager's
  two ``admission`` spans (deferred, then admitted, with the decision's attributes), the
  task's send and the agent's ``invoke_agent`` run — from all three services, each span the
  child of the message that caused it — and the deferral as an event with its reason.
* The same for ``run_task`` on the lease path (the manager's ``acquire`` span).
* A producer whose sampler drops its traces makes no process export anything: the manager and
  the agent follow the sampling decision the messages carry.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import sys
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from mesh.core.policy.settings import Stage
from mesh.manager.admission import AdmissionPolicy
from mesh.producer import MeshClient
from mesh.wire import CapabilityRange
from mesh.wire.admission import local_descriptor

from .harness import eventually

pytest.importorskip("opentelemetry.sdk", reason="tracing needs the otel extra")

AGENT_ID = "echo-traced"
AGENT_SERVICE = f"mesh-agent-{AGENT_ID}"

# The producer: a process of its own, its SDK set up as the `mesh` CLI sets up its own.
PRODUCER = r"""
import asyncio, json, sys
from mesh.tracing.setup import PRODUCER_SERVICE, configure

print(json.dumps({"configured": configure(PRODUCER_SERVICE)}), flush=True)

from mesh import tracing
from mesh.demo import requirements
from mesh.producer import MeshClient


async def main(url, namespace):
    client = await MeshClient.connect(url, namespace=namespace, name="traced-producer")
    found = tracing.tracer()
    out = {"deferrals": []}
    try:
        # The pool's one slot held by a slow task, so the next submit is deferred once: it
        # waits (on_deferred) until that task is done, then asks again and is admitted.
        slow = asyncio.create_task(client.submit(
            requirements("test.echo", ">=1"), {"message": "slow", "sleep_ms": 3000},
            timeout_s=30,
        ))
        await asyncio.sleep(1.0)  # the slow one admitted and running

        async def deferred(decision):
            out["deferrals"].append(decision.reason.value)
            await asyncio.shield(slow)
            return True

        step = found.start_as_current_span("plan step") if found else None
        with step or _nothing() as span:
            done = await client.submit(
                requirements("test.echo", ">=1"), {"message": "traced"}, timeout_s=30,
                on_deferred=deferred,
            )
            out["submit_trace"] = _trace_of(span)
            out["admission_id"] = done.decision.admission_id
        step = found.start_as_current_span("plan step") if found else None
        with step or _nothing() as span:
            ran = await client.run_task("test.echo", {"message": "leased"}, timeout_s=30)
            out["run_task_trace"] = _trace_of(span)
            out["lease_id"] = ran.lease.lease_id
        await slow
    finally:
        await client.close()
    print(json.dumps(out), flush=True)


def _trace_of(span):
    return None if span is None else format(span.get_span_context().trace_id, "032x")


class _nothing:
    def __enter__(self):
        return None

    def __exit__(self, *exc):
        return None


asyncio.run(main(sys.argv[1], sys.argv[2]))
"""


@dataclass
class Traced:
    """The processes' span files, by service."""

    files: dict[str, Path]

    def spans(self, service: str) -> list[dict[str, Any]]:
        path = self.files[service]
        if not path.exists():
            return []
        return [json.loads(line) for line in path.read_text().splitlines() if line]

    def trace(self, trace_id: str) -> list[dict[str, Any]]:
        return [
            s for service in self.files for s in self.spans(service) if s["trace_id"] == trace_id
        ]


def traced_env(path: Path, **more: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("OTEL_", "MESH_HTTP"))}
    env.update(OTEL_TRACES_EXPORTER="mesh_jsonl", MESH_OTEL_JSONL_PATH=str(path), **more)
    return env


async def spawn(argv: list[str], env: dict[str, str], log: Path) -> asyncio.subprocess.Process:
    with log.open("ab") as out:
        return await asyncio.create_subprocess_exec(
            *argv, stdout=out, stderr=asyncio.subprocess.STDOUT, env=env, start_new_session=True
        )


async def stop(proc: asyncio.subprocess.Process) -> None:
    if proc.returncode is None:
        with contextlib.suppress(ProcessLookupError):
            proc.terminate()
        try:
            await asyncio.wait_for(proc.wait(), 20)
        except TimeoutError:
            proc.kill()
            await proc.wait()


@contextlib.asynccontextmanager
async def manager_and_agent(
    amqp_url: str, namespace: str, tmp: Path, **env: str
) -> AsyncIterator[Traced]:
    """``mesh manager`` and ``mesh agent echo`` (the echo pool's descriptor: one slot),
    traced (and ``env`` added to their environment); the agent Ready."""
    files = {"mesh-manager": tmp / "manager.jsonl", AGENT_SERVICE: tmp / "agent.jsonl"}
    mesh = [sys.executable, "-m", "mesh", "--amqp-url", amqp_url, "--namespace", namespace]
    manager = await spawn(
        [*mesh, "manager", "--journal", str(tmp / "journal.sqlite3"),
         "--ledger", f"sqlite:{tmp / 'ledger.sqlite3'}", "--operator-user", "guest",
         "--http-port", "-1"],
        traced_env(files["mesh-manager"], **env), tmp / "manager.log",
    )  # fmt: skip
    agent = client = None
    try:
        client = await _connect(amqp_url, namespace)
        answering = client
        await eventually(lambda: _answers(answering), what="the manager answering", timeout_s=30)
        now = time.time()
        descriptor = local_descriptor(
            "echo", CapabilityRange(name="test.echo", version_spec=">=1"), epoch=int(now),
            issued_by="guest", now=now, policy_generation=AdmissionPolicy().active_generation,
            ttl_s=600, slots=1,
        )  # fmt: skip
        assert (await client.publish_descriptor(descriptor)).type.endswith("accepted.v1")
        agent = await spawn(
            [*mesh, "agent", "--id", AGENT_ID, "--heartbeat-interval", "5", "echo"],
            traced_env(files[AGENT_SERVICE], **env), tmp / "agent.log",
        )  # fmt: skip

        async def ready() -> bool:
            return any(a.agent_id == AGENT_ID for a in (await client.status()).agents)

        await eventually(ready, what="the agent Ready", timeout_s=30)
        yield Traced(files)
    finally:
        if client is not None:
            await client.close()
        if agent is not None:
            await stop(agent)
        await stop(manager)


async def _connect(amqp_url: str, namespace: str) -> MeshClient:
    return await MeshClient.connect(amqp_url, namespace=namespace, name="tracing-test")


async def _answers(client: MeshClient) -> bool:
    try:
        await client.status(timeout_s=1)
    except Exception:
        return False
    return True


async def produce(
    amqp_url: str, namespace: str, traced: Traced, tmp: Path, **env: str
) -> dict[str, Any]:
    """Run the producer script to its end; what it printed last."""
    script = tmp / "producer.py"
    script.write_text(PRODUCER)
    traced.files["mesh-producer"] = tmp / "producer.jsonl"
    proc = await asyncio.create_subprocess_exec(
        sys.executable, str(script), amqp_url, namespace,
        stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE,
        env=traced_env(traced.files["mesh-producer"], **env),
    )  # fmt: skip
    out, err = await asyncio.wait_for(proc.communicate(), 60)
    assert proc.returncode == 0, err.decode()[-3000:]
    lines = out.decode().splitlines()
    assert json.loads(lines[0])["configured"], lines
    result: dict[str, Any] = json.loads(lines[-1])
    return result


def one(spans: list[dict[str, Any]], name: str, **attributes: Any) -> dict[str, Any]:
    found = [
        s for s in spans
        if s["name"] == name
        and all(s["attributes"].get(k) == v for k, v in attributes.items())
    ]  # fmt: skip
    assert len(found) == 1, (name, attributes, [(s["name"], s["attributes"]) for s in spans])
    return found[0]


def child_of(span: dict[str, Any], parent: dict[str, Any]) -> bool:
    return bool(
        span["parent_span_id"] == parent["span_id"] and span["trace_id"] == parent["trace_id"]
    )


async def test_a_deferred_submit_and_a_run_task_are_each_one_trace_across_three_processes(
    amqp_url: str, namespace: str, tmp_path: Path
) -> None:
    async with manager_and_agent(amqp_url, namespace, tmp_path) as traced:
        out = await produce(amqp_url, namespace, traced, tmp_path)
        assert out["deferrals"] == ["CAPACITY"]  # deferred once, then admitted
        services = {"mesh-producer", "mesh-manager", AGENT_SERVICE}

        def whole(trace_id: str, names: set[str]) -> bool:
            return names <= {s["name"] for s in traced.trace(trace_id)}

        submit_names = {"submit test.echo", "admission test.echo", "invoke_agent test.echo"}
        await eventually(lambda: whole(out["submit_trace"], submit_names), what="the spans")
        run_names = {"run_task test.echo", "acquire test.echo", "invoke_agent test.echo"}
        await eventually(lambda: whole(out["run_task_trace"], run_names), what="the spans")

    # ---- submit: deferred once, then admitted -----------------------------------------------
    spans = traced.trace(out["submit_trace"])
    assert {s["service"] for s in spans} == services
    step, submit = one(spans, "plan step"), one(spans, "submit test.echo")
    assert step["parent_span_id"] is None and child_of(submit, step)
    (event,) = submit["events"]  # one wait, one event, with its reason
    assert event["name"] == "mesh.admission.deferred"
    assert event["attributes"]["mesh.admission.reason"] == "CAPACITY"
    assert event["attributes"]["mesh.attempt"] == 1
    assert event["attributes"]["mesh.retry_after_ms"] >= 0

    asks = [s for s in spans if s["name"].startswith("send ") and s["attributes"].get(
        "messaging.rabbitmq.destination.routing_key") == "rpc.admit"]  # fmt: skip
    assert len(asks) == 2 and all(child_of(a, submit) for a in asks)
    assert all(a["kind"] == "PRODUCER" and a["service"] == "mesh-producer" for a in asks)
    deferred = one(spans, "admission test.echo", **{"mesh.admission.decision": "deferred"})
    admitted = one(spans, "admission test.echo", **{"mesh.admission.decision": "admitted"})
    assert {deferred["parent_span_id"], admitted["parent_span_id"]} == {a["span_id"] for a in asks}
    assert deferred["service"] == admitted["service"] == "mesh-manager"
    assert deferred["kind"] == "SERVER"
    assert deferred["attributes"]["mesh.admission.reason"] == "CAPACITY"
    assert (
        deferred["attributes"]["mesh.retry_after_ms"] == event["attributes"]["mesh.retry_after_ms"]
    )
    assert "mesh.line.position" in deferred["attributes"]
    decided = admitted["attributes"]
    assert decided["mesh.admission_id"] == out["admission_id"]
    assert decided["mesh.pool"] == "echo"
    assert decided["mesh.descriptor_epoch"] >= 1 and decided["mesh.fence"] >= 1
    assert decided["mesh.shedding.stage"] in Stage.__members__  # one slot, full: TIGHTEN
    assert "mesh.admission.reason" not in decided  # unknown ones left out, not invented

    task_sent = one(spans, "send " + f"{namespace}.tasks")
    assert child_of(task_sent, submit)
    run = one(spans, "invoke_agent test.echo")
    assert child_of(run, task_sent) and run["service"] == AGENT_SERVICE
    assert run["kind"] == "CONSUMER" and run["status"]["code"] == "UNSET"
    assert run["attributes"]["gen_ai.operation.name"] == "invoke_agent"
    assert run["attributes"]["gen_ai.agent.id"] == AGENT_ID
    assert run["attributes"]["gen_ai.agent.name"] == "echo"
    assert run["attributes"]["mesh.admission_id"] == out["admission_id"]
    released = one(spans, "release admission")
    assert released["service"] == "mesh-manager" and released["attributes"]["mesh.released"]
    asked = next(s for s in spans if s["span_id"] == released["parent_span_id"])
    assert asked["name"].startswith("send ") and child_of(asked, submit)

    # ---- run_task: the lease path ---------------------------------------------------------------
    spans = traced.trace(out["run_task_trace"])
    assert {s["service"] for s in spans} == services
    step, call = one(spans, "plan step"), one(spans, "run_task test.echo")
    assert child_of(call, step) and call["events"] == []
    acquire = one(spans, "acquire test.echo")
    assert acquire["attributes"]["mesh.lease_id"] == out["lease_id"]
    assert acquire["attributes"]["mesh.agent_id"] == AGENT_ID
    ask = next(s for s in spans if s["span_id"] == acquire["parent_span_id"])
    assert ask["name"].startswith("send ") and child_of(ask, call)
    run = one(spans, "invoke_agent test.echo")
    sent = next(s for s in spans if s["span_id"] == run["parent_span_id"])
    assert sent["attributes"]["messaging.rabbitmq.destination.routing_key"] == AGENT_ID
    assert child_of(sent, call) and run["attributes"]["mesh.lease_id"] == out["lease_id"]
    assert one(spans, "release lease")["attributes"]["mesh.released"] is True


async def test_a_trace_the_producer_samples_out_is_exported_by_no_process(
    amqp_url: str, namespace: str, tmp_path: Path
) -> None:
    async with manager_and_agent(amqp_url, namespace, tmp_path) as traced:
        before = {service: len(traced.spans(service)) for service in traced.files}
        out = await produce(amqp_url, namespace, traced, tmp_path, OTEL_TRACES_SAMPLER="always_off")
        assert out["deferrals"] == ["CAPACITY"] and out["lease_id"]  # the same work was done
        await asyncio.sleep(1.0)  # what the agent and the manager would write, written
        after = {service: len(traced.spans(service)) for service in before}
        assert after == before
        assert traced.spans("mesh-producer") == []
