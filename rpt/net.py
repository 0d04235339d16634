"""What the commands that listen share: a port option's range, and the warning for a service open to the network
without a token."""

from __future__ import annotations

import argparse
import ipaddress
import os

from rpt.errors import RptError


def port_number(text: str, lowest: int = 1) -> int:
    """A port as given on a command line or in the environment, refused outside `lowest`-65535 (the socket layer
    would otherwise take it modulo 65536: 99999 listened on 34463)."""
    try:
        value = int(text)
    except ValueError:
        raise ValueError(f"{text!r} is not a port number") from None
    if not lowest <= value <= 65535:
        raise ValueError(f"{value} is outside {lowest}-65535" + (" (0: any free port)" if lowest == 0 else ""))
    return value


def port_option(lowest: int = 1):
    """argparse's `type=` for a --port option: the parser's own usage and message on a bad value."""
    def parse(text: str) -> int:
        try:
            return port_number(text, lowest)
        except ValueError as exc:
            raise argparse.ArgumentTypeError(str(exc)) from None
    return parse


def port_from_env(name: str, default: int) -> int:
    """A port an environment variable names (MASTER_PORT), refused with the fix when it is not one."""
    text = os.environ.get(name)
    if text is None:
        return default
    try:
        return port_number(text)
    except ValueError as exc:
        raise RptError(f"{name}={text}: {exc}", f"set {name} to a free port from 1 to 65535, e.g. {default}") from None


def is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:  # a host name: whatever it resolves to may be reachable
        return False


def open_warning(host: str, token: str | None, what: str, token_flag: str = "--token") -> str | None:
    """The warning a command prints when it listens beyond this machine with no token, or None."""
    if token or is_loopback(host):
        return None
    return (f"warning: {what} on {host} is open to the network with no token: anyone who reaches this machine can "
            f"use it; give {token_flag} SECRET, or --host 127.0.0.1 for this machine only")
