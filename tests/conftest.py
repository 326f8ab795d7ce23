"""Fixtures shared by every test directory, and the harness for tests against a real RabbitMQ.

Modelled on aio-pika's ``tests/conftest.py``: connections are named after the test's node id
(so the broker UI shows which test holds which connection), factories close what they made
last-in-first-out, and every test gets its own namespace so runs never see each other's
messages.

Where the broker comes from, in order:

1. ``MESH_TEST_AMQP_URL`` (default ``amqp://guest:guest@127.0.0.1:5672/``) when it answers;
2. else, when ``testcontainers`` is installed (``pip install -e '.[docker]'``) and a Docker
   engine answers, a throw-away ``rabbitmq:3-management`` container for the session;
3. else the session fails with one sentence saying what to run. Never a skip: in CI an
   unreachable broker must be a red build, not a green one with nothing tested.

The management API (``MESH_TEST_MANAGEMENT_URL``, default ``http://<amqp host>:15672``, with
the AMQP URL's credentials) is used to clean up and to observe the broker the way an operator
does: queue depth, queue arguments, connections.

Fixtures for the broker: ``amqp_url``, ``management_api``, ``transport_factory``. Pure ones
that work without a broker: ``namespace``, ``topology``. A test that uses ``amqp_url``
(directly or through another fixture) gets every queue and exchange named ``<namespace>.*``
deleted after it.
"""

from __future__ import annotations

import base64
import contextlib
import gc
import importlib.util
import json
import os
import re
import socket
import time
import urllib.error
import urllib.parse
import urllib.request
import uuid
import warnings
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass
from typing import Any

import pytest
from hypothesis import settings as hypothesis_settings

from mesh.topology import Topology
from mesh.transport import AmqpTransport

# In CI, property tests run derandomized: the same examples every run, so a red build is
# reproducible and a green one is not luck. Locally they explore new examples every run.
hypothesis_settings.register_profile("ci", derandomize=True, print_blob=True)
if os.environ.get("CI"):
    hypothesis_settings.load_profile("ci")

DEFAULT_TEST_AMQP_URL = "amqp://guest:guest@127.0.0.1:5672/"
BROKER_IMAGE = "rabbitmq:3-management"
NAMESPACE_MAX_LEN = 40
START_BROKER_HINT = "run `bash scripts/ensure-rabbitmq.sh` (or `docker compose up -d rabbitmq`)"


# ---- where the broker is --------------------------------------------------------------------
@dataclass(frozen=True, slots=True)
class BrokerEndpoint:
    amqp_url: str
    management_url: str
    source: str  # "env/default" or "testcontainers"


def _amqp_answers(url: str, timeout_s: float = 2.0) -> bool:
    """True when ``url``'s host speaks AMQP 0-9-1 (it answers our protocol header with a frame)."""
    parts = urllib.parse.urlsplit(url)
    try:
        with socket.create_connection(
            (parts.hostname or "127.0.0.1", parts.port or 5672), timeout=timeout_s
        ) as sock:
            sock.settimeout(timeout_s)
            sock.sendall(b"AMQP\x00\x00\x09\x01")
            return sock.recv(1) == b"\x01"  # frame type 1: Connection.Start
    except OSError:
        return False


def _default_management_url(amqp_url: str, port: int = 15672) -> str:
    host = urllib.parse.urlsplit(amqp_url).hostname or "127.0.0.1"
    return f"http://{host}:{port}"


def _docker_engine_answers() -> bool:
    if not os.environ.get("DOCKER_HOST") and not os.path.exists("/var/run/docker.sock"):
        return False
    # The docker SDK leaks a socket when the engine is absent; let it be collected here, with
    # warnings off, instead of surfacing later as an "unraisable" ResourceWarning.
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        try:
            import docker  # type: ignore[import-not-found]  # installed with testcontainers

            client = docker.from_env(timeout=3)
            try:
                return bool(client.ping())
            finally:
                client.close()
        except Exception:
            return False
        finally:
            gc.collect()


