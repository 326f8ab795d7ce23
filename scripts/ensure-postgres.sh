#!/usr/bin/env bash
# Make sure PostgreSQL answers on 127.0.0.1:5432 and the test database `mesh_test` exists.
#
#   bash scripts/ensure-postgres.sh
#
# Safe to run again and again: a server that is already up is left alone, and the database is
# only created when it is missing. Starts the locally installed Debian cluster
# (`pg_ctlcluster --skip-systemctl-redirect <version> main start`, as root or the postgres
# user, or through `sudo -n`) when nothing answers. The ledger tests then connect with
# MESH_TEST_POSTGRES_DSN (default postgresql://postgres@127.0.0.1:5432/mesh_test).
#
# Settings (environment): MESH_POSTGRES_HOST (127.0.0.1), MESH_POSTGRES_PORT (5432),
# MESH_POSTGRES_USER (postgres), MESH_POSTGRES_DB (mesh_test), MESH_POSTGRES_CLUSTER (main),
# MESH_POSTGRES_START_TIMEOUT_S (60).
set -euo pipefail

HOST="${MESH_POSTGRES_HOST:-127.0.0.1}"
PORT="${MESH_POSTGRES_PORT:-5432}"
DB_USER="${MESH_POSTGRES_USER:-postgres}"
DB_NAME="${MESH_POSTGRES_DB:-mesh_test}"
CLUSTER="${MESH_POSTGRES_CLUSTER:-main}"
START_TIMEOUT_S="${MESH_POSTGRES_START_TIMEOUT_S:-60}"

say() { printf 'ensure-postgres: %s\n' "$*"; }
die() {
    printf 'ensure-postgres: ERROR: %s\n' "$*" >&2
    exit 1
}

# True when the server on HOST:PORT accepts connections (pg_isready, else a bare TCP connect).
postgres_up() {
    if command -v pg_isready >/dev/null; then
        pg_isready -q -h "$HOST" -p "$PORT" -t 2
    else
        timeout 2 bash -c "exec 3<>/dev/tcp/$HOST/$PORT" 2>/dev/null
    fi
}

# Wait until "$@" succeeds or $timeout seconds pass; prints a dot every 5 s.
wait_for() {
    local timeout=$1 what=$2
    shift 2
    local start=$SECONDS
    until "$@"; do
        if ((SECONDS - start >= timeout)); then
            echo
            return 1
        fi
        if (((SECONDS - start) % 5 == 0)); then printf '.'; fi
        sleep 1
    done
    if ((SECONDS - start > 0)); then echo; fi
    say "$what is up after $((SECONDS - start)) s"
}

# Run a cluster admin command with the rights it needs: directly as root or postgres, else
# `sudo -n`; 126 when neither is possible.
as_cluster_admin() {
    if [[ $EUID -eq 0 || "$(id -un)" == postgres ]]; then
        "$@"
    elif command -v sudo >/dev/null && sudo -n true 2>/dev/null; then
        sudo -n "$@"
    else
        return 126
    fi
}

show_server_logs() {
    local f
    for f in /var/log/postgresql/postgresql-*-"$CLUSTER".log; do
        if [[ -r $f ]]; then
            echo "----- last lines of $f" >&2
            tail -n 20 "$f" >&2 || true
        fi
    done
}

ensure_server() {
    if postgres_up; then
        say "PostgreSQL already answers on $HOST:$PORT"
        return 0
    fi
    if [[ $HOST != 127.0.0.1 && $HOST != localhost ]]; then
        die "no PostgreSQL answers on $HOST:$PORT, and it is not local, so this script cannot start it"
    fi
    command -v pg_ctlcluster >/dev/null ||
        die "no PostgreSQL on $HOST:$PORT and pg_ctlcluster is not installed; install postgresql (Debian) or start a server yourself"
    local version
    version="$(find /etc/postgresql -mindepth 1 -maxdepth 1 -printf '%f\n' 2>/dev/null | sort -V | tail -n 1)"
    [[ -n $version ]] || die "no cluster under /etc/postgresql; create one with pg_createcluster"

    say "starting PostgreSQL $version/$CLUSTER (pg_ctlcluster --skip-systemctl-redirect $version $CLUSTER start)"
    local rc=0
    as_cluster_admin pg_ctlcluster --skip-systemctl-redirect "$version" "$CLUSTER" start || rc=$?
    if ((rc == 126)); then
        die "PostgreSQL is not running and starting it needs root: run \`sudo pg_ctlcluster $version $CLUSTER start\`, then this script again"
    fi
    # "already running" (another run started it at the same moment) also lands here.
    ((rc == 0)) || say "pg_ctlcluster exited with $rc; waiting for the server anyway"
    printf 'ensure-postgres: waiting up to %s s for %s:%s ' "$START_TIMEOUT_S" "$HOST" "$PORT"
    if ! wait_for "$START_TIMEOUT_S" "PostgreSQL on $HOST:$PORT" postgres_up; then
        show_server_logs
        die "PostgreSQL did not accept connections on $HOST:$PORT within $START_TIMEOUT_S s (logs above)"
    fi
}

database_exists() {
    [[ "$(psql -h "$HOST" -p "$PORT" -U "$DB_USER" -d postgres -X -tAq \
        -c "SELECT 1 FROM pg_database WHERE datname = '$DB_NAME'")" == 1 ]]
}

ensure_database() {
    command -v psql >/dev/null || die "psql is not installed (postgresql-client)"
    if database_exists; then
        say "database $DB_NAME exists"
        return 0
    fi
    say "creating database $DB_NAME (createdb -U $DB_USER)"
    # A concurrent run may create it first: only a database that is still missing is an error.
    createdb -h "$HOST" -p "$PORT" -U "$DB_USER" "$DB_NAME" || database_exists ||
        die "could not create database $DB_NAME as $DB_USER on $HOST:$PORT"
}

# Let tests and CI source this file for the probe functions without side effects.
if [[ "${BASH_SOURCE[0]}" == "$0" ]]; then
    ensure_server
    ensure_database
    say "ready: postgresql://$DB_USER@$HOST:$PORT/$DB_NAME"
fi
