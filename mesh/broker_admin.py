"""Broker users for agents, through RabbitMQ's management HTTP API (``mesh broker``).

``add_agent`` makes (or updates) the broker user of one agent — named as the agent, which is
what the manager's ``--agent-identity on`` compares ``user_id`` with — and gives it exactly
the permissions of :func:`mesh.topology.permissions.agent_permissions`. ``remove_agent``
deletes the user: RabbitMQ closes its connections at once, the agent cannot reconnect, stops
beating, and the manager declares it lost within its heartbeat window (revocation).
``add_pool_agents`` makes one user for every agent of some pools, where agent IDs are not
known in advance (a Kubernetes Deployment's pods): the same permissions for any agent ID.

The API is called with the standard library (a handful of synchronous requests from a CLI);
the management URL carries an administrator's credentials:
``http://admin:secret@rabbitmq:15672`` (``MESH_MANAGEMENT_URL``).
"""

from __future__ import annotations

import base64
import json
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Sequence
from typing import Any

from mesh.errors import MeshError
from mesh.topology.permissions import (
    AgentPermissions,
    agent_permissions,
    pool_agents_permissions,
)

DEFAULT_MANAGEMENT_URL = "http://guest:guest@127.0.0.1:15672"


class BrokerAdminError(MeshError):
    """The management API refused a request or could not be reached."""


class BrokerAdmin:
    def __init__(self, management_url: str, *, vhost: str = "/", timeout_s: float = 10.0) -> None:
        parts = urllib.parse.urlsplit(management_url)
        if parts.scheme not in ("http", "https") or not parts.hostname:
            raise BrokerAdminError(
                f"not a management API URL: {management_url!r} (want http://user:pass@host:15672)"
            )
        user = urllib.parse.unquote(parts.username or "guest")
        password = urllib.parse.unquote(parts.password or "guest")
        netloc = parts.hostname + (f":{parts.port}" if parts.port else "")
        self.base_url = urllib.parse.urlunsplit(parts._replace(netloc=netloc)).rstrip("/")
        self.vhost = vhost
        self.timeout_s = timeout_s
        self._auth = "Basic " + base64.b64encode(f"{user}:{password}".encode()).decode()

    # ---- agents ---------------------------------------------------------------------------
    def add_agent(
        self, agent_id: str, password: str, *, namespace: str, pool_id: str
    ) -> AgentPermissions:
        """Create or update agent ``agent_id``'s user with its permissions; returns them."""
        permissions = agent_permissions(namespace, agent_id, pool_id)
        self._set_user(agent_id, password, permissions)
        return permissions

    def add_pool_agents(
        self, user: str, password: str, *, namespace: str, pool_ids: Sequence[str]
    ) -> AgentPermissions:
        """Create or update ``user``, shared by every agent of ``pool_ids`` (the pods of a
        Deployment), with :func:`~mesh.topology.permissions.pool_agents_permissions`."""
        permissions = pool_agents_permissions(namespace, pool_ids)
        self._set_user(user, password, permissions)
        return permissions

    def _set_user(self, user: str, password: str, permissions: AgentPermissions) -> None:
        self._request("PUT", f"/api/users/{_q(user)}", {"password": password, "tags": ""})
        self._request(
            "PUT",
            f"/api/permissions/{_q(self.vhost)}/{_q(user)}",
            {
                "configure": permissions.configure,
                "write": permissions.write,
                "read": permissions.read,
            },
        )
        try:  # an update replaces every topic permission the user had (another namespace's)
            self._request("DELETE", f"/api/topic-permissions/{_q(self.vhost)}/{_q(user)}")
        except BrokerAdminError as exc:
            if "HTTP 404" not in str(exc):
                raise
        for topic in permissions.topics:
            self._request(
                "PUT",
                f"/api/topic-permissions/{_q(self.vhost)}/{_q(user)}",
                {"exchange": topic.exchange, "write": topic.write, "read": topic.read},
            )

    def remove_agent(self, agent_id: str) -> bool:
        """Delete the agent's user (its connections are closed); ``False`` if there was none."""
        try:
            self._request("DELETE", f"/api/users/{_q(agent_id)}")
        except BrokerAdminError as exc:
            if "HTTP 404" in str(exc):
                return False
            raise
        return True

    def connections_of(self, user: str) -> list[str]:
        """The names of the user's open connections."""
        rows = self._request("GET", "/api/connections?columns=name,user") or []
        return [str(row["name"]) for row in rows if row.get("user") == user]

    # ---- plumbing -------------------------------------------------------------------------
    def _request(self, method: str, path: str, body: Any = None) -> Any:
        data = None if body is None else json.dumps(body).encode()
        request = urllib.request.Request(self.base_url + path, data=data, method=method)
        request.add_header("Authorization", self._auth)
        request.add_header("Content-Type", "application/json")
        try:
            with urllib.request.urlopen(request, timeout=self.timeout_s) as response:
                raw = response.read()
        except urllib.error.HTTPError as exc:
            detail = exc.read().decode(errors="replace")[:300]
            exc.close()
            raise BrokerAdminError(
                f"{method} {path} -> HTTP {exc.code}: {detail or exc.reason}"
            ) from None
        except (urllib.error.URLError, OSError) as exc:
            raise BrokerAdminError(
                f"cannot reach the RabbitMQ management API at {self.base_url} ({exc}); is "
                "the rabbitmq_management plugin enabled?"
            ) from None
        return json.loads(raw) if raw else None


def _q(segment: str) -> str:
    return urllib.parse.quote(segment, safe="")
