"""Fixtures for the Kubernetes scaler: a fake API server and a real client pointed at it."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from kubernetes import client as k8s

from .fake_api import FakeKubernetesApi


@pytest.fixture
def fake_k8s() -> Iterator[FakeKubernetesApi]:
    """A running fake API server with no objects; add deployments and pods in the test."""
    api = FakeKubernetesApi().start()
    try:
        yield api
    finally:
        api.stop()


@pytest.fixture
def k8s_api_client(fake_k8s: FakeKubernetesApi) -> Iterator[k8s.ApiClient]:
    """The official client, configured for the fake server: plain HTTP, no credentials."""
    configuration = k8s.Configuration(host=fake_k8s.url)
    api_client = k8s.ApiClient(configuration)
    try:
        yield api_client
    finally:
        api_client.close()  # type: ignore[no-untyped-call]
