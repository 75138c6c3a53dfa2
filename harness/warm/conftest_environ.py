"""What a session's conftests set in the environment, kept for the next session's fork
server, which starts before the conftests load (an adopted suite's: warm/session.py).

A library the server imports early may read a variable as it is imported; the server
starts in the environment the last session's conftests left, and is replaced where this
session's leave another (forkserver.give_early). The values may be secrets a conftest
sets (a token): they are kept in a file of this user's own (0600, below a 0700 folder in
the user's cache: $XDG_CACHE_HOME or ~/.cache, rankwise/), one per project, never in the
project's .pytest_cache; read as JSON only from a file no one else may read or write.
Nothing is kept or read under -p no:cacheprovider or --cache-clear. Imports no torch.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
from collections.abc import Mapping
from pathlib import Path

import pytest

from harness.common import own_files

# Never taken from the file for a server's start: what would have a process run other code
# than its own (a preloaded library, Python's start-up), and the harness's own variables.
NOT_PREDICTED = ("LD_", "DYLD_", "PYTHON", "HARNESS_")
_VARIABLE = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")


def kept_file(config: pytest.Config) -> Path | None:
    """This project's file, or None where the session keeps nothing between sessions."""
    if config.pluginmanager.is_blocked("cacheprovider"):
        return None
    if getattr(config.known_args_namespace, "cacheclear", False):
        return None
    home = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    project = hashlib.sha256(str(config.rootpath.resolve()).encode()).hexdigest()[:32]
    return Path(home) / "rankwise" / "conftest-environ" / f"{project}.json"


def predicted(config: pytest.Config) -> dict[str, str]:
    """This process's environment as its conftests will likely leave it: now, with what the
    last session's conftests changed."""
    environ = dict(os.environ)
    for name, value in _changes(kept_file(config)).items():
        if value is None:
            environ.pop(name, None)
        else:
            environ[name] = value
    return environ


def _changes(path: Path | None) -> dict[str, str | None]:
    if path is None:
        return {}
    text = own_files.read_own(path, others_may_read=False)
    try:
        found = json.loads(text) if text is not None else None
    except ValueError:
        return {}
    if not isinstance(found, dict):
        return {}
    return {
        name: value
        for name, value in found.items()
        if isinstance(name, str)
        and _VARIABLE.fullmatch(name)
        and not name.startswith(NOT_PREDICTED)
        and (value is None or (isinstance(value, str) and "\0" not in value))
    }


def record(config: pytest.Config, before: Mapping[str, str]) -> None:
    """Keep what this session's conftests changed (`before`: the environment before they
    loaded) for the next session, in one rename."""
    path = kept_file(config)
    if path is None:
        return
    now = dict(os.environ)
    changed = {k: now.get(k) for k in before.keys() | now.keys() if before.get(k) != now.get(k)}
    own_files.write_own(path, json.dumps(changed), folder_mode=0o700)
