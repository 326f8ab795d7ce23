"""KubernetesScaler drives the official client against a real HTTP server (tests/k8s/fake_api.py);
each test asserts the exact requests that reached it: verb, path, patch body, content type."""

from __future__ import annotations

import inspect
import re
import socket
from collections.abc import AsyncIterator
from pathlib import Path

import pytest
import yaml
from kubernetes import client as k8s
from kubernetes.config import incluster_config, kube_config

from mesh.scaler import Scaler, ScalerError
from mesh.scaler import kubernetes as scaler_module
from mesh.scaler.kubernetes import KubernetesScaler

from .fake_api import FakeKubernetesApi

NS = "agents"
SCALE = f"/apis/apps/v1/namespaces/{NS}/deployments/calc/scale"
POD_A = f"/api/v1/namespaces/{NS}/pods/calc-7d9f-a"
MERGE = "application/merge-patch+json"
DELETION_COST = {
    "metadata": {"annotations": {"controller.kubernetes.io/pod-deletion-cost": "-1000"}}
}


@pytest.fixture
async def scaler(k8s_api_client: k8s.ApiClient) -> AsyncIterator[KubernetesScaler]:
    s = KubernetesScaler(NS, api_client=k8s_api_client)
    yield s
    await s.close()


@pytest.fixture
def cluster(fake_k8s: FakeKubernetesApi) -> FakeKubernetesApi:
    """Deployment ``calc`` at 2 replicas with pods ``calc-7d9f-a`` and ``calc-7d9f-b``."""
    fake_k8s.add_deployment("calc", replicas=2, namespace=NS)
    fake_k8s.add_pod("calc-7d9f-a", deployment="calc", namespace=NS)
    fake_k8s.add_pod("calc-7d9f-b", deployment="calc", namespace=NS)
    return fake_k8s


def test_it_satisfies_the_scaler_port() -> None:
    """Every method of the port, as a coroutine with the port's parameters (mypy checks the
    types; this checks what a duck-typed caller relies on at run time)."""
    scaler = KubernetesScaler(NS, api_client=k8s.ApiClient(k8s.Configuration(host="http://x")))
    port = [n for n, _ in inspect.getmembers(Scaler, inspect.isfunction) if not n.startswith("_")]
    assert {"current_replicas", "scale_to", "delete_pod", "close"} <= set(port)
    for name in port:
        ours = getattr(scaler, name)
        assert inspect.iscoroutinefunction(ours), name
        wanted = list(inspect.signature(getattr(Scaler, name)).parameters)[1:]  # minus self
        assert list(inspect.signature(ours).parameters) == wanted, name


async def test_current_replicas_reads_the_scale_subresource(
    scaler: KubernetesScaler, cluster: FakeKubernetesApi
) -> None:
    assert await scaler.current_replicas("calc") == 2
    assert [r.shape for r in cluster.requests] == [("GET", SCALE, None)]


async def test_current_replicas_of_a_missing_deployment_is_none(
    scaler: KubernetesScaler, cluster: FakeKubernetesApi
) -> None:
    assert await scaler.current_replicas("nope") is None
    assert [r.shape for r in cluster.requests] == [
        ("GET", f"/apis/apps/v1/namespaces/{NS}/deployments/nope/scale", None)
    ]


async def test_scale_to_patches_only_the_scale_subresource(
    scaler: KubernetesScaler, cluster: FakeKubernetesApi
) -> None:
    await scaler.scale_to("calc", 5)

    assert [(r.method, r.path, r.body, r.content_type) for r in cluster.requests] == [
        ("PATCH", SCALE, {"spec": {"replicas": 5}}, MERGE)
    ]
    assert cluster.replicas("calc", namespace=NS) == 5
    assert await scaler.current_replicas("calc") == 5


