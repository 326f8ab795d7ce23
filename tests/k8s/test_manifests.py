"""The Kubernetes manifests in ``deploy/k8s/``: schema-valid, and true to the mesh.

Every YAML document under ``deploy/k8s`` (``optional/`` and ``secret.example.yaml``
included) is validated offline with ``kubernetes-validate`` in strict mode (unknown fields
are errors) against the newest Kubernetes version whose schemas the installed package ships.
Three kinds have no schema there: ``Kustomization`` (a kustomize file, not an API object),
KEDA's ``ScaledObject`` and the RabbitMQ Cluster Operator's ``RabbitmqCluster`` (CRDs); their
shape is checked by hand below — the ``ScaledObject`` against a JSON Schema of the part of
KEDA's CRD it uses, and its ``metrics-api`` trigger against the manager's real endpoint — and
a test makes sure no other kind slips past the schemas.

The policy tests pin what the schemas cannot see: no broker credentials, secrets only by
reference, the agent probes and drain hook, a grace period longer than the agent's own drain
bound (read from ``AgentSettings``), the labels the samples actually announce, RBAC limited to
what the scaler uses, and a scaling file that names real Deployments.

The several-managers overlay (``deploy/k8s-several-managers``) is rendered with
``kubectl kustomize`` (skipped without kubectl) and checked the same way, plus what several
managers need: replicas, a journal volume each, shards on the PostgreSQL ledger from the
Secret, a disruption budget over the manager pods, and no single-replica manager left.
"""

from __future__ import annotations

import asyncio
import copy
import json
import re
import shutil
import subprocess
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import aiohttp
import jsonschema
import kubernetes_validate
import pytest
import yaml
from kubernetes_validate.utils import SchemaNotFoundError, latest_version

from mesh.agent import AgentSettings
from mesh.core.signals import PoolActivity, PoolFigures, pool_signals
from mesh.manager.metrics import ManagerMetrics, MeshView
from mesh.manager.web import ManagerWeb
from mesh.samples import SAMPLES
from mesh.wire.status import PoolSignals

ROOT = Path(__file__).parents[2]
K8S = ROOT / "deploy" / "k8s"

KUBERNETES_VERSION = latest_version()
"""The newest Kubernetes version the installed kubernetes-validate has schemas for."""

NOT_IN_KUBERNETES_SCHEMAS = {
    ("kustomize.config.k8s.io/v1beta1", "Kustomization"),
    ("keda.sh/v1alpha1", "ScaledObject"),
    ("rabbitmq.com/v1beta1", "RabbitmqCluster"),
}
"""Checked by hand below: kustomize's own file, KEDA's CRDs and the RabbitMQ Cluster
Operator's."""

AGENT_DEPLOYMENTS = {"calc": "calc", "textstats": "textstats", "echo": "echo"}
"""Deployment name → the sample it runs (``mesh agent <sample>``). The names are equal because
they must be: see ``test_agent_deployment_is_named_after_the_deployment_its_agents_announce``."""

AGENT_HTTP_PORT = 8080
SECRET_NAME, SECRET_KEY = "mesh-amqp", "url"
MANAGER_USER_KEY = "manager-user"  # the managers' broker user, as agents are told it

Doc = dict[str, Any]


# ---- loading ----------------------------------------------------------------------------------


def manifest_files() -> list[Path]:
    return sorted(p for p in K8S.rglob("*") if p.suffix in (".yaml", ".yml"))


def load_docs() -> list[tuple[str, Doc]]:
    """``(where, document)`` for every non-empty YAML document under deploy/k8s."""
    docs = []
    for path in manifest_files():
        for index, doc in enumerate(yaml.safe_load_all(path.read_text())):
            if doc is not None:
                docs.append((f"{path.relative_to(K8S)}#{index}", doc))
    return docs


DOCS = load_docs()


def kind_key(doc: Doc) -> tuple[str, str]:
    return (doc["apiVersion"], doc["kind"])


def docs_of(kind: str, *, path: str | None = None) -> list[Doc]:
    return [
        doc
        for where, doc in DOCS
        if doc["kind"] == kind and (path is None or where.split("#")[0] == path)
    ]


def one(kind: str, name: str) -> Doc:
    found = [doc for doc in docs_of(kind) if doc["metadata"]["name"] == name]
    assert len(found) == 1, f"expected exactly one {kind} {name}, found {len(found)}"
    return found[0]


def deployments() -> dict[str, Doc]:
    return {doc["metadata"]["name"]: doc for doc in docs_of("Deployment")}


def container(deployment: Doc) -> Doc:
    containers = deployment["spec"]["template"]["spec"]["containers"]
    assert len(containers) == 1, "one container per pod"
    result: Doc = containers[0]
    return result


def env_of(c: Doc) -> dict[str, Doc]:
    return {e["name"]: e for e in c.get("env", [])}


def manager() -> Doc:
    return one("Deployment", "mesh-manager")


# ---- schemas ----------------------------------------------------------------------------------


def test_the_manifests_exist_and_every_document_has_a_kind() -> None:
    assert len(DOCS) >= 10
    for where, doc in DOCS:
        assert {"apiVersion", "kind", "metadata"} <= doc.keys() or doc["kind"] == "Kustomization", (
            where
        )


