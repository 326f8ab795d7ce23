"""The Kubernetes scaler: carries out the manager's scaling decisions against the API server.

How it works. Each agent type runs as a Deployment; an agent's ID is its pod's name. The manager's
core decides when and how far to scale; this module only turns each decision into one or two
requests on the official ``kubernetes`` client, and never creates a pod itself (the Deployment's
ReplicaSet does that):

- ``current_replicas``: ``GET /apis/apps/v1/namespaces/{ns}/deployments/{name}/scale`` and read
  ``spec.replicas`` (``None`` when the Deployment does not exist).
- ``scale_to``: ``PATCH`` the same ``scale`` subresource with ``{"spec": {"replicas": N}}``. When
  scaling down, ``remove_first`` names the (idle, draining) pod that must go: it is first annotated
  ``controller.kubernetes.io/pod-deletion-cost: "-1000"`` so the ReplicaSet removes it before any
  pod that still holds work. A pod that is already gone is logged and skipped.
- ``delete_pod``: ``DELETE /api/v1/namespaces/{ns}/pods/{pod}`` for a pod declared lost; the
  ReplicaSet replaces it. A pod that is already gone is fine.

Patches are sent as JSON merge patches (``application/merge-patch+json``, RFC 7386), which every
API server accepts on both objects. The client is synchronous; each call runs in a worker thread
(``asyncio.to_thread``) so the manager's event loop never blocks on the network. Any other API
error, and any failure to reach the API server, becomes a :class:`~mesh.scaler.base.ScalerError`
whose message names the verb, the object, the status code and the server's reason.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any, Final, TypeVar

import urllib3.exceptions
from kubernetes import client as k8s
from kubernetes import config as k8s_config
from kubernetes.client.exceptions import ApiException

from mesh.scaler.base import ScalerError

__all__ = ["POD_DELETION_COST_ANNOTATION", "KubernetesScaler"]

log = logging.getLogger(__name__)

POD_DELETION_COST_ANNOTATION: Final = "controller.kubernetes.io/pod-deletion-cost"
REMOVE_FIRST_COST: Final = "-1000"
MERGE_PATCH: Final = "application/merge-patch+json"
SERVICE_ACCOUNT_NAMESPACE_FILE: Final = Path(
    "/var/run/secrets/kubernetes.io/serviceaccount/namespace"
)
DEFAULT_NAMESPACE: Final = "default"
REQUEST_TIMEOUT_S: Final = 30.0

_T = TypeVar("_T")


class KubernetesScaler:
    """Scales Deployments through their ``apps/v1`` scale subresource and deletes lost pods.

    ``namespace`` is where the agent Deployments live. ``api_client`` is the configured client
    to use (tests point it at a fake API server); without it the client's default configuration
    is used — prefer :meth:`from_environment`. The scaler owns the client: :meth:`close` closes it.
    """

    def __init__(self, namespace: str, *, api_client: k8s.ApiClient | None = None) -> None:
        self.namespace = namespace
        self._api_client: k8s.ApiClient = api_client if api_client is not None else k8s.ApiClient()
        self._apps = k8s.AppsV1Api(self._api_client)
        self._core = k8s.CoreV1Api(self._api_client)

    @property
    def api_client(self) -> k8s.ApiClient:
        """The configured client this scaler talks through."""
        return self._api_client

    @classmethod
    def from_environment(cls, namespace: str | None = None) -> KubernetesScaler:
        """A scaler configured the way ``kubectl`` would be, for the namespace the agents run in.

        Inside a pod (``KUBERNETES_SERVICE_HOST`` is set) it uses the pod's service account, and
        the namespace defaults to the pod's own (read from the service account's ``namespace``
        file). Elsewhere it loads ``~/.kube/config`` (or ``$KUBECONFIG``), and the namespace
        defaults to the current context's namespace, else ``"default"``.

        The least-privilege RBAC this needs in that namespace (a ``Role``, not a ClusterRole)::

            rules:
              - apiGroups: ["apps"]
                resources: ["deployments/scale"]
                verbs: ["get", "patch"]
              - apiGroups: [""]
                resources: ["pods"]
                verbs: ["patch", "delete"]

        Nothing else: it never reads or edits the Deployment itself, never lists, watches or
        creates pods. Raises :class:`ScalerError` when neither configuration can be loaded.
        """
        configuration = k8s.Configuration()
        in_cluster = bool(os.environ.get("KUBERNETES_SERVICE_HOST"))
        try:
            if in_cluster:
                k8s_config.load_incluster_config(client_configuration=configuration)  # type: ignore[no-untyped-call]
                namespace = namespace or _service_account_namespace()
            else:
                k8s_config.load_kube_config(client_configuration=configuration)  # type: ignore[no-untyped-call]
                namespace = namespace or _kubeconfig_namespace()
        except k8s_config.ConfigException as exc:
            where = "the pod's service account" if in_cluster else "the kubeconfig"
            raise ScalerError(
                f"Cannot configure the Kubernetes client from {where}: {exc}"
            ) from exc
        return cls(namespace, api_client=k8s.ApiClient(configuration))

    # -- the Scaler port ----------------------------------------------------------------------
    async def current_replicas(self, deployment: str) -> int | None:
        """The Deployment's desired replica count (``spec.replicas``), ``None`` if it is absent."""
        task = f"read the scale of deployment {deployment!r}"
        try:
            scale = await self._call(
                task, self._apps.read_namespaced_deployment_scale, deployment, self.namespace
            )
        except _NotFound:
            return None
        spec = scale.spec
        # The API server omits ``replicas`` when it is 0.
        return int(spec.replicas) if spec is not None and spec.replicas is not None else 0

    async def scale_to(
        self, deployment: str, replicas: int, *, remove_first: str | None = None
    ) -> None:
        """Patch the Deployment's scale to ``replicas``; mark ``remove_first`` to go first."""
        if remove_first is not None:
            await self._mark_for_removal(deployment, remove_first)
        task = (
            f"scale deployment {deployment!r} to {replicas} replica{'' if replicas == 1 else 's'}"
        )
        try:
            await self._call(
                task,
                self._apps.patch_namespaced_deployment_scale,
                deployment,
                self.namespace,
                {"spec": {"replicas": replicas}},
                _content_type=MERGE_PATCH,
            )
        except _NotFound as exc:
            raise exc.error from exc.__cause__
        log.info(
            "scaled deployment %s to %d replicas",
            deployment,
            replicas,
            extra={
                "deployment": deployment,
                "replicas": replicas,
                "remove_first": remove_first,
                "k8s_namespace": self.namespace,
            },
        )

    async def delete_pod(self, deployment: str, pod: str) -> None:
        """Delete a pod declared lost; one that is already gone counts as deleted."""
        extra = {"agent_id": pod, "deployment": deployment, "k8s_namespace": self.namespace}
        task = f"delete pod {pod!r} of deployment {deployment!r}"
        try:
            await self._call(task, self._core.delete_namespaced_pod, pod, self.namespace)
        except _NotFound:
            log.info("lost pod %s was already gone", pod, extra=extra)
            return
        log.info("deleted lost pod %s", pod, extra=extra)

    async def close(self) -> None:
        """Close the API client and its connection pool."""
        await asyncio.to_thread(self._api_client.close)

    # -- plumbing -------------------------------------------------------------------------------
    async def _mark_for_removal(self, deployment: str, pod: str) -> None:
        patch = {"metadata": {"annotations": {POD_DELETION_COST_ANNOTATION: REMOVE_FIRST_COST}}}
        task = f"set the pod-deletion-cost of pod {pod!r} of deployment {deployment!r}"
        try:
            await self._call(
                task,
                self._core.patch_namespaced_pod,
                pod,
                self.namespace,
                patch,
                _content_type=MERGE_PATCH,
            )
        except _NotFound:
            log.warning(
                "pod %s to remove first is already gone; scaling anyway",
                pod,
                extra={"agent_id": pod, "deployment": deployment, "k8s_namespace": self.namespace},
            )

    async def _call(self, task: str, method: Callable[..., _T], *args: Any, **kwargs: Any) -> _T:
        """Run one client call in a worker thread; API and network failures become
        :class:`ScalerError` (a 404 as :class:`_NotFound`, for the caller to decide)."""
        try:
            return await asyncio.to_thread(
                method, *args, _request_timeout=REQUEST_TIMEOUT_S, **kwargs
            )
        except ApiException as exc:
            error = ScalerError(
                f"Could not {task} in namespace {self.namespace!r}: the Kubernetes API answered "
                f"HTTP {exc.status} {exc.reason or ''}".rstrip()
                + _detail(exc.body)
            )
            if exc.status == 404:
                raise _NotFound(error) from exc
            raise error from exc
        except (urllib3.exceptions.HTTPError, OSError) as exc:
            host = self._api_client.configuration.host
            raise ScalerError(
                f"Could not {task} in namespace {self.namespace!r}: "
                f"the Kubernetes API at {host} did not answer ({exc})"
            ) from exc


