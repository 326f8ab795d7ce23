"""``docker-compose.yml``: valid Compose, offline, and running only commands docs/cli.md documents.

The machines here have a docker client without the compose plugin and no daemon, so the file
is validated against the Compose Specification's own JSON Schema, vendored in
``tests/k8s/data/compose-spec.json`` (where it comes from: ``compose-spec.SOURCE.md``).

The services' ``command`` is the argument list of the image's ``ENTRYPOINT ["mesh"]``; each
must be a subcommand, positional and flags documented in the CLI table of docs/cli.md, and must
parse with the real CLI parser as well.
"""

from __future__ import annotations

import copy
import hashlib
import json
import re
import shlex
import tomllib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import jsonschema
import pytest
import yaml

from mesh.agent import AgentSettings

ROOT = Path(__file__).parents[2]
COMPOSE = ROOT / "docker-compose.yml"
CLI_DOC = ROOT / "docs" / "cli.md"
DOCKERFILE = ROOT / "Dockerfile"
DATA = Path(__file__).parent / "data"
SCHEMA = DATA / "compose-spec.json"
SCHEMA_SOURCE = DATA / "compose-spec.SOURCE.md"


def compose() -> dict[str, Any]:
    doc: dict[str, Any] = yaml.safe_load(COMPOSE.read_text())  # merge keys (<<) resolved
    return doc


def validator() -> jsonschema.protocols.Validator:
    schema = json.loads(SCHEMA.read_text())
    # Its $schema names draft 2019-09 by a URI jsonschema does not recognise, so the draft is
    # chosen here. No format checker: `format: duration` there means "5s", not ISO 8601.
    jsonschema.Draft201909Validator.check_schema(schema)
    return jsonschema.Draft201909Validator(schema)


def errors(doc: dict[str, Any]) -> list[str]:
    return [
        f"{'/'.join(map(str, e.absolute_path)) or '<root>'}: {e.message}"
        for e in validator().iter_errors(doc)
    ]


# ---- the schema -------------------------------------------------------------------------------


def test_the_compose_file_validates_against_the_compose_specification() -> None:
    assert errors(compose()) == []


def test_the_vendored_schema_is_the_recorded_upstream_copy() -> None:
    recorded = re.search(r"sha256:\*\* `([0-9a-f]{64})`", SCHEMA_SOURCE.read_text())
    assert recorded is not None
    assert hashlib.sha256(SCHEMA.read_bytes()).hexdigest() == recorded.group(1)
    assert "Apache License" in (DATA / "compose-spec.LICENSE").read_text()


def test_schema_validation_does_catch_mistakes() -> None:
    misspelt = copy.deepcopy(compose())
    misspelt["services"]["manager-1"]["comand"] = ["manager"]
    bad_condition = copy.deepcopy(compose())
    bad_condition["services"]["calc"]["depends_on"]["rabbitmq"]["condition"] = "healthy"
    bad_type = copy.deepcopy(compose())
    bad_type["services"]["rabbitmq"]["healthcheck"]["retries"] = "many"
    for doc in (misspelt, bad_condition, bad_type):
        assert errors(doc), "the schema should have rejected this"


# ---- what the file runs -----------------------------------------------------------------------


def services() -> dict[str, dict[str, Any]]:
    result: dict[str, dict[str, Any]] = compose()["services"]
    return result


def mesh_services() -> dict[str, dict[str, Any]]:
    """Services that run the agent-mesh image (built from the Dockerfile)."""
    return {
        name: svc
        for name, svc in services().items()
        if "build" in svc or str(svc.get("image", "")).startswith("agent-mesh")
    }


def command_of(service: dict[str, Any]) -> list[str]:
    command = service["command"]
    return list(command) if isinstance(command, list) else shlex.split(command)


def test_the_image_entrypoint_is_mesh() -> None:
    entrypoints = re.findall(r"^ENTRYPOINT\s+(.+)$", DOCKERFILE.read_text(), flags=re.M)
    assert [json.loads(e) for e in entrypoints] == [["mesh"]]


