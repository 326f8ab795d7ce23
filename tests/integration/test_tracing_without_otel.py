"""Without OpenTelemetry the mesh runs as before: ``mesh manager``, ``mesh agent echo`` and a
producer, each in a process where ``opentelemetry`` cannot be imported (a ``sitecustomize``
that blocks it), serve a ``submit`` and a ``run_task``; ``mesh.tracing`` says tracing is
unavailable, the ``OTEL_*`` environment asking for traces gets one line naming what to
install, and no span is written anywhere.
"""

from __future__ import annotations

import asyncio
import json
import os
import sys
from pathlib import Path

from .test_tracing import manager_and_agent, traced_env

BLOCK = "import sys\nsys.modules['opentelemetry'] = None  # `import opentelemetry` fails\n"

PRODUCER = r"""
import asyncio, json, sys

from mesh import tracing
from mesh.demo import requirements
from mesh.producer import MeshClient
from mesh.tracing.setup import PRODUCER_SERVICE, configure


async def main(url, namespace):
    configured = configure(PRODUCER_SERVICE)
    client = await MeshClient.connect(url, namespace=namespace, name="untraced-producer")
    try:
        done = await client.submit(requirements("test.echo", ">=1"), {"message": "a"})
        ran = await client.run_task("test.echo", {"message": "b"})
    finally:
        await client.close()
    print(json.dumps({
        "available": tracing.available(),
        "tracer": tracing.tracer() is not None,
        "configured": configured,
        "outputs": [done.output["message"], ran.output["message"]],
        "otel_modules": sorted(m for m in sys.modules if m.startswith("opentelemetry.")),
    }), flush=True)


asyncio.run(main(sys.argv[1], sys.argv[2]))
"""


async def test_the_mesh_serves_tasks_without_opentelemetry_and_says_tracing_is_unavailable(
    amqp_url: str, namespace: str, tmp_path: Path
) -> None:
    blocked = tmp_path / "no-otel"
    blocked.mkdir()
    (blocked / "sitecustomize.py").write_text(BLOCK)
    path = os.pathsep.join(p for p in (str(blocked), os.environ.get("PYTHONPATH")) if p)
    async with manager_and_agent(amqp_url, namespace, tmp_path, PYTHONPATH=path) as traced:
        script = tmp_path / "producer.py"
        script.write_text(PRODUCER)
        proc = await asyncio.create_subprocess_exec(
            sys.executable, str(script), amqp_url, namespace,
            stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE,
            env=traced_env(tmp_path / "producer.jsonl", PYTHONPATH=path),
        )  # fmt: skip
        out, err = await asyncio.wait_for(proc.communicate(), 60)
        assert proc.returncode == 0, err.decode()[-3000:]
        said = json.loads(out.decode().splitlines()[-1])
        assert said == {
            "available": False,
            "tracer": False,
            "configured": None,
            "outputs": ["a", "b"],
            "otel_modules": [],
        }
        assert "OpenTelemetry is not installed (pip install 'agent-mesh[otel]')" in err.decode()
    for log in ("manager.log", "agent.log"):  # each said so once, and ran
        assert (tmp_path / log).read_text().count("OpenTelemetry is not installed") == 1
    assert not any(path.exists() for path in traced.files.values())
    assert not (tmp_path / "producer.jsonl").exists()
