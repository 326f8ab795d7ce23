"""The heartbeat-lag histogram counts a batch at a time with its own collector; what a scrape
reads must be what prometheus-client's own Histogram would have exposed for the same values."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Histogram, generate_latest

from mesh.manager.metrics import BatchHistogram

BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10)
# on a bound (le is inclusive), between bounds, past the last, zero, and in several batches
VALUES = [0.0, 0.005, 0.0050001, 0.3, 1.0, 1.5, 10.0, 11.0, 250.0, 0.01]


def exposition(registry: CollectorRegistry) -> list[str]:
    """The sample lines, less ``_created`` (the library stamps its own creation time)."""
    lines = generate_latest(registry).decode().splitlines()
    return [line for line in lines if line and "_created" not in line]


def test_a_batch_histogram_exposes_what_prometheus_clients_histogram_would() -> None:
    theirs, ours = CollectorRegistry(), CollectorRegistry()
    reference = Histogram("lag_seconds", "Lag.", buckets=BUCKETS, registry=theirs)
    histogram = BatchHistogram("lag_seconds", "Lag.", buckets=BUCKETS, registry=ours)
    for value in VALUES:
        reference.observe(value)
    histogram.observe_many(VALUES[:4])
    histogram.observe_many([])
    histogram.observe_many(VALUES[4:-1])
    histogram.observe(VALUES[-1])

    assert exposition(ours) == exposition(theirs)
    assert 'lag_seconds_bucket{le="0.005"} 2.0' in exposition(ours)  # 0 and 0.005 itself
    assert "lag_seconds_count 10.0" in exposition(ours)
