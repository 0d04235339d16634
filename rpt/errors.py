"""The one exception type for errors a user can cause.

Config, data, checkpoint and launch problems raise `RptError` with the fix in it; the CLI
prints it as one clear message without a traceback (`--debug` shows the traceback).
Programming errors stay ordinary exceptions so that they are never mistaken for user errors.
"""


class RptError(Exception):
    def __init__(self, message: str, fix: str | None = None):
        super().__init__(message)
        self.message = message
        self.fix = fix

    def __str__(self) -> str:
        return self.message if not self.fix else f"{self.message}\n  fix: {self.fix}"
