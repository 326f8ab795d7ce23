"""A RabbitMQ node of the fault suite's own, so destructive tests never touch the shared broker.

The node runs from the locally installed RabbitMQ (``rabbitmq-server``, the same one
``scripts/ensure-rabbitmq.sh`` starts) with its own node name, ports, data directory, log
directory and Erlang cookie, as whoever runs the tests (no ``su rabbitmq``: everything it
writes is under the suite's temporary directory):

==============  =========================================
node name       ``mesh-faults@localhost``
AMQP            ``127.0.0.1:5682`` (guest/guest)
management API  ``127.0.0.1:15682``
distribution    ``25682``
==============  =========================================

It is started once per session (about 4 s) and keeps its data directory across restarts, so
durable queues and persistent messages survive a ``kill -9`` exactly as they would in
production. Everything the tests do to it goes through the same tools an operator has:
signals, ``rabbitmqctl`` (``close_all_connections``, ``stop_app``/``start_app``,
``set_disk_free_limit``, ``set_vm_memory_high_watermark``) and the management API.
"""

from __future__ import annotations

import base64
import json
import os
import shutil
import signal
import socket
import subprocess
import time
import urllib.parse
import urllib.request
from pathlib import Path
from typing import Any

NODE_NAME = "mesh-faults@localhost"
AMQP_PORT = 5682
MANAGEMENT_PORT = 15682
DIST_PORT = 25682
# Not a secret: the node listens on 127.0.0.1 only and lives for one test session. A fixed
# cookie lets a later run stop a node an earlier, killed run left behind.
COOKIE = "MESHFAULTSUITENODECOOKIE"
START_TIMEOUT_S = 90.0
LIB_DIR = Path(os.environ.get("MESH_FAULTS_RABBITMQ_BIN", "/usr/lib/rabbitmq/bin"))


def _tool(name: str) -> str | None:
    """The real script (not Debian's ``/usr/sbin`` wrapper, which switches to the rabbitmq
    user and its own cookie), else whatever is on PATH."""
    candidate = LIB_DIR / name
    if candidate.is_file() and os.access(candidate, os.X_OK):
        return str(candidate)
    return shutil.which(name)


def node_unavailable_reason() -> str | None:
    """Why the suite's node cannot be started here (``None``: it can)."""
    for tool in ("rabbitmq-server", "rabbitmqctl"):
        if _tool(tool) is None:
            return (
                f"the fault suite starts a RabbitMQ node of its own and needs {tool} "
                f"(install rabbitmq-server, or set MESH_FAULTS_RABBITMQ_BIN to its bin dir)"
            )
    return None


def amqp_answers(port: int, timeout_s: float = 1.0) -> bool:
    """True when something on 127.0.0.1:``port`` speaks AMQP 0-9-1."""
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=timeout_s) as sock:
            sock.settimeout(timeout_s)
            sock.sendall(b"AMQP\x00\x00\x09\x01")
            return sock.recv(1) == b"\x01"
    except OSError:
        return False


def _holds(check: Any) -> bool:
    try:
        return bool(check())
    except OSError:  # the management API is not up yet (URLError is an OSError)
        return False


