"""py-cpuinfo's description of this CPU, kept from one session to the next in pytest's cache.

DeepSpeed's op builders ask py-cpuinfo for the CPU's architecture and flags (their compiler
flags), and each ask runs a Python subprocess that times the CPU: about a second of the
first test that loads an op, in every session. The answer is kept with a fingerprint of the
CPU it describes (the machine, py-cpuinfo's version, and the vendor, family, model and flags
lines of /proc/cpuinfo): a cache shared with another machine (a network home, a CI cache)
is asked again there. Read as JSON, never unpickled. Imports no torch.
"""

from __future__ import annotations

import hashlib
import json
import platform
from pathlib import Path
from typing import Any

import pytest

CACHE_KEY = "harness/deepspeed-cpuinfo"
_IDENTIFYING = ("vendor_id", "cpu family", "model", "model name", "stepping", "flags")


def fingerprint(cpuinfo: Any, proc_cpuinfo: Path = Path("/proc/cpuinfo")) -> str | None:
    """What identifies the CPU py-cpuinfo describes here; None where /proc/cpuinfo cannot be
    read (then nothing is kept)."""
    try:
        text = proc_cpuinfo.read_text(errors="replace")
    except OSError:
        return None
    lines = {
        " ".join(line.split())
        for line in text.splitlines()
        if line.partition(":")[0].strip() in _IDENTIFYING
    }
    version = str(getattr(cpuinfo, "CPUINFO_VERSION_STRING", ""))
    said = "\n".join([platform.machine(), version, *sorted(lines)])
    return hashlib.sha256(said.encode()).hexdigest()


def kept(config: pytest.Config, cpuinfo: Any) -> dict[str, Any] | None:
    """The answer an earlier session kept for this CPU, or None."""
    cache = getattr(config, "cache", None)
    found = cache.get(CACHE_KEY, None) if cache is not None else None
    if not isinstance(found, dict) or not isinstance(found.get("info"), dict):
        return None
    mine = fingerprint(cpuinfo)
    return found["info"] if mine is not None and found.get("cpu") == mine else None


def keep(config: pytest.Config, cpuinfo: Any, info: Any) -> None:
    """Keep `info` for the next sessions on this CPU (where it is plain JSON)."""
    cache = getattr(config, "cache", None)
    mine = fingerprint(cpuinfo)
    if cache is None or mine is None or not isinstance(info, dict):
        return
    try:
        json.dumps(info)
    except (TypeError, ValueError):
        return
    if cache.get(CACHE_KEY, None) != {"cpu": mine, "info": info}:
        cache.set(CACHE_KEY, {"cpu": mine, "info": info})
