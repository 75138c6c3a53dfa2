"""Small files of this user's own that the harness keeps from one session to the next (what
an adopted session's conftests set, py-cpuinfo's answer): written whole, in one rename, as
0600; read back only from a file this user owns that no one else may write (nor read, for
one that may hold a secret). Imports no torch."""

from __future__ import annotations

import contextlib
import os
import stat
import tempfile
from pathlib import Path


def write_own(path: Path, text: str, folder_mode: int = 0o777) -> bool:
    """Write `text` to `path` in one rename (readers never see half of it), the folders
    above made with `folder_mode` where missing; False where it could not be written."""
    try:
        path.parent.mkdir(mode=folder_mode, parents=True, exist_ok=True)
        fd, partial = tempfile.mkstemp(prefix=f".{path.name}-", dir=path.parent)  # 0600
        try:
            with os.fdopen(fd, "w") as f:
                f.write(text)
            os.replace(partial, path)
        except OSError:
            with contextlib.suppress(OSError):
                os.unlink(partial)
            raise
    except OSError:
        return False
    return True


def read_own(path: Path, others_may_read: bool) -> str | None:
    """What `path` holds, where this user owns it and no one else may write it (nor read it,
    unless `others_may_read`); None otherwise, or where it cannot be read."""
    closed = stat.S_IWGRP | stat.S_IWOTH if others_may_read else stat.S_IRWXG | stat.S_IRWXO
    try:
        info = path.stat()
        if info.st_uid != os.getuid() or info.st_mode & closed:
            return None
        return path.read_text()
    except OSError:
        return None
