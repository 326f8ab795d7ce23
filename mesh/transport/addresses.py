"""Several broker addresses in one setting: a RabbitMQ cluster without a load balancer.

``--amqp-url`` / ``MESH_AMQP_URL`` take one AMQP URL, or several separated by commas — one
per cluster node, all with the same user, password and virtual host (a comma cannot appear
in a URL's host, and a password with one is written ``%2C``)::

    amqp://mesh:secret@rabbit-0:5672/mesh,amqp://mesh:secret@rabbit-1:5672/mesh

Each process tries them in an order of its own (shuffled once, so a fleet spreads over the
nodes instead of all crowding the first) and, when its connection drops, reconnects to the
next one in that order: a node that died is left at once. One URL (a load balancer in front of
the cluster, or a single node) works as before.
"""

from __future__ import annotations

import random
from dataclasses import dataclass
from urllib.parse import unquote, urlsplit, urlunsplit

from mesh.errors import LocalProtocolError


@dataclass(frozen=True, slots=True)
class BrokerAddresses:
    """The broker URLs of one setting, in this process's order (see the module doc)."""

    urls: tuple[str, ...]

    @classmethod
    def parse(
        cls, text: str, rng: random.Random | None = None, *, shuffle: bool = True
    ) -> BrokerAddresses:
        """Split ``text`` on commas and shuffle the URLs with ``rng`` (a fresh one by
        default: every process its own order; ``shuffle=False`` keeps them as written).
        :class:`LocalProtocolError` if one is not an AMQP URL or they do not share user,
        password and virtual host."""
        urls = [part.strip() for part in text.split(",") if part.strip()]
        if not urls:
            raise LocalProtocolError("no broker URL given (MESH_AMQP_URL / --amqp-url)")
        first = _identity(urls[0])
        for url in urls[1:]:
            if _identity(url) != first:
                raise LocalProtocolError(
                    "the broker URLs in one setting must share the user, the password and "
                    f"the virtual host (one cluster): {redact(urls[0])!r} and "
                    f"{redact(url)!r} differ"
                )
        if shuffle and len(urls) > 1:
            (rng or random.Random()).shuffle(urls)
        return cls(tuple(urls))

    @property
    def first(self) -> str:
        return self.urls[0]

    def starting_at(self, url: str) -> str:
        """The setting again, in this order but from ``url`` on (for a second connection
        that should reach the node the first one did)."""
        start = self.urls.index(url) if url in self.urls else 0
        return ",".join(self.urls[start:] + self.urls[:start])

    def after(self, url: str) -> str:
        """The URL to try once ``url`` failed or dropped: the next in this process's order."""
        try:
            return self.urls[(self.urls.index(url) + 1) % len(self.urls)]
        except ValueError:
            return self.urls[0]


def first_url(text: str) -> str:
    """The first URL of a setting as written (for what all of them share: user, vhost)."""
    return text.split(",", 1)[0].strip()


def _identity(url: str) -> tuple[str, str, str, str]:
    parts = urlsplit(url)
    if parts.scheme not in ("amqp", "amqps"):
        raise LocalProtocolError(
            f"{redact(url)!r} is not an AMQP URL (amqp://user:password@host:port/vhost); "
            "several are separated by commas"
        )
    return (
        parts.scheme,
        unquote(parts.username or ""),
        unquote(parts.password or ""),
        unquote(parts.path[1:]) or "/",
    )


def redact(url: str) -> str:
    """The URL with its password replaced, for messages and logs."""
    parts = urlsplit(url)
    if parts.password is None:
        return url
    netloc = parts.netloc.replace(f":{parts.password}@", ":***@", 1)
    return urlunsplit(parts._replace(netloc=netloc))
