"""Scale to zero on the real broker, with the local scaler starting real ``mesh agent``
processes: a pool with ``min_replicas: 0`` starts with no agent; a producer's ``submit`` is
deferred (never refused), exactly one agent process is started, and the task is served; once
nothing waits, runs or asks for the pool for ``scale_to_zero_after_s``, it goes back to zero
replicas — its agent drained first, its process exiting on its own."""

from __future__ import annotations

import time
from pathlib import Path

from mesh.core.scaling import ScalingPolicy
from mesh.scaler.local import LocalProcessScaler, sample_command
from mesh.wire import AdmissionDecision, OrchestrationEvent

from .harness import eventually
from .test_backpressure import echo_requirements
from .test_one_pool import HEARTBEAT_S, echo_manager

IDLE_S = 2.0  # the pool's scale_to_zero_after_s


async def test_a_pool_at_zero_is_started_by_a_submit_served_and_taken_back_to_zero(
    amqp_url: str, namespace: str, tmp_path: Path
) -> None:
    policy = ScalingPolicy(
        "echo", min_replicas=0, max_replicas=2, window_s=1.0, start_s=3.0,
        scale_to_zero_after_s=IDLE_S,
    )  # fmt: skip
    command = sample_command(namespace, amqp_url, HEARTBEAT_S, extra_args=["--drain-timeout", "5"])
    scaler = LocalProcessScaler(command, log_dir=tmp_path / "agents", termination_grace_s=10)
    scale_log: list[tuple[float, int]] = []

    def on_log(event: OrchestrationEvent) -> None:
        if event.kind == "scale":
            scale_log.append((time.monotonic(), int(event.detail["replicas"])))

    try:
        async with echo_manager(
            amqp_url, namespace, tmp_path, policy=policy, scaler=scaler, on_log=on_log
        ) as (manager, client):
            assert scaler.pods("echo") == []  # min_replicas 0: nothing started
            assert manager.core.scaling.desired("echo") == 0

            deferrals: list[AdmissionDecision] = []

            def keep_waiting(decision: AdmissionDecision) -> bool:
                deferrals.append(decision)
                return True

            done = await client.submit(
                echo_requirements(),
                {"message": "wake up"},
                timeout_s=20,
                on_deferred=keep_waiting,
            )

            # Deferred while the replica started (never rejected: submit would have raised),
            # with the retry time of a start; one scale-up, one process; served by it.
            assert deferrals and {d.reason for d in deferrals} == {"NO_LIVE_AGENT"}
            assert all(d.outcome == "deferred" for d in deferrals)
            assert deferrals[0].retry_after_ms is not None
            assert deferrals[0].retry_after_ms <= 1000 * policy.start_s * 1.2
            assert done.result.agent_id == "echo-1"
            assert [replicas for _, replicas in scale_log] == [1]
            assert scaler.pods("echo") == ["echo-1"]
            assert manager.core.counters["starts_measured"] == 1
            measured = manager.core.scaling.start_estimate_s("echo")
            assert measured is not None and measured != policy.start_s

            # Nothing waits, runs or asks: after the idle delay, back to zero; the agent
            # drains and its process exits by itself (code 0: no SIGKILL).
            served_at = time.monotonic()
            await eventually(
                lambda: [r for _, r in scale_log] == [1, 0], what="scaled to zero", timeout_s=15
            )
            assert scale_log[-1][0] - served_at >= IDLE_S
            await eventually(
                lambda: scaler.pods("echo") == [] and scaler.terminating("echo") == [],
                what="the agent process exited",
                timeout_s=12,
            )
            assert scaler.exit_code("echo-1") == 0
            await eventually(lambda: "echo-1" not in manager.core.agents, what="agent gone")
            assert manager.core.scaling.desired("echo") == 0
    finally:
        await scaler.close()
