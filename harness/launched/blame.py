"""Which rank a verdict's first line blames: the rank torchrun's summary should name."""

from __future__ import annotations

import re

# The first line of a failure report that blames one rank: "rank 1 failed: ...", "rank 2's
# teardown failed ...", "rank 3 returned while ranks 0, 1 waited ...".
_BLAMED = re.compile(r"^rank (\d+)\b")
# ... or a lost node, with its ranks: "node 0 (host n1) was lost: ... (ranks 0, 1); ...".
_LOST = re.compile(r"^\S.* was lost: .*\(ranks? (\d+)[,)]")


def blamed_rank(first_line: str) -> int | None:
    """The rank `first_line` (a report's headline) names as the root cause, if any."""
    found = _BLAMED.match(first_line) or _LOST.search(first_line)
    return int(found.group(1)) if found else None


def headline(text: str) -> str:
    """A report's first line that says something."""
    return next((line for line in text.splitlines() if line.strip()), text)