SCHEMA_DOCS = [
    (where, doc) for where, doc in DOCS if kind_key(doc) not in NOT_IN_KUBERNETES_SCHEMAS
]


@pytest.mark.parametrize(("where", "doc"), SCHEMA_DOCS, ids=[where for where, _ in SCHEMA_DOCS])
def test_every_manifest_validates_against_the_kubernetes_schemas_strictly(
    where: str, doc: Doc
) -> None:
    validated_against = kubernetes_validate.validate(doc, KUBERNETES_VERSION, strict=True)
    assert validated_against == ".".join(KUBERNETES_VERSION.split(".")[:2])


def test_only_the_known_kinds_have_no_kubernetes_schema() -> None:
    """A new CRD must get its own shape test instead of silently skipping validation."""
    unvalidated = {kind_key(doc) for _, doc in DOCS} & NOT_IN_KUBERNETES_SCHEMAS
    assert unvalidated == NOT_IN_KUBERNETES_SCHEMAS
    for _, doc in DOCS:
        if kind_key(doc) in NOT_IN_KUBERNETES_SCHEMAS:
            with pytest.raises(SchemaNotFoundError):
                kubernetes_validate.validate(doc, KUBERNETES_VERSION, strict=True)


def test_strict_validation_does_catch_mistakes() -> None:
    """The validator is not vacuous: a misspelt field and a wrong type are both rejected."""
    misspelt = copy.deepcopy(one("Deployment", "calc"))
    misspelt["spec"]["template"]["spec"]["containers"][0]["readinesProbe"] = {}
    wrong_type = copy.deepcopy(one("Deployment", "calc"))
    wrong_type["spec"]["template"]["spec"]["terminationGracePeriodSeconds"] = "120"
    for doc in (misspelt, wrong_type):
        with pytest.raises(kubernetes_validate.ValidationError):
            kubernetes_validate.validate(doc, KUBERNETES_VERSION, strict=True)


# ---- kustomization ----------------------------------------------------------------------------


def test_the_kustomization_lists_every_manifest_but_the_example_secret_and_optional_ones() -> None:
    (kustomization,) = docs_of("Kustomization")
    assert kind_key(kustomization) == ("kustomize.config.k8s.io/v1beta1", "Kustomization")
    assert set(kustomization) <= {"apiVersion", "kind", "resources", "images"}
    listed = kustomization["resources"]
    assert len(listed) == len(set(listed)), "a resource is listed twice"
    expected = sorted(
        p.name
        for p in K8S.glob("*.yaml")
        if p.name not in ("kustomization.yaml", "secret.example.yaml")
    )
    assert sorted(listed) == expected
    for image in kustomization.get("images", []):
        assert image["name"] == "agent-mesh"


def test_no_manifest_pins_a_namespace() -> None:
    for where, doc in DOCS:
        assert "namespace" not in doc.get("metadata", {}), where
        for subject in doc.get("subjects", []):
            assert "namespace" not in subject, f"{where}: the binding's own namespace is implied"


# ---- credentials ------------------------------------------------------------------------------


@pytest.mark.parametrize("path", manifest_files(), ids=lambda p: str(p.relative_to(K8S)))
def test_no_guest_credentials_in_any_manifest(path: Path) -> None:
    assert "guest" not in path.read_text().lower()


def secret_ref(key: str) -> Doc:
    return {"secretKeyRef": {"name": SECRET_NAME, "key": key}}


def test_the_broker_url_comes_only_from_the_secret_by_reference() -> None:
    for name, deployment in deployments().items():
        env = env_of(container(deployment))
        key = SECRET_KEY if name == "mesh-manager" else f"agent-url-{name}"
        assert env["MESH_AMQP_URL"] == {"name": "MESH_AMQP_URL", "valueFrom": secret_ref(key)}, name
        for var in env.values():
            assert "amqp://" not in str(var.get("value", "")), f"{name}: {var['name']}"
    for where, doc in DOCS:
        if doc["kind"] == "Secret":
            assert where.startswith("secret.example.yaml"), f"{where}: a Secret in the manifests"


def test_the_example_secret_shows_the_keys_the_manifests_read_with_placeholders_only() -> None:
    (secret,) = docs_of("Secret", path="secret.example.yaml")
    assert secret["metadata"]["name"] == SECRET_NAME
    assert "data" not in secret, "stringData placeholders, no encoded values"
    url = secret["stringData"][SECRET_KEY]
    assert url.startswith("amqp://") and "REPLACE_WITH_PASSWORD" in url
    for key, value in secret["stringData"].items():
        assert "REPLACE_WITH_PASSWORD" in value or key == MANAGER_USER_KEY, key
    read = {
        var["valueFrom"]["secretKeyRef"]["key"]
        for deployment in deployments().values()
        for var in env_of(container(deployment)).values()
        if "secretKeyRef" in var.get("valueFrom", {})
    }
    assert read <= set(secret["stringData"]), read - set(secret["stringData"])


