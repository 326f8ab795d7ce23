"""The local scaler: agent processes on this machine, kept at a desired count per deployment.

Theory of operation
-------------------
A miniature ReplicaSet. For each deployment it keeps a *desired* replica count and the
processes it started, oldest first. ``command_for(deployment, agent_id)`` gives the argv
of one agent; agent IDs are ``<deployment>-<n>`` with ``n`` counting up per deployment and
never reused by one scaler (a new process is a new agent, as a new pod is). Each child runs
in its own session (``start_new_session=True``, so a Ctrl-C at the terminal reaches only
the parent), logs to ``<log_dir>/<agent_id>.log``, and gets ``AGENT_ID`` in its
environment, as a pod gets it from the downward API.

* ``scale_to(d, n)`` starts processes up to ``n``. Scaling down stops ``remove_first``
  first, then others newest first: each gets SIGTERM (an agent drains and exits) and moves
  to *terminating*, which no longer counts towards the desired replicas; one still alive
  after ``termination_grace_s`` gets SIGKILL, as Kubernetes does after the grace period.
* ``delete_pod(d, pod)``: the agent was declared lost, so its process gets SIGKILL at once
  and a replacement starts, keeping the desired count.
* Every call, and a background reconcile every ``reconcile_interval_s`` (started by the
  first call), reaps exited processes. A process that exited on its own while it was
  wanted is replaced; replacements of processes that died young back off exponentially
  (up to ``max_restart_backoff_s``), so a crash-looping command cannot spin.
* ``close()`` sends SIGTERM to every process, waits up to ``termination_grace_s``, then
  SIGKILLs the process group of whatever is left.

State changes happen synchronously on the event loop, between awaits, so concurrent calls
and the background reconcile never see a half-done change.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import signal
import subprocess
import sys
import time
from collections import OrderedDict
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from mesh.scaler.base import ScalerError

log = logging.getLogger(__name__)

CommandFor = Callable[[str, str], list[str]]
"""``command_for(deployment, agent_id)``: the argv that starts one agent."""

_REAP_POLL_S = 0.05
_EXIT_CODES_KEPT = 1000
_DIED_YOUNG_S = 10.0
_KILL_WAIT_S = 5.0


@dataclass(slots=True)
class _Process:
    agent_id: str
    popen: subprocess.Popen[bytes]
    started_at: float
    kill_at: float | None = None
    """When terminating: the monotonic time at which SIGKILL follows the SIGTERM."""


@dataclass(slots=True)
class _Deployment:
    desired: int = 0
    next_index: int = 1
    running: dict[str, _Process] = field(default_factory=dict)  # oldest first
    terminating: dict[str, _Process] = field(default_factory=dict)
    restart_backoff_s: float = 0.0
    restart_not_before: float = 0.0


class LocalProcessScaler:
    """Runs agent processes on this machine; implements :class:`~mesh.scaler.Scaler`."""

    def __init__(
        self,
        command_for: CommandFor,
        *,
        log_dir: Path,
        env: Mapping[str, str] | None = None,
        termination_grace_s: float = 30.0,
        reconcile_interval_s: float | None = 1.0,
        max_restart_backoff_s: float = 30.0,
    ) -> None:
        """``env`` is added to this process's environment for every child;
        ``reconcile_interval_s=None`` reconciles only when called."""
        self.command_for = command_for
        self.log_dir = Path(log_dir)
        self.env = dict(env or {})
        self.termination_grace_s = termination_grace_s
        self.reconcile_interval_s = reconcile_interval_s
        self.max_restart_backoff_s = max_restart_backoff_s
        self._deployments: dict[str, _Deployment] = {}
        self._exit_codes: OrderedDict[str, int] = OrderedDict()
        self._reconciler: asyncio.Task[None] | None = None
        self._closed = False

    # ---- the Scaler port ------------------------------------------------------------------
    async def current_replicas(self, deployment: str) -> int | None:
        """The desired replica count; 0 for a deployment this scaler has not started yet
        (it can start any deployment ``command_for`` knows, so none is "missing")."""
        self._reconcile()
        known = self._deployments.get(deployment)
        return 0 if known is None else known.desired

    async def scale_to(
        self, deployment: str, replicas: int, *, remove_first: str | None = None
    ) -> None:
        """Start or stop processes until ``replicas`` run; see the module documentation."""
        if replicas < 0:
            raise ValueError(f"replicas must be >= 0, not {replicas}")
        self._check_open()
        self._ensure_reconciler()
        self._reap()
        dep = self._deployments.setdefault(deployment, _Deployment())
        dep.desired = replicas
        excess = len(dep.running) - replicas
        if excess > 0:
            newest_first = list(reversed(dep.running))
            if remove_first in dep.running:
                newest_first.remove(remove_first)
                newest_first.insert(0, remove_first)
            elif remove_first is not None:
                log.info(
                    "remove_first is not running; stopping the newest instead",
                    extra={"deployment": deployment, "agent_id": remove_first},
                )
            for agent_id in newest_first[:excess]:
                self._terminate(dep, agent_id)
        self._fill(deployment, dep, restart=False)

    async def delete_pod(self, deployment: str, pod: str) -> None:
        """SIGKILL a process declared lost and start a replacement (desired count kept)."""
        self._check_open()
        self._ensure_reconciler()
        dep = self._deployments.get(deployment)
        if dep is None:
            return
        proc = dep.running.pop(pod, None) or dep.terminating.pop(pod, None)
        if proc is not None:
            log.warning("killing a lost agent", extra={"deployment": deployment, "agent_id": pod})
            _signal_group(proc.popen, signal.SIGKILL)
            proc.kill_at = time.monotonic()
            dep.terminating[pod] = proc
        self._reconcile()
        self._fill(deployment, dep, restart=False)

    async def close(self) -> None:
        """SIGTERM every process, wait up to ``termination_grace_s``, SIGKILL what is left."""
        self._closed = True
        if self._reconciler is not None:
            self._reconciler.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._reconciler
            self._reconciler = None
        for dep in self._deployments.values():
            dep.desired = 0
            for agent_id in list(dep.running):
                self._terminate(dep, agent_id)
        deadline = time.monotonic() + self.termination_grace_s
        while self._any_terminating():
            now = time.monotonic()
            if now >= deadline + _KILL_WAIT_S:
                log.error("agent processes survived SIGKILL", extra={"pids": self._live_pids()})
                return
            if now >= deadline:
                for dep in self._deployments.values():
                    for proc in dep.terminating.values():
                        proc.kill_at = now  # the next reap SIGKILLs it
            self._reap()
            if self._any_terminating():
                await asyncio.sleep(_REAP_POLL_S)

    # ---- observing ------------------------------------------------------------------------
    def pods(self, deployment: str) -> list[str]:
        """Agent IDs of the running (not terminating) processes, oldest first."""
        self._reap()
        dep = self._deployments.get(deployment)
        return [] if dep is None else list(dep.running)

    def terminating(self, deployment: str) -> list[str]:
        """Agent IDs that were told to stop and have not exited yet."""
        self._reap()
        dep = self._deployments.get(deployment)
        return [] if dep is None else list(dep.terminating)

    def pid(self, agent_id: str) -> int | None:
        """The process ID of a live (running or terminating) agent."""
        for dep in self._deployments.values():
            proc = dep.running.get(agent_id) or dep.terminating.get(agent_id)
            if proc is not None:
                return proc.popen.pid
        return None

    def exit_code(self, agent_id: str) -> int | None:
        """How an agent's process ended (negative: the signal), once it was reaped."""
        self._reap()
        return self._exit_codes.get(agent_id)

    # ---- reconciling ----------------------------------------------------------------------
    def _reconcile(self) -> None:
        self._reap()
        if self._closed:
            return
        for name, dep in self._deployments.items():
            self._fill(name, dep, restart=True)

    def _reap(self) -> None:
        now = time.monotonic()
        for name, dep in self._deployments.items():
            for agent_id, proc in list(dep.running.items()):
                code = proc.popen.poll()
                if code is None:
                    continue
                del dep.running[agent_id]
                self._record_exit(agent_id, code)
                self._note_unexpected_exit(name, dep, proc, code, now)
            for agent_id, proc in list(dep.terminating.items()):
                code = proc.popen.poll()
                if code is not None:
                    del dep.terminating[agent_id]
                    self._record_exit(agent_id, code)
                    log.info(
                        "agent process exited",
                        extra={"deployment": name, "agent_id": agent_id, "code": code},
                    )
                elif proc.kill_at is not None and now >= proc.kill_at:
                    _signal_group(proc.popen, signal.SIGKILL)

    def _note_unexpected_exit(
        self, name: str, dep: _Deployment, proc: _Process, code: int, now: float
    ) -> None:
        if now - proc.started_at < _DIED_YOUNG_S:
            dep.restart_backoff_s = min(
                self.max_restart_backoff_s, max(0.5, 2 * dep.restart_backoff_s)
            )
        else:
            dep.restart_backoff_s = 0.0
        dep.restart_not_before = now + dep.restart_backoff_s
        log.warning(
            "agent process exited unexpectedly; it will be replaced",
            extra={
                "deployment": name,
                "agent_id": proc.agent_id,
                "code": code,
                "retry_in_s": dep.restart_backoff_s,
            },
        )

    def _record_exit(self, agent_id: str, code: int) -> None:
        self._exit_codes[agent_id] = code
        while len(self._exit_codes) > _EXIT_CODES_KEPT:
            self._exit_codes.popitem(last=False)

    def _fill(self, name: str, dep: _Deployment, *, restart: bool) -> None:
        """Start processes until ``desired`` run; ``restart``: respect the crash backoff."""
        if restart and time.monotonic() < dep.restart_not_before:
            return
        while len(dep.running) < dep.desired:
            self._spawn(name, dep)

    def _spawn(self, name: str, dep: _Deployment) -> None:
        agent_id = f"{name}-{dep.next_index}"
        dep.next_index += 1
        argv = self.command_for(name, agent_id)
        self.log_dir.mkdir(parents=True, exist_ok=True)
        env = {**os.environ, **self.env, "AGENT_ID": agent_id}
        with (self.log_dir / f"{agent_id}.log").open("ab") as log_file:
            try:
                popen = subprocess.Popen(
                    argv,
                    stdin=subprocess.DEVNULL,
                    stdout=log_file,
                    stderr=subprocess.STDOUT,
                    env=env,
                    start_new_session=True,
                )
            except OSError as exc:
                raise ScalerError(f"cannot start {agent_id} ({argv[0]}): {exc}") from exc
        dep.running[agent_id] = _Process(agent_id, popen, time.monotonic())
        log.info(
            "agent process started",
            extra={"deployment": name, "agent_id": agent_id, "pid": popen.pid},
        )

    def _terminate(self, dep: _Deployment, agent_id: str) -> None:
        proc = dep.running.pop(agent_id)
        with contextlib.suppress(ProcessLookupError):
            if proc.popen.poll() is None:
                proc.popen.send_signal(signal.SIGTERM)
        proc.kill_at = time.monotonic() + self.termination_grace_s
        dep.terminating[agent_id] = proc
        log.info("stopping agent process", extra={"agent_id": agent_id, "pid": proc.popen.pid})

    def _any_terminating(self) -> bool:
        return any(dep.terminating for dep in self._deployments.values())

    def _live_pids(self) -> list[int]:
        return [
            proc.popen.pid
            for dep in self._deployments.values()
            for proc in (*dep.running.values(), *dep.terminating.values())
        ]

    def _ensure_reconciler(self) -> None:
        if self._reconciler is None and self.reconcile_interval_s is not None:
            self._reconciler = asyncio.create_task(
                self._reconcile_forever(self.reconcile_interval_s), name="local-scaler-reconcile"
            )

    async def _reconcile_forever(self, interval_s: float) -> None:
        while True:
            await asyncio.sleep(interval_s)
            try:
                self._reconcile()
            except ScalerError as exc:  # the command cannot start: say so, try again later
                log.error("reconcile failed", extra={"error": str(exc)})

    def _check_open(self) -> None:
        if self._closed:
            raise ScalerError("the scaler is closed")


