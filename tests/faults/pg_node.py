"""PostgreSQL instances of the fault suite's own: a primary and a streaming standby on ports of
their own, so the suite may crash, restart and fail over what it kills without touching the
shared server on 5432.

==========  ===========================  =====================================
instance    port                          role
==========  ===========================  =====================================
``pg-a``    ``127.0.0.1:5497``            primary at first
``pg-b``    ``127.0.0.1:5498``            synchronous standby of ``pg-a``
==========  ===========================  =====================================

Both run from the installed server (``initdb``, ``pg_ctl``, ``pg_basebackup``; as the
``postgres`` user when the suite runs as root, which initdb refuses to be), with their data in
a fresh directory each. Replication is **synchronous** (``synchronous_standby_names``,
``synchronous_commit = on``): a commit returns only once the standby has the WAL, so a failover
loses no committed grant — the setting docs/architecture.md ("Production topology") asks for.
A crash is ``kill -9`` of the postmaster and every backend (recovery on the next start); a
failover is a crash of the primary and ``pg_ctl promote`` of the standby, as an operator or
Patroni would do it.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import tempfile
import time
from pathlib import Path

import psycopg

PRIMARY_PORT = 5497
STANDBY_PORT = 5498
START_TIMEOUT_S = 60.0


def _bin_dir() -> Path | None:
    """The installed server's tools: ``pg_config --bindir``, else wherever initdb is on
    PATH (Debian keeps them under /usr/lib/postgresql/<major>/bin)."""
    pg_config = shutil.which("pg_config")
    if pg_config is not None:
        out = subprocess.run([pg_config, "--bindir"], capture_output=True, text=True, check=False)
        candidate = Path(out.stdout.strip())
        if out.returncode == 0 and (candidate / "initdb").exists():
            return candidate
    initdb = shutil.which("initdb")
    return Path(initdb).resolve().parent if initdb else None


def pg_unavailable_reason() -> str | None:
    """Why the suite cannot start PostgreSQL instances of its own here (``None``: it can)."""
    bindir = _bin_dir()
    if bindir is None:
        return "the fault suite starts PostgreSQL instances of its own and needs initdb"
    for tool in ("pg_ctl", "postgres", "pg_basebackup"):
        if not (bindir / tool).exists():
            return f"the fault suite needs {tool} beside {bindir / 'initdb'}"
    if os.geteuid() == 0 and shutil.which("runuser") is None:
        return "running as root, the suite needs runuser to start PostgreSQL as postgres"
    return None


class PgInstance:
    """One PostgreSQL instance in ``data`` on ``port``."""

    def __init__(self, name: str, data: Path, port: int) -> None:
        self.name, self.data, self.port = name, data, port
        self.log = data.parent / f"{name}.log"

    @property
    def host(self) -> str:
        return f"127.0.0.1:{self.port}"

    def dsn(self, dbname: str = "postgres") -> str:
        return f"postgresql://postgres@{self.host}/{dbname}"

    def start(self) -> None:
        _run(self, "pg_ctl", "-D", str(self.data), "-l", str(self.log), "-w",
             "-t", str(int(START_TIMEOUT_S)), "start")  # fmt: skip

    def stop(self) -> None:
        """A clean, fast shutdown (nothing if it is not running)."""
        if self.running():
            _run(self, "pg_ctl", "-D", str(self.data), "-m", "fast", "-w", "stop")

    def crash(self) -> None:
        """kill -9 of the postmaster and every process it started: a machine that died."""
        pid = self.postmaster_pid()
        if pid is None:
            return
        victims = [pid, *_children(pid)]
        for victim in victims:
            try:
                os.kill(victim, signal.SIGKILL)
            except ProcessLookupError:
                pass
        # Until they are gone, reaped too: a start finds a zombie postmaster "still running".
        deadline = time.monotonic() + 10
        while any(Path(f"/proc/{v}").exists() for v in victims) and time.monotonic() < deadline:
            time.sleep(0.02)

    def promote(self) -> None:
        """A standby becomes a primary (``pg_ctl promote``, waiting until it accepts writes)."""
        _run(self, "pg_ctl", "-D", str(self.data), "-w", "promote")

    def running(self) -> bool:
        pid = self.postmaster_pid()
        return pid is not None and _alive(pid)

    def postmaster_pid(self) -> int | None:
        try:
            return int((self.data / "postmaster.pid").read_text().split("\n", 1)[0])
        except (OSError, ValueError):
            return None

    def in_recovery(self) -> bool:
        with psycopg.connect(self.dsn(), connect_timeout=3, autocommit=True) as conn:
            row = conn.execute("SELECT pg_is_in_recovery()").fetchone()
        return bool(row and row[0])


class PgPair:
    """A primary and its synchronous standby, made fresh under a directory of their own."""

    def __init__(self) -> None:
        # Not pytest's tmp_path: under root that is a 0700 directory postgres cannot enter.
        self.root = Path(tempfile.mkdtemp(prefix="mesh-faults-pg-"))
        os.chmod(self.root, 0o755)
        self.primary = PgInstance("pg-a", self.root / "pg-a", PRIMARY_PORT)
        self.standby = PgInstance("pg-b", self.root / "pg-b", STANDBY_PORT)
        self.database = "mesh"

    def multi_host_dsn(self) -> str:
        """libpq's own failover: both hosts, the one that takes writes is used."""
        hosts = f"{self.primary.host},{self.standby.host}"
        return f"postgresql://postgres@{hosts}/{self.database}?target_session_attrs=read-write"

    def start(self) -> None:
        for instance in (self.primary, self.standby):
            _stop_leftover(instance.port)
        self._chown(self.root)
        _run(self.primary, "initdb", "-D", str(self.primary.data), "-U", "postgres",
             "--auth=trust", "-E", "UTF8", "--no-sync")  # fmt: skip
        with (self.primary.data / "postgresql.conf").open("a") as conf:
            conf.write(
                "\n# the fault suite's primary\n"
                f"port = {self.primary.port}\nlisten_addresses = '127.0.0.1'\n"
                "unix_socket_directories = ''\nwal_level = replica\nmax_wal_senders = 4\n"
                "hot_standby = on\nfsync = on\nsynchronous_commit = on\n"
                "wal_keep_size = '64MB'\n"
            )
        self.primary.start()
        with psycopg.connect(self.primary.dsn(), autocommit=True) as conn:
            conn.execute(f"CREATE DATABASE {self.database}")
        _run(self.standby, "pg_basebackup", "-h", "127.0.0.1", "-p", str(self.primary.port),
             "-U", "postgres", "-D", str(self.standby.data), "-X", "stream", "--no-sync",
             "--checkpoint=fast")  # fmt: skip
        with (self.standby.data / "postgresql.conf").open("a") as conf:
            conf.write(
                f"\n# the fault suite's standby\nport = {self.standby.port}\n"
                f"primary_conninfo = 'host=127.0.0.1 port={self.primary.port} user=postgres "
                "application_name=pg_b'\n"
                # Promoted, it has no standby of its own: commits must not wait for one.
                "synchronous_standby_names = ''\n"
            )
        (self.standby.data / "standby.signal").touch()
        self._chown(self.standby.data)
        self.standby.start()
        # Synchronous only now: until the standby is there, a commit would wait for ever.
        with psycopg.connect(self.primary.dsn(), autocommit=True) as conn:
            conn.execute("ALTER SYSTEM SET synchronous_standby_names = 'pg_b'")
            conn.execute("SELECT pg_reload_conf()")
        self.wait_synchronous()

    def wait_synchronous(self, timeout_s: float = 30.0) -> None:
        """Until the primary sees its standby as synchronous (commits wait for it)."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            with psycopg.connect(self.primary.dsn(), autocommit=True) as conn:
                row = conn.execute(
                    "SELECT sync_state FROM pg_stat_replication WHERE application_name = 'pg_b'"
                ).fetchone()
            if row and row[0] == "sync":
                return
            time.sleep(0.1)
        raise TimeoutError("the standby did not become synchronous")

    def stop(self) -> None:
        for instance in (self.primary, self.standby):
            try:
                instance.stop()
            except subprocess.CalledProcessError:
                instance.crash()
        shutil.rmtree(self.root, ignore_errors=True)

    @staticmethod
    def _chown(path: Path) -> None:
        if os.geteuid() == 0:
            shutil.chown(path, "postgres", "postgres")
            for sub in path.rglob("*"):
                shutil.chown(sub, "postgres", "postgres")


def _run(instance: PgInstance, tool: str, *args: str) -> None:
    bindir = _bin_dir()
    assert bindir is not None, pg_unavailable_reason()
    command = [str(bindir / tool), *args]
    if os.geteuid() == 0:
        command = ["runuser", "-u", "postgres", "--", *command]
    # Output to a file, not a pipe: the server pg_ctl starts keeps a pipe open forever.
    with tempfile.TemporaryFile() as out:
        done = subprocess.run(command, stdout=out, stderr=out, check=False, timeout=120)
        if done.returncode != 0:
            out.seek(0)
            said = out.read().decode(errors="replace")[-3000:]
            log = instance.log.read_text()[-3000:] if instance.log.exists() else ""
            raise subprocess.CalledProcessError(
                done.returncode, command, said, f"--- {instance.log}:\n{log}"
            )


def _children(pid: int) -> list[int]:
    found = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except (OSError, IndexError):
            continue
        if int(fields[1]) == pid:
            found.append(int(stat.parent.name))
    return found


def _alive(pid: int) -> bool:
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except (OSError, IndexError):
        return False
    return fields[0] != "Z"


def _stop_leftover(port: int) -> None:
    """An instance an earlier, killed run left on ``port``: crash it (its directory is gone
    with that run's, or will be)."""
    for pidfile in Path(tempfile.gettempdir()).glob("mesh-faults-pg-*/pg-*/postmaster.pid"):
        lines = pidfile.read_text().splitlines()
        if len(lines) > 3 and lines[3].strip() == str(port):
            PgInstance("leftover", pidfile.parent, port).crash()
            shutil.rmtree(pidfile.parent.parent, ignore_errors=True)