async def test_scale_down_marks_the_pod_to_remove_first_then_patches_the_scale(
    scaler: KubernetesScaler, cluster: FakeKubernetesApi
) -> None:
    await scaler.scale_to("calc", 1, remove_first="calc-7d9f-a")

    assert [(r.method, r.path, r.body, r.content_type) for r in cluster.requests] == [
        ("PATCH", POD_A, DELETION_COST, MERGE),
        ("PATCH", SCALE, {"spec": {"replicas": 1}}, MERGE),
    ]
    assert cluster.pod_annotations("calc-7d9f-a", namespace=NS) == {
        "controller.kubernetes.io/pod-deletion-cost": "-1000"
    }
    assert cluster.pod_annotations("calc-7d9f-b", namespace=NS) == {}
    assert cluster.replicas("calc", namespace=NS) == 1


async def test_scale_down_goes_on_when_the_pod_to_remove_first_is_already_gone(
    scaler: KubernetesScaler, cluster: FakeKubernetesApi
) -> None:
    await scaler.scale_to("calc", 1, remove_first="calc-gone")

    assert [r.shape for r in cluster.requests] == [
        ("PATCH", f"/api/v1/namespaces/{NS}/pods/calc-gone", DELETION_COST),
        ("PATCH", SCALE, {"spec": {"replicas": 1}}),
    ]
    assert cluster.replicas("calc", namespace=NS) == 1


async def test_scale_down_stops_when_the_pod_cannot_be_marked(
    scaler: KubernetesScaler, cluster: FakeKubernetesApi
) -> None:
    cluster.fail("PATCH", POD_A, 403, 'pods "calc-7d9f-a" is forbidden: cannot patch pods')

    with pytest.raises(ScalerError) as caught:
        await scaler.scale_to("calc", 1, remove_first="calc-7d9f-a")

    # Without the mark the ReplicaSet could remove a busy pod: the scale is left alone.
    assert [r.shape for r in cluster.requests] == [("PATCH", POD_A, DELETION_COST)]
    assert cluster.replicas("calc", namespace=NS) == 2
    assert str(caught.value) == (
        "Could not set the pod-deletion-cost of pod 'calc-7d9f-a' of deployment 'calc' in "
        "namespace 'agents': the Kubernetes API answered HTTP 403 Forbidden: "
        'pods "calc-7d9f-a" is forbidden: cannot patch pods'
    )


async def test_delete_pod_sends_one_delete_for_that_pod(
    scaler: KubernetesScaler, cluster: FakeKubernetesApi
) -> None:
    await scaler.delete_pod("calc", "calc-7d9f-a")

    assert [r.shape for r in cluster.requests] == [("DELETE", POD_A, None)]
    assert not cluster.has_pod("calc-7d9f-a", namespace=NS)
    assert cluster.has_pod("calc-7d9f-b", namespace=NS)


async def test_deleting_a_pod_that_is_already_gone_is_fine(
    scaler: KubernetesScaler, cluster: FakeKubernetesApi
) -> None:
    await scaler.delete_pod("calc", "calc-7d9f-a")
    await scaler.delete_pod("calc", "calc-7d9f-a")

    assert [r.shape for r in cluster.requests] == [("DELETE", POD_A, None)] * 2


async def test_a_forbidden_scale_patch_raises_a_scaler_error_naming_the_object(
    scaler: KubernetesScaler, cluster: FakeKubernetesApi
) -> None:
    cluster.fail(
        "PATCH",
        SCALE,
        403,
        'deployments.apps "calc" is forbidden: User "system:serviceaccount:agents:mesh-manager" '
        'cannot patch resource "deployments/scale" in API group "apps"',
    )

    with pytest.raises(ScalerError) as caught:
        await scaler.scale_to("calc", 3)

    assert str(caught.value) == (
        "Could not scale deployment 'calc' to 3 replicas in namespace 'agents': the Kubernetes "
        'API answered HTTP 403 Forbidden: deployments.apps "calc" is forbidden: User '
        '"system:serviceaccount:agents:mesh-manager" cannot patch resource "deployments/scale" '
        'in API group "apps"'
    )
    assert cluster.replicas("calc", namespace=NS) == 2