def test_agents_have_broker_users_of_their_own_and_take_control_only_from_the_managers() -> None:
    """No agent holds the managers' broker user (it could sign control messages as them):
    each Deployment's agents read their pool's user, made by ``mesh broker add-pool-agents``,
    which may not declare the shared topology (so they check it), and are told the managers'
    user, which the example Secret keeps apart from every agent user."""
    (secret,) = docs_of("Secret", path="secret.example.yaml")
    data = secret["stringData"]
    managers = urlsplit(data[SECRET_KEY]).username
    assert data[MANAGER_USER_KEY] == managers
    for name in AGENT_DEPLOYMENTS:
        env = env_of(container(one("Deployment", name)))
        assert env["MESH_MANAGER_USER"]["valueFrom"] == secret_ref(MANAGER_USER_KEY), name
        assert env["MESH_SHARED_TOPOLOGY"]["value"] == "check", name
        assert urlsplit(data[f"agent-url-{name}"]).username not in (None, managers), name


# ---- agents -----------------------------------------------------------------------------------


def registration(sample: str) -> Any:
    return SAMPLES[sample]("manifest-check").registration("incarnation")


def announced(sample: str) -> tuple[str, str]:
    """The (capability, version) the sample really registers with: the labels must match."""
    capabilities = registration(sample).capabilities
    assert len(capabilities) == 1
    return capabilities[0].name, capabilities[0].version


@pytest.mark.parametrize(("name", "sample"), AGENT_DEPLOYMENTS.items())
def test_agent_deployment_is_named_after_the_deployment_its_agents_announce(
    name: str, sample: str
) -> None:
    """The manager counts live and idle agents, and deletes lost pods, per the ``deployment``
    field of their registration, and scales the Kubernetes Deployment of that same name. Were
    the names to differ, it would see no live agent in the Deployment (so wait forever for
    "pending" replicas instead of scaling up), never pick one to scale down, and never delete
    a lost agent's pod."""
    assert registration(sample).deployment == name


def test_there_is_an_agent_deployment_per_sample() -> None:
    assert set(AGENT_DEPLOYMENTS.values()) == set(SAMPLES)
    assert AGENT_DEPLOYMENTS.keys() <= deployments().keys()


@pytest.mark.parametrize(("name", "sample"), AGENT_DEPLOYMENTS.items())
def test_agent_labels_name_the_capability_the_sample_announces(name: str, sample: str) -> None:
    deployment = one("Deployment", name)
    capability, version = announced(sample)
    expected = {"app": name, "capability": capability, "cap-version": version}
    for labels in (
        deployment["metadata"]["labels"],
        deployment["spec"]["template"]["metadata"]["labels"],
    ):
        assert expected.items() <= labels.items()
    assert deployment["spec"]["selector"] == {"matchLabels": {"app": name}}


@pytest.mark.parametrize(("name", "sample"), AGENT_DEPLOYMENTS.items())
def test_agent_runs_its_sample_with_the_http_endpoints(name: str, sample: str) -> None:
    c = container(one("Deployment", name))
    assert c["args"] == ["agent", sample, "--http-port", str(AGENT_HTTP_PORT)]
    assert c["image"].split(":")[0] == "agent-mesh"
    env = env_of(c)
    assert env["AGENT_ID"]["valueFrom"] == {"fieldRef": {"fieldPath": "metadata.name"}}
    assert float(env["HEARTBEAT_INTERVAL_S"]["value"]) >= 5  # the manager refuses less
    assert env["MESH_HTTP_PORT"]["value"] == str(AGENT_HTTP_PORT)
    assert {"containerPort": AGENT_HTTP_PORT}.items() <= c["ports"][0].items()

    assert c["readinessProbe"]["httpGet"] == {"path": "/ready", "port": AGENT_HTTP_PORT}
    assert c["livenessProbe"]["httpGet"] == {"path": "/healthz", "port": AGENT_HTTP_PORT}
    assert c["lifecycle"] == {"preStop": {"httpGet": {"path": "/drain", "port": AGENT_HTTP_PORT}}}


@pytest.mark.parametrize("name", AGENT_DEPLOYMENTS)
def test_agent_grace_period_outlasts_its_own_drain_bound(name: str) -> None:
    """preStop /drain may take drain_timeout_s + shutdown_grace_s (60 + 30 s by default)."""
    settings = AgentSettings()
    drain_bound = settings.drain_timeout_s + settings.shutdown_grace_s
    grace = one("Deployment", name)["spec"]["template"]["spec"]["terminationGracePeriodSeconds"]
    assert grace > drain_bound


@pytest.mark.parametrize("name", AGENT_DEPLOYMENTS)
def test_agent_rolls_out_one_new_pod_before_removing_an_old_one(name: str) -> None:
    spec = one("Deployment", name)["spec"]
    assert spec["strategy"] == {
        "type": "RollingUpdate",
        "rollingUpdate": {"maxUnavailable": 0, "maxSurge": 1},
    }
    assert "replicas" not in spec, "the manager owns spec.replicas; apply must not reset it"


