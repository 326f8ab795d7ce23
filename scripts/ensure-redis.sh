#!/usr/bin/env bash
# Make sure Redis answers on 127.0.0.1:6379 (the shared budgets' tests and checks use it).
#
#   bash scripts/ensure-redis.sh
#
# Safe to run again and again: a server that already answers PING is left alone. When nothing
# answers, starts the locally installed `redis-server --daemonize yes` (any user may; its
# snapshot and log go to MESH_REDIS_DIR), installing Debian's redis-server first when it is
# missing and we are root. The tests then connect with MESH_TEST_REDIS_URL (default
# redis://127.0.0.1:6379/0).
#
# Settings (environment): MESH_REDIS_HOST (127.0.0.1), MESH_REDIS_PORT (6379),
# MESH_REDIS_DIR (${TMPDIR:-/tmp}/mesh-redis), MESH_REDIS_START_TIMEOUT_S (30).
set -euo pipefail

HOST="${MESH_REDIS_HOST:-127.0.0.1}"
PORT="${MESH_REDIS_PORT:-6379}"
DATA_DIR="${MESH_REDIS_DIR:-${TMPDIR:-/tmp}/mesh-redis}"
START_TIMEOUT_S="${MESH_REDIS_START_TIMEOUT_S:-30}"

say() { printf 'ensure-redis: %s\n' "$*"; }
die() {
    printf 'ensure-redis: ERROR: %s\n' "$*" >&2
    exit 1
}

# True when the server on HOST:PORT answers PING with PONG (redis-cli, else a bare socket).
redis_up() {
    if command -v redis-cli >/dev/null; then
        [[ "$(timeout 3 redis-cli -h "$HOST" -p "$PORT" ping 2>/dev/null)" == PONG ]]
    else
        timeout 3 bash -c "exec 3<>/dev/tcp/$HOST/$PORT && printf 'PING\r\n' >&3 &&
            IFS= read -r line <&3 && [[ \$line == +PONG* ]]" 2>/dev/null
    fi
}

install_redis() {
    ((EUID == 0)) || die "redis-server is not installed; install it (Debian: apt-get install redis-server)"
    say "installing Debian's redis-server"
    local install=(env DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends
        redis-server)
    "${install[@]}" >/dev/null || { apt-get update -qq && "${install[@]}" >/dev/null; } ||
        die "could not install redis-server"
}

ensure_server() {
    if redis_up; then
        say "Redis already answers on $HOST:$PORT"
        return 0
    fi
    if [[ $HOST != 127.0.0.1 && $HOST != localhost ]]; then
        die "no Redis answers on $HOST:$PORT, and it is not local, so this script cannot start it"
    fi
    command -v redis-server >/dev/null || install_redis
    mkdir -p "$DATA_DIR"
    say "starting redis-server on $HOST:$PORT (data and log in $DATA_DIR)"
    redis-server --daemonize yes --bind "$HOST" --port "$PORT" --dir "$DATA_DIR" \
        --logfile "$DATA_DIR/redis.log" --save '' ||
        say "redis-server exited with $?; waiting for the server anyway"
    local start=$SECONDS
    until redis_up; do
        if ((SECONDS - start >= START_TIMEOUT_S)); then
            tail -n 20 "$DATA_DIR/redis.log" >&2 2>/dev/null || true
            die "Redis did not answer on $HOST:$PORT within $START_TIMEOUT_S s (log above)"
        fi
        sleep 1
    done
    say "Redis is up after $((SECONDS - start)) s"
}

# Let tests and CI source this file for the probe functions without side effects.
if [[ "${BASH_SOURCE[0]}" == "$0" ]]; then
    ensure_server
    say "ready: redis://$HOST:$PORT/0"
fi