def test_the_compose_file_runs_the_whole_mesh() -> None:
    """The issue's list: the broker with its UI and a healthcheck, the manager (two of them on
    PostgreSQL since issue 21), two or three sample agents and a producer."""
    all_services = services()
    broker = all_services["rabbitmq"]
    assert broker["image"].startswith("rabbitmq:3-management")
    assert "test" in broker["healthcheck"]
    assert any(str(port).endswith(":15672") for port in broker["ports"])

    commands = {name: command_of(svc) for name, svc in mesh_services().items()}
    assert len(manager_services()) == 2
    agents = [c[1] for c in commands.values() if c[0] == "agent"]
    assert 2 <= len(agents) <= 3 and len(set(agents)) == len(agents)
    producers = [c for c in commands.values() if c[0] == "demo"]
    assert len(producers) == 1 and "--producer-only" in producers[0]

    for name, svc in mesh_services().items():
        assert svc["depends_on"]["rabbitmq"]["condition"] == "service_healthy", name
        host = urlsplit(svc["environment"]["MESH_AMQP_URL"]).hostname
        assert host in all_services, f"{name}: the broker URL names no compose service"


# ---- several managers ---------------------------------------------------------------------------


def manager_services() -> dict[str, dict[str, Any]]:
    return {n: svc for n, svc in mesh_services().items() if command_of(svc)[0] == "manager"}


def effective_settings(service: dict[str, Any], monkeypatch: pytest.MonkeyPatch) -> Any:
    """The service's command parsed by the real CLI under the service's environment (the
    parser takes its defaults from MESH_… variables, as in the container)."""
    from mesh.cli import build_parser

    with monkeypatch.context() as patched:
        for var, value in service["environment"].items():
            patched.setenv(var, str(value))
        return build_parser().parse_args(command_of(service))


def test_two_managers_share_the_same_shards_on_the_postgresql_service(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    settings = {n: effective_settings(svc, monkeypatch) for n, svc in manager_services().items()}
    assert len(settings) == 2
    shard_counts = {s.shards for s in settings.values()}
    assert len(shard_counts) == 1, f"every manager needs the same --shards: {shard_counts}"
    (shard_count,) = shard_counts
    assert shard_count is not None and shard_count >= len(settings)
    ledgers = {s.ledger for s in settings.values()}
    assert len(ledgers) == 1, "one shared ledger"
    for name, s in settings.items():
        assert s.admission_capacity == "live", f"{name}: bounded by live agents, as with one"
        assert s.ledger_schema == settings[min(settings)].ledger_schema
    assert len({s.manager_id for s in settings.values()}) == len(settings), "distinct IDs"

    (dsn,) = ledgers
    url = urlsplit(dsn)
    assert url.scheme in ("postgresql", "postgres")
    database = services()[str(url.hostname)]
    assert database["image"].startswith("postgres:")
    assert "test" in database["healthcheck"]
    env = database["environment"]
    assert (url.username, url.password) == (env["POSTGRES_USER"], env["POSTGRES_PASSWORD"])
    assert url.path.lstrip("/") == env["POSTGRES_DB"]
    for name, svc in manager_services().items():
        assert svc["depends_on"][str(url.hostname)]["condition"] == "service_healthy", name


def test_each_manager_has_its_own_journal_volume_and_status_port() -> None:
    journals, host_ports = [], []
    for name, svc in manager_services().items():
        (volume,) = svc["volumes"]
        source, target = volume.split(":")[:2]
        assert target == "/home/mesh/.mesh", f"{name}: the default journal's directory"
        assert source in compose()["volumes"], f"{name}: a named volume"
        journals.append(source)
        (port,) = svc["ports"]
        host_port, container_port = str(port).split(":")
        assert container_port == "8090"
        host_ports.append(int(host_port))
    assert len(set(journals)) == len(journals), "a journal is SQLite with one writer"
    assert sorted(host_ports) == [8090, 8091]


def test_agents_and_the_producer_start_after_every_manager() -> None:
    for name, svc in mesh_services().items():
        if command_of(svc)[0] != "manager":
            assert manager_services().keys() <= svc["depends_on"].keys(), name


def test_the_image_has_the_postgresql_driver_the_managers_need() -> None:
    """The Dockerfile installs the project with its dependencies (`pip install .`); psycopg
    with its binary extra brings libpq along, so the slim base image needs no system one."""
    dependencies = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["dependencies"]
    assert any(re.match(r"psycopg\[binary\]", d) for d in dependencies), dependencies
    installs = re.findall(r"^RUN pip install ([^\n&\\]*)", DOCKERFILE.read_text(), re.M)
    assert [i.split() for i in installs] == [["'.[otel]'"]], (
        "the project, its dependencies included"
    )


def test_every_mesh_process_exports_its_traces_to_the_jaeger_service() -> None:
    """The image has the otel extra, whose OTLP/HTTP exporter the SDK uses for
    ``OTEL_TRACES_EXPORTER=otlp``; every mesh service sends there, and the Jaeger service
    takes OTLP/HTTP on that port and shows the UI on the host's 16686."""
    extras = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"][
        "optional-dependencies"
    ]
    assert any(d.startswith("opentelemetry-exporter-otlp-proto-http") for d in extras["otel"])
    jaeger = compose()["services"]["jaeger"]
    assert str(jaeger["image"]).startswith("jaegertracing/jaeger:2.")
    assert "--set=receivers.otlp.protocols.http.endpoint=0.0.0.0:4318" in jaeger["command"]
    assert "16686:16686" in jaeger["ports"]
    for name, svc in mesh_services().items():
        env = svc["environment"]
        assert env["OTEL_TRACES_EXPORTER"] == "otlp", name
        endpoint = urlsplit(env["OTEL_EXPORTER_OTLP_ENDPOINT"])
        assert (endpoint.hostname, endpoint.port) == ("jaeger", 4318), name


