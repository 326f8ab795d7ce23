"""What the ``mesh`` commands print: plain-text renderings of the manager's replies and the
orchestration log, apart from the argument parsing in :mod:`mesh.cli`. Pure functions of a
reply (and, where ages are shown, ``now``), so tests render without a broker."""

from __future__ import annotations

import textwrap
from datetime import datetime
from typing import Any

from mesh.wire.admission import AdmissionDecision, ExplainReply
from mesh.wire.events import OrchestrationEvent
from mesh.wire.status import StatusReply

LIFECYCLE_ORDER = ("Spawning", "Registering", "Ready", "Busy", "Draining", "Terminated")


def render_status(reply: StatusReply) -> str:
    """``mesh status``: the summary (pools by state, capabilities), the page of agent rows the
    reply carries, what each described pool can grant, and the counters. A reply from a
    manager that predates the summary has only rows: the summary is counted from them."""
    total = reply.agents_total if reply.agents_total is not None else len(reply.agents)
    by_pool = _pools_by_state(reply)
    by_state: dict[str, int] = {}
    for states in by_pool.values():
        for state, n in states.items():
            by_state[state] = by_state.get(state, 0) + n
    order = [s for s in LIFECYCLE_ORDER if s in by_state]
    order += sorted(set(by_state) - set(LIFECYCLE_ORDER))
    states_text = " · ".join(f"{s} {by_state[s]:,}" for s in order)
    lines = [
        f"manager {reply.manager_id} · up {reply.uptime_s:.0f} s · {total:,} agent(s)"
        + (f": {states_text}" if states_text else "")
    ]
    if reply.unanswered_shards:
        lines.append(
            f"partial: the owners of {reply.unanswered_shards} shard(s) did not answer in time;"
            " the agents in them are missing from these figures: ask again"
        )
    if reply.settling_shards:
        lines.append(
            f"settling: {reply.settling_shards} shard(s) changed hands just now; their agents"
            " may still be registering again with the new owner (missing here until then)"
        )
    if by_pool:
        lines += ["", f"{'POOL':<24} " + " ".join(f"{s.upper():>11}" for s in order)]
        for pool_id, states in by_pool.items():
            lines.append(f"{pool_id:<24} " + " ".join(f"{states.get(s, 0):>11,}" for s in order))
    if reply.capability_loads:
        lines += [
            "",
            f"{'CAPABILITY':<24} {'AGENTS':>9} {'TAKING WORK':>11} {'IN-FLIGHT':>10} "
            f"{'CAPACITY':>9}",
        ]
        lines += [
            f"{c.name:<24} {c.agents:>9,} {c.taking_work:>11,} {c.in_flight:>10,} {c.capacity:>9,}"
            for c in reply.capability_loads
        ]
    lines += _shard_rows(reply)
    lines += _agent_rows(reply, total)
    lines += _pool_capacity_rows(reply)
    lines += _pool_signal_rows(reply)
    counters = " ".join(f"{k}={v}" for k, v in reply.counters.items())
    lines += ["", f"counters: {counters or '-'}"]
    return "\n".join(lines)


def _pools_by_state(reply: StatusReply) -> dict[str, dict[str, int]]:
    if reply.pool_states is not None:
        return {p.pool_id: p.states for p in reply.pool_states}
    by_pool: dict[str, dict[str, int]] = {}
    for agent in reply.agents:  # an older manager: count the rows
        states = by_pool.setdefault(agent.deployment, {})
        states[agent.state] = states.get(agent.state, 0) + 1
    return by_pool


def _pool_signal_rows(reply: StatusReply) -> list[str]:
    """Each pool's signals for scaling (``--json`` has every field; docs/operating.md)."""
    if not reply.pool_signals:
        return []
    window = next(iter(reply.pool_signals.values())).window_s
    lines = [
        "",
        f"pool signals (rates per second over {window:.0f} s):",
        f"{'POOL':<24} {'QUEUED':>7} {'DEFERRED':>8} {'OLDEST':>8} {'ADD/S':>7} "
        f"{'DISPATCH/S':>10} {'IN-FLIGHT':>9} {'LIVE':>6} {'READY':>6} {'DESIRED':>7}",
    ]
    for pool_id, s in reply.pool_signals.items():
        desired = "-" if s.desired_replicas is None else f"{s.desired_replicas:,}"
        lines.append(
            f"{pool_id:<24} {s.queued:>7,} {s.deferred:>8,} {s.oldest_wait_s:>7.1f}s "
            f"{s.add_rate:>7.2f} {s.dispatch_rate:>10.2f} {s.in_flight:>9,} "
            f"{s.live_capacity:>6,} {s.agents_ready:>6,} {desired:>7}"
        )
        if s.refusals:
            refused = ", ".join(f"{reason} {n:,}" for reason, n in s.refusals.items())
            lines.append(f"{'':<24} refused in the window: {refused}")
    return lines