async def test_a_server_error_on_delete_raises_a_scaler_error(
    scaler: KubernetesScaler, cluster: FakeKubernetesApi
) -> None:
    cluster.fail("DELETE", POD_A, 500, "etcdserver: request timed out")

    with pytest.raises(ScalerError, match="HTTP 500 Internal Server Error") as caught:
        await scaler.delete_pod("calc", "calc-7d9f-a")

    assert "delete pod 'calc-7d9f-a' of deployment 'calc'" in str(caught.value)
    assert str(caught.value).endswith("etcdserver: request timed out")
    assert cluster.has_pod("calc-7d9f-a", namespace=NS)


async def test_a_server_error_on_read_raises_instead_of_reporting_a_missing_deployment(
    scaler: KubernetesScaler, cluster: FakeKubernetesApi
) -> None:
    cluster.fail("GET", SCALE, 500)

    with pytest.raises(ScalerError, match=r"read the scale of deployment 'calc'.*HTTP 500"):
        await scaler.current_replicas("calc")


async def test_scaling_a_missing_deployment_is_an_error(
    scaler: KubernetesScaler, cluster: FakeKubernetesApi
) -> None:
    with pytest.raises(ScalerError, match=r'HTTP 404 Not Found: deployments.apps "nope" not found'):
        await scaler.scale_to("nope", 2)


async def test_an_unreachable_api_server_raises_a_scaler_error() -> None:
    with socket.socket() as sock:  # a port that was free a moment ago: nothing listens there
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    configuration = k8s.Configuration(host=f"http://127.0.0.1:{port}")
    configuration.retries = 0
    scaler = KubernetesScaler(NS, api_client=k8s.ApiClient(configuration))
    try:
        with pytest.raises(ScalerError, match=rf"the Kubernetes API at http://127.0.0.1:{port}"):
            await scaler.current_replicas("calc")
    finally:
        await scaler.close()


# ---- from_environment -----------------------------------------------------------------------
def _kubeconfig(path: Path, server: str, namespace: str | None) -> Path:
    context: dict[str, str] = {"cluster": "fake", "user": "tester"}
    if namespace is not None:
        context["namespace"] = namespace
    path.write_text(
        yaml.safe_dump(
            {
                "apiVersion": "v1",
                "kind": "Config",
                "clusters": [{"name": "fake", "cluster": {"server": server}}],
                "users": [{"name": "tester", "user": {"token": "t0ken"}}],
                "contexts": [{"name": "fake", "context": context}],
                "current-context": "fake",
            }
        )
    )
    return path


