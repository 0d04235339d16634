"""The commands that listen: a port option's range (the socket layer takes a port modulo 65536: `--port 99999`
listened on 34463), and the warning for a service open to the network without a token."""

from __future__ import annotations

import argparse

import pytest

from rpt.errors import RptError
from rpt.net import open_warning, port_from_env, port_option


@pytest.mark.parametrize("text, lowest, ok", [("8000", 1, True), ("65535", 1, True), ("0", 0, True), ("0", 1, False),
                                              ("65536", 0, False), ("99999", 1, False), ("-1", 0, False),
                                              ("http", 1, False)])
def test_a_port_option_takes_its_range_only(text, lowest, ok):
    parse = port_option(lowest)
    if ok:
        assert parse(text) == int(text)
    else:
        with pytest.raises(argparse.ArgumentTypeError):
            parse(text)


def test_master_port_outside_the_range_is_refused_with_the_fix(monkeypatch):
    monkeypatch.setenv("MASTER_PORT", "99999")
    with pytest.raises(RptError, match="MASTER_PORT=99999: 99999 is outside 1-65535"):
        port_from_env("MASTER_PORT", 29500)
    monkeypatch.setenv("MASTER_PORT", "29501")
    assert port_from_env("MASTER_PORT", 29500) == 29501
    monkeypatch.delenv("MASTER_PORT")
    assert port_from_env("MASTER_PORT", 29500) == 29500


@pytest.mark.parametrize("host, warned", [("127.0.0.1", False), ("localhost", False), ("::1", False),
                                          ("127.0.0.2", False), ("0.0.0.0", True), ("::", True),
                                          ("192.168.1.5", True), ("myhost.example", True)])
def test_a_host_beyond_this_machine_without_a_token_is_warned_of(host, warned):
    warning = open_warning(host, None, "the API")
    assert (warning is not None) == warned
    if warned:
        assert "--token" in warning and host in warning
    assert open_warning(host, "s3cret", "the API") is None


def test_the_monitor_warns_of_an_open_host_too(tmp_path, monkeypatch, capsys):
    from rpt.monitor import server

    (tmp_path / "config.toml").write_text("")
    ran = {}
    monkeypatch.setattr("uvicorn.run", lambda app, **kw: ran.update(kw))
    server.serve([str(tmp_path)], "0.0.0.0", 0, None)
    assert ran["host"] == "0.0.0.0" and "open to the network with no token" in capsys.readouterr().err