@pytest.mark.parametrize("name", [*AGENT_DEPLOYMENTS, "mesh-manager"])
def test_pods_are_locked_down_and_sized(name: str) -> None:
    pod = one("Deployment", name)["spec"]["template"]["spec"]
    assert pod["securityContext"]["runAsNonRoot"] is True
    assert pod["securityContext"]["runAsUser"] == 10001  # the image's user
    c = container(one("Deployment", name))
    assert c["securityContext"]["allowPrivilegeEscalation"] is False
    assert c["securityContext"]["readOnlyRootFilesystem"] is True
    assert c["securityContext"]["capabilities"]["drop"] == ["ALL"]
    for kind in ("requests", "limits"):
        assert {"cpu", "memory"} <= c["resources"][kind].keys()
    if name in AGENT_DEPLOYMENTS:
        assert pod["automountServiceAccountToken"] is False


# ---- manager ----------------------------------------------------------------------------------


def mounts(deployment: Doc) -> dict[str, tuple[str, Doc]]:
    """Volume name → (mount path, volume source)."""
    volumes = {v["name"]: v for v in deployment["spec"]["template"]["spec"]["volumes"]}
    return {
        m["name"]: (m["mountPath"], volumes[m["name"]])
        for m in container(deployment)["volumeMounts"]
    }


def arg(c: Doc, flag: str) -> str:
    args: list[str] = c["args"]
    return args[args.index(flag) + 1]


def test_manager_is_a_single_replica_recreated_never_rolled() -> None:
    spec = manager()["spec"]
    assert spec["replicas"] == 1
    assert spec["strategy"] == {"type": "Recreate"}


def test_manager_journal_lives_on_the_persistent_volume() -> None:
    c = container(manager())
    journal = Path(arg(c, "--journal"))
    path, volume = mounts(manager())["journal"]
    assert journal.parent == Path(path) == Path("/var/lib/mesh")
    claim = volume["persistentVolumeClaim"]["claimName"]
    pvc = one("PersistentVolumeClaim", claim)
    assert pvc["spec"]["accessModes"] == ["ReadWriteOnce"]


def test_manager_runs_the_kubernetes_scaler_with_the_mounted_scaling_file() -> None:
    c = container(manager())
    assert c["args"][0] == "manager"
    assert arg(c, "--scaler") == "kubernetes"
    env = env_of(c)
    assert env["MESH_SCALER"]["value"] == "kubernetes"
    scaling = Path(arg(c, "--scaling"))
    assert env["MESH_SCALING_FILE"]["value"] == str(scaling)
    path, volume = mounts(manager())["scaling"]
    assert scaling.parent == Path(path)
    config_map = one("ConfigMap", volume["configMap"]["name"])
    assert scaling.name in config_map["data"]
    assert env["MESH_K8S_NAMESPACE"]["valueFrom"] == {
        "fieldRef": {"fieldPath": "metadata.namespace"}
    }
    assert env["MESH_LOG_FORMAT"]["value"] == "json"


def test_manager_service_selects_the_manager_pod() -> None:
    service = one("Service", "mesh-manager")
    labels = manager()["spec"]["template"]["metadata"]["labels"]
    assert service["spec"]["selector"].items() <= labels.items()
    assert [p["port"] for p in service["spec"]["ports"]] == [8090]
    for other in deployments().values():
        if other is not manager():
            other_labels = other["spec"]["template"]["metadata"]["labels"]
            assert not service["spec"]["selector"].items() <= other_labels.items()


# ---- RBAC -------------------------------------------------------------------------------------


def test_the_role_grants_exactly_what_the_scaler_uses() -> None:
    (role,) = docs_of("Role")
    granted: dict[tuple[str, str], set[str]] = {}
    for rule in role["rules"]:
        assert "resourceNames" not in rule and "nonResourceURLs" not in rule
        for group in rule["apiGroups"]:
            for resource in rule["resources"]:
                granted.setdefault((group, resource), set()).update(rule["verbs"])
    assert granted == {
        ("apps", "deployments/scale"): {"get", "patch"},
        ("", "pods"): {"patch", "delete"},
    }
    assert not docs_of("ClusterRole") and not docs_of("ClusterRoleBinding")


def test_the_role_is_bound_to_the_managers_service_account_only() -> None:
    (role,) = docs_of("Role")
    (binding,) = docs_of("RoleBinding")
    account = manager()["spec"]["template"]["spec"]["serviceAccountName"]
    one("ServiceAccount", account)
    assert binding["roleRef"] == {
        "apiGroup": "rbac.authorization.k8s.io",
        "kind": "Role",
        "name": role["metadata"]["name"],
    }
    assert binding["subjects"] == [{"kind": "ServiceAccount", "name": account}]
    for name in AGENT_DEPLOYMENTS:
        assert "serviceAccountName" not in one("Deployment", name)["spec"]["template"]["spec"]


# ---- scaling file -----------------------------------------------------------------------------


def scaling_file() -> Doc:
    c = container(manager())
    volume = mounts(manager())["scaling"][1]
    config_map = one("ConfigMap", volume["configMap"]["name"])
    parsed: Doc = json.loads(config_map["data"][Path(arg(c, "--scaling")).name])
    return parsed


