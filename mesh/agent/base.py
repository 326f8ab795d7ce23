"""Declaring an agent: an :class:`Agent` subclass with one ``@capability`` method per capability.

How it works
------------
``@capability(...)`` checks its arguments at import time by building the wire
:class:`~mesh.wire.Capability` (name, semver, both schemas must be valid JSON
Schemas) and compiles the input and output validators once. It marks the
method and returns it unchanged, so the method stays an ordinary coroutine
method that tests can call directly.

``Agent.__init_subclass__`` collects the marked methods (inherited ones too)
into the class attribute ``capabilities``. Constructing an agent validates
everything the manager would check, by building a registration with a
placeholder incarnation: a mistake (a 1 s heartbeat interval, a bad agent ID)
is a :class:`~mesh.errors.LocalProtocolError` before anything is sent.

The agent itself does no I/O: :class:`mesh.agent.AgentRuntime` registers it,
heartbeats for it and feeds it tasks.
"""

from __future__ import annotations

import asyncio
import inspect
import re
import secrets
from collections.abc import Awaitable, Callable, Coroutine, Mapping
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any, ClassVar, TypeVar, cast

from jsonschema.protocols import Validator
from jsonschema.validators import validator_for
from pydantic import ValidationError

from mesh import constants as c
from mesh.errors import LocalProtocolError
from mesh.wire.models import AgentRegistration, Capability, CostClass

__all__ = [
    "Agent",
    "BoundCapability",
    "CapabilitySpec",
    "HandlerMethod",
    "capability",
]

AGENT_ID_PATTERN = re.compile(f"^{c.AGENT_ID_WORD}$")
_DEPLOYMENT_PATTERN = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_-]{0,55}$")  # room for "-<6 hex>"
_MARK = "__mesh_capability__"

Payload = dict[str, Any]
HandlerMethod = Callable[..., Coroutine[Any, Any, Payload]]
BoundHandler = Callable[[Payload], Awaitable[Payload]]
_H = TypeVar("_H", bound=HandlerMethod)


@dataclass(frozen=True, slots=True)
class CapabilitySpec:
    """One declared capability: its wire description and its validators, compiled once."""

    capability: Capability
    method_name: str
    input_validator: Validator = field(compare=False, repr=False)
    output_validator: Validator = field(compare=False, repr=False)

    @property
    def name(self) -> str:
        return self.capability.name

    @property
    def max_concurrency(self) -> int:
        return self.capability.max_concurrency


@dataclass(frozen=True, slots=True)
class BoundCapability:
    """A capability of one agent instance: the bound handler and its concurrency gate."""

    spec: CapabilitySpec
    handler: BoundHandler
    semaphore: asyncio.Semaphore = field(compare=False, repr=False)


def _compile(schema: Mapping[str, Any]) -> Validator:
    return validator_for(schema)(schema)


def capability(
    name: str,
    *,
    version: str,
    input_schema: Mapping[str, Any],
    output_schema: Mapping[str, Any],
    max_concurrency: int = 1,
    cost_class: CostClass = "B",
    description: str = "",
) -> Callable[[_H], _H]:
    """Mark ``async def handler(self, payload) -> dict`` as the handler of ``name@version``.

    Raises :class:`LocalProtocolError` at import time if the declaration would be refused.
    """
    try:
        wire = Capability(
            name=name,
            version=version,
            input_schema=dict(input_schema),
            output_schema=dict(output_schema),
            max_concurrency=max_concurrency,
            cost_class=cost_class,
            description=description,
        )
    except ValidationError as exc:
        raise LocalProtocolError(f"capability {name!r}: {_describe(exc)}") from None
    except (TypeError, AttributeError) as exc:  # jsonschema chokes on, e.g., a non-string $schema
        raise LocalProtocolError(f"capability {name!r}: not a valid JSON Schema ({exc})") from None

    def mark(method: _H) -> _H:
        if not inspect.iscoroutinefunction(method):
            raise LocalProtocolError(
                f"capability {name!r}: handler {method.__qualname__} must be an `async def`"
            )
        spec = CapabilitySpec(
            capability=wire,
            method_name=method.__name__,
            input_validator=_compile(wire.input_schema),
            output_validator=_compile(wire.output_schema),
        )
        setattr(method, _MARK, spec)
        return method

    return mark


