"""Imported only in the fork server that starts the ranks (last in its preload list).

Imports the modules the pytest process chose (harness/preload.py) once, so that every rank
forked from the server starts with them loaded. The pytest process names a directory of its
private work directory in PRELOAD_DIR while it starts the server; in it:

- ``started``: made when the server, its own imports done, begins with these;
- ``early``: for a server started before the tests were collected, the names the last
  session preloaded, imported while pytest collects; then the server waits for ``modules``.
  A server started before the session's conftests load (an adopted suite's) waits for it:
  the pytest process writes it as collection starts, once its environment is known;
- ``modules``: the names to import, one per line (written by the pytest process, in one
  rename, once the tests are collected);
- ``early.path``, ``modules.path``: the pytest process's sys.path as each list was written,
  one entry per line (multiprocessing's server before Python 3.12 does not take it);
- ``early.env``, ``modules.env``: the pytest process's environment as each list was written
  (JSON), used while importing it;
- ``modules.files``: the files the pytest process imported the list's top-level packages
  from (JSON): a server that imported one early from another file, or under another
  environment, imports no more and says ``stale WHY`` (the pytest process replaces it);
- ``at``: the module being imported now, for a report if the import never ends;
- ``output``: what the imports printed (the server's stdout and stderr are pytest's own);
- ``done``: written last, in one rename: ``imported N``, ``seconds S``, ``threads T`` (more
  than the server ran before), ``cuda NAME`` if importing NAME initialised CUDA (the
  server is then no use to ranks that need it; the rest is not imported), then
  ``at started|early-handed|early-done|modules-handed|modules-done T`` (time.time()),
  ``took NAME S`` for the slowest imports, ``failed NAME: ERROR`` lines.

A module that fails here is left to the ranks, which import it as they would have. What the
imports changed in torch's process-wide settings is put back (rank/state.py), and no
variable of the harness's stays in the server's environment: the ranks inherit both.
"""

from __future__ import annotations

import contextlib
import importlib
import json
import os
import sys
import time
from collections.abc import Iterator
from pathlib import Path

from harness.common import reaper
from harness.common.protocol import SERVER_DIR, SERVER_PARENT

PRELOAD_DIR = SERVER_DIR
PRELOAD_PARENT = SERVER_PARENT


def _threads() -> int:
    try:
        return len(os.listdir("/proc/self/task"))
    except OSError:
        return 0


@contextlib.contextmanager
def _output_to(path: Path) -> Iterator[None]:
    """Send what the imports print, from Python or native code, to `path`."""
    sys.stdout.flush()
    sys.stderr.flush()
    saved = os.dup(1), os.dup(2)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
    try:
        os.dup2(fd, 1)
        os.dup2(fd, 2)
        yield
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        os.dup2(saved[0], 1)
        os.dup2(saved[1], 2)
        for each in (fd, *saved):
            os.close(each)


@contextlib.contextmanager
def _path_from(path: Path) -> Iterator[None]:
    saved = sys.path[:]
    if path.exists():
        sys.path[:] = path.read_text().splitlines()
    try:
        yield
    finally:
        sys.path[:] = saved  # a rank takes its test's sys.path with each task


SLOWEST_SHOWN = 10  # the modules whose imports took longest, in ``done``


def preload(directory: Path) -> None:
    (directory / "started").touch()
    at = directory / "at"
    threads_before, started = _threads(), time.monotonic()
    imported, failed, cuda, stale = 0, [], "", ""
    timeline = [f"at started {time.time():.3f}"]  # wall-clock stamps the pytest side places
    took: dict[str, float] = {}  # seconds per module imported here
    from harness.rank import state  # imported with the worker, before this

    early_environ: dict[str, str] = {}
    with _output_to(directory / "output"), state.torch_globals_kept():
        for phase in ("early", "modules"):  # last session's list while pytest collects
            if not _handed_over(directory / phase):  # early: written at once, or at collection
                break
            timeline.append(f"at {phase}-handed {time.time():.3f}")
            if phase == "modules" and (stale := _stale(directory, early_environ)):
                break
            with _path_from(directory / f"{phase}.path"), _environ_from(directory, phase):
                for name in _names(directory / phase):
                    if name in sys.modules:
                        imported += 1
                        continue  # imported with its parent, a sibling, or earlier
                    at.write_text(name)
                    began = time.monotonic()
                    try:
                        importlib.import_module(name)
                        imported += 1
                    except (Exception, SystemExit) as exc:
                        error = " ".join(f"{type(exc).__name__}: {exc}".split())[:300]
                        failed.append(f"failed {name}: {error}")
                    took[name] = time.monotonic() - began
                    if _cuda_initialized():
                        cuda = name  # forks of this server could not use CUDA: stop here
                        break
                if phase == "early":
                    early_environ = dict(os.environ)  # as the early imports left it
            timeline.append(f"at {phase}-done {time.time():.3f}")
            if cuda:
                break
    slowest = sorted(took.items(), key=lambda item: -item[1])[:SLOWEST_SHOWN]
    lines = [
        f"imported {imported}",
        f"seconds {time.monotonic() - started:.3f}",
        f"threads {max(0, _threads() - threads_before)}",
        *([f"cuda {cuda}"] if cuda else []),
        *([f"stale {stale}"] if stale else []),
        *timeline,
        *(f"took {name} {seconds:.3f}" for name, seconds in slowest),
        *failed,
    ]
    written = directory / "done.partial"
    written.write_text("\n".join(lines) + "\n")
    written.rename(directory / "done")