def test_the_scaling_file_is_json_naming_the_agent_deployments() -> None:
    entries = scaling_file()["deployments"]
    named = [entry["deployment"] for entry in entries]
    assert sorted(named) == sorted(AGENT_DEPLOYMENTS), "every agent Deployment, once"
    for entry in entries:
        deployment = one("Deployment", entry["deployment"])
        capability, _ = announced(AGENT_DEPLOYMENTS[entry["deployment"]])
        assert entry["capabilities"] == [capability]
        assert deployment["metadata"]["labels"]["capability"] == capability
        assert 0 <= entry["min_replicas"] <= entry["max_replicas"]
        assert entry["scale_up_step"] >= 1 and entry["window_s"] > 0
        assert entry["scale_down_idle_s"] > 0


# ---- the CLI the manifests call -----------------------------------------------------------------


@pytest.mark.parametrize("name", [*AGENT_DEPLOYMENTS, "mesh-manager"])
def test_container_args_are_accepted_by_the_mesh_cli(name: str) -> None:
    """The image's ENTRYPOINT is ``mesh``: the args must parse with the real CLI."""
    from mesh.cli import build_parser

    args = container(one("Deployment", name))["args"]
    build_parser().parse_args(args)  # exits (SystemExit) on an unknown flag or choice


@pytest.mark.parametrize("name", [*AGENT_DEPLOYMENTS, "mesh-manager"])
def test_every_environment_variable_set_is_one_the_mesh_reads(name: str) -> None:
    sources = "\n".join(p.read_text() for p in (ROOT / "mesh").rglob("*.py"))
    for var in env_of(container(one("Deployment", name))):
        assert f'"{var}"' in sources, f"{name}: nothing in mesh/ reads {var}"


# ---- KEDA (optional) --------------------------------------------------------------------------

KEDA = "optional/keda-scaledobject.yaml"

_STRINGS = {"type": "object", "additionalProperties": {"type": "string"}}
SCALED_OBJECT_SCHEMA: Doc = {
    "$schema": "https://json-schema.org/draft/2020-12/schema",
    "title": "KEDA ScaledObject (keda.sh/v1alpha1): the fields of KEDA's CRD this repo uses",
    "type": "object",
    "required": ["apiVersion", "kind", "metadata", "spec"],
    "additionalProperties": False,
    "properties": {
        "apiVersion": {"const": "keda.sh/v1alpha1"},
        "kind": {"const": "ScaledObject"},
        "metadata": {
            "type": "object",
            "required": ["name"],
            "properties": {"name": {"type": "string", "minLength": 1}, "labels": _STRINGS},
        },
        "spec": {
            "type": "object",
            "required": ["scaleTargetRef", "triggers"],
            "additionalProperties": False,
            "properties": {
                "scaleTargetRef": {
                    "type": "object",
                    "required": ["name"],
                    "additionalProperties": False,
                    "properties": {
                        "apiVersion": {"type": "string"},
                        "kind": {"type": "string"},
                        "name": {"type": "string"},
                        "envSourceContainerName": {"type": "string"},
                    },
                },
                "pollingInterval": {"type": "integer", "minimum": 1},
                "cooldownPeriod": {"type": "integer", "minimum": 0},
                "idleReplicaCount": {"type": "integer", "minimum": 0},
                "minReplicaCount": {"type": "integer", "minimum": 0},
                "maxReplicaCount": {"type": "integer", "minimum": 1},
                "advanced": {
                    "type": "object",
                    "additionalProperties": False,
                    "properties": {
                        "restoreToOriginalReplicaCount": {"type": "boolean"},
                        "horizontalPodAutoscalerConfig": {
                            "type": "object",
                            "additionalProperties": False,
                            "properties": {
                                "name": {"type": "string"},
                                "behavior": {"type": "object"},
                            },
                        },
                    },
                },
                "triggers": {
                    "type": "array",
                    "minItems": 1,
                    "items": {
                        "type": "object",
                        "required": ["type", "metadata"],
                        "additionalProperties": False,
                        "properties": {
                            "type": {"type": "string"},
                            "name": {"type": "string"},
                            "metricType": {"enum": ["AverageValue", "Value", "Utilization"]},
                            "useCachedMetrics": {"type": "boolean"},
                            "metadata": _STRINGS,  # KEDA's metadata is map[string]string
                            "authenticationRef": {
                                "type": "object",
                                "required": ["name"],
                                "properties": {
                                    "name": {"type": "string"},
                                    "kind": {"type": "string"},
                                },
                            },
                        },
                        # The metrics-api scaler's parameters (keda.sh/docs/scalers/metrics-api).
                        "if": {"properties": {"type": {"const": "metrics-api"}}},
                        "then": {
                            "properties": {
                                "metadata": {
                                    "required": ["url", "valueLocation", "targetValue"],
                                    "additionalProperties": False,
                                    "properties": {
                                        "url": {"type": "string", "pattern": "^https?://"},
                                        "valueLocation": {"type": "string", "minLength": 1},
                                        "targetValue": {
                                            "type": "string",
                                            "pattern": "^[0-9]+(\\.[0-9]+)?$",
                                        },
                                        "activationTargetValue": {"type": "string"},
                                        "format": {"enum": ["json", "xml", "yaml", "prometheus"]},
                                        "authMode": {"type": "string"},
                                        "unsafeSsl": {"enum": ["true", "false"]},
                                    },
                                }
                            }
                        },
                    },
                },
            },
        },
    },
}
"""The part of KEDA's ScaledObject CRD the example uses, strict like the Kubernetes schemas:
an unknown or misspelt field is an error, and a ``metrics-api`` trigger must name its URL,
where in the answer its value is, and a numeric target."""


