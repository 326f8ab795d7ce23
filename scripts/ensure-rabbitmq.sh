#!/usr/bin/env bash
# Make sure a RabbitMQ broker answers on 127.0.0.1:5672 and its management API on :15672.
#
#   bash scripts/ensure-rabbitmq.sh
#
# Safe to run again and again: a broker that is already up is left alone, and the management
# plugin is only enabled when its API does not answer. Starts a locally installed broker
# (`rabbitmq-server -detached`, as root or the rabbitmq user, or through `sudo -n`) when nothing
# listens. With Docker, `docker compose up -d rabbitmq` gives you the same thing instead.
#
# Settings (environment): MESH_RABBITMQ_HOST (127.0.0.1), MESH_RABBITMQ_PORT (5672),
# MESH_RABBITMQ_MGMT_PORT (15672), MESH_RABBITMQ_USER / MESH_RABBITMQ_PASSWORD (guest / guest),
# MESH_RABBITMQ_START_TIMEOUT_S (90), MESH_RABBITMQ_MGMT_TIMEOUT_S (60).
set -euo pipefail

HOST="${MESH_RABBITMQ_HOST:-127.0.0.1}"
PORT="${MESH_RABBITMQ_PORT:-5672}"
MGMT_PORT="${MESH_RABBITMQ_MGMT_PORT:-15672}"
USER_NAME="${MESH_RABBITMQ_USER:-guest}"
PASSWORD="${MESH_RABBITMQ_PASSWORD:-guest}"
START_TIMEOUT_S="${MESH_RABBITMQ_START_TIMEOUT_S:-90}"
MGMT_TIMEOUT_S="${MESH_RABBITMQ_MGMT_TIMEOUT_S:-60}"
PYTHON="${PYTHON:-python3}"

say() { printf 'ensure-rabbitmq: %s\n' "$*"; }
die() {
    printf 'ensure-rabbitmq: ERROR: %s\n' "$*" >&2
    exit 1
}

# True when something on HOST:PORT speaks AMQP 0-9-1: we send the protocol header and expect a
# Connection.Start method frame (frame type 1) back, so a random listener does not count.
amqp_up() {
    "$PYTHON" - "$1" "$2" <<'PY' 2>/dev/null
import socket, sys
try:
    with socket.create_connection((sys.argv[1], int(sys.argv[2])), timeout=2) as s:
        s.settimeout(2)
        s.sendall(b"AMQP\x00\x00\x09\x01")
        sys.exit(0 if s.recv(1) == b"\x01" else 1)
except OSError:
    sys.exit(1)
PY
}