async def test_from_environment_uses_the_kubeconfig_context_and_its_namespace(
    fake_k8s: FakeKubernetesApi, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv("KUBERNETES_SERVICE_HOST", raising=False)
    config = _kubeconfig(tmp_path / "config", fake_k8s.url, "team-a")
    monkeypatch.setattr(kube_config, "KUBE_CONFIG_DEFAULT_LOCATION", str(config))
    fake_k8s.add_deployment("calc", replicas=4, namespace="team-a")

    scaler = KubernetesScaler.from_environment()
    try:
        assert scaler.namespace == "team-a"
        assert await scaler.current_replicas("calc") == 4
    finally:
        await scaler.close()
    [request] = fake_k8s.requests
    assert request.path == "/apis/apps/v1/namespaces/team-a/deployments/calc/scale"
    assert request.authorization == "Bearer t0ken"


async def test_from_environment_defaults_to_the_default_namespace(
    fake_k8s: FakeKubernetesApi, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv("KUBERNETES_SERVICE_HOST", raising=False)
    config = _kubeconfig(tmp_path / "config", fake_k8s.url, None)
    monkeypatch.setattr(kube_config, "KUBE_CONFIG_DEFAULT_LOCATION", str(config))

    scaler = KubernetesScaler.from_environment()
    explicit = KubernetesScaler.from_environment("elsewhere")
    try:
        assert (scaler.namespace, explicit.namespace) == ("default", "elsewhere")
    finally:
        await scaler.close()
        await explicit.close()


async def test_from_environment_in_a_pod_uses_the_service_account(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    (tmp_path / "token").write_text("sa-token")
    (tmp_path / "ca.crt").write_text("-----BEGIN CERTIFICATE-----\n")
    (tmp_path / "namespace").write_text("mesh-agents\n")
    monkeypatch.setenv("KUBERNETES_SERVICE_HOST", "10.96.0.1")
    monkeypatch.setenv("KUBERNETES_SERVICE_PORT", "443")
    monkeypatch.setattr(incluster_config, "SERVICE_TOKEN_FILENAME", str(tmp_path / "token"))
    monkeypatch.setattr(incluster_config, "SERVICE_CERT_FILENAME", str(tmp_path / "ca.crt"))
    monkeypatch.setattr(scaler_module, "SERVICE_ACCOUNT_NAMESPACE_FILE", tmp_path / "namespace")

    scaler = KubernetesScaler.from_environment()
    explicit = KubernetesScaler.from_environment("other")
    try:
        assert scaler.namespace == "mesh-agents"
        assert explicit.namespace == "other"
        configuration = scaler.api_client.configuration
        assert configuration.host == "https://10.96.0.1:443"
        assert configuration.api_key["BearerToken"].lower() == "bearer sa-token"
    finally:
        await scaler.close()
        await explicit.close()


def test_from_environment_without_any_configuration_says_so(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv("KUBERNETES_SERVICE_HOST", raising=False)
    monkeypatch.setattr(kube_config, "KUBE_CONFIG_DEFAULT_LOCATION", str(tmp_path / "missing"))

    with pytest.raises(
        ScalerError, match="Cannot configure the Kubernetes client from the kubeconfig"
    ):
        KubernetesScaler.from_environment()


# ---- least privilege ------------------------------------------------------------------------
RBAC_MANIFEST = Path(__file__).parents[2] / "deploy" / "k8s" / "manager-rbac.yaml"
VERBS = {"GET": "get", "PATCH": "patch", "DELETE": "delete"}


def _permission(method: str, path: str) -> tuple[str, str, str]:
    """(apiGroup, resource, verb) that RBAC checks for one request of the scaler."""
    if match := re.fullmatch(r"/apis/([^/]+)/v1/namespaces/[^/]+/([^/]+)/[^/]+/([^/]+)", path):
        return (match[1], f"{match[2]}/{match[3]}", VERBS[method])
    if match := re.fullmatch(r"/api/v1/namespaces/[^/]+/([^/]+)/[^/]+", path):
        return ("", match[1], VERBS[method])
    raise AssertionError(f"unexpected request path {path}")


async def test_the_manager_role_grants_exactly_what_the_scaler_uses(
    scaler: KubernetesScaler, cluster: FakeKubernetesApi
) -> None:
    await scaler.current_replicas("calc")
    await scaler.scale_to("calc", 1, remove_first="calc-7d9f-a")
    await scaler.delete_pod("calc", "calc-7d9f-b")
    used = {_permission(r.method, r.path) for r in cluster.requests}

    [role] = [d for d in yaml.safe_load_all(RBAC_MANIFEST.read_text()) if d["kind"] == "Role"]
    granted = {
        (group, resource, verb)
        for rule in role["rules"]
        for group in rule["apiGroups"]
        for resource in rule["resources"]
        for verb in rule["verbs"]
    }
    assert (
        used
        == granted
        == {
            ("apps", "deployments/scale", "get"),
            ("apps", "deployments/scale", "patch"),
            ("", "pods", "patch"),
            ("", "pods", "delete"),
        }
    )


# ---- the fake itself ------------------------------------------------------------------------
def test_the_fake_applies_the_strategic_merge_patch_the_client_sends_by_default(
    k8s_api_client: k8s.ApiClient, cluster: FakeKubernetesApi
) -> None:
    k8s.AppsV1Api(k8s_api_client).patch_namespaced_deployment_scale(
        "calc", NS, {"spec": {"replicas": 7}}
    )
    scale = k8s.AppsV1Api(k8s_api_client).read_namespaced_deployment_scale("calc", NS)

    [patch, _read] = cluster.requests
    assert patch.content_type == "application/strategic-merge-patch+json"
    assert scale.spec is not None and scale.metadata is not None
    assert (scale.kind, scale.api_version, scale.spec.replicas) == ("Scale", "autoscaling/v1", 7)
    assert (scale.metadata.name, scale.metadata.namespace) == ("calc", NS)
