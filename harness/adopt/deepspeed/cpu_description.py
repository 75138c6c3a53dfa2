"""py-cpuinfo's description of this CPU, kept from one session to the next beside the ops it
decides: in torch's extensions folder (TORCH_EXTENSIONS_DIR, else torch's default).

DeepSpeed's op builders ask py-cpuinfo for the CPU's architecture and flags (their compiler
flags), and each ask runs a Python subprocess that times the CPU: about a second of the
first test that loads an op, in every session, a new clone's and a new venv's too. The
answer is kept with a fingerprint of the CPU it describes (the machine, py-cpuinfo's
version, and the vendor, family, model and flags lines of /proc/cpuinfo): a folder shared
with another machine (a network home) is asked again there. Read as JSON, never unpickled,
and only from a file this user owns that no one else may write. Imports no torch until used.
"""

from __future__ import annotations

import hashlib
import json
import os
import platform
from pathlib import Path
from typing import Any

from harness.common import own_files

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


KEPT_NAME = "harness-cpuinfo.json"


def kept_file() -> Path:
    """Where the answer is kept: torch's extensions folder, where the builds it decides are."""
    given = os.environ.get("TORCH_EXTENSIONS_DIR")
    if given:
        return Path(given) / KEPT_NAME
    from torch.utils import cpp_extension

    return Path(cpp_extension.get_default_build_root()) / KEPT_NAME


def kept(cpuinfo: Any, path: Path | None = None) -> dict[str, Any] | None:
    """The answer an earlier session kept for this CPU, or None (none kept, another CPU's,
    or a file another user could have written)."""
    text = own_files.read_own(path or kept_file(), others_may_read=True)
    try:
        found = json.loads(text) if text is not None else None
    except ValueError:
        return None
    if not isinstance(found, dict) or not isinstance(found.get("info"), dict):
        return None
    mine = fingerprint(cpuinfo)
    return found["info"] if mine is not None and found.get("cpu") == mine else None


def keep(cpuinfo: Any, info: Any, path: Path | None = None) -> None:
    """Keep `info` for the next sessions on this CPU (where it is plain JSON), in one rename."""
    mine = fingerprint(cpuinfo)
    if mine is None or not isinstance(info, dict):
        return
    try:
        text = json.dumps({"cpu": mine, "info": info})
    except (TypeError, ValueError):
        return
    own_files.write_own(path or kept_file(), text)