# True when GET /api/overview answers 200 with the given credentials.
management_up() {
    "$PYTHON" - "$1" "$2" "$USER_NAME" "$PASSWORD" <<'PY' 2>/dev/null
import base64, sys, urllib.request
host, port, user, password = sys.argv[1:5]
req = urllib.request.Request(f"http://{host}:{port}/api/overview")
token = base64.b64encode(f"{user}:{password}".encode()).decode()
req.add_header("Authorization", f"Basic {token}")
try:
    with urllib.request.urlopen(req, timeout=3) as resp:
        sys.exit(0 if resp.status == 200 else 1)
except Exception:
    sys.exit(1)
PY
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

# Run a RabbitMQ admin command with the rights it needs: directly as root or rabbitmq (the
# Debian wrappers switch to the rabbitmq user and its Erlang cookie themselves), else `sudo -n`.
as_broker_admin() {
    if [[ $EUID -eq 0 || "$(id -un)" == rabbitmq ]]; then
        "$@"
    elif command -v sudo >/dev/null && sudo -n true 2>/dev/null; then
        sudo -n "$@"
    else
        return 126
    fi
}

show_broker_logs() {
    local f
    for f in /var/log/rabbitmq/*.log /var/log/rabbitmq/startup_err; do
        if [[ -r $f ]]; then
            echo "----- last lines of $f" >&2
            tail -n 20 "$f" >&2 || true
        fi
    done
}

ensure_broker() {
    if amqp_up "$HOST" "$PORT"; then
        say "broker already answers AMQP on $HOST:$PORT"
        return 0
    fi
    if [[ $HOST != 127.0.0.1 && $HOST != localhost ]]; then
        die "no AMQP broker answers on $HOST:$PORT, and it is not local, so this script cannot start it"
    fi
    command -v rabbitmq-server >/dev/null ||
        die "no broker on $HOST:$PORT and rabbitmq-server is not installed; install RabbitMQ or run \`docker compose up -d rabbitmq\`"

    # A node that is still booting answers a ping before its AMQP listener is open: do not
    # start a second one, just wait for it.
    if as_broker_admin rabbitmq-diagnostics -q ping >/dev/null 2>&1; then
        say "the RabbitMQ node is running but AMQP is not open yet; waiting"
    else
        say "starting RabbitMQ (rabbitmq-server -detached)"
        local rc=0
        as_broker_admin rabbitmq-server -detached || rc=$?
        if ((rc == 126)); then
            die "RabbitMQ is not running and starting it needs root: run \`sudo rabbitmq-server -detached\` (or \`sudo systemctl start rabbitmq-server\`), then this script again"
        fi
        # Another run may have started it at the same moment; the wait below decides.
        ((rc == 0)) || say "rabbitmq-server -detached exited with $rc; waiting for a broker anyway"
    fi
    printf 'ensure-rabbitmq: waiting up to %s s for AMQP on %s:%s ' "$START_TIMEOUT_S" "$HOST" "$PORT"
    if ! wait_for "$START_TIMEOUT_S" "AMQP on $HOST:$PORT" amqp_up "$HOST" "$PORT"; then
        show_broker_logs
        die "RabbitMQ did not open $HOST:$PORT within $START_TIMEOUT_S s (logs above)"
    fi
}

ensure_management() {
    if management_up "$HOST" "$MGMT_PORT"; then
        say "management API already answers on http://$HOST:$MGMT_PORT/api/"
        return 0
    fi
    if command -v rabbitmq-plugins >/dev/null; then
        say "enabling the management plugin (rabbitmq-plugins enable rabbitmq_management)"
        local rc=0
        as_broker_admin rabbitmq-plugins enable rabbitmq_management || rc=$?
        if ((rc == 126)); then
            die "enabling the management plugin needs root: run \`sudo rabbitmq-plugins enable rabbitmq_management\`"
        fi
        ((rc == 0)) || die "rabbitmq-plugins enable rabbitmq_management failed (exit $rc)"
    else
        say "rabbitmq-plugins is not installed here; waiting in case the broker enables it itself"
    fi
    printf 'ensure-rabbitmq: waiting up to %s s for http://%s:%s/api/overview ' \
        "$MGMT_TIMEOUT_S" "$HOST" "$MGMT_PORT"
    if ! wait_for "$MGMT_TIMEOUT_S" "management API" management_up "$HOST" "$MGMT_PORT"; then
        show_broker_logs
        die "the management API at http://$HOST:$MGMT_PORT/api/overview did not answer with $USER_NAME's credentials within $MGMT_TIMEOUT_S s"
    fi
}

# The user's tags, from GET /api/whoami ("administrator,management", say); empty on failure.
user_tags() {
    "$PYTHON" - "$HOST" "$MGMT_PORT" "$USER_NAME" "$PASSWORD" <<'PY' 2>/dev/null
import base64, json, sys, urllib.request
host, port, user, password = sys.argv[1:5]
req = urllib.request.Request(f"http://{host}:{port}/api/whoami")
token = base64.b64encode(f"{user}:{password}".encode()).decode()
req.add_header("Authorization", f"Basic {token}")
with urllib.request.urlopen(req, timeout=3) as resp:
    tags = json.load(resp).get("tags", [])
print(",".join(tags) if isinstance(tags, list) else str(tags))
PY
}

# The tests provision their own broker users through the management API — agents with exactly
# their own permissions (`mesh broker add-agent`), users revoked mid-test — so the test user
# must be an administrator on the broker, with every permission on the vhost the tests use.
ensure_test_user_rights() {
    if [[ ",$(user_tags)," == *",administrator,"* ]]; then
        say "$USER_NAME is a broker administrator (the tests make and delete users)"
        return 0
    fi
    say "granting $USER_NAME the administrator tag and all permissions on / (the tests make users)"
    local rc=0
    as_broker_admin rabbitmqctl set_user_tags "$USER_NAME" administrator >/dev/null || rc=$?
    ((rc == 0)) && { as_broker_admin rabbitmqctl set_permissions -p / "$USER_NAME" ".*" ".*" ".*" >/dev/null || rc=$?; }
    if ((rc != 0)); then
        die "$USER_NAME is not a broker administrator and granting it failed (exit $rc): run \`sudo rabbitmqctl set_user_tags $USER_NAME administrator\`"
    fi
    [[ ",$(user_tags)," == *",administrator,"* ]] || die "$USER_NAME is still not an administrator"
}

# Let tests and CI source this file for the probe functions without side effects.
if [[ "${BASH_SOURCE[0]}" == "$0" ]]; then
    ensure_broker
    ensure_management
    ensure_test_user_rights
    say "ready: amqp://$USER_NAME:***@$HOST:$PORT/  http://$HOST:$MGMT_PORT/"
fi