class Agent:
    """Base class of every agent. Subclasses set ``deployment`` and declare capabilities.

    ``heartbeat_interval_s`` must be at least 5 s: the manager declares an agent lost after
    three missed heartbeats, so a shorter interval evicts healthy agents during GC pauses.
    """

    deployment: ClassVar[str]
    capabilities: ClassVar[Mapping[str, CapabilitySpec]] = MappingProxyType({})

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        found: dict[str, CapabilitySpec] = {}
        seen_methods: set[str] = set()
        for klass in cls.__mro__:
            for attr, value in vars(klass).items():
                if attr in seen_methods:
                    continue  # overridden further down the MRO
                seen_methods.add(attr)
                spec = getattr(value, _MARK, None)
                if not isinstance(spec, CapabilitySpec):
                    continue
                if spec.name in found:
                    raise LocalProtocolError(
                        f"{cls.__qualname__}: capability {spec.name!r} is declared by both "
                        f"{found[spec.name].method_name}() and {spec.method_name}()"
                    )
                found[spec.name] = spec
        cls.capabilities = MappingProxyType(found)

    def __init__(
        self,
        agent_id: str | None = None,
        *,
        heartbeat_interval_s: float = c.DEFAULT_HEARTBEAT_INTERVAL_S,
        metadata: Mapping[str, str] | None = None,
        endpoint: str = "",
    ) -> None:
        cls = type(self)
        deployment = getattr(cls, "deployment", None)
        if not isinstance(deployment, str) or not _DEPLOYMENT_PATTERN.match(deployment):
            raise LocalProtocolError(
                f"{cls.__qualname__}.deployment must be set to a name matching "
                f"{_DEPLOYMENT_PATTERN.pattern} (got {deployment!r})"
            )
        if not cls.capabilities:
            raise LocalProtocolError(f"{cls.__qualname__} declares no @capability handler")
        if heartbeat_interval_s < c.MIN_HEARTBEAT_INTERVAL_S:
            raise LocalProtocolError(
                f"heartbeat_interval_s={heartbeat_interval_s:g} is below the minimum of "
                f"{c.MIN_HEARTBEAT_INTERVAL_S:g} s: the manager declares an agent lost after "
                f"{c.MISSED_HEARTBEATS_BEFORE_LOST} missed heartbeats (the "
                f"{c.MISSED_HEARTBEATS_BEFORE_LOST}-miss rule), so such a short interval "
                "evicts healthy agents during GC pauses; the manager would refuse it"
            )
        if agent_id is None:
            agent_id = f"{deployment}-{secrets.token_hex(3)}"
        if not AGENT_ID_PATTERN.match(agent_id):
            raise LocalProtocolError(
                f"agent_id {agent_id!r} must match {AGENT_ID_PATTERN.pattern} "
                "(it is a routing-key word: letters, digits, '_' and '-', no dots)"
            )
        self.agent_id = agent_id
        self.heartbeat_interval_s = float(heartbeat_interval_s)
        self.metadata = dict(metadata or {})
        self.endpoint = endpoint
        self.registration("validation")  # everything the manager checks, checked now

    def registration(self, incarnation: str) -> AgentRegistration:
        """The registration message for this agent and process incarnation."""
        try:
            return AgentRegistration(
                agent_id=self.agent_id,
                incarnation=incarnation,
                deployment=type(self).deployment,
                endpoint=self.endpoint,
                capabilities=[spec.capability for spec in self.capabilities.values()],
                heartbeat_interval_s=self.heartbeat_interval_s,
                metadata=self.metadata,
                features=list(c.AGENT_FEATURES),  # what the runtime implements
            )
        except ValidationError as exc:
            raise LocalProtocolError(
                f"the registration of {self.agent_id} would be refused: {_describe(exc)}"
            ) from None

    def bind(self) -> dict[str, BoundCapability]:
        """Each capability with its bound handler and a fresh ``Semaphore(max_concurrency)``."""
        return {
            name: BoundCapability(
                spec=spec,
                handler=cast(BoundHandler, getattr(self, spec.method_name)),
                semaphore=asyncio.Semaphore(spec.max_concurrency),
            )
            for name, spec in self.capabilities.items()
        }

    @property
    def total_concurrency(self) -> int:
        """The sum of ``max_concurrency`` over all capabilities: the task prefetch."""
        return sum(spec.max_concurrency for spec in self.capabilities.values())

    def __repr__(self) -> str:
        return f"{type(self).__name__}(agent_id={self.agent_id!r})"


def _describe(exc: ValidationError) -> str:
    errors = exc.errors(include_url=False, include_input=False)
    return "; ".join(
        f"{'.'.join(str(p) for p in e['loc']) or '<root>'}: {e['msg']}" for e in errors[:5]
    )
