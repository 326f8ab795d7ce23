"""What a broker's AMQP URL says, and what to tell the operator when one does not work.

Pure functions over URL strings (and a failed connection's exception): they need no
connection, and the services build their settings with them (``url_user``, ``with_heartbeat``).
"""

from __future__ import annotations

from urllib.parse import parse_qsl, unquote, urlencode, urlsplit, urlunsplit

import aiormq

from mesh.transport.addresses import first_url, redact


def not_an_amqp_url(url: str) -> str | None:
    """Why ``url`` cannot be a broker's AMQP URL, or ``None``."""
    scheme = urlsplit(url).scheme
    if scheme in ("amqp", "amqps"):
        return None
    hint = (
        " (an http:// URL is the management API's: give it as --management-url)"
        if scheme in ("http", "https")
        else ""
    )
    return (
        f"{redact(url)} is not an AMQP URL{hint}; the broker's is "
        "amqp://USER:PASSWORD@HOST:5672/VHOST (MESH_AMQP_URL or --amqp-url)"
    )


def with_heartbeat(url: str, seconds: int) -> str:
    """``url`` asking for an AMQP heartbeat of ``seconds`` unless it names one already (the
    operator's choice wins); each of several comma-separated URLs alike. The broker closes a
    connection that stays silent for about two heartbeat intervals — a frozen or cut-off
    process's included."""
    if "," in url:
        return ",".join(with_heartbeat(part.strip(), seconds) for part in url.split(","))
    parts = urlsplit(url)
    query = parse_qsl(parts.query, keep_blank_values=True)
    if any(name == "heartbeat" for name, _ in query):
        return url
    return urlunsplit(parts._replace(query=urlencode([*query, ("heartbeat", str(seconds))])))


def why_not_connected(url: str, exc: BaseException) -> str:
    """One sentence that points at the real cause of a failed connection."""
    parts = urlsplit(url)
    where = f"RabbitMQ at {parts.hostname}:{parts.port or 5672}"
    if isinstance(exc, aiormq.exceptions.ProbableAuthenticationError):
        return (
            f"{where} refused the login of user {parts.username or 'guest'!r} "
            "(ACCESS_REFUSED): check the user name and password in MESH_AMQP_URL or "
            "--amqp-url (`rabbitmqctl list_users`)"
        )
    if isinstance(exc, aiormq.exceptions.InvalidFrameError) and "Connection.Close" in str(exc):
        vhost = parts.path[1:] or "/"
        return (
            f"{where} accepted the login but closed the connection while opening vhost "
            f"{vhost!r}: it does not exist, or user {parts.username or 'guest'!r} has no "
            "permissions on it (`rabbitmqctl list_vhosts`, `rabbitmqctl list_permissions`)"
        )
    return (
        f"cannot reach RabbitMQ at {redact(url)} ({type(exc).__name__}: {exc}); "
        "start it (`rabbitmq-server -detached`, or `docker compose up -d rabbitmq`) "
        "or point MESH_AMQP_URL at a running broker"
    )


def url_user(url: str) -> str | None:
    """The broker user an AMQP URL logs in as (percent-decoded, as the client sends it), or
    ``None`` if it names none (the client then logs in as ``guest``)."""
    return unquote(urlsplit(first_url(url)).username or "") or None
