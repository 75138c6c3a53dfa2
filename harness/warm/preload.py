"""Which modules the fork server imports once, before it starts any rank (--rank-preload).

A rank is a fork of multiprocessing's fork server. Without this, each fresh rank imports
what its test module imports: four ranks importing transformers at once on a busy 2-core
machine took over 30 s, and every replaced rank paid again. Chosen here, after collection,
from what the pytest process imported since the plugin was loaded (conftests, test modules),
they are imported once per session in the server (rank/forkserver_preload.py), and every
rank of every world size then starts with them loaded: about one fork each.

Only installed and standard-library modules are chosen. The project's own modules (test
helpers, conftests, its packages, installed or not) are still imported in each rank, after
the rank knows who it is: a module of the project that reads the rank's environment at
import time keeps reading its own rank. One exception: a library whose suite is adopted
(DeepSpeed's, tested from its source checkout) is preloaded from wherever the pytest process
imported it, and by a server started early from where it can be found as collection starts
(the server checks that the tests imported that same file). Imports no torch.
"""

from __future__ import annotations

import fnmatch
import importlib.machinery
import importlib.util
import os
import re
import site
import sys
import sysconfig
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest

from harness.common import launch_detect
from harness.plan import adopter_needs
from harness.plan.settings import settings_of

# What this process had imported when it first loaded the plugin; a session's own snapshot,
# taken before its conftests load (see before_conftests), is used where there is one.
_AT_PLUGIN_LOAD = frozenset(sys.modules)
_before_key = pytest.StashKey[frozenset[str]]()

# Top-level packages never preloaded: pytest's own, and what multiprocessing runs as main.
_NEVER = frozenset({"__main__", "__mp_main__", "_pytest", "pytest", "pluggy", "py", "harness"})


@dataclass(frozen=True)
class PreloadPlan:
    """The modules the fork server imports before its first rank, and its bound for that."""

    modules: tuple[str, ...]
    bound_s: float
    environ: tuple[tuple[str, str], ...] = ()  # the pytest process's, once tests are collected


@dataclass(frozen=True)
class _Collected:
    """What the session had imported once its tests were collected, sorted out into a plan
    only when a fork server first needs one (most sessions never start ranks: a realpath
    per module is not paid at every start)."""

    names: tuple[str, ...]  # sys.modules then
    bound_s: float
    environ: tuple[tuple[str, str], ...]


_collected_key = pytest.StashKey[_Collected]()
_plan_key = pytest.StashKey[PreloadPlan]()


def before_conftests(config: pytest.Config) -> None:
    """What this process has imported before the session's conftests and test modules: what
    is new at the end of collection is what they imported (a pytest run inside another
    process's session counts only its own)."""
    config.stash[_before_key] = frozenset(sys.modules)


def note_collected(session: pytest.Session, mode: str, bound_s: float) -> None:
    """Choose, once the session's tests are collected, what the fork server preloads."""
    if mode == "none":
        return
    collected = _Collected(tuple(sys.modules), bound_s, tuple(os.environ.items()))
    session.config.stash[_collected_key] = collected


def plan_of(config: pytest.Config) -> PreloadPlan | None:
    """The session's plan (None before its tests are collected, or with --rank-preload none)."""
    plan = config.stash.get(_plan_key, None)
    collected = config.stash.get(_collected_key, None)
    if plan is None and collected is not None:
        before = config.stash.get(_before_key, _AT_PLUGIN_LOAD)
        also = adopted_libraries(config)
        never = (_plugin_packages(config) | _project_packages(config.rootpath)) - also
        modules = {name: sys.modules.get(name) for name in collected.names}
        found = tuple(chosen(before, modules, never, also))
        plan = config.stash[_plan_key] = PreloadPlan(found, collected.bound_s, collected.environ)
    return plan


# pytest's cache: what the last session that started ranks preloaded (module names, JSON).
CACHE_KEY = "harness/preloaded"
_MODULE_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*(\.[A-Za-z_][A-Za-z0-9_]*)*")


