"""Operators' and read-only commands: status, drain, top, explain, descriptor, admission,
broker, schemas."""

from __future__ import annotations

import argparse
import os
import secrets
import sys
import time
import urllib.parse
from pathlib import Path
from typing import TYPE_CHECKING, Any

from mesh.cli.common import _run, _with_client
from mesh.errors import MessageRejected
from mesh.render import render_explain, render_status
from mesh.transport.addresses import first_url
from mesh.wire.models import Refusal
from mesh.wire.status import StatusReply

if TYPE_CHECKING:
    pass


def cmd_status(args: argparse.Namespace) -> int:
    async def show(client: Any) -> int:
        reply: StatusReply = await client.status(
            timeout_s=args.timeout,
            agents_offset=args.offset,
            agents_limit=args.limit if args.agents else 0,
        )
        if args.json:
            print(reply.model_dump_json(indent=2))
        else:
            print(render_status(reply))
        return 0

    return _run(_with_client(args, show, read_only=True))


def cmd_drain(args: argparse.Namespace) -> int:
    async def drain(client: Any) -> int:
        reply = await client.drain(args.agent_id, args.reason)
        if isinstance(reply, Refusal):
            print(f"refused: {reply.reason} ({reply.detail})", file=sys.stderr)
            return 1
        print(f"{reply.agent_id} is draining; {reply.in_flight} task(s) in flight")
        return 0

    return _run(_with_client(args, drain))


def cmd_top(args: argparse.Namespace) -> int:
    from mesh.top import run_top

    try:
        return run_top(args.url, interval_s=args.interval, once=args.once)
    except KeyboardInterrupt:
        return 0


def cmd_explain(args: argparse.Namespace) -> int:
    async def explain(client: Any) -> int:
        reply = await client.explain(args.admission_id)
        if args.json:
            print(reply.model_dump_json(indent=2))
        else:
            print(render_explain(reply, now=time.time()))
        return 0 if reply.found else 1

    return _run(_with_client(args, explain, read_only=True))


def cmd_descriptor(args: argparse.Namespace) -> int:
    from mesh.wire import CapabilityDescriptor, decode_as

    descriptor = None
    if args.action != "unshadow":
        try:
            descriptor = decode_as(Path(args.file).read_bytes(), CapabilityDescriptor)
        except OSError as exc:
            print(f"mesh: cannot read {args.file}: {exc}", file=sys.stderr)
            return 1
        except MessageRejected as exc:
            print(f"mesh: {args.file} is not a valid descriptor: {exc}", file=sys.stderr)
            return 1

    async def send(client: Any) -> int:
        if args.action == "publish":
            reply = await client.publish_descriptor(descriptor)
            done = "is active"
        elif args.action == "shadow" and descriptor is not None:
            reply = await client.shadow_descriptor(descriptor.pool_id, descriptor)
            done = "is evaluated in shadow (recorded with every decision, not enforced)"
        else:
            reply = await client.shadow_descriptor(args.file, None)
            done = "routes alone: no shadow"
        if isinstance(reply, Refusal):
            print(f"refused: {reply.reason} ({reply.detail})", file=sys.stderr)
            return 1
        print(f"{reply.pool_id}: descriptor epoch {reply.descriptor_epoch} {done}")
        return 0

    return _run(_with_client(args, send))


def cmd_admission(args: argparse.Namespace) -> int:
    async def revoke(client: Any) -> int:
        reply = await client.revoke_admission(args.admission_id, args.reason)
        if not reply.released:
            print(f"not revoked: {reply.reason} ({reply.detail})", file=sys.stderr)
            return 1
        print(f"{args.admission_id}: revoked; its attempt is cancelled and its result refused")
        return 0

    return _run(_with_client(args, revoke))


def cmd_broker(args: argparse.Namespace) -> int:
    from mesh.broker_admin import BrokerAdmin, BrokerAdminError

    vhost = urllib.parse.unquote(urllib.parse.urlsplit(first_url(args.amqp_url)).path[1:]) or "/"
    pools = list(dict.fromkeys(args.pool or []))
    try:
        admin = BrokerAdmin(args.management_url, vhost=vhost)
        if args.action == "remove-agent":
            if admin.remove_agent(args.agent_id):
                print(f"{args.agent_id}: broker user deleted; its connections are closed")
            else:
                print(f"{args.agent_id}: no such broker user")
            return 0
        if args.action == "add-agent" and len(pools) != 1:
            print("mesh: broker add-agent needs one --pool POOL", file=sys.stderr)
            return 2
        if not pools:
            print("mesh: broker add-pool-agents needs --pool POOL (one or more)", file=sys.stderr)
            return 2
        password, generated = os.environ.get(args.password_env or "", ""), False
        if args.password_env and not password:
            print(f"mesh: ${args.password_env} is empty or unset", file=sys.stderr)
            return 2
        if not password:
            password, generated = secrets.token_urlsafe(24), True
        if args.action == "add-agent":
            permissions = admin.add_agent(
                args.agent_id, password, namespace=args.namespace, pool_id=pools[0]
            )
            print(f"{args.agent_id}: broker user with its own permissions on vhost {vhost!r}")
        else:
            permissions = admin.add_pool_agents(
                args.agent_id, password, namespace=args.namespace, pool_ids=pools
            )
            print(
                f"{args.agent_id}: broker user shared by the agents of {', '.join(pools)} on "
                f"vhost {vhost!r} (they may speak for one another, never for the managers)"
            )
    except BrokerAdminError as exc:
        print(f"mesh: {exc}", file=sys.stderr)
        return 1
    print(f"  configure  {permissions.configure}")
    print(f"  write      {permissions.write}")
    print(f"  read       {permissions.read}")
    for topic in permissions.topics:
        print(f"  topic      {topic.exchange}: write {topic.write}")
    if generated:
        parts = urllib.parse.urlsplit(first_url(args.amqp_url))
        netloc = f"{urllib.parse.quote(args.agent_id)}:{password}@{parts.hostname}"
        netloc += f":{parts.port}" if parts.port else ""
        print(
            "  its AMQP URL (shown once; pass it as MESH_AMQP_URL with MESH_SHARED_TOPOLOGY=check"
            " and MESH_MANAGER_USER=<the managers' broker user>):"
        )
        print(f"  {urllib.parse.urlunsplit(parts._replace(netloc=netloc))}")
    return 0


def cmd_schemas(args: argparse.Namespace) -> int:
    from mesh.wire import schemas

    directory = Path(args.dir)
    if args.action == "export":
        written = schemas.export(directory)
        print(f"wrote {len(written)} schemas to {directory}/")
        return 0
    problems = schemas.drift(directory)
    if problems:
        for problem in problems:
            print(f"schema drift: {problem}", file=sys.stderr)
        print("run `mesh schemas export` and commit the result", file=sys.stderr)
        return 1
    print(f"{len(schemas.generate())} schemas in {directory}/ match the models")
    return 0
