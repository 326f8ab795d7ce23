"""The agent's control queue (``<ns>.agent.<id>.control``): what the managers tell this agent,
checked before it is acted on.

Each message is decoded and must be addressed to this agent (garbage and others' messages are
dead-lettered with their reason). It is taken only from the managers' broker user (its
RabbitMQ-validated ``user_id``; ``AgentSettings.manager_user``, or the user that signed the
acceptance of this incarnation's first registration): anything else is dead-lettered
``NOT_AUTHORIZED`` and counted (``control_not_from_manager``), so a broker user that may
publish to the agents or events exchange cannot drain an agent or make it drop its leases. An
unsigned request to register again is taken as one that keeps the leases: doing what it asks
cannot hurt (an older manager's, mid-upgrade, must still be heard). Events from the grant feed
(``grant.<deployment>.#`` on the events exchange) of a kind this SDK does not know are ignored.
What passes goes to the runtime's ``dispatch``, then the delivery is acked.
"""

from __future__ import annotations

import logging
from collections import Counter
from collections.abc import Callable

from mesh.agent.settings import Identity
from mesh.agent.settling import ack, dead_letter
from mesh.errors import MessageRejected
from mesh.topology import BindingSpec, Declarations, Topology, names
from mesh.transport import Delivery
from mesh.transport.ports import Transport as AgentTransport
from mesh.wire.codec import decode_as
from mesh.wire.events import OrchestrationEvent
from mesh.wire.models import (
    AdmissionState,
    DrainAccepted,
    DrainComplete,
    DrainNotice,
    LeaseNotice,
    Message,
    Refusal,
    RegistrationAccepted,
    RegistrationRefused,
    ReRegisterRequest,
    Standing,
)
from mesh.wire.reasons import Reason

log = logging.getLogger(__name__)

CONTROL_TYPES: tuple[type[Message], ...] = (
    RegistrationAccepted,
    RegistrationRefused,
    ReRegisterRequest,
    DrainNotice,
    DrainComplete,
    DrainAccepted,
    Refusal,
    LeaseNotice,
    OrchestrationEvent,  # grant revocations from the events exchange
    Standing,
    AdmissionState,
)
CONTROL_PREFETCH = 16


class ControlInbox:
    """Takes the control queue's deliveries and hands on what the managers said."""

    def __init__(
        self,
        identity: Identity,
        *,
        manager_user: str | None,
        topology: Topology,
        transport: Callable[[], AgentTransport],
        counters: Counter[str],
        awaiting_acceptance: Callable[[], bool],
        dispatch: Callable[[Message], None],
    ) -> None:
        self._identity = identity
        self.manager_user = manager_user
        """The managers' broker user: control messages are taken only from it (``None``:
        not known yet, nothing checked)."""
        self._topology = topology
        self.queue = topology.agent_control_queue(identity.agent_id)
        self._transport = transport
        self._counters = counters
        self._awaiting_acceptance = awaiting_acceptance
        self._dispatch = dispatch

    def grant_feed(self) -> Declarations:
        """The binding by which this queue hears every grant revocation and epoch of our
        pool (``grant.<deployment>.#`` on the events exchange)."""
        binding = BindingSpec(
            self.queue,
            self._topology.events_exchange,
            names.grant_binding(self._identity.deployment),
        )
        return Declarations(bindings=(binding,))

    async def on_control(self, delivery: Delivery) -> None:
        extra = self._identity.extra
        try:
            message = decode_as(delivery.body, *CONTROL_TYPES)
            if not isinstance(message, OrchestrationEvent):  # events are for the whole pool
                self._check_addressee(message)
        except MessageRejected as exc:
            if delivery.exchange == self._topology.events_exchange:
                # The grant feed: an event of a kind (or a detail) this SDK does not know —
                # a newer manager's — is ignored, as the kinds it does not act on are.
                self._counters["events_ignored"] += 1
                log.debug("event ignored", extra=extra(error=str(exc)[:200]))
                await ack(delivery, extra())
                return
            self._counters["control_dead_lettered"] += 1
            await self._dead_letter(delivery, exc)
            return
        sender = self._check_sender(message, delivery.user_id)
        if sender is None:
            self._counters["control_not_from_manager"] += 1
            await self._dead_letter(
                delivery,
                MessageRejected(
                    Reason.NOT_AUTHORIZED,
                    f"{message.type} from {delivery.user_id or 'an unsigned publisher'!r}, "
                    f"not the managers' user {self.manager_user!r}",
                ),
            )
            return
        self._dispatch(sender)
        await ack(delivery, extra())

    def _check_sender(self, message: Message, user_id: str | None) -> Message | None:
        """``message`` if the managers' user sent it (or nothing is checked yet), else None.
        An unsigned request to register again is taken as one that keeps the leases: doing
        what it asks cannot hurt (an older manager's, mid-upgrade, must still be heard),
        forgetting our leases on anyone's word could. The first signed acceptance of our
        pending registration names the managers' user when the settings do not."""
        expected = self.manager_user
        if expected is None:
            if (
                isinstance(message, RegistrationAccepted)
                and user_id is not None
                and message.incarnation == self._identity.incarnation
                and self._awaiting_acceptance()
            ):
                self.manager_user = user_id
                log.info(
                    "the managers' user learned", extra=self._identity.extra(manager_user=user_id)
                )
            return message
        if user_id == expected:
            return message
        if isinstance(message, ReRegisterRequest) and user_id is None:
            self._counters["control_unsigned_reregister"] += 1
            return message.model_copy(update={"leases_kept": True})
        return None

    def _check_addressee(self, message: Message) -> None:
        me = self._identity.agent_id
        addressee = getattr(message, "agent_id", me)
        if addressee != me:
            raise MessageRejected(
                Reason.UNKNOWN_AGENT, f"addressed to {addressee!r}, received by {me!r}"
            )

    async def _dead_letter(self, delivery: Delivery, exc: MessageRejected) -> None:
        await dead_letter(
            self._transport(), self._topology, delivery, self.queue, exc, self._identity.extra()
        )