def compose_seconds(duration: str) -> float:
    """A Compose duration such as ``1m30s`` or ``120s`` in seconds."""
    units = {"h": 3600.0, "m": 60.0, "s": 1.0, "ms": 1e-3, "us": 1e-6}
    parts = re.findall(r"(\d+(?:\.\d+)?)(ms|us|h|m|s)", duration)
    assert parts and "".join(n + u for n, u in parts) == duration, duration
    return sum(float(n) * units[u] for n, u in parts)


def agent_services() -> list[str]:
    return sorted(n for n, svc in mesh_services().items() if command_of(svc)[0] == "agent")


@pytest.mark.parametrize("name", agent_services())
def test_agents_are_given_longer_to_stop_than_their_drain_takes(name: str) -> None:
    """Docker sends SIGKILL after stop_grace_period; SIGTERM's drain may take the drain
    timeout plus the shutdown grace (60 + 30 s by default)."""
    service = mesh_services()[name]
    settings = AgentSettings()
    drain_bound = settings.drain_timeout_s + settings.shutdown_grace_s
    assert compose_seconds(service["stop_grace_period"]) > drain_bound


def test_compose_durations_are_read_right() -> None:
    assert compose_seconds("120s") == 120
    assert compose_seconds("1m30s") == 90
    assert compose_seconds("1h") == 3600


# ---- the CLI table (docs/cli.md) ---------------------------------------------------------------


@dataclass
class Documented:
    """What docs/cli.md documents for one subcommand."""

    flags: dict[str, bool] = field(default_factory=dict)  # flag → takes a value
    positionals: list[set[str] | None] = field(default_factory=list)  # choices, None: any


def cli_table_rows() -> list[str]:
    text = CLI_DOC.read_text()
    section = text.split("\n## The CLI\n", 1)[1].split("\n## ", 1)[0]
    return [line for line in section.splitlines() if line.startswith("| `mesh ")]


def parse_usage(usage: str, into: Documented) -> None:
    """``mesh demo [--duration S] [--producer-only]``, ``mesh agent calc|echo [--id ID]``."""
    for group in re.findall(r"\[([^\]]*)\]", usage):
        tokens = group.split()
        if tokens and tokens[0].startswith("-"):
            for flag in tokens[0].split("|"):  # `-n N` / `--lines N` style alternatives
                into.flags[flag] = len(tokens) > 1
    bare = re.sub(r"\[[^\]]*\]", " ", usage).split()[2:]  # after `mesh <subcommand>`
    for token in bare:
        if token.startswith("-"):
            into.flags[token] = False
        elif "|" in token:
            into.positionals.append(set(token.split("|")))
        elif token.isupper():
            into.positionals.append(None)  # a placeholder such as AGENT_ID
        else:
            into.positionals.append({token})