def _stale(directory: Path, early_environ: dict[str, str]) -> str:
    """Why what this server imported before the tests were collected is not what the ranks
    need, or "": a variable the collection set or changed that its early imports did not set
    the same way (a conftest's, read at import by a library imported early), or a package
    imported from another file than the pytest process's (a checkout a later conftest put
    first on sys.path)."""
    try:
        handed = json.loads((directory / "modules.env").read_text())
        files = json.loads((directory / "modules.files").read_text())
    except (OSError, ValueError):
        return ""  # not started early: nothing was imported before the tests were collected
    if not isinstance(handed, dict) or not isinstance(files, dict):
        return ""
    keys = (set(handed) | set(early_environ)) - {_NO_CUDA_INIT}  # set here for every import
    changed = sorted(k for k in keys if handed.get(k) != early_environ.get(k))
    if changed:
        return f"set while pytest collected: {', '.join(changed[:5])}"
    for name, file in files.items():
        here = getattr(sys.modules.get(name), "__file__", None)
        if isinstance(here, str) and os.path.realpath(here) != file:
            return f"{name} imported from {here}, the tests' from {file}"
    return ""


# Set while importing, so that torch asks NVML whether CUDA is there without initialising it.
_NO_CUDA_INIT = "PYTORCH_NVML_BASED_CUDA_CHECK"


def _cuda_initialized() -> bool:
    torch = sys.modules.get("torch")
    return bool(torch is not None and torch.cuda.is_initialized())


@contextlib.contextmanager
def _environ_from(directory: Path, phase: str) -> Iterator[None]:
    """The pytest process's environment as it handed the list over (a conftest may set
    variables a library reads at import), with torch asked not to initialise CUDA to see
    whether it is there; this server's own environment after."""
    saved = dict(os.environ)
    try:
        handed = json.loads((directory / f"{phase}.env").read_text())
    except (OSError, ValueError):
        handed = None
    if isinstance(handed, dict):
        os.environ.clear()
        os.environ.update({str(k): str(v) for k, v in handed.items()})
    os.environ[_NO_CUDA_INIT] = "1"
    try:
        yield
    finally:
        os.environ.clear()
        os.environ.update(saved)


def _names(path: Path) -> list[str]:
    try:
        return path.read_text().split()
    except FileNotFoundError:
        return []


# How long a server started before collection waits for the session's list: a safety net
# (the pytest process hands it over when its tests are collected, or ends, and so does this).
HAND_OVER_WAIT_S = 3600.0


def _handed_over(path: Path) -> bool:
    """Wait until the pytest process writes `path` (one rename); False if it ended first."""
    deadline = time.monotonic() + HAND_OVER_WAIT_S
    while not path.exists():
        if os.getppid() != _STARTED_BY or time.monotonic() > deadline:
            return False
        time.sleep(0.01)
    return True


_directory = os.environ.pop(PRELOAD_DIR, None)
# The pytest process that started the server, as it said (it may be gone by now: killed
# while the server still imported torch, before this could ask to end with it).
_STARTED_BY = int(os.environ.pop(PRELOAD_PARENT, "0") or 0) or os.getppid()
if _directory:
    # While it preloads, the server ends with the pytest process that started it (its own
    # watch on pytest starts only once it serves).
    reaper.die_with_parent(parent=_STARTED_BY)
    try:
        preload(Path(_directory))
    except Exception:  # its directory removed (the session ended first): serve all the same
        pass
    finally:
        reaper.die_with_parent(False)