def scaled_object() -> Doc:
    (scaled,) = docs_of("ScaledObject", path=KEDA)
    return scaled


def metrics_api_trigger() -> Doc:
    (trigger,) = scaled_object()["spec"]["triggers"]
    assert trigger["type"] == "metrics-api"
    return trigger  # type: ignore[no-any-return]


def test_the_keda_scaled_object_validates_against_the_crd_schema() -> None:
    jsonschema.validate(scaled_object(), SCALED_OBJECT_SCHEMA)
    assert not docs_of("TriggerAuthentication"), "the manager's endpoint takes no credentials"


@pytest.mark.parametrize(
    "mistake",
    [
        lambda d: d["spec"].update(minReplicas=1),  # KEDA says minReplicaCount
        lambda d: d["spec"]["triggers"][0]["metadata"].update(targetValue=8),  # not a string
        lambda d: d["spec"]["triggers"][0]["metadata"].pop("valueLocation"),
        lambda d: d["spec"]["triggers"][0].update(metricType="Average"),
        lambda d: d["spec"]["scaleTargetRef"].update(nmae="echo"),
    ],
    ids=["misspelt-field", "wrong-type", "no-value-location", "bad-metric-type", "bad-target"],
)
def test_the_scaled_object_schema_does_catch_mistakes(mistake: Any) -> None:
    broken = copy.deepcopy(scaled_object())
    mistake(broken)
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate(broken, SCALED_OBJECT_SCHEMA)


def test_the_keda_example_scales_an_agent_deployment_on_its_own_pool() -> None:
    spec = scaled_object()["spec"]
    target = spec["scaleTargetRef"]
    assert target.get("kind", "Deployment") == "Deployment"
    assert target["name"] in AGENT_DEPLOYMENTS
    assert 1 <= spec["minReplicaCount"] <= spec["maxReplicaCount"]
    trigger = metrics_api_trigger()
    assert trigger["metricType"] == "AverageValue" and float(trigger["metadata"]["targetValue"]) > 0
    url = urlsplit(trigger["metadata"]["url"])
    # The pool is the Deployment's name: the `deployment` its agents announce.
    assert url.path == f"/api/pools/{target['name']}"


def test_the_keda_url_is_the_manager_service_and_its_http_port() -> None:
    url = urlsplit(metrics_api_trigger()["metadata"]["url"])
    service = one("Service", "mesh-manager")
    (port,) = service["spec"]["ports"]
    assert url.scheme == "http" and url.port == port["port"]
    assert url.hostname is not None
    # KEDA's operator runs in its own namespace: <service>.<namespace>.svc[.cluster.local].
    name, _namespace, svc, *rest = url.hostname.split(".")
    assert (name, svc) == (service["metadata"]["name"], "svc") and rest in (
        [],
        ["cluster", "local"],
    )
    manager_port = next(p for p in container(manager())["ports"] if p["name"] == port["targetPort"])
    assert arg(container(manager()), "--http-port") == str(manager_port["containerPort"])


def test_the_keda_url_and_value_location_are_what_the_manager_really_serves() -> None:
    """The trigger's path is served by the manager's own HTTP app, and its valueLocation
    (a GJSON path) names a number in the JSON that path really returns."""
    trigger = metrics_api_trigger()
    url = urlsplit(trigger["metadata"]["url"])
    pool = url.path.rsplit("/", 1)[-1]
    signals = pool_signals(
        {pool: PoolFigures(in_flight=5, waiting=[(0.0, 1e12)])}, PoolActivity(), 1.0
    )

    async def served() -> tuple[int, Any]:
        web = ManagerWeb(
            ManagerMetrics(MeshView()), lambda _o, _l: {}, host="127.0.0.1", pools=lambda: signals
        )
        await web.start()
        try:
            async with (
                aiohttp.ClientSession() as session,
                session.get(f"http://127.0.0.1:{web.port}{url.path}") as response,
            ):
                return response.status, await response.json()
        finally:
            await web.close()

    status, document = asyncio.run(served())
    assert status == 200
    value: Any = document
    for key in trigger["metadata"]["valueLocation"].split("."):
        value = value[key]
    assert value == 6  # demand: 5 grants in flight + 1 request deferred
    assert trigger["metadata"]["valueLocation"].split(".")[0] in PoolSignals.model_fields


# ---- several managers (deploy/k8s-several-managers) -------------------------------------------
#
# The overlay is checked as Kubernetes would receive it: rendered by `kubectl kustomize` (the
# base with its manager replaced), every document validated strictly like the base's, then
# the properties several managers depend on. Kustomize refuses an overlay inside its own base
# ("cycle detected"), hence a directory beside deploy/k8s rather than under it.

