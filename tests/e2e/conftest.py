import pytest

from tests.e2e.fleet import PLANES, Fleet, env_with


@pytest.fixture(scope="module", params=list(PLANES))
def fleet(tmp_path_factory, request):
    """Two mock workers behind router and frontend, started by `infera up`: on a real nats-server, and
    on the no-broker plane (etcd, infera.server calling the engines over HTTP, KV events from ZMQ)."""
    f = Fleet(tmp_path_factory.mktemp("fleet"), workers=2, plane=request.param,
              extra=["--engine-arg=--speedup 20"], env=env_with(INFERA_DISCOVERY_TTL="2")).start()
    yield f
    f.stop()


@pytest.fixture(scope="module", params=list(PLANES))
def rr_fleet(tmp_path_factory, request):
    """The same fleet with --router-policy round-robin (the default is kv-aware) and session affinity on."""
    f = Fleet(tmp_path_factory.mktemp("rr-fleet"), workers=2, plane=request.param,
              extra=["--engine-arg=--speedup 20", "--router-policy", "round-robin"],
              env=env_with(INFERA_DISCOVERY_TTL="2", INFERA_SESSION_AFFINITY="both")).start()
    yield f
    f.stop()


@pytest.fixture(scope="module", params=list(PLANES))
def ll_fleet(tmp_path_factory, request):
    """The same fleet with --router-policy least-loaded, its engines at speedup 2: a 4,000-token
    answer then runs for ~11 s, however late a loaded machine gets to look at it."""
    f = Fleet(tmp_path_factory.mktemp("ll-fleet"), workers=2, plane=request.param,
              extra=["--engine-arg=--speedup 2", "--router-policy", "least-loaded"],
              env=env_with(INFERA_DISCOVERY_TTL="2")).start()
    yield f
    f.stop()


@pytest.fixture(scope="module", params=list(PLANES))
def slow_fleet(tmp_path_factory, request):
    """Two mock workers at speedup 2 behind a frontend whose --upstream-timeout is 3 s: a 2,500-token
    answer takes ~7 s there."""
    f = Fleet(tmp_path_factory.mktemp("slow-fleet"), workers=2, plane=request.param,
              extra=["--engine-arg=--speedup 2"],
              env=env_with(INFERA_DISCOVERY_TTL="2", INFERA_UPSTREAM_TIMEOUT="3")).start()
    yield f
    f.stop()
