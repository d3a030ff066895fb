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


@pytest.mark.parametrize("ttl", [45, 1, 2.5])
def test_an_etcd_lease_ttl_etcd_would_not_grant_as_given_is_refused(ttl):
    # etcd leases are whole seconds, and shorter than 2 s etcd raises them: refused, not rounded
    with pytest.raises(ValueError, match="whole seconds, 2 to 30"):
        PlaneSettings(discovery_backend="etcd", discovery_ttl=ttl)
    assert PlaneSettings(discovery_backend="nats", discovery_ttl=ttl).discovery_ttl == ttl