def documented_commands() -> dict[str, Documented]:
    documented: dict[str, Documented] = {}
    for row in cli_table_rows():
        first_cell = re.split(r"(?<!\\)\|", row)[1]
        for usage in re.findall(r"`(mesh [^`]+)`", first_cell):
            usage = usage.replace("\\|", "|")
            subcommand = usage.split()[1]
            parse_usage(usage, documented.setdefault(subcommand, Documented()))
    return documented


def test_the_cli_table_is_understood() -> None:
    documented = documented_commands()
    assert {"demo", "manager", "agent", "status", "log", "drain", "schemas"} <= documented.keys()
    assert documented["agent"].positionals[0] == {"calc", "textstats", "echo"}
    assert documented["demo"].flags["--producer-only"] is False
    assert documented["demo"].flags["--duration"] is True
    assert documented["log"].flags["--follow"] is False
    assert documented["drain"].positionals == [None]


def undocumented_parts(command: list[str], documented: dict[str, Documented]) -> list[str]:
    subcommand, rest = command[0], command[1:]
    if subcommand not in documented:
        return [f"subcommand {subcommand!r}"]
    doc, problems, positionals = documented[subcommand], [], []
    i = 0
    while i < len(rest):
        token = rest[i]
        if token.startswith("-"):
            flag = token.split("=", 1)[0]
            if flag not in doc.flags:
                problems.append(f"flag {flag}")
            elif doc.flags[flag] and "=" not in token:
                i += 1  # its value
        else:
            positionals.append(token)
        i += 1
    if len(positionals) > len(doc.positionals):
        problems.append(f"positional(s) {positionals[len(doc.positionals) :]}")
    for token, choices in zip(positionals, doc.positionals, strict=False):
        if choices is not None and token not in choices:
            problems.append(f"{token!r} (documented: {sorted(choices)})")
    return problems


@pytest.mark.parametrize("name", sorted(mesh_services()))
def test_every_service_command_is_one_the_cli_docs_document(name: str) -> None:
    command = command_of(mesh_services()[name])
    assert undocumented_parts(command, documented_commands()) == []


@pytest.mark.parametrize("name", sorted(mesh_services()))
def test_every_service_command_parses_with_the_real_cli(name: str) -> None:
    from mesh.cli import build_parser

    build_parser().parse_args(command_of(mesh_services()[name]))  # SystemExit if not


def test_the_command_check_rejects_what_the_readme_does_not_document() -> None:
    documented = documented_commands()
    assert undocumented_parts(["agent", "calc"], documented) == []
    assert undocumented_parts(["demo", "--producer-only", "--duration", "0"], documented) == []
    assert undocumented_parts(["agent", "upper"], documented)
    assert undocumented_parts(["demo", "--producers", "3"], documented)
    assert undocumented_parts(["serve"], documented)
    assert undocumented_parts(["drain", "calc-1", "extra"], documented)


# ---- the three-node cluster profile -------------------------------------------------------------


def test_the_cluster_profile_runs_three_rabbitmq_nodes_that_form_one_cluster() -> None:
    """Only with ``--profile cluster``: three nodes with one Erlang cookie, each with the
    classic peer discovery file that names all three by the node names their hostnames give."""
    nodes = {n: svc for n, svc in services().items() if "cluster" in svc.get("profiles", [])}
    assert sorted(nodes) == ["rabbit-1", "rabbit-2", "rabbit-3"]
    cookies = {svc["environment"]["RABBITMQ_ERLANG_COOKIE"] for svc in nodes.values()}
    assert len(cookies) == 1
    config_file = ROOT / "deploy" / "rabbitmq-cluster" / "cluster.conf"
    listed = re.findall(r"^cluster_formation\.classic_config\.nodes\.\d+ = (\S+)$",
                        config_file.read_text(), flags=re.M)  # fmt: skip
    assert sorted(listed) == sorted(f"rabbit@{svc['hostname']}" for svc in nodes.values())
    for name, svc in nodes.items():
        mounts = [v.split(":")[:2] for v in svc["volumes"]]
        assert [
            "./deploy/rabbitmq-cluster/cluster.conf",
            "/etc/rabbitmq/conf.d/20-cluster.conf",
        ] in (mounts), name
    host_ports = {p.split(":")[0] for svc in nodes.values() for p in svc["ports"]}
    assert len(host_ports) == 6  # each node its own AMQP and management port
    for svc in mesh_services().values():  # the default mesh does not wait for the cluster
        assert not set(svc.get("depends_on", {})) & set(nodes)