def _signal_group(popen: subprocess.Popen[bytes], sig: signal.Signals) -> None:
    """Signal the child's process group (it leads its own session) while it is unreaped."""
    if popen.poll() is not None:
        return
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(popen.pid, sig)


def sample_command(
    namespace: str,
    amqp_url: str | None,
    heartbeat_interval_s: float,
    *,
    extra_args: Sequence[str] = (),
) -> CommandFor:
    """A ``command_for`` running ``mesh agent <deployment>``, the deployment being a sample
    name (``calc``, ``textstats``, ``echo``).

    ``amqp_url`` goes on the command line, where ``ps`` shows its password; pass ``None``
    and ``env={"MESH_AMQP_URL": ...}`` to the scaler to keep it out of sight.
    ``extra_args`` follow the agent's own options (``--drain-timeout 20``, for instance).
    """
    from mesh.samples import SAMPLES

    url_args = [] if amqp_url is None else ["--amqp-url", amqp_url]

    def command_for(deployment: str, agent_id: str) -> list[str]:
        if deployment not in SAMPLES:
            raise ScalerError(f"no sample agent {deployment!r}; one of {sorted(SAMPLES)}")
        return [
            sys.executable, "-m", "mesh", *url_args, "--namespace", namespace,
            "agent", deployment, "--id", agent_id,
            "--heartbeat-interval", str(heartbeat_interval_s), *extra_args,
        ]  # fmt: skip

    return command_for
