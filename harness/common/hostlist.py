"""SLURM's compact lists, expanded: host lists (``n[1-3,7],gpu-a[01-02]``) and tasks per node
(``2(x3),1``), as ``scontrol show hostnames`` and SLURM's documentation read them.

Imports nothing outside the standard library; no process is started.
"""

from __future__ import annotations

import re


class HostListError(ValueError):
    """A list that is not in SLURM's compact form."""


def expand_hosts(text: str) -> list[str]:
    """``n[1-3,7],m2`` -> ``["n1", "n2", "n3", "n7", "m2"]``; zero-padded ranges keep width."""
    hosts: list[str] = []
    for part in _top_level_parts(text):
        hosts += _expand_one(part)
    return hosts


def _top_level_parts(text: str) -> list[str]:
    """Split at the commas outside brackets."""
    parts, depth, start = [], 0, 0
    for i, char in enumerate(text):
        if char == "[":
            depth += 1
        elif char == "]":
            depth -= 1
            if depth < 0:
                raise HostListError(f"unbalanced ']' in host list {text!r}")
        elif char == "," and depth == 0:
            parts.append(text[start:i])
            start = i + 1
    if depth:
        raise HostListError(f"unbalanced '[' in host list {text!r}")
    parts.append(text[start:])
    return [p.strip() for p in parts if p.strip()]


def _expand_one(part: str) -> list[str]:
    match = re.fullmatch(r"([^\[\]]*)\[([^\[\]]+)\](.*)", part)
    if match is None:
        if "[" in part or "]" in part:
            raise HostListError(f"cannot read host list part {part!r}")
        return [part]
    prefix, ranges, rest = match.groups()
    tails = _expand_one(rest) if rest else [""]
    return [f"{prefix}{number}{tail}" for number in _numbers(ranges, part) for tail in tails]


def _numbers(ranges: str, part: str) -> list[str]:
    numbers: list[str] = []
    for item in ranges.split(","):
        low, _, high = item.strip().partition("-")
        if not low.isdigit() or (high and not high.isdigit()):
            raise HostListError(f"cannot read the range {item!r} in host list part {part!r}")
        if not high:
            numbers.append(low)
            continue
        width = len(low) if low.startswith("0") else 0
        if int(high) < int(low):
            raise HostListError(f"the range {item!r} in {part!r} runs backwards")
        numbers += [str(n).zfill(width) for n in range(int(low), int(high) + 1)]
    return numbers


def expand_tasks_per_node(text: str) -> list[int]:
    """``2(x3),1`` -> ``[2, 2, 2, 1]``: how many tasks each node of the step runs."""
    counts: list[int] = []
    for item in text.split(","):
        match = re.fullmatch(r"\s*(\d+)(?:\(x(\d+)\))?\s*", item)
        if match is None:
            raise HostListError(f"cannot read tasks per node {text!r}")
        counts += [int(match[1])] * int(match[2] or 1)
    return counts