def start_early_wanted(config: pytest.Config, ranks_collected: bool = False) -> list[str] | None:
    """What a fork server started before collection ends imports first (the last session's
    list, from pytest's cache, and an adopted suite's library where it can be found now),
    or None where starting one early is not wanted: only where this session needs ranks
    (--rank-adopt is on, or a ranks test was just collected; never for what the cache says
    of the last session: a session of plain tests starts none), and never in xdist's
    controller (its workers run the tests) or under torchrun."""
    session = settings_of(config)
    if session.preload != "auto" or session.start_method != "forkserver":
        return None
    if session.launched is not None or _xdist_controller(config) or config.option.collectonly:
        return None
    cache = getattr(config, "cache", None)
    last = cache.get(CACHE_KEY, None) if cache is not None else None
    if not session.adopt and not ranks_collected:
        return None
    found = [name for name in sorted(adopted_libraries(config)) if _findable(name)]
    return [*(_trusted(last) if isinstance(last, list) else []), *found]


def before_conftests_wanted(config: pytest.Config) -> bool:
    """Whether the fork server starts before the session's conftests load, read from the
    command line and the ini file as they are then: only where the session adopts suites
    (--rank-adopt: it has ranks to start), with the default preload and start method; never
    under xdist, a launch (torchrun starts the ranks), or --collect-only."""
    args = config.known_args_namespace

    def value(name: str) -> Any:
        given = getattr(args, name, None)
        return given if given is not None else config.getini(name)

    if not value("rank_adopt") or getattr(args, "collectonly", False):
        return False
    if value("rank_preload") not in (None, "", "auto"):
        return False
    if value("rank_start_method") not in (None, "", "forkserver"):
        return False
    # xdist's controller runs no test. Its workers, started with the same arguments, are
    # not told from a controller this early (a pytest run by a worker's test inherits the
    # worker's variables): they start theirs as collection starts.
    if getattr(args, "numprocesses", None) or getattr(args, "dist", "no") not in (None, "no"):
        return False
    try:
        return launch_detect.detect() is None
    except launch_detect.LaunchError:
        return False  # said at configure


# What a test module's text says when it has ranks tests: read before pytest imports it.
RANKS_WORDS = (b"mark.ranks", b"run_on_ranks", b"rank_pool")
RANKS_READ = 1 << 20  # bytes of a module read for them, at most


def names_ranks(path: Path, config: pytest.Config) -> bool:
    """Whether `path` is a test module pytest will import (named on the command line, or
    matching python_files below a directory that is) whose text names the ranks marker or
    fixtures. pytest also offers the files beside a file named alone: not imported."""
    if path.suffix != ".py":
        return False
    asked = [config.invocation_params.dir / arg.split("::")[0] for arg in config.args]
    asked = [a.resolve() for a in asked]
    if path not in asked:
        below = any(a in path.parents for a in asked if a.is_dir())
        patterns = config.getini("python_files")
        if not below or not any(fnmatch.fnmatch(path.name, p) for p in patterns):
            return False
    try:
        with open(path, "rb") as f:
            text = f.read(RANKS_READ)
    except OSError:
        return False
    return any(word in text for word in RANKS_WORDS)


def _findable(top: str) -> bool:
    """Whether a top-level package can be imported from this process's sys.path (found, not
    imported): an adopted suite's checkout is on it once the initial conftests have run."""
    return _spec_of(top) is not None


def _spec_of(top: str) -> importlib.machinery.ModuleSpec | None:
    try:
        return importlib.util.find_spec(top)  # a top-level name: nothing is imported
    except (ImportError, ValueError):
        return None


def record(config: pytest.Config, started_ranks: bool, failed: list[str]) -> None:
    """Keep this session's list, less what could not be preloaded, for the next session's
    early start; a session that ran tests but started no ranks clears it."""
    cache = getattr(config, "cache", None)
    if cache is None:
        return
    plan = plan_of(config) if started_ranks else None
    if plan is None:
        cache.set(CACHE_KEY, None)
        return
    roots = installed_roots()  # a source checkout's modules: the early server would import
    kept = [n for n in plan.modules if n not in set(failed) and _installed(n, roots)]
    cache.set(CACHE_KEY, kept)  # the installed copy, before conftest puts the checkout first