def _shard_rows(reply: StatusReply) -> list[str]:
    """Several managers: which manager holds which shard (a line per manager)."""
    if reply.shard_count is None:
        return []
    by_owner: dict[str, list[int]] = {}
    for row in reply.shards or []:
        by_owner.setdefault(row.owner, []).append(row.shard)
    held = sum(len(shards) for shards in by_owner.values())
    lines = ["", f"shards: {held} of {reply.shard_count} held"]
    for owner, shards in sorted(by_owner.items()):
        lines.append(f"  {owner:<22} {len(shards):>4}  {', '.join(map(str, sorted(shards)))}")
    if held < reply.shard_count:
        lines.append("  (a shard nobody holds is waiting for a manager to take it)")
    return lines


def _agent_rows(reply: StatusReply, total: int) -> list[str]:
    paged = reply.agents_total is not None
    if not total:
        return ["", "(no agents registered)"]
    if paged and not reply.agents:
        return ["", f"({total:,} agent(s): list them with --agents, a page at a time)"]
    lines = [
        "",
        f"{'AGENT':<24} {'DEPLOYMENT':<12} {'STATE':<11} {'IN-FLIGHT':>9}  "
        f"{'HEARTBEAT':<10} CAPABILITIES",
    ]
    for agent in reply.agents:
        age = agent.last_heartbeat_age_s
        hb = "-" if age is None else f"{age:.1f}s ago"
        caps = ", ".join(
            f"{c.name}@{c.version} ({c.cost_class}, {c.in_flight}/{c.max_concurrency})"
            for c in agent.capabilities
        )
        lines.append(
            f"{agent.agent_id:<24} {agent.deployment:<12} {agent.state:<11} "
            f"{agent.in_flight:>9}  {hb:<10} {caps}"
        )
    if paged:
        first = (reply.agents_offset or 0) + 1
        last = first + len(reply.agents) - 1
        more = f"; next page: --offset {last}" if last < total else ""
        lines.append(f"(agents {first:,} to {last:,} of {total:,}{more})")
    return lines


def _pool_capacity_rows(reply: StatusReply) -> list[str]:
    if not reply.pools:
        return []
    lines = [
        "",
        f"{'POOL':<16} {'CAPABILITY':<20} {'LIVE AGENTS':>11} {'LIVE SLOTS':>10} "
        f"{'GRANTED':>8} {'MODEL SLOTS':>12}",
    ]
    for pool in reply.pools:
        granted = "-" if pool.granted is None else str(pool.granted)
        model = (
            "-"
            if pool.model_slots is None
            else f"{pool.model_slots_granted or 0}/{pool.model_slots}"
        )
        lines.append(
            f"{pool.pool_id:<16} {pool.capability:<20} {pool.live_agents:>11} "
            f"{pool.live_slots:>10} {granted:>8} {model:>12}"
        )
    return lines


def format_event(ev: OrchestrationEvent) -> str:
    when = datetime.fromtimestamp(ev.at).strftime("%H:%M:%S.%f")[:-3]
    seq = "" if ev.seq is None else f"#{ev.seq:<6}"
    move = f"{ev.from_state}→{ev.to_state}" if ev.to_state else ""
    parts = [seq, when, f"{ev.kind:<20}", f"{ev.agent_id or '-':<22}", f"{move:<22}"]
    if ev.capability:
        parts.append(ev.capability)
    if ev.reason:
        parts.append(f"({ev.reason})")
    admission = ev.detail.get("admission_id")
    if admission:  # the handle for `mesh explain`
        parts.append(f"admission {admission}")
    return " ".join(p for p in parts if p)


def _wrapped(label: str, text: str, width: int = 100) -> str:
    """``label`` then ``text``, wrapped at ``width`` under the text's first column."""
    indent = " " * len(label)
    return textwrap.fill(
        text, width, initial_indent=label, subsequent_indent=indent, break_on_hyphens=False
    )


def _when(at: Any) -> str:
    if not isinstance(at, int | float):
        return "-"
    return datetime.fromtimestamp(at).isoformat(sep=" ", timespec="milliseconds")


def _relative(at: Any, now: float | None) -> str:
    if now is None or not isinstance(at, int | float):
        return ""
    delta = at - now
    return f" (in {delta:.1f} s)" if delta >= 0 else f" ({-delta:.1f} s ago)"


def render_explain(reply: ExplainReply, *, now: float | None = None) -> str:
    """``mesh explain``: the decision, every pool considered with the rule that filtered it,
    and the reservation. ``now`` adds "in 12.0 s" / "3.0 s ago" to the reservation's times."""
    if not reply.found:
        return f"no admission {reply.admission_id!r} is known to this manager or its ledger"
    lines = [f"admission {reply.admission_id}"]
    lines += _explain_decision(reply.decision, now)
    if reply.eligibility is not None:
        lines += _explain_eligibility(reply.eligibility, now)
    elif reply.decision is None:
        lines.append("  no decision is recorded (its manager stopped before recording it)")
    lines += _explain_reservation(reply.reservation, now)
    return "\n".join(lines)


