"""One generator for the committed JSON Schemas in ``schemas/``.

``mesh schemas export`` writes them; ``mesh schemas check`` (and a test) fails
when the models and the committed files drift apart.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import orjson

from mesh.wire.catalog import MESSAGE_TYPES
from mesh.wire.events import EVENT_DETAILS, detail_schema_name
from mesh.wire.models import Capability

DRAFT = "https://json-schema.org/draft/2020-12/schema"


def _schema_for(model: Any, schema_id: str) -> dict[str, Any]:
    schema: dict[str, Any] = model.model_json_schema(mode="validation")
    props = schema.get("properties", {})
    if "type" in props:
        # The type tag has a default for Python callers, but on the wire it is required.
        required = schema.setdefault("required", [])
        if "type" not in required:
            required.insert(0, "type")
    return {"$schema": DRAFT, "$id": f"urn:agent-mesh:schema:{schema_id}", **schema}


def generate() -> dict[str, dict[str, Any]]:
    """File name -> JSON Schema for every wire message, the embedded capability, and the
    ``detail`` of each orchestration event kind (``mesh.event.<kind>.v1``)."""
    out = {f"{cls.TYPE}.json": _schema_for(cls, cls.TYPE) for cls in MESSAGE_TYPES}
    out["mesh.capability.v1.json"] = _schema_for(Capability, "mesh.capability.v1")
    for kind, model in EVENT_DETAILS.items():
        name = detail_schema_name(kind)
        out[f"{name}.json"] = _schema_for(model, name)
    return dict(sorted(out.items()))


def render(schema: dict[str, Any]) -> bytes:
    return orjson.dumps(schema, option=orjson.OPT_INDENT_2 | orjson.OPT_SORT_KEYS) + b"\n"


def export(directory: Path) -> list[Path]:
    """Write every schema into ``directory``; remove stale ``mesh.*.json`` files."""
    directory.mkdir(parents=True, exist_ok=True)
    wanted = generate()
    for stale in directory.glob("mesh.*.json"):
        if stale.name not in wanted:
            stale.unlink()
    written = []
    for name, schema in wanted.items():
        path = directory / name
        path.write_bytes(render(schema))
        written.append(path)
    return written


def drift(directory: Path) -> list[str]:
    """Names of schema files that are missing, stale or different from the models."""
    wanted = generate()
    problems = []
    for name, schema in wanted.items():
        path = directory / name
        if not path.exists():
            problems.append(f"missing: {name}")
        elif path.read_bytes() != render(schema):
            problems.append(f"differs: {name}")
    for path in sorted(directory.glob("mesh.*.json")):
        if path.name not in wanted:
            problems.append(f"stale: {path.name}")
    return problems