def _installed(name: str, roots: tuple[str, ...]) -> bool:
    file = getattr(sys.modules.get(name), "__file__", None)
    return not isinstance(file, str) or os.path.realpath(file).startswith(roots)


def adopted_libraries(config: pytest.Config) -> frozenset[str]:
    """Libraries an adopted suite tests from a source checkout (DeepSpeed's conftest puts its
    repository first on sys.path): preloaded wherever they come from, so that a new rank
    costs a fork, not their import."""
    return adopter_needs.libraries(config)


def _trusted(names: list[object]) -> list[str]:
    """The cache's names that could have been chosen (see chosen): a module name, under a
    top-level package installed here, never a __main__ or one of pytest's. pytest's cache
    is a file in the project: what it lists must not decide what the server runs."""
    roots = installed_roots()
    found = []
    for name in names:
        if not isinstance(name, str) or not _MODULE_NAME.fullmatch(name):
            continue
        parts = name.split(".")
        if "__main__" in parts or parts[0] in _NEVER:
            continue
        if _installed_top(parts[0], roots):
            found.append(name)
    return found


def _installed_top(top: str, roots: tuple[str, ...]) -> bool:
    spec = _spec_of(top)
    origin = spec.origin if spec is not None else None
    return isinstance(origin, str) and os.path.realpath(origin).startswith(roots)


def _xdist_controller(config: pytest.Config) -> bool:
    return not hasattr(config, "workerinput") and config.getoption("dist", "no") != "no"


def chosen(
    before: frozenset[str],
    modules: Mapping[str, ModuleType | None],
    never: frozenset[str],
    also: frozenset[str] = frozenset(),
) -> list[str]:
    """The modules imported since `before` that come from the standard library or an
    installed distribution (or whose top-level package is in `also`, from wherever), in the
    order their imports began (parents first)."""
    roots, never = installed_roots(), never | _NEVER
    found = []
    for name, module in list(modules.items()):
        if name in before or module is None or name.partition(".")[0] in never:
            continue
        if getattr(module, "__name__", None) != name:
            continue  # an alias another module put there (six.moves, torch.ops.*)
        file = getattr(module, "__file__", None)
        if isinstance(file, str) and (
            os.path.realpath(file).startswith(roots) or name.partition(".")[0] in also
        ):
            found.append(name)
    return found


def installed_roots() -> tuple[str, ...]:
    """Where the standard library and installed distributions live, each ending in a
    separator (a project's venv may lie inside its own directory: its site-packages are
    installed code, the project's files beside it are not)."""
    paths = sysconfig.get_paths()
    roots = {paths[key] for key in ("stdlib", "platstdlib", "purelib", "platlib") if key in paths}
    roots.update(site.getsitepackages())
    if site.ENABLE_USER_SITE:
        roots.add(site.getusersitepackages())
    return tuple(sorted({os.path.realpath(root) + os.sep for root in roots}))


def _project_packages(rootdir: Path) -> frozenset[str]:
    """The top-level packages and modules the project itself holds (in its root, src/ or
    lib/): installed without -e they are in site-packages, and still the project's own."""
    names = set()
    for folder in (rootdir, rootdir / "src", rootdir / "lib"):
        try:
            entries = list(folder.iterdir())
        except OSError:
            continue
        for entry in entries:
            if entry.suffix == ".py" or (entry / "__init__.py").is_file():
                names.add(entry.stem if entry.suffix == ".py" else entry.name)
    return frozenset(names)


def _plugin_packages(config: pytest.Config) -> frozenset[str]:
    """The top-level packages of pytest's loaded plugins: pytest's side, not the tests'."""
    tops = set()
    for plugin in config.pluginmanager.get_plugins():
        name = getattr(plugin, "__name__", None) if isinstance(plugin, ModuleType) else None
        if name is not None and not Path(getattr(plugin, "__file__", "") or "").name.startswith(
            "conftest"
        ):
            tops.add(name.partition(".")[0])
    return frozenset(tops)