@contextlib.contextmanager
def _rabbitmq_container() -> Iterator[BrokerEndpoint]:
    """A ``rabbitmq:3-management`` container for the session (testcontainers, imported lazily)."""
    with warnings.catch_warnings():  # third-party deprecations must not fail our run
        warnings.simplefilter("ignore")
        try:  # testcontainers >= 4.10 moved it; the old path still works with a warning
            from testcontainers.community.rabbitmq import (  # type: ignore[import-not-found]
                RabbitMqContainer,
            )
        except ImportError:
            from testcontainers.rabbitmq import (  # type: ignore[import-not-found]
                RabbitMqContainer,
            )

    # Explicit port and credentials: testcontainers would otherwise read RABBITMQ_NODE_PORT &co.
    # from our environment, which the fault tests set for their second broker node.
    container = RabbitMqContainer(
        BROKER_IMAGE, port=5672, username="guest", password="guest", vhost="/"
    ).with_exposed_ports(15672)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        container.start()
    try:
        host = container.get_container_host_ip()
        amqp_url = f"amqp://guest:guest@{host}:{container.get_exposed_port(5672)}/"
        management_url = f"http://{host}:{container.get_exposed_port(15672)}"
        api = ManagementApi(management_url, "guest", "guest")
        api.wait_until_up(timeout_s=60)
        yield BrokerEndpoint(amqp_url, management_url, "testcontainers")
    finally:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            container.stop()


def _in_ci() -> bool:
    return os.environ.get("CI", "").lower() not in ("", "0", "false", "no")


@pytest.fixture(scope="session")
def broker() -> Iterator[BrokerEndpoint]:
    url = os.environ.get("MESH_TEST_AMQP_URL", DEFAULT_TEST_AMQP_URL)
    management_url = os.environ.get("MESH_TEST_MANAGEMENT_URL") or _default_management_url(url)
    if _amqp_answers(url):
        yield BrokerEndpoint(url, management_url, "env/default")
        return
    has_testcontainers = importlib.util.find_spec("testcontainers") is not None
    if has_testcontainers and _docker_engine_answers():
        with _rabbitmq_container() as endpoint:
            yield endpoint
        return
    where = _redact(url)
    why = "CI=true, so this is a failure, not a skip; " if _in_ci() else ""
    pytest.fail(
        f"No RabbitMQ broker answers at {where} and no Docker engine is available to start one; "
        f"{why}{START_BROKER_HINT}, or set MESH_TEST_AMQP_URL to a running broker.",
        pytrace=False,
    )


@pytest.fixture(scope="session")
def amqp_url(broker: BrokerEndpoint) -> str:
    return broker.amqp_url


def _redact(url: str) -> str:
    parts = urllib.parse.urlsplit(url)
    if parts.password is None:
        return url
    return urllib.parse.urlunsplit(
        parts._replace(netloc=parts.netloc.replace(f":{parts.password}@", ":***@", 1))
    )


# ---- the management HTTP API ----------------------------------------------------------------
class ManagementApiError(RuntimeError):
    def __init__(self, method: str, path: str, status: int, body: str) -> None:
        super().__init__(f"{method} {path} -> HTTP {status}: {body[:300]}")
        self.status = status