class BrokerNode:
    """The suite's RabbitMQ node (see the module docstring). Another name and other ports
    make another node (:mod:`tests.faults.broker_cluster` starts three and joins them)."""

    def __init__(
        self,
        workdir: Path,
        *,
        node_name: str = NODE_NAME,
        amqp_port: int = AMQP_PORT,
        management_port: int = MANAGEMENT_PORT,
        dist_port: int = DIST_PORT,
    ) -> None:
        self.workdir = workdir
        self.node_name = node_name
        self.amqp_port = amqp_port
        self.management_port = management_port
        self.dist_port = dist_port
        self.home = workdir / "home"  # the Erlang cookie, for the node and rabbitmqctl
        self.pid_file = workdir / "rabbitmq.pid"
        self.amqp_url = f"amqp://guest:guest@127.0.0.1:{amqp_port}/"
        self.management_url = f"http://127.0.0.1:{management_port}"
        self._process: subprocess.Popen[bytes] | None = None
        self.starts = 0
        self._prepare()

    def _prepare(self) -> None:
        for sub in ("home", "log", "mnesia"):
            (self.workdir / sub).mkdir(parents=True, exist_ok=True)
        cookie = self.home / ".erlang.cookie"
        if not cookie.exists():
            cookie.write_text(COOKIE)
            cookie.chmod(0o400)
        (self.workdir / "rabbitmq.conf").write_text(
            "\n".join(
                [
                    f"listeners.tcp.default = 127.0.0.1:{self.amqp_port}",
                    "management.tcp.ip = 127.0.0.1",
                    f"management.tcp.port = {self.management_port}",
                    # Disk alarms are raised on purpose (set_disk_free_limit); check often.
                    "disk_free_limit.absolute = 1MB",
                    "",
                ]
            )
        )
        (self.workdir / "enabled_plugins").write_text("[rabbitmq_management].\n")

    def _env(self) -> dict[str, str]:
        w = self.workdir
        return {
            **os.environ,
            "HOME": str(self.home),
            "RABBITMQ_NODENAME": self.node_name,
            "RABBITMQ_DIST_PORT": str(self.dist_port),
            "RABBITMQ_MNESIA_BASE": str(w / "mnesia"),
            "RABBITMQ_LOG_BASE": str(w / "log"),
            "RABBITMQ_CONFIG_FILE": str(w / "rabbitmq.conf"),
            "RABBITMQ_ENABLED_PLUGINS_FILE": str(w / "enabled_plugins"),
            "RABBITMQ_PID_FILE": str(self.pid_file),
        }

    # ---- life ------------------------------------------------------------------------------
    @property
    def running(self) -> bool:
        return amqp_answers(self.amqp_port)

    def start(self) -> float:
        """Start the node and wait until AMQP answers; returns the seconds it took."""
        if self.running:  # a node an earlier, killed run left behind: stop it first
            self.ctl("stop", check=False)
            self._wait(lambda: not self.running, "the leftover node to stop")
        server = _tool("rabbitmq-server")
        assert server is not None
        started = time.monotonic()
        log = (self.workdir / "log" / "server.out").open("ab")
        self._process = subprocess.Popen(
            [server],
            cwd=self.workdir,
            env=self._env(),
            stdout=log,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            start_new_session=True,
        )
        log.close()
        self._wait(lambda: self.running, "the node to accept AMQP connections")
        self.starts += 1
        return time.monotonic() - started

    def ensure_running(self) -> None:
        if not self.running:
            self.start()

    def beam_pid(self) -> int:
        """The Erlang VM's PID (what ``kill -9`` in production would hit)."""
        self._wait(self.pid_file.exists, "the node's pid file")
        return int(self.pid_file.read_text().strip())

    def kill9(self) -> None:
        """``kill -9`` the Erlang VM: no goodbye to clients, nothing flushed beyond what the
        broker had already written."""
        os.kill(self.beam_pid(), signal.SIGKILL)
        self._wait(lambda: not self.running, "the killed node's port to close")
        if self._process is not None:
            self._process.wait(timeout=30)
            self._process = None
        self.pid_file.unlink(missing_ok=True)

    def stop(self) -> None:
        if self.running:
            self.ctl("stop", check=False)
        if self._process is not None:
            try:
                self._process.wait(timeout=60)
            except subprocess.TimeoutExpired:
                self._process.kill()
            self._process = None

    def restart_app(self) -> float:
        """A graceful restart of the broker application (``stop_app``/``start_app``, the
        Erlang VM stays up): clients are told and disconnected. Returns the seconds it took."""
        started = time.monotonic()
        self.ctl("stop_app")
        self.ctl("start_app")
        self._wait(lambda: self.running, "the restarted node to accept AMQP connections")
        return time.monotonic() - started

    def close_all_connections(self, reason: str = "fault suite") -> None:
        self.ctl("close_all_connections", reason)

    # ---- alarms ----------------------------------------------------------------------------
    def raise_disk_alarm(self) -> None:
        """Every publishing connection is blocked until :meth:`clear_alarms`."""
        self.ctl("set_disk_free_limit", str(2**60))  # bytes: more than any disk has
        self._wait(lambda: "disk" in self.alarms(), "the disk alarm")

    def raise_memory_alarm(self) -> None:
        self.ctl("set_vm_memory_high_watermark", "absolute", "1")
        self._wait(lambda: "memory" in self.alarms(), "the memory alarm")

    def clear_alarms(self) -> None:
        if not self.running:
            return
        self.ctl("set_disk_free_limit", "1MB")
        self.ctl("set_vm_memory_high_watermark", "0.4")
        self._wait(lambda: not self.alarms(), "the alarms to clear")

    def alarms(self) -> set[str]:
        """The resources in alarm (``disk``, ``memory``), from the management API."""
        nodes = self.api("/api/nodes")
        found = set()
        for node in nodes:
            if node.get("disk_free_alarm"):
                found.add("disk")
            if node.get("mem_alarm"):
                found.add("memory")
        return found

    # ---- tools -----------------------------------------------------------------------------
    def ctl(self, *args: str, check: bool = True) -> str:
        tool = _tool("rabbitmqctl")
        assert tool is not None
        done = subprocess.run(
            [tool, "-n", self.node_name, *args],
            env=self._env(),
            capture_output=True,
            timeout=120,
            check=False,
        )
        if check and done.returncode != 0:
            raise AssertionError(
                f"rabbitmqctl {' '.join(args)} failed ({done.returncode}): "
                f"{done.stderr.decode(errors='replace')[-2000:]}"
            )
        return done.stdout.decode(errors="replace")

    def api(self, path: str, *, method: str = "GET", body: object = None) -> Any:
        request = urllib.request.Request(
            self.management_url + path,
            method=method,
            data=None if body is None else json.dumps(body).encode(),
        )
        token = base64.b64encode(b"guest:guest").decode()
        request.add_header("Authorization", f"Basic {token}")
        request.add_header("Content-Type", "application/json")
        with urllib.request.urlopen(request, timeout=10) as response:
            data = response.read()
        return json.loads(data) if data else None

    def queue(self, name: str) -> dict[str, Any]:
        """The management API's view of a queue (``messages``, ``consumers``…)."""
        quoted = urllib.parse.quote(name, safe="")
        result: dict[str, Any] = self.api(f"/api/queues/%2F/{quoted}")
        return result

    def _wait(self, check: Any, what: str, timeout_s: float = START_TIMEOUT_S) -> None:
        deadline = time.monotonic() + timeout_s
        while not _holds(check):
            if self._process is not None and self._process.poll() not in (None, 0):
                log = (self.workdir / "log" / "server.out").read_text(errors="replace")
                raise AssertionError(f"the fault node exited while waiting for {what}:\n{log}")
            if time.monotonic() > deadline:
                raise AssertionError(f"timed out after {timeout_s:g} s waiting for {what}")
            time.sleep(0.1)
