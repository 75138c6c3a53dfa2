"""torch's JIT-build lock, waited on with a bound before the pytest process builds or loads a
DeepSpeed op.

torch's ``cpp_extension.load`` takes ``<build folder>/lock`` (created exclusively) to run its
ninja check or build, and waits with no bound while the file exists. A process killed while it
held the lock (a session cancelled mid-build) leaves the file, and every later load, in every
session, would wait on it for ever.
"""

from __future__ import annotations

import os
import time
from pathlib import Path

from harness.common.errors import SpecError

# The lock held this long while no process works in its folder (ninja and the compiler run
# there) is left over: a safety net, far above the moment torch's load holds it between steps.
STALE_S = 120.0
CHECK_S = 0.2


def build_folder(name: str) -> Path:
    """Where torch builds (and finds) the op `name` (TORCH_EXTENSIONS_DIR, or its default)."""
    from torch.utils import cpp_extension

    return Path(cpp_extension._get_build_directory(name, verbose=False))


_left_over: dict[Path, int] = {}  # locks found left over (by inode): the next test fails at once


def wait_for_build_lock(name: str) -> None:
    """Return once no build of `name` holds torch's lock; raise if the lock is left over."""
    folder = build_folder(name)
    lock = folder / "lock"
    quiet_since = time.monotonic()
    while (inode := _inode(lock)) is not None:
        if _left_over.get(lock) == inode:
            raise _stale(name, folder, lock)
        if _worked_in(folder):
            quiet_since = time.monotonic()
        elif time.monotonic() - quiet_since >= STALE_S:
            _left_over[lock] = inode
            raise _stale(name, folder, lock)
        time.sleep(CHECK_S)


def _inode(path: Path) -> int | None:
    try:
        return path.stat().st_ino
    except OSError:
        return None


def _stale(name: str, folder: Path, lock: Path) -> SpecError:
    return SpecError(
        f"torch's build lock {lock} is held and no process has worked in {folder} for "
        f"{STALE_S:.0f} s: a build or load killed midway leaves it, and torch waits on it for "
        f"ever. If no build of {name} runs, remove it (rm {lock}) and run again"
    )


def _worked_in(folder: Path) -> bool:
    """Whether a process of this user runs in `folder` (torch runs ninja there)."""
    where = str(folder.resolve())
    for entry in os.listdir("/proc") if os.path.isdir("/proc") else ():
        if entry.isdigit():
            try:
                cwd = os.readlink(f"/proc/{entry}/cwd")
            except OSError:
                continue
            if cwd == where or cwd.startswith(where + os.sep):
                return True
    return False
