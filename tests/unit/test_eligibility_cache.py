"""The eligibility cache: same verdicts as computing them, until a descriptor changes or expires;
and its key holds every requirement field a rule reads (checked by watching the rules read)."""

from __future__ import annotations

from typing import Any

from mesh.core.eligibility import (
    EligibilityCache,
    EligibilitySnapshot,
    check_eligibility,
    eligibility_key,
)
from mesh.wire import CapabilityDescriptor, TaskRequirements

from .samples import DESCRIPTOR, REQUIREMENTS, T0

TENANT = "acme"
EPOCHS = {DESCRIPTOR.pool_id: DESCRIPTOR.descriptor_epoch}
GENERATION = DESCRIPTOR.policy_generation


def descriptor(**changes: Any) -> CapabilityDescriptor:
    return CapabilityDescriptor.model_validate({**DESCRIPTOR.model_dump(mode="json"), **changes})


def lookup(
    cache: EligibilityCache,
    descriptors: dict[str, CapabilityDescriptor],
    now: float,
    *,
    state: object = 1,
    requirements: TaskRequirements = REQUIREMENTS,
) -> Any:
    return cache.get(
        requirements, TENANT, descriptors, state=state,
        active_epochs=EPOCHS, active_generation=GENERATION, now=now,
    )  # fmt: skip


def computed(descriptors: dict[str, CapabilityDescriptor], now: float) -> Any:
    return check_eligibility(
        REQUIREMENTS, TENANT, descriptors,
        active_epochs=EPOCHS, active_generation=GENERATION, now=now,
    )  # fmt: skip


def test_a_hit_gives_the_verdicts_computing_would_give_at_the_callers_time() -> None:
    cache = EligibilityCache()
    descriptors = {DESCRIPTOR.pool_id: DESCRIPTOR}
    first = lookup(cache, descriptors, T0)
    again = lookup(cache, descriptors, T0 + 5)
    assert (cache.misses, cache.hits) == (1, 1)
    assert again == computed(descriptors, T0 + 5) and again.now == T0 + 5
    assert first.eligible == again.eligible == (DESCRIPTOR.pool_id,)


def test_lookup_hands_out_the_cached_result_as_computed_sharing_its_snapshot() -> None:
    cache = EligibilityCache()
    descriptors = {DESCRIPTOR.pool_id: DESCRIPTOR}
    first = lookup(cache, descriptors, T0)
    kept = cache.lookup(
        REQUIREMENTS, TENANT, descriptors, state=1,
        active_epochs=EPOCHS, active_generation=GENERATION, now=T0 + 5,
    )  # fmt: skip
    restamped = lookup(cache, descriptors, T0 + 9)

    assert kept is first and kept.now == T0  # the verdicts, as computed
    assert restamped == computed(descriptors, T0 + 9) and restamped.now == T0 + 9
    # Worked out once for all copies: the snapshot (without the time) is the same object.
    assert restamped.snapshot() is first.snapshot()
    assert "now" not in first.snapshot().record
    assert first.snapshot().ref == EligibilitySnapshot.of(first.snapshot().record).ref


def test_a_new_descriptor_state_or_another_request_shape_is_computed_afresh() -> None:
    cache = EligibilityCache()
    descriptors = {DESCRIPTOR.pool_id: DESCRIPTOR}
    lookup(cache, descriptors, T0)
    unhealthy = {DESCRIPTOR.pool_id: descriptor(health={"status": "unhealthy", "checked_at": T0})}
    result = lookup(cache, unhealthy, T0, state=2)
    assert result.eligible == () and result.verdicts[0].rule == "healthy"
    elsewhere = REQUIREMENTS.model_copy(update={"regions": ["ap-south-1"]})
    assert lookup(cache, unhealthy, T0, state=2, requirements=elsewhere).eligible == ()
    assert (cache.misses, cache.hits) == (3, 0)


def test_an_entry_ends_when_the_earliest_descriptor_expires() -> None:
    cache = EligibilityCache()
    expires = T0 + 10
    descriptors = {DESCRIPTOR.pool_id: descriptor(expires_at=expires)}
    assert lookup(cache, descriptors, T0).eligible == (DESCRIPTOR.pool_id,)
    assert lookup(cache, descriptors, expires - 0.001).eligible == (DESCRIPTOR.pool_id,)
    late = lookup(cache, descriptors, expires)
    assert late.eligible == () and late.verdicts[0].rule == "not_expired"
    assert late == computed(descriptors, expires)
    # An expired descriptor stays expired: that result holds from then on.
    assert lookup(cache, descriptors, expires + 1) == computed(descriptors, expires + 1)
    assert (cache.misses, cache.hits) == (2, 2)


class Watched:
    """The requirements, recording every field a rule reads."""

    def __init__(self, requirements: TaskRequirements) -> None:
        self._requirements = requirements
        self.read: set[str] = set()

    def __getattr__(self, name: str) -> Any:
        self.read.add(name)
        return getattr(self._requirements, name)


def test_the_key_holds_every_requirement_field_a_rule_reads() -> None:
    # Descriptors that pass every rule, and some that stop at each: every rule runs somewhere.
    variants = [
        DESCRIPTOR,
        descriptor(regions=["ap-south-1"]),
        descriptor(tenant_isolation={"mode": "dedicated", "tenants": ["other"]}),
        descriptor(expires_at=T0 - 1),
        descriptor(health={"status": "unhealthy", "checked_at": T0}),
    ]
    watched = Watched(REQUIREMENTS)
    for variant in variants:
        check_eligibility(
            watched, TENANT, {variant.pool_id: variant},  # type: ignore[arg-type]
            active_epochs=EPOCHS, active_generation=GENERATION, now=T0,
        )  # fmt: skip
    in_key = {
        "capability",
        "task_schema_version",
        "result_schema_version",
        "required_tools",
        "input_classifications",
        "regions",
    }
    assert watched.read <= in_key, f"rules read {sorted(watched.read - in_key)}: add to the key"
    assert watched.read == in_key  # and the key holds nothing they do not read
    base = eligibility_key(REQUIREMENTS, TENANT)
    for name, value in [
        ("regions", ["ap-south-1"]),
        ("input_classifications", ["public"]),
        ("task_schema_version", "1.4.1"),
        ("result_schema_version", "2.0.1"),
        ("required_tools", []),
    ]:
        assert eligibility_key(REQUIREMENTS.model_copy(update={name: value}), TENANT) != base
    assert eligibility_key(REQUIREMENTS, "other") != base
    not_read = REQUIREMENTS.model_copy(update={"deadline": T0 + 1, "priority": 1})
    assert eligibility_key(not_read, TENANT) == base  # what no rule reads shares the entry
