"""The manager core is sans-I/O: importing it pulls in no event loop, broker client or store."""

from __future__ import annotations

import ast
import json
import subprocess
import sys
from collections.abc import Sequence
from pathlib import Path

import pytest

import mesh.core

CORE_DIR = Path(mesh.core.__file__).parent

# Never loaded, directly or transitively, by ``import mesh.core``.
FORBIDDEN_MODULES = ("asyncio", "aio_pika", "aiormq", "pamqp", "kubernetes", "sqlite3")
# The I/O shells around the core.
SHELL_PACKAGES = ("mesh.transport", "mesh.manager", "mesh.agent", "mesh.producer", "mesh.cli")
# Never imported by the core's own source: I/O, concurrency, and hidden time or randomness
# (time and randomness are inputs).
FORBIDDEN_IN_SOURCE = (
    *FORBIDDEN_MODULES,
    *SHELL_PACKAGES,
    "threading",
    "socket",
    "time",
    "random",
    "os",
    "subprocess",
)


def _modules_loaded_by(statement: str) -> list[str]:
    script = f"import json, sys\n{statement}\nprint(json.dumps(sorted(sys.modules)))"
    done = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, check=True, timeout=60
    )
    modules: list[str] = json.loads(done.stdout)
    return modules


def _is_or_under(module: str, package: str) -> bool:
    return module == package or module.startswith(package + ".")


EVERY_CORE_MODULE = (
    "import importlib, pkgutil, mesh.core\n"
    "for found in pkgutil.iter_modules(mesh.core.__path__):\n"
    "    importlib.import_module('mesh.core.' + found.name)"
)


@pytest.fixture(scope="module")
def loaded_by_core() -> list[str]:
    """``sys.modules`` of a fresh interpreter after importing every module of ``mesh.core``
    (the admission decision too, which ``mesh.core`` itself does not import)."""
    return _modules_loaded_by(EVERY_CORE_MODULE)


def test_importing_the_core_loads_no_event_loop_broker_client_or_store(
    loaded_by_core: list[str],
) -> None:
    loaded = loaded_by_core

    assert {"mesh.core.pool", "mesh.core.admission"} <= set(loaded)  # the imports happened
    assert "mesh.ledger.store" not in loaded  # the decision reads a view, not the store
    offenders = [m for m in loaded if any(_is_or_under(m, bad) for bad in FORBIDDEN_MODULES)]
    assert offenders == []


def test_importing_the_core_loads_none_of_the_io_shells(loaded_by_core: list[str]) -> None:
    offenders = [
        m for m in loaded_by_core if any(_is_or_under(m, shell) for shell in SHELL_PACKAGES)
    ]
    assert offenders == []


def test_the_check_would_notice_asyncio() -> None:
    # Guards the test above against passing vacuously (say, if the subprocess output changed).
    assert "asyncio" in _modules_loaded_by("import mesh.core, asyncio")


def _imports_of(path: Path) -> set[str]:
    tree = ast.parse(path.read_text(encoding="utf-8"), filename=str(path))
    found: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            found.add(node.module)
    return found


def _offenders(sources: list[Path], forbidden: Sequence[str]) -> set[str]:
    """``file: module`` for every import of ``sources`` that is, or is under, a forbidden one."""
    return {
        f"{path.name}: {module}"
        for path in sources
        for module in _imports_of(path)
        if any(_is_or_under(module, bad) for bad in forbidden)
    }


def test_no_core_module_imports_io_clocks_or_randomness_itself() -> None:
    sources = sorted(CORE_DIR.glob("*.py"))
    assert {p.name for p in sources} >= {"__init__.py", "pool.py", "lifecycle.py", "index.py"}

    assert _offenders(sources, FORBIDDEN_IN_SOURCE) == set()


def test_the_public_test_harness_does_not_load_the_broker_client() -> None:
    """Users' unit tests of their agents run on ``mesh.testing``'s in-memory broker: no
    aio-pika, no aiormq (a test of the check's own power is below)."""
    loaded = _modules_loaded_by("import mesh.testing")

    assert "mesh.testing.memory" in loaded
    assert [m for m in loaded if _is_or_under(m, "aio_pika") or _is_or_under(m, "aiormq")] == []
    with_client = _modules_loaded_by(
        "import mesh.testing\nfrom mesh.transport import AmqpTransport"
    )
    assert "aio_pika" in with_client  # the check sees the client when it is loaded


def test_the_agents_core_imports_no_io_clocks_or_randomness_itself() -> None:
    """The agent's decisions (mesh/agent/core.py, and the grant rules it applies) take time
    as an argument and do no I/O; the asyncio shell around them is mesh/agent/runtime.py and
    its rooms."""
    agent_dir = CORE_DIR.parent / "agent"
    sources = [agent_dir / "core.py", agent_dir / "grants.py"]
    forbidden = [m for m in FORBIDDEN_IN_SOURCE if m != "mesh.agent"]
    shell = ["runtime", "http", "processing", "registration", "liveness", "control"]
    shell += ["credentials", "tasks", "pool_queue", "settling", "work", "leaving"]
    forbidden += [f"mesh.agent.{module}" for module in shell]

    assert _offenders(sources, forbidden) == set()
    assert "mesh.agent.grants" in _imports_of(agent_dir / "core.py")  # the check reads imports