class _NotFound(Exception):
    """The object a call named does not exist (HTTP 404); carries the error to raise if that
    is not fine for the caller."""

    def __init__(self, error: ScalerError) -> None:
        super().__init__(str(error))
        self.error = error


def _detail(body: object) -> str:
    """``": <message>"`` from a ``Status`` body, or a short piece of whatever the server sent."""
    if isinstance(body, bytes):
        body = body.decode(errors="replace")
    if not isinstance(body, str) or not body.strip():
        return ""
    try:
        parsed = json.loads(body)
    except ValueError:
        return f": {body.strip()[:200]}"
    if isinstance(parsed, dict) and isinstance(parsed.get("message"), str):
        return f": {parsed['message']}"
    return f": {body.strip()[:200]}"


def _service_account_namespace() -> str:
    try:
        return SERVICE_ACCOUNT_NAMESPACE_FILE.read_text().strip() or DEFAULT_NAMESPACE
    except OSError:
        return DEFAULT_NAMESPACE


def _kubeconfig_namespace() -> str:
    _contexts, current = k8s_config.list_kube_config_contexts()  # type: ignore[no-untyped-call]
    context = (current or {}).get("context") or {}
    namespace = context.get("namespace")
    return namespace if isinstance(namespace, str) and namespace else DEFAULT_NAMESPACE