class ManagementApi:
    """A few calls of RabbitMQ's management HTTP API, with the standard library only.

    Queue statistics (``messages``, ``consumers``) are refreshed by the broker every
    ``collect_statistics_interval`` (5 s by default), so poll with :meth:`wait_for_queue`
    instead of asserting on one read.
    """

    def __init__(self, base_url: str, user: str, password: str, vhost: str = "/") -> None:
        self.base_url = base_url.rstrip("/")
        self.vhost = vhost
        self._auth = "Basic " + base64.b64encode(f"{user}:{password}".encode()).decode()

    # -- plumbing -------------------------------------------------------------------------
    def _q(self, segment: str) -> str:
        return urllib.parse.quote(segment, safe="")

    def request(
        self, method: str, path: str, *, reason: str | None = None, body: Any = None
    ) -> Any:
        data = None if body is None else json.dumps(body).encode()
        req = urllib.request.Request(self.base_url + path, data=data, method=method)
        req.add_header("Authorization", self._auth)
        req.add_header("Content-Type", "application/json")
        if reason:
            req.add_header("X-Reason", reason)
        try:
            with urllib.request.urlopen(req, timeout=10) as resp:
                data = resp.read()
        except urllib.error.HTTPError as exc:
            body = exc.read().decode(errors="replace")
            exc.close()
            raise ManagementApiError(method, path, exc.code, body) from None
        return json.loads(data) if data else None

    def _delete(self, path: str, *, reason: str | None = None) -> bool:
        """DELETE that tolerates "already gone"; True when something was deleted."""
        try:
            self.request("DELETE", path, reason=reason)
        except ManagementApiError as exc:
            if exc.status == 404:
                return False
            raise
        return True

    def wait_until_up(self, timeout_s: float = 30.0) -> None:
        deadline = time.monotonic() + timeout_s
        while True:
            try:
                self.request("GET", "/api/overview")
                return
            except (OSError, ManagementApiError):
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.5)

    # -- queues and exchanges ---------------------------------------------------------------
    def get_queue(self, name: str) -> dict[str, Any]:
        """The queue as the management UI shows it: ``messages``, ``consumers``,
        ``arguments``, ``durable``, ``type``… (statistics may lag by a few seconds)."""
        info: dict[str, Any] = self.request(
            "GET", f"/api/queues/{self._q(self.vhost)}/{self._q(name)}"
        )
        info.setdefault("messages", 0)
        info.setdefault("consumers", 0)
        return info

    def get_exchange(self, name: str) -> dict[str, Any]:
        info: dict[str, Any] = self.request(
            "GET", f"/api/exchanges/{self._q(self.vhost)}/{self._q(name)}"
        )
        return info

    def wait_for_queue(
        self, name: str, field: str, expected: Any, *, timeout_s: float = 15.0
    ) -> dict[str, Any]:
        """Poll until ``get_queue(name)[field] == expected``; the last read on timeout fails."""
        deadline = time.monotonic() + timeout_s
        while True:
            info = self.get_queue(name)
            if info.get(field) == expected or time.monotonic() > deadline:
                return info
            time.sleep(0.25)

    def list_names(self, kind: str, prefix: str) -> list[str]:
        """Names of ``kind`` ("queues" or "exchanges") in the vhost that start with ``prefix``."""
        items = self.request("GET", f"/api/{kind}/{self._q(self.vhost)}?columns=name")
        return sorted(i["name"] for i in items if i["name"].startswith(prefix))

    def purge_queue(self, name: str) -> None:
        """Drop every ready message of ``name`` (the UI's "Purge Messages")."""
        self.request("DELETE", f"/api/queues/{self._q(self.vhost)}/{self._q(name)}/contents")

    def delete_queue(self, name: str) -> bool:
        return self._delete(f"/api/queues/{self._q(self.vhost)}/{self._q(name)}")

    def delete_exchange(self, name: str) -> bool:
        return self._delete(f"/api/exchanges/{self._q(self.vhost)}/{self._q(name)}")

    def delete_prefixed(self, prefix: str) -> list[str]:
        """Delete every queue, exchange and policy whose name starts with ``prefix``."""
        deleted = [q for q in self.list_names("queues", prefix) if self.delete_queue(q)]
        deleted += [x for x in self.list_names("exchanges", prefix) if self.delete_exchange(x)]
        deleted += [
            p
            for p in self.list_names("policies", prefix)
            if self._delete(f"/api/policies/{self._q(self.vhost)}/{self._q(p)}")
        ]
        return deleted

    # -- users ----------------------------------------------------------------------------
    def ensure_user(self, name: str, password: str) -> None:
        """A broker user with full permissions on this vhost (a producer tenant in tests)."""
        self.request("PUT", f"/api/users/{self._q(name)}", body={"password": password, "tags": ""})
        self.request(
            "PUT",
            f"/api/permissions/{self._q(self.vhost)}/{self._q(name)}",
            body={"configure": ".*", "write": ".*", "read": ".*"},
        )

    def delete_user(self, name: str) -> None:
        """Remove a user ``ensure_user`` made (RabbitMQ closes its connections): the broker is
        shared, and a test's users must not outlive it. Already gone is fine."""
        self._delete(f"/api/users/{self._q(name)}")

    # -- connections ----------------------------------------------------------------------
    def connections(self, name_prefix: str = "") -> list[dict[str, Any]]:
        """Connections whose client-provided ``connection_name`` starts with ``name_prefix``."""
        found: list[dict[str, Any]] = []
        for conn in self.request("GET", "/api/connections"):
            client_name = (conn.get("client_properties") or {}).get("connection_name") or ""
            if client_name.startswith(name_prefix) and conn.get("vhost", self.vhost) == self.vhost:
                found.append(conn)
        return found

    def close_connections(
        self, name_prefix: str, *, timeout_s: float = 10.0, reason: str = "closed by a test"
    ) -> int:
        """Force-close (as an operator would) every connection named ``name_prefix…``.

        Waits up to ``timeout_s`` for at least one such connection to show up in the API (new
        connections appear after a short delay) and fails if none does.
        """
        if not name_prefix:
            raise ValueError("refusing to close every connection on the broker")
        deadline = time.monotonic() + timeout_s
        while not (found := self.connections(name_prefix)):
            if time.monotonic() > deadline:
                raise AssertionError(f"no broker connection named {name_prefix!r}*")
            time.sleep(0.2)
        return sum(
            self._delete(f"/api/connections/{self._q(conn['name'])}", reason=reason)
            for conn in found
        )


