"""A rank's sys.stdin: reading it raises, saying why, as a plain test's read does under
pytest's capture (an empty line, which a rank's /dev/null gives, would pass for input).
Runs inside ranks."""

from __future__ import annotations

import io
import sys
from typing import Any, NoReturn


class NoTerminal(io.TextIOBase):
    """Stands for stdin in rank `rank`: several ranks cannot share one terminal."""

    def __init__(self, rank_of: Any) -> None:
        super().__init__()
        self._rank_of = rank_of  # the rank running now (a warm process serves any rank)

    def _refuse(self) -> NoReturn:
        raise OSError(
            f"rank {self._rank_of()}: reading from stdin in a rank: ranks have no terminal to "
            f"read from (nor to debug on: breakpoint() and pdb read it too); print what you "
            f"need instead (live with -s, per rank in the report with -rA), or pass input "
            f"through a file or a fixture"
        )

    def read(self, size: int | None = -1) -> str:
        self._refuse()

    def readline(self, size: int | None = -1) -> str:  # type: ignore[override]
        self._refuse()

    def readlines(self, hint: int | None = -1) -> list[str]:  # type: ignore[override]
        self._refuse()

    def __next__(self) -> str:  # type: ignore[override]
        self._refuse()

    def readable(self) -> bool:
        return False  # as pytest's own stand-in says

    def close(self) -> None:
        pass  # it stays for the next test on this rank, as pytest's stays for the session

    @property
    def closed(self) -> bool:
        return False

    @property
    def buffer(self) -> NoTerminal:
        return self  # its binary reads refuse alike

    @property
    def name(self) -> str:
        return "<stdin>"

    @property
    def mode(self) -> str:
        return "r"

    def isatty(self) -> bool:
        return False

    def fileno(self) -> int:
        raise io.UnsupportedOperation("a rank's stdin has no file descriptor to read")

    @property
    def encoding(self) -> str:  # type: ignore[override]
        return "utf-8"


def replace_stdin(rank_of: Any) -> None:
    """Make this rank process's sys.stdin refuse reads; `rank_of()` gives the rank now. So
    does ``breakpoint()``, at once: the debugger would read stdin all the same, after
    readline had set LINES and COLUMNS in the rank's environment (a change the test never
    made, which the hygiene check would blame on it)."""
    terminal = NoTerminal(rank_of)
    sys.stdin = terminal

    def no_debugger(*args: Any, **kwargs: Any) -> None:
        terminal.read()

    sys.breakpointhook = no_debugger
