"""`rpt serve`'s options (rpt/serve/config.py): the command line is made from the config's fields, a bad value is
refused naming its flag and a fix, and the token falls back to RPT_SERVE_TOKEN."""

import argparse
import dataclasses

import pytest

from rpt.errors import RptError
from rpt.serve.config import ServeConfig


def parsed(*argv: str) -> ServeConfig:
    parser = argparse.ArgumentParser()
    ServeConfig.add_arguments(parser)
    return ServeConfig.from_args(parser.parse_args(list(argv)))


def test_every_field_is_an_option_with_its_default(monkeypatch):
    monkeypatch.delenv("RPT_SERVE_TOKEN", raising=False)
    assert parsed() == ServeConfig()
    given = parsed("--max-streams", "3", "--grace", "2.5", "--port", "0", "--prefill-tokens", "100")
    assert (given.max_streams, given.grace, given.port, given.prefill_tokens) == (3, 2.5, 0, 100)
    assert {f.name for f in dataclasses.fields(ServeConfig)} >= {"host", "max_queue", "token", "device", "checkpoint"}


def test_the_token_falls_back_to_the_environment(monkeypatch):
    monkeypatch.setenv("RPT_SERVE_TOKEN", "from-env")
    assert parsed().token == "from-env" and parsed("--token", "given").token == "given"


@pytest.mark.parametrize("change, flag", [({"max_streams": 0}, "--max-streams"), ({"prefill_chunk": -1}, "--prefill-chunk"),
                                          ({"max_queue": -1}, "--max-queue"), ({"grace": -0.5}, "--grace")])
def test_a_bad_value_is_refused_naming_its_flag_and_a_fix(change, flag):
    with pytest.raises(RptError) as refused:
        ServeConfig(**change)
    assert flag in refused.value.message and refused.value.fix


def test_a_port_outside_its_range_is_the_parser_s_error():
    with pytest.raises(SystemExit):
        parsed("--port", "70000")
