"""Invocation leases: a short-lived credential bound to one admission, checked where it is used.

Theory of operation
-------------------
A manager started with a lease key (``mesh manager --lease-key FILE``) puts an
:class:`~mesh.wire.models.InvocationLease` into every grant it issues: the admission, its fence,
the pool, the descriptor epoch, the tools the requirements named, and an expiry — the grant's,
or ``lease_ttl_s`` after issue if that is sooner — signed with the manager's **Ed25519** private
key. Verifiers hold only the public key (``FILE.pub``), so a consumption point can check a
lease but never mint one: the lease is narrower than any credential an agent or a tool holds.

A *consumption point* is where an attempt spends what it was granted: the agent when it claims
the task and when it publishes the result, a tool service when it is called. Each checks, in
this order (:meth:`LeaseVerifier.check`):

1. *unknown key*: ``key_id`` names no key this verifier trusts;
2. *signature*: the Ed25519 signature over the canonical JSON of every other field fails
   (any changed field — another admission, a wider tool list, a later expiry — fails here);
3. *expired*: ``now >= expires_at``;
4. *bound elsewhere*: the lease is for another admission, fence or pool than the one the
   caller is acting for (a lease lifted from one task and presented with another);
5. *out of scope*: the tool being called is not among the lease's ``tools``.

A :class:`ConsumptionPoint` adds *replayed*: a point that may be passed once per admission
(publishing the result, a payment, a write) remembers the leases it consumed, until they
expire, and refuses a second presentation. A point that may be passed many times (reading)
does not remember. Memory is per point: two agents are two points; across them the ledger is
the authority (a release of an admission is final, :mod:`mesh.ledger`).

Keys. ``LeaseSigner.load_or_create(path)`` reads a PKCS#8 PEM private key, or creates one
(mode 0600) with the public key next to it (``path.pub``, SubjectPublicKeyInfo PEM). Several
managers on one ledger share the file. A verifier loads any number of public keys (rotation:
trust old and new, then drop the old once its leases have expired).

Why a library: ``cryptography`` (the PyCA package, OpenSSL underneath) gives Ed25519 —
asymmetric signatures are what makes "verify without being able to sign" possible; an HMAC
shared with every verifier would let any of them mint leases.
"""

from __future__ import annotations

import base64
import hashlib
import os
import uuid
from collections import OrderedDict
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path

import orjson
from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric.ed25519 import (
    Ed25519PrivateKey,
    Ed25519PublicKey,
)

from mesh.errors import MeshError
from mesh.wire.models import InvocationLease

DEFAULT_MAX_REMEMBERED = 100_000
"""Leases a once-only consumption point remembers (the oldest expiring first)."""


class LeaseKeyError(MeshError):
    """A lease key file is missing, unreadable or not an Ed25519 key."""


def key_id(public: Ed25519PublicKey) -> str:
    raw = public.public_bytes(serialization.Encoding.Raw, serialization.PublicFormat.Raw)
    return hashlib.sha256(raw).hexdigest()[:16]


def signed_bytes(lease: InvocationLease) -> bytes:
    """What the signature covers: every field but the signature, sorted keys, compact."""
    return orjson.dumps(
        lease.model_dump(mode="json", exclude={"signature"}), option=orjson.OPT_SORT_KEYS
    )


def _b64(data: bytes) -> str:
    return base64.urlsafe_b64encode(data).rstrip(b"=").decode()


def _unb64(text: str) -> bytes:
    return base64.urlsafe_b64decode(text + "=" * (-len(text) % 4))


class LeaseSigner:
    """The manager's side: signs one lease per grant."""

    def __init__(self, private_key: Ed25519PrivateKey) -> None:
        self._private = private_key
        self.public_key = private_key.public_key()
        self.key_id = key_id(self.public_key)

    @classmethod
    def generate(cls) -> LeaseSigner:
        return cls(Ed25519PrivateKey.generate())

    @classmethod
    def load_or_create(cls, path: Path | str) -> LeaseSigner:
        """The key in ``path`` (PKCS#8 PEM), created with ``path.pub`` if the file is absent."""
        path = Path(path)
        if not path.exists():
            signer = cls.generate()
            path.parent.mkdir(parents=True, exist_ok=True)
            pem = signer._private.private_bytes(
                serialization.Encoding.PEM,
                serialization.PrivateFormat.PKCS8,
                serialization.NoEncryption(),
            )
            fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
            with os.fdopen(fd, "wb") as out:
                out.write(pem)
            public_path(path).write_bytes(signer.public_pem())
            return signer
        try:
            key = serialization.load_pem_private_key(path.read_bytes(), password=None)
        except (OSError, ValueError, TypeError) as exc:
            raise LeaseKeyError(f"cannot read the lease key {path}: {exc}") from None
        if not isinstance(key, Ed25519PrivateKey):
            raise LeaseKeyError(f"{path} holds a {type(key).__name__}, not an Ed25519 key")
        return cls(key)

    def public_pem(self) -> bytes:
        return self.public_key.public_bytes(
            serialization.Encoding.PEM, serialization.PublicFormat.SubjectPublicKeyInfo
        )

    def sign(
        self,
        *,
        admission_id: str,
        pool_id: str,
        fence: int,
        descriptor_epoch: int,
        tools: Sequence[str],
        issued_at: float,
        expires_at: float,
    ) -> InvocationLease:
        unsigned = InvocationLease.model_construct(
            lease_id=uuid.uuid4().hex,
            admission_id=admission_id,
            pool_id=pool_id,
            fence=fence,
            descriptor_epoch=descriptor_epoch,
            tools=sorted(tools),
            issued_at=issued_at,
            expires_at=expires_at,
            key_id=self.key_id,
            signature="",
        )
        signature = _b64(self._private.sign(signed_bytes(unsigned)))
        return InvocationLease.model_validate(
            {**unsigned.model_dump(mode="json"), "signature": signature}
        )