OVERLAY = ROOT / "deploy" / "k8s-several-managers"
LEDGER_KEY = "ledger-url"


def kustomize(directory: Path) -> list[Doc]:
    kubectl = shutil.which("kubectl")
    if kubectl is None:
        pytest.skip("kubectl is not installed: the overlay cannot be rendered (kubectl kustomize)")
    rendered = subprocess.run(
        [kubectl, "kustomize", str(directory)], capture_output=True, text=True, timeout=60
    )
    assert rendered.returncode == 0, rendered.stderr
    return [doc for doc in yaml.safe_load_all(rendered.stdout) if doc is not None]


@pytest.fixture(scope="module")
def overlay() -> list[Doc]:
    return kustomize(OVERLAY)


@pytest.fixture(scope="module")
def base() -> list[Doc]:
    return kustomize(K8S)


def named(docs: list[Doc], kind: str, name: str) -> Doc:
    found = [d for d in docs if d["kind"] == kind and d["metadata"]["name"] == name]
    assert len(found) == 1, f"expected exactly one {kind} {name}, found {len(found)}"
    return found[0]


def managers(docs: list[Doc]) -> Doc:
    return named(docs, "StatefulSet", "mesh-manager")


def matches(selector: dict[str, str], labels: dict[str, str]) -> bool:
    return selector.items() <= labels.items()


def test_the_overlay_renders_to_documents_that_validate_strictly(overlay: list[Doc]) -> None:
    for doc in overlay:
        where = f"{doc['kind']} {doc['metadata']['name']}"
        try:
            kubernetes_validate.validate(doc, KUBERNETES_VERSION, strict=True)
        except kubernetes_validate.ValidationError as exc:
            pytest.fail(f"{where}: {exc}")
    assert {d["kind"] for d in overlay} >= {"StatefulSet", "PodDisruptionBudget", "Service"}


def test_the_overlay_replaces_the_single_manager_and_keeps_the_rest_of_the_base(
    overlay: list[Doc], base: list[Doc]
) -> None:
    def key(doc: Doc) -> tuple[str, str]:
        return (doc["kind"], doc["metadata"]["name"])

    replaced = {("Deployment", "mesh-manager"), ("PersistentVolumeClaim", "mesh-manager-journal")}
    added = {
        ("StatefulSet", "mesh-manager"),
        ("Service", "mesh-manager-pods"),
        ("PodDisruptionBudget", "mesh-manager"),
    }
    base_by_key = {key(d): d for d in base}
    overlay_by_key = {key(d): d for d in overlay}
    assert replaced <= base_by_key.keys(), "the base's single manager is what the overlay removes"
    assert overlay_by_key.keys() == (base_by_key.keys() - replaced) | added
    for k in base_by_key.keys() - replaced:
        assert overlay_by_key[k] == base_by_key[k], f"{k}: changed by the overlay"


def test_several_managers_run_in_parallel_each_with_its_own_journal_volume(
    overlay: list[Doc],
) -> None:
    spec = managers(overlay)["spec"]
    assert spec["replicas"] >= 2
    assert spec["podManagementPolicy"] == "Parallel"
    assert spec["updateStrategy"] == {"type": "RollingUpdate"}
    c = container(managers(overlay))
    journal = Path(arg(c, "--journal"))
    (template,) = [t for t in spec["volumeClaimTemplates"] if t["metadata"]["name"] == "journal"]
    assert template["spec"]["accessModes"] == ["ReadWriteOnce"]
    pod_volumes = {v["name"] for v in spec["template"]["spec"]["volumes"]}
    assert "journal" not in pod_volumes, "a pod volume would shadow the per-replica claim"
    (mount,) = [m for m in c["volumeMounts"] if m["name"] == "journal"]
    assert journal.parent == Path(mount["mountPath"])
    assert not [d for d in overlay if d["kind"] == "PersistentVolumeClaim"], "no shared claim"


def test_managers_share_shards_on_the_postgresql_ledger_from_the_secret(
    overlay: list[Doc],
) -> None:
    from mesh.cli import build_parser

    c = container(managers(overlay))
    parsed = build_parser().parse_args(c["args"])  # SystemExit on an unknown flag or choice
    assert parsed.command == "manager" and parsed.scaler == "kubernetes"
    assert c["args"].count("--shards") == 1 and int(arg(c, "--shards")) >= 2
    assert "--admission-capacity" not in c["args"], "live (the default): owners share it"
    assert "--ledger" not in c["args"], "the DSN holds a password: only from the Secret"
    env = env_of(c)
    assert env["MESH_LEDGER_URL"]["valueFrom"] == {
        "secretKeyRef": {"name": SECRET_NAME, "key": LEDGER_KEY}
    }
    (secret,) = docs_of("Secret", path="secret.example.yaml")
    assert secret["stringData"][LEDGER_KEY].startswith("postgresql://")
    assert env["MESH_AMQP_URL"]["valueFrom"] == {
        "secretKeyRef": {"name": SECRET_NAME, "key": SECRET_KEY}
    }
    # Each manager is named after its pod: distinct per replica, stable across restarts.
    assert env["MESH_MANAGER_ID"]["valueFrom"] == {"fieldRef": {"fieldPath": "metadata.name"}}
    sources = "\n".join(p.read_text() for p in (ROOT / "mesh").rglob("*.py"))
    for var in env:
        assert f'"{var}"' in sources, f"nothing in mesh/ reads {var}"


