"""The one exception type for errors a user can cause.

Config, data, checkpoint and launch problems raise `RptError` with the fix in it; the CLI
prints it as one clear message without a traceback (`--debug` shows the traceback).
Programming errors stay ordinary exceptions so that they are never mistaken for user errors.
"""

import difflib


class RptError(Exception):
    def __init__(self, message: str, fix: str | None = None):
        super().__init__(message)
        self.message = message
        self.fix = fix

    def __str__(self) -> str:
        return self.message if not self.fix else f"{self.message}\n  fix: {self.fix}"


def did_you_mean(name: str, valid: list[str]) -> str:
    """"did you mean 'x'? " for the valid name closest to a mistyped one, or nothing."""
    close = difflib.get_close_matches(name, valid, n=1, cutoff=0.5)
    return f"did you mean '{close[0]}'? " if close else ""
