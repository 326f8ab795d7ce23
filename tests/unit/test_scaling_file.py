"""The scaling file (``mesh manager --scaling FILE``): a pydantic model, errors that say where."""

from __future__ import annotations

from pathlib import Path

import orjson
import pytest

from mesh.core.scaling import ScalingPolicy
from mesh.errors import LocalProtocolError
from mesh.manager.settings import load_scaling_policies


def write(tmp_path: Path, doc: object) -> Path:
    path = tmp_path / "scaling.json"
    path.write_bytes(doc if isinstance(doc, bytes) else orjson.dumps(doc))
    return path


def test_a_file_becomes_one_policy_per_deployment_with_the_policys_defaults(
    tmp_path: Path,
) -> None:
    path = write(
        tmp_path,
        {
            "deployments": [
                {"deployment": "calc", "capabilities": ["math.evaluate"], "max_replicas": 4},
                {"deployment": "echo", "min_replicas": 0, "window_s": 2.5},
            ]
        },
    )
    calc, echo = load_scaling_policies(path)
    assert calc == ScalingPolicy(deployment="calc", capabilities=("math.evaluate",), max_replicas=4)
    assert echo == ScalingPolicy(deployment="echo", min_replicas=0, window_s=2.5)


@pytest.mark.parametrize(
    ("doc", "said"),
    [
        ({"deployments": [{"deployment": "calc", "max_replica": 3}]}, "deployments.0.max_replica"),
        ({"deployments": [{"deployment": "calc", "min_replicas": 5, "max_replicas": 2}]}, "above"),
        ({"deployments": [{"deployment": "calc", "scale_up_step": 0}]}, "scale_up_step"),
        ({"deployments": [{"deployment": "calc", "window_s": -1}]}, "window_s"),
        ({"deployments": [{"capabilities": []}]}, "deployments.0.deployment: Field required"),
        ({"deployment": []}, "deployments: Field required"),
        (b"{not json", "Invalid JSON"),
    ],
)
def test_a_mistake_is_one_sentence_naming_the_file_and_where(
    tmp_path: Path, doc: object, said: str
) -> None:
    path = write(tmp_path, doc)
    with pytest.raises(LocalProtocolError) as raised:
        load_scaling_policies(path)
    assert str(raised.value).startswith(f"bad scaling file {path}: ")
    assert said in str(raised.value), str(raised.value)


def test_a_missing_file_says_so(tmp_path: Path) -> None:
    with pytest.raises(LocalProtocolError, match="No such file"):
        load_scaling_policies(tmp_path / "absent.json")


def test_the_scaling_file_deploy_ships_loads(tmp_path: Path) -> None:
    import yaml

    shipped = [
        doc
        for manifest in sorted((Path(__file__).parents[2] / "deploy").rglob("*.yaml"))
        for doc in yaml.safe_load_all(manifest.read_text())
        if doc and doc.get("kind") == "ConfigMap" and "scaling.json" in doc.get("data", {})
    ]
    assert shipped, "deploy/ ships a scaling file"
    for config_map in shipped:
        policies = load_scaling_policies(
            write(tmp_path, config_map["data"]["scaling.json"].encode())
        )
        assert policies and all(p.capabilities for p in policies)