def public_path(private_path: Path | str) -> Path:
    """Where the public key of a private key file lives: ``<file>.pub``."""
    return Path(f"{private_path}.pub")


def load_public_key(path: Path | str) -> Ed25519PublicKey:
    try:
        key = serialization.load_pem_public_key(Path(path).read_bytes())
    except (OSError, ValueError, TypeError) as exc:
        raise LeaseKeyError(f"cannot read the lease public key {path}: {exc}") from None
    if not isinstance(key, Ed25519PublicKey):
        raise LeaseKeyError(f"{path} holds a {type(key).__name__}, not an Ed25519 public key")
    return key


class LeaseVerifier:
    """Checks leases with the managers' public keys (it cannot sign)."""

    def __init__(self, public_keys: Iterable[Ed25519PublicKey]) -> None:
        self._keys: Mapping[str, Ed25519PublicKey] = {key_id(k): k for k in public_keys}
        if not self._keys:
            raise LeaseKeyError("a lease verifier needs at least one public key")

    @classmethod
    def from_files(cls, paths: Iterable[Path | str]) -> LeaseVerifier:
        return cls(load_public_key(path) for path in paths)

    def check(
        self,
        lease: InvocationLease,
        *,
        now: float,
        admission_id: str | None = None,
        fence: int | None = None,
        pool_id: str | None = None,
        tool: str | None = None,
    ) -> str | None:
        """``None`` if ``lease`` may be used now for what the caller names; else why not."""
        key = self._keys.get(lease.key_id)
        if key is None:
            return f"lease signed by unknown key {lease.key_id}"
        try:
            key.verify(_unb64(lease.signature), signed_bytes(lease))
        except (InvalidSignature, ValueError):
            return "lease signature does not verify (altered or forged)"
        if now >= lease.expires_at:
            return f"lease expired {now - lease.expires_at:.1f} s ago"
        for field, wanted, held in (
            ("admission", admission_id, lease.admission_id),
            ("fence", fence, lease.fence),
            ("pool", pool_id, lease.pool_id),
        ):
            if wanted is not None and wanted != held:
                return f"lease is bound to {field} {held!r}, not {wanted!r}"
        if tool is not None and tool not in lease.tools:
            return f"lease does not cover tool {tool!r} (it covers {lease.tools})"
        return None


class ConsumptionPoint:
    """One place where leases are spent: :meth:`LeaseVerifier.check`, plus — for a point that
    may be passed once per lease (``once=True``) — refusal of a lease presented again."""

    def __init__(
        self,
        verifier: LeaseVerifier,
        name: str,
        *,
        once: bool = True,
        max_remembered: int = DEFAULT_MAX_REMEMBERED,
    ) -> None:
        self.verifier = verifier
        self.name = name
        self.once = once
        self.max_remembered = max_remembered
        self._consumed: OrderedDict[str, float] = OrderedDict()  # lease_id -> expires_at

    def consumed(self, lease: InvocationLease) -> bool:
        return lease.lease_id in self._consumed

    def consume(
        self,
        lease: InvocationLease,
        *,
        now: float,
        admission_id: str | None = None,
        fence: int | None = None,
        pool_id: str | None = None,
        tool: str | None = None,
    ) -> str | None:
        """Check and spend ``lease`` here; ``None`` if allowed, else why not."""
        problem = self.verifier.check(
            lease, now=now, admission_id=admission_id, fence=fence, pool_id=pool_id, tool=tool
        )
        if problem is not None or not self.once:
            return problem
        self._forget_expired(now)
        if lease.lease_id in self._consumed:
            return f"lease replayed: already consumed at {self.name}"
        self._consumed[lease.lease_id] = lease.expires_at
        while len(self._consumed) > self.max_remembered:
            self._consumed.popitem(last=False)
        return None

    def give_back(self, lease: InvocationLease) -> None:
        """Undo :meth:`consume`: what the lease was spent on did not happen after all (the
        result could not be published; the task goes back to the queue)."""
        self._consumed.pop(lease.lease_id, None)

    def _forget_expired(self, now: float) -> None:
        """An expired lease is refused as expired anyway: no need to remember it."""
        while self._consumed:
            lease_id, expires_at = next(iter(self._consumed.items()))
            if expires_at > now:
                break
            del self._consumed[lease_id]
