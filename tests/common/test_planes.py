"""The plane settings every service takes: etcd discovery described with its endpoint, lease bounds."""

from __future__ import annotations

import pytest

from infera_common.discovery_select import discovery_for
from infera_common.settings import PlaneSettings


def test_etcd_discovery_is_accepted_and_described_with_its_endpoint():
    settings = PlaneSettings(discovery_backend="etcd", etcd_endpoint="10.0.0.10:2379")
    discovery = discovery_for(settings)
    assert discovery.log_fields() == {"discovery_backend": "etcd", "etcd_endpoint": "10.0.0.10:2379"}
    assert discovery.describe() == "etcd at 10.0.0.10:2379 (keys /infera/workers/<worker_id>)"
    assert "is etcd running at 10.0.0.10:2379?" in discovery.start_failed(ConnectionError("refused"))
    assert discovery_for(PlaneSettings()).log_fields() == {"discovery_backend": "nats"}


def test_a_lease_longer_than_30_s_is_refused_with_etcd():
    with pytest.raises(ValueError, match="at most 30 s"):
        PlaneSettings(discovery_backend="etcd", discovery_ttl=45)
