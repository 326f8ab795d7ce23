"""Several broker addresses in one setting (mesh.transport.addresses): parsed, checked, and
each process's own order."""

from __future__ import annotations

import random

import pytest

from mesh.errors import LocalProtocolError
from mesh.transport.addresses import BrokerAddresses, first_url
from mesh.transport.amqp import url_user, with_heartbeat

NODES = ",".join(f"amqp://mesh:s3cret@rabbit-{n}:5672/prod" for n in range(3))


def test_one_url_is_one_address() -> None:
    assert BrokerAddresses.parse("amqp://guest:guest@127.0.0.1:5672/").urls == (
        "amqp://guest:guest@127.0.0.1:5672/",
    )


def test_several_are_shuffled_per_process_and_tried_in_turn() -> None:
    orders = {BrokerAddresses.parse(NODES, random.Random(seed)).urls for seed in range(20)}
    assert len(orders) > 1  # processes spread over the nodes
    assert all(sorted(order) == sorted(NODES.split(",")) for order in orders)
    addresses = BrokerAddresses.parse(NODES, random.Random(1))
    first, second, third = addresses.urls
    assert [addresses.after(first), addresses.after(second), addresses.after(third)] == [
        second,
        third,
        first,
    ]


def test_urls_of_one_setting_must_share_user_password_and_vhost() -> None:
    with pytest.raises(LocalProtocolError, match="share the user"):
        BrokerAddresses.parse("amqp://a:x@n1/prod,amqp://b:x@n2/prod")
    with pytest.raises(LocalProtocolError, match="share the user") as refused:
        BrokerAddresses.parse("amqp://a:x@n1/prod,amqp://a:x@n2/test")
    assert ":x@" not in str(refused.value)  # passwords stay out of the message
    with pytest.raises(LocalProtocolError, match="not an AMQP URL"):
        BrokerAddresses.parse("amqp://a:x@n1/prod,n2:5672")


def test_what_the_urls_share_is_read_from_the_first() -> None:
    assert first_url(NODES) == "amqp://mesh:s3cret@rabbit-0:5672/prod"
    assert url_user("amqp://mesh:s@n1:5672,amqp://mesh:s@n2:5672") == "mesh"


def test_the_heartbeat_is_asked_of_every_address() -> None:
    assert with_heartbeat("amqp://u:p@a/v,amqp://u:p@b/v?heartbeat=9", 5) == (
        "amqp://u:p@a/v?heartbeat=5,amqp://u:p@b/v?heartbeat=9"
    )