@pytest.fixture(scope="session")
def management_api(broker: BrokerEndpoint) -> ManagementApi:
    parts = urllib.parse.urlsplit(broker.amqp_url)
    vhost = urllib.parse.unquote(parts.path[1:]) if len(parts.path) > 1 else "/"
    api = ManagementApi(
        broker.management_url,
        urllib.parse.unquote(parts.username or "guest"),
        urllib.parse.unquote(parts.password or "guest"),
        vhost,
    )
    try:
        api.wait_until_up(timeout_s=5)
    except (OSError, ManagementApiError) as exc:
        pytest.fail(
            f"The RabbitMQ management API at {api.base_url} does not answer ({exc}); "
            f"{START_BROKER_HINT} to enable it, or set MESH_TEST_MANAGEMENT_URL.",
            pytrace=False,
        )
    return api


# ---- per-test isolation ---------------------------------------------------------------------
def make_namespace(test_name: str, unique: str | None = None) -> str:
    """``t-<short test name>-<6 hex>``: readable in the broker UI, [a-z0-9-], ≤ 40 chars."""
    suffix = unique or uuid.uuid4().hex[:6]
    short = re.sub(r"^test_?", "", test_name.lower())
    short = re.sub(r"[^a-z0-9]+", "-", short).strip("-") or "x"
    room = NAMESPACE_MAX_LEN - len("t-") - len("-") - len(suffix)
    short = short[:room].rstrip("-") or "x"
    return f"t-{short}-{suffix}"


@pytest.fixture
def namespace(request: pytest.FixtureRequest) -> Iterator[str]:
    """A namespace of the test's own. When the test touches the broker (uses ``amqp_url``),
    every queue and exchange named ``<namespace>.*`` is deleted after it."""
    ns = make_namespace(request.node.name)
    api: ManagementApi | None = None
    if "amqp_url" in request.fixturenames:
        api = request.getfixturevalue("management_api")
    yield ns
    if api is not None:
        api.delete_prefixed(f"{ns}.")


@pytest.fixture
def topology(namespace: str) -> Topology:
    return Topology(namespace=namespace)


class TransportFactory:
    """``await transport_factory()`` connects an :class:`AmqpTransport` named after the test.

    ``name`` overrides the connection name; ``suffix`` appends ``#<suffix>`` to the test's node
    id, which keeps several connections of one test apart (``management_api.close_connections``
    matches by prefix). Transports are closed last-in-first-out when the test ends.
    """

    def __init__(self, amqp_url: str, node_id: str) -> None:
        self.amqp_url = amqp_url
        self.node_id = node_id
        self.transports: list[AmqpTransport] = []

    def name_for(self, suffix: str = "") -> str:
        return f"{self.node_id}#{suffix}" if suffix else self.node_id

    async def __call__(
        self, *, suffix: str = "", name: str | None = None, **kwargs: Any
    ) -> AmqpTransport:
        transport = await AmqpTransport.connect(
            self.amqp_url, name=name or self.name_for(suffix), **kwargs
        )
        self.transports.append(transport)
        return transport

    async def close_all(self) -> None:
        while self.transports:
            await self.transports.pop().close()


@pytest.fixture
async def transport_factory(
    amqp_url: str, namespace: str, request: pytest.FixtureRequest
) -> AsyncIterator[TransportFactory]:
    # Depends on ``namespace`` so the namespace's cleanup runs after these transports close.
    factory = TransportFactory(amqp_url, request.node.nodeid)
    try:
        yield factory
    finally:
        await factory.close_all()
