import pytest

from tests.e2e.fleet import Fleet, env_with


@pytest.fixture(scope="module")
def fleet(tmp_path_factory):
    """Two mock workers behind router and frontend, on a real nats-server, started by `infera up`."""
    f = Fleet(tmp_path_factory.mktemp("fleet"), workers=2,
              extra=["--engine-arg=--speedup 20"], env=env_with(INFERA_DISCOVERY_TTL="2")).start()
    yield f
    f.stop()


@pytest.fixture(scope="module")
def rr_fleet(tmp_path_factory):
    """The same fleet with --router-policy round-robin (the default is kv-aware)."""
    f = Fleet(tmp_path_factory.mktemp("rr-fleet"), workers=2,
              extra=["--engine-arg=--speedup 20", "--router-policy", "round-robin"],
              env=env_with(INFERA_DISCOVERY_TTL="2")).start()
    yield f
    f.stop()