def test_the_disruption_budget_lets_one_manager_go_at_a_time(overlay: list[Doc]) -> None:
    pdb = named(overlay, "PodDisruptionBudget", "mesh-manager")
    assert pdb["apiVersion"] == "policy/v1"
    assert pdb["spec"]["maxUnavailable"] == 1 and "minAvailable" not in pdb["spec"]
    selector = pdb["spec"]["selector"]["matchLabels"]
    spec = managers(overlay)["spec"]
    assert selector == spec["selector"]["matchLabels"]
    assert matches(selector, spec["template"]["metadata"]["labels"])
    for d in overlay:
        if d["kind"] == "Deployment":
            assert not matches(selector, d["spec"]["template"]["metadata"]["labels"])
    assert spec["replicas"] - pdb["spec"]["maxUnavailable"] >= 1, "one manager always serves"


def test_the_services_select_the_manager_pods(overlay: list[Doc]) -> None:
    labels = managers(overlay)["spec"]["template"]["metadata"]["labels"]
    service = named(overlay, "Service", "mesh-manager")
    assert matches(service["spec"]["selector"], labels)
    headless = named(overlay, "Service", managers(overlay)["spec"]["serviceName"])
    assert headless["spec"]["clusterIP"] == "None"
    assert matches(headless["spec"]["selector"], labels)
    for d in overlay:
        if d["kind"] == "Deployment":
            agent_labels = d["spec"]["template"]["metadata"]["labels"]
            assert not matches(service["spec"]["selector"], agent_labels)


def test_the_managers_keep_the_single_managers_hardening_and_scaler_access(
    overlay: list[Doc], base: list[Doc]
) -> None:
    single = named(base, "Deployment", "mesh-manager")["spec"]["template"]
    several = managers(overlay)["spec"]["template"]
    for field_name in (
        "securityContext",
        "serviceAccountName",
        "automountServiceAccountToken",
        "enableServiceLinks",
        "terminationGracePeriodSeconds",
    ):
        assert several["spec"][field_name] == single["spec"][field_name], field_name
    assert several["metadata"] == single["metadata"]
    one_c, many_c = single["spec"]["containers"][0], several["spec"]["containers"][0]
    for field_name in (
        "image",
        "securityContext",
        "readinessProbe",
        "livenessProbe",
        "resources",
        "ports",
    ):
        assert many_c[field_name] == one_c[field_name], field_name
    kept = ("MESH_NAMESPACE", "MESH_SCALER", "MESH_SCALING_FILE", "MESH_K8S_NAMESPACE")
    for var in kept:
        assert env_of(many_c)[var] == env_of(one_c)[var], var
    for flag in ("--scaler", "--scaling", "--journal", "--http-port"):
        assert arg(many_c, flag) == arg(one_c, flag), flag
    assert {m["mountPath"] for m in many_c["volumeMounts"]} == {
        m["mountPath"] for m in one_c["volumeMounts"]
    }
    # The scaler's Role is bound to the account every manager runs as.
    binding = named(overlay, "RoleBinding", "mesh-manager-scaler")
    assert binding["subjects"] == [
        {"kind": "ServiceAccount", "name": several["spec"]["serviceAccountName"]}
    ]
    named(overlay, "Role", binding["roleRef"]["name"])


@pytest.mark.parametrize("path", sorted(OVERLAY.glob("*.yaml")), ids=lambda p: p.name)
def test_the_overlay_names_no_namespace_and_no_credentials(path: Path) -> None:
    text = path.read_text()
    assert "guest" not in text.lower()
    assert not re.search(r"(amqp|postgres(ql)?)://\S+@", text), "a URL with credentials"
    for doc in yaml.safe_load_all(text):
        assert "namespace" not in doc.get("metadata", {}) and "namespace" not in doc


# ---- a RabbitMQ cluster (optional) ------------------------------------------------------------

RABBITMQ_CLUSTER = "optional/rabbitmq-cluster.yaml"


def test_the_rabbitmq_cluster_has_three_nodes_and_quorum_queues_on_all_of_them() -> None:
    """Three nodes keep a majority of every quorum queue through one node's loss; the
    management plugin is what the manager reads queue depths from."""
    (cluster,) = docs_of("RabbitmqCluster", path=RABBITMQ_CLUSTER)
    spec = cluster["spec"]
    assert set(spec) <= {"replicas", "resources", "persistence", "rabbitmq", "image"}
    assert spec["replicas"] == 3
    assert "rabbitmq_management" in spec["rabbitmq"]["additionalPlugins"]
    config = dict(
        line.split(" = ", 1)
        for line in spec["rabbitmq"]["additionalConfig"].splitlines()
        if " = " in line and not line.lstrip().startswith("#")
    )
    assert config == {
        "quorum_queue.initial_group_size": "3",
        "cluster_partition_handling": "pause_minority",
    }
