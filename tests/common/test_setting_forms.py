"""Settings whose wrong form would only show later, as a timeout or a log line, are refused at once
(exit 2 naming the flag): a NATS URL of another scheme, an OTLP endpoint without one, an etcd lease
etcd would not grant as given, a file where a directory is wanted."""

from __future__ import annotations

import asyncio

import pytest

from infera.procs import free_port
from infera_common.nats_conn import connect
from infera_common.settings import LogSettings, PlaneSettings, directory_to_write, parse_cli


def refusal(cls, argv: list[str], capsys) -> str:
    with pytest.raises(SystemExit) as exit_:
        parse_cli(cls, argv, prog="svc")
    assert exit_.value.code == 2
    return capsys.readouterr().err.splitlines()[-1]


@pytest.mark.parametrize("url", ["http://127.0.0.1:4222", "https://nats.example:443", "127.0.0.1:4222,,"])
def test_a_url_the_nats_client_would_not_dial_is_refused(url, capsys):
    err = refusal(PlaneSettings, ["--nats-url", url], capsys)
    assert "--nats-url (env INFERA_NATS_URL)" in err and "is not a NATS server URL: use nats://HOST:PORT" in err


@pytest.mark.parametrize("url", ["nats://10.0.0.1:4222", "127.0.0.1:4222", "tls://a:1,nats://b:2", "ws://a:80"])
def test_nats_urls_the_client_dials_are_accepted(url):
    assert PlaneSettings(nats_url=url).nats_url == url


def test_an_otlp_endpoint_without_its_scheme_is_refused(capsys):
    err = refusal(LogSettings, ["--otlp-traces-endpoint", "collector:4318"], capsys)
    assert "--otlp-traces-endpoint" in err and "starts with http:// or https://" in err
    assert LogSettings(otlp_traces_endpoint="https://c:4318/v1/traces").otlp_traces_endpoint


def test_a_file_where_a_directory_is_wanted_is_named(tmp_path):
    (tmp_path / "afile").write_text("x")
    for given in (tmp_path / "afile", tmp_path / "afile" / "below"):
        with pytest.raises(ValueError, match=f"{tmp_path / 'afile'} is a file"):
            directory_to_write(str(given))
    assert directory_to_write(str(tmp_path / "new" / "dir")) == str(tmp_path / "new" / "dir")


def test_a_service_whose_planes_need_no_nats_says_why_it_dials_it():
    url = f"nats://127.0.0.1:{free_port()}"  # nothing listens
    with pytest.raises(ConnectionError) as planes:
        asyncio.run(connect(url, "t", connect_timeout=0.3, planes_need_it=False))
    assert "run them as one process: python -m infera.server" in str(planes.value)
    with pytest.raises(ConnectionError) as plain:
        asyncio.run(connect(url, "t", connect_timeout=0.3))
    assert "infera.server" not in str(plain.value)