def _explain_decision(decision: AdmissionDecision | None, now: float | None) -> list[str]:
    if decision is None:
        return []
    reason = f" {decision.reason.value}" if decision.reason else ""
    lines = [f"  outcome      {decision.outcome}{reason}"]
    if decision.detail:
        lines.append(_wrapped("  detail       ", decision.detail))
    if decision.retry_after_ms is not None:
        lines.append(f"  retry after  {decision.retry_after_ms} ms")
    if decision.allowed_degradations:
        lines.append(f"  degradations {', '.join(decision.allowed_degradations)}")
    if decision.grant is not None:
        g = decision.grant
        lines.append(
            f"  grant        pool {g.pool_id} · descriptor epoch {g.descriptor_epoch} · "
            f"policy generation {g.policy_generation} · fence {g.fence}"
        )
        lines.append(f"  grant until  {_when(g.expires_at)}{_relative(g.expires_at, now)}")
        if g.grant_ids:
            lines.append(f"  grant ids    {', '.join(g.grant_ids)}")
    return lines


def _explain_eligibility(record: dict[str, Any], now: float | None) -> list[str]:
    pools: list[dict[str, Any]] = list(record.get("pools") or [])
    generation = record.get("active_generation")
    eligible = [str(p.get("pool_id")) for p in pools if p.get("rule") is None]
    lines = [
        f"  decided at   {_when(record.get('now'))}{_relative(record.get('now'), now)}",
        f"  generation   {generation} (the active policy generation)",
        _wrapped(
            "  rules        ",
            f"{' → '.join(record.get('rules') or ['?'])} (the first that fails filters the pool)",
        ),
        f"  pools        {len(pools)} considered, {len(eligible)} eligible"
        + (f": {', '.join(eligible)}" if eligible else ""),
    ]
    if not pools:
        return [*lines, "  (no pool had a descriptor)"]
    width = max(len("POOL"), *(len(str(p.get("pool_id"))) for p in pools))
    lines += ["", f"  {'POOL':<{width}}  {'EPOCH':>5}  {'ACTIVE':>6}  {'GENERATION':>10}  VERDICT"]
    for pool in pools:
        epoch, active = pool.get("descriptor_epoch"), pool.get("active_epoch")
        own = pool.get("policy_generation")
        gen = f"{own}" if own == generation else f"{own}≠{generation}"
        verdict = pool.get("rule") or "eligible"
        if pool.get("detail"):
            verdict += f" — {pool['detail']}"
        shown_active = "-" if active is None else str(active)
        lines.append(
            f"  {pool.get('pool_id')!s:<{width}}  {epoch!s:>5}  {shown_active:>6}"
            f"  {gen:>10}  {verdict}"
        )
    return lines + _explain_shadow(record.get("shadow"))


def _explain_shadow(shadow: object) -> list[str]:
    """What a shadow descriptor would have changed (recorded, never enforced)."""
    if not isinstance(shadow, dict):
        return []
    agree = "the same" if shadow.get("agree") else "DIFFERENT"
    lines = ["", f"  shadow       with the shadow descriptors eligibility would be {agree}:"]
    for pool in shadow.get("pools") or []:
        live = pool.get("live") or "eligible"
        under = pool.get("shadow") or "eligible"
        lines.append(
            f"    {pool.get('pool_id')} epoch {pool.get('descriptor_epoch')}: "
            f"live {live} → shadow {under}"
        )
    return lines


def _explain_reservation(held: dict[str, Any] | None, now: float | None) -> list[str]:
    if held is None:
        return ["", "  reservation  none (nothing was reserved, or it is no longer stored)"]
    state = held.get("state")
    lines = [
        "",
        f"  reservation  {state} · fence {held.get('fence')} · pool {held.get('pool_id')}",
        f"    created    {_when(held.get('created_at'))}{_relative(held.get('created_at'), now)}",
        f"    expires    {_when(held.get('expires_at'))}{_relative(held.get('expires_at'), now)}",
    ]
    released_at = held.get("released_at", held.get("updated_at"))
    if state == "RELEASED":
        when = _when(released_at) if released_at is not None else "(time not in the reply)"
        lines.append(f"    released   {when}")
    elif state == "EXPIRED":
        expired_at = held.get("expires_at") if released_at is None else released_at
        lines.append(f"    expired    {_when(expired_at)}")
    items = held.get("items") or []
    if items:
        listed = " · ".join(f"{pool}/{resource} {amount}" for pool, resource, amount in items)
        lines.append(f"    items      {listed}")
    return lines
