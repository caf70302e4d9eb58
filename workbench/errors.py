"""The one exception type the workbench raises for bad input.

Every message is a single line that names the cause and the fix, so that a notebook cell or the
CLI can show it without a stack trace. Raise it before expensive work starts.

    raise WorkbenchError("server.max_model_len is 256", "set it to at least 560 (prompt 512 + completion 48)")
"""
from __future__ import annotations


class WorkbenchError(Exception):
    """Bad input or a broken environment, described as 'cause; fix'."""

    def __init__(self, cause: str, fix: str | None = None):
        self.cause = cause
        self.fix = fix
        super().__init__(f"{cause}; fix: {fix}" if fix else cause)
