"""`rpt serve`'s options in one place: each field's default and help (the command line is made from them:
`add_arguments`), and their checks, each refusal naming the fix (torchtitan keeps a component's config beside it)."""

from __future__ import annotations

import argparse
import dataclasses
import os
from dataclasses import dataclass, field

from rpt.errors import RptError
from rpt.net import port_option


def option(default, help: str, **argparse_kw):
    return field(default=default, metadata={"help": help, **argparse_kw})


@dataclass(frozen=True)
class ServeConfig:
    checkpoint: str = option("best", "which checkpoint: best, latest, a step or a checkpoint folder")
    host: str = option("127.0.0.1", "address to listen on (default loopback only)")
    port: int = option(8000, "1-65535, or 0 for any free port (the one taken is printed)", type=port_option(0))
    max_streams: int = option(64, "streams generated at once (each holds one state)")
    max_queue: int = option(64, "streams that may wait for a slot; beyond, 429")
    max_prompt_bytes: int = option(1 << 20, "the largest request body (413 beyond)")
    token: str | None = option(None, "require `Authorization: Bearer TOKEN` on every route but /health (default: "
                                     "the RPT_SERVE_TOKEN environment variable, if set)")
    grace: float = option(30.0, "seconds running streams get to finish on SIGTERM")
    prefill_chunk: int = option(256, "tokens of each waiting prompt run per engine step: a long prompt runs in "
                                     "pieces")
    prefill_tokens: int = option(8192, "prompt tokens run per engine step in all (the waiting prompts batched): "
                                       "what a step of the running streams may wait for a new prompt")
    device: str = option("auto", "auto, cpu or cuda", choices=["auto", "cpu", "cuda"])

    def __post_init__(self):
        for name in ("max_streams", "max_prompt_bytes", "prefill_chunk", "prefill_tokens"):
            value = getattr(self, name)
            if value < 1:
                flag = "--" + name.replace("_", "-")
                raise RptError(f"{flag} {value} must be 1 or more", f"e.g. {flag} {self.default(name)}")
        if self.max_queue < 0 or self.grace < 0:
            raise RptError("--max-queue and --grace must be 0 or more", "e.g. --max-queue 64 --grace 30")

    @classmethod
    def default(cls, name: str):
        return {f.name: f.default for f in dataclasses.fields(cls)}[name]

    @classmethod
    def add_arguments(cls, parser: argparse.ArgumentParser, helps: dict[str, str] | None = None) -> None:
        """Each field as --its-name, with its type, default and help (`helps`: the command line's own words for
        some)."""
        for f in dataclasses.fields(cls):
            spec = {"type": {"int": int, "float": float}.get(str(f.type), str), **f.metadata}
            spec["help"] = (helps or {}).get(f.name, spec["help"])
            parser.add_argument("--" + f.name.replace("_", "-"), default=f.default, **spec)

    @classmethod
    def from_args(cls, args: argparse.Namespace) -> "ServeConfig":
        values = {f.name: getattr(args, f.name) for f in dataclasses.fields(cls)}
        values["token"] = values["token"] or os.environ.get("RPT_SERVE_TOKEN") or None
        return cls(**values)
