"""DeepSpeed's DistributedTest suites on warm ranks: ``--rank-adopt deepspeed``, one instance of
the adopter seam (adopt/core.py).

DeepSpeed's unit tests derive from ``DistributedTest`` or ``DistributedFixture`` (both on
``DistributedExec``, in its ``tests/unit/common.py``; followed here as of DeepSpeed commit
edaa722). Their source and DeepSpeed's own conftest stay as they are: the conftest still calls
the class with the test's request, so fixtures, parametrize values and world sizes (an int, a
list, the ``world_size`` marker or fixture) are resolved in the pytest process exactly as
DeepSpeed resolves them. Only the launch changes. The base's ``_launch_with_file_store`` (a new
process pool per world size, a teardown barrier, then a 0.5 s pause) is replaced for the
session: per world size the test keeps its file-store rendezvous and DeepSpeed's skip rule
(``device_count()`` below the world size), and every warm rank runs the instance's own
``_dist_run`` (ranks.py beside this). The harness judges each rank's end: the rank that
failed first is the root cause, a rank's ``sys.exit`` fails the test naming it, a hang is cut
at the harness's bound with every rank's stack.

A class the adapter cannot follow (one that overrides the launch, or a DistributedExec that is
not the one above) runs as before, and the session says so once. Imports no torch.
"""

from __future__ import annotations

import contextlib
import copy
import functools
import importlib
import os
import pickle
import re
import socket
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import pytest

from harness.adopt import core
from harness.adopt.deepspeed import build_lock, cpu_description, ranks, shm_buffers
from harness.common.errors import SpecError
from harness.common.outcome import RankOutcome
from harness.plan import packing
from harness.plan.settings import DEFAULT_TIMEOUT_S, session_timeout, settings_of

BASE = "DistributedExec"
# What the base must have for the adapter to follow it, and what a class must not override
# (the launch the adapter replaces).
NEEDED = ("run", "_launch_with_file_store", "_launch_procs", "_dist_run", "_dist_destroy")
REPLACED = (
    "_launch_with_file_store",
    "_launch_procs",
    "_launch_daemonic_procs",
    "_launch_non_daemonic_procs",
)
DIST_RUN_ARGS = ["local_rank", "num_procs", "master_port", "init_method"]
# Built by DeepSpeed's TorchBackend on a CPU accelerator at every init_distributed: built here
# once, outside any test's bound, so a rank only loads it.
SHM_BUILDER = "ShareMemCommBuilder"


@dataclass
class _Session:
    why_not: dict[type, str | None] = field(default_factory=dict)  # class -> why not adopted
    patched: dict[type, Callable[..., Any]] = field(default_factory=dict)  # base -> original
    extensions_ready: bool = False
    ops_built: dict[str, str] = field(default_factory=dict)  # JIT op -> the file loaded here
    cpu_info: Any = None  # py-cpuinfo's description of this CPU, once asked (_cpu_described_once)


_session_key = pytest.StashKey[_Session]()


def _session(config: pytest.Config) -> _Session:
    return core.session_state(config, _session_key, _Session)


class DeepSpeedAdopter(core.Adopter):
    """DeepSpeed's DistributedTest and DistributedFixture (on DistributedExec)."""

    name = "deepspeed"
    libraries = ("deepspeed",)  # its suite tests it from its checkout

    def claims(self, cls: type) -> bool:
        return find_base(cls) is not None

    def not_asked(self) -> str:
        return (
            "DeepSpeed's DistributedTest starts its own process pool per test; add deepspeed "
            "to --rank-adopt (--rank-adopt torch,deepspeed) to run it on warm ranks"
        )

    def collected(self, config: pytest.Config, items: list[pytest.Item]) -> None:
        """Replace the launch of every DeepSpeed base the collected tests use (a test
        class's, or a DistributedFixture's the test asks for), once per base, for the
        session."""
        session = _session(config)
        for item in items:
            for cls in _exec_classes(item):
                base = find_base(cls)
                if base is None or base in session.patched or why_base_differs(base) is not None:
                    continue
                session.patched[base] = vars(base)["_launch_with_file_store"]
                launch = _adopted_launch(self, session.patched[base])
                base._launch_with_file_store = launch  # type: ignore[attr-defined]

    def setting_up(self, item: pytest.Item) -> None:
        """A DeepSpeed class that runs as it is gets its line in the summary (only those
        whose tests run)."""
        for cls in _exec_classes(item):
            why = _why_not(item.config, cls)
            if why is not None:
                core.note_not_adopted(item.config, f"{cls.__module__}.{cls.__qualname__}", why)

    def ended(self, config: pytest.Config) -> None:
        session = config.stash.get(_session_key, None)
        for base, original in (session.patched if session is not None else {}).items():
            base._launch_with_file_store = original  # type: ignore[attr-defined]

    def endings(self, config: pytest.Config) -> list[Callable[[], None]]:
        """The all-reduce buffers of the runs going on when a signal ends the session."""
        return [shm_buffers.remove_in_use]

    def attempts(
        self,
        item: pytest.Item,
        run_once: Callable[[tuple[Any, ...]], list[RankOutcome]],
        args: tuple[Any, ...],
    ) -> list[RankOutcome]:
        """Each run on a new file store (in the store folder), told which JIT ops are built
        and where; each op the ranks found not built is built here once, and the test runs
        again (at most MAX_BUILDS times)."""
        exec_, num_procs, port, store_dir, deepspeed_file = args
        built = _session(item.config).ops_built

        def run_on_a_new_store() -> list[RankOutcome]:
            fd, store = tempfile.mkstemp(dir=store_dir, suffix="_filestore")
            os.close(fd)
            ready = tuple(sorted(built.items()))
            with shm_buffers.buffers_removed_after(port):
                return run_once((exec_, num_procs, port, f"file://{store}", deepspeed_file, ready))

        outcomes = run_on_a_new_store()
        for _ in range(MAX_BUILDS):  # each op a test asks for is built once, then it runs again
            asked = builders_asked(outcomes)
            if not asked:
                break
            for builder in asked:
                built.update([_build(item.config, builder)])
            outcomes = run_on_a_new_store()
        return outcomes


def _exec_classes(item: pytest.Item) -> list[type]:
    """The DistributedExec classes `item` runs: its class, and the DistributedFixtures among
    the fixtures it asks for (DeepSpeed registers the class itself as the fixture)."""
    found = []
    cls = getattr(item, "cls", None)
    if isinstance(cls, type):
        found.append(cls)
    info = getattr(item, "_fixtureinfo", None)
    for defs in getattr(info, "name2fixturedefs", {}).values():
        for fixturedef in defs:
            func = getattr(fixturedef, "func", None)
            if isinstance(func, type) and getattr(func, "is_dist_fixture", False):
                found.append(func)
    return [c for c in found if find_base(c) is not None]


# ---- which classes --------------------------------------------------------------------------


def find_base(cls: type) -> type | None:
    """DeepSpeed's DistributedExec among `cls`'s bases, known by its name and its launch."""
    return core.base_named(cls, BASE, ("_launch_procs", "_dist_run"))


def why_base_differs(base: type) -> str | None:
    """Why the adapter cannot follow this DistributedExec (None when it can)."""
    missing = [name for name in NEEDED if not callable(vars(base).get(name))]
    dist_run = vars(base).get("_dist_run")
    launch = vars(base).get("_launch_procs")
    if missing or core.parameters_of(dist_run)[:4] != DIST_RUN_ARGS:
        changed = ", ".join(missing) or "_dist_run's parameters"
        return f"its DistributedExec is not the one the harness follows ({changed} changed)"
    if "get_accelerator" not in getattr(launch, "__globals__", {}):
        return "its DistributedExec's module has no get_accelerator (the skip rule's source)"
    return None


def why_not(cls: type) -> str | None:
    """Why `cls` runs as it is under ``--rank-adopt deepspeed`` (None: it is adopted)."""
    base = find_base(cls)
    if base is None:
        return "not a DeepSpeed DistributedExec"
    differs = why_base_differs(base)
    if differs is not None:
        return differs
    for owner in cls.__mro__[: cls.__mro__.index(base)]:
        overridden = [name for name in REPLACED if name in vars(owner)]
        if overridden:
            return f"{owner.__qualname__} overrides {', '.join(overridden)}"
    return None


def _why_not(config: pytest.Config, cls: type) -> str | None:
    session = _session(config)
    if cls not in session.why_not:
        session.why_not[cls] = why_not(cls)
    return session.why_not[cls]


# ---- the launch -----------------------------------------------------------------------------


def _adopted_launch(adopter: DeepSpeedAdopter, original: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(original)
    def launch(self: Any, request: Any, world_size: Any) -> None:
        item = getattr(request, "node", None)
        if _why_not(request.config, type(self)) is not None:
            original(self, request, world_size)  # its line is in the summary (runtest_setup)
            return
        if not isinstance(item, pytest.Item):  # a DistributedFixture of a wider scope
            where = f"{type(self).__module__}.{type(self).__qualname__}"
            core.note_not_adopted(request.config, where, "a fixture set up outside a test")
            original(self, request, world_size)
            return
        tmpdir = request.getfixturevalue("tmpdir")  # where DeepSpeed makes its file stores
        for procs in _world_sizes(world_size):
            run_world(adopter, self, item, procs, str(tmpdir))

    return launch


def _world_sizes(value: Any) -> list[int]:
    sizes = [value] if isinstance(value, int) else value
    if not isinstance(sizes, list | tuple) or not all(
        isinstance(n, int) and not isinstance(n, bool) for n in sizes
    ):
        raise SpecError(
            f"world_size is {value!r}: DeepSpeed's DistributedTest takes an int or a list of "
            f"ints (the class attribute, @pytest.mark.world_size(n) or a world_size fixture)"
        )
    return list(sizes)


def run_world(
    adopter: DeepSpeedAdopter, exec_: Any, item: pytest.Item, num_procs: int, store_dir: str
) -> None:
    """One world size of a DeepSpeed test or fixture, on warm ranks (DeepSpeed's _launch_procs),
    each run with a file store of its own in `store_dir`, as DeepSpeed makes one per launch."""
    base = find_base(type(exec_))
    assert base is not None
    accelerator = vars(base)["_launch_procs"].__globals__["get_accelerator"]()
    if accelerator.is_available() and accelerator.device_count() < num_procs:
        raise pytest.skip.Exception(  # DeepSpeed's rule and words (CPU: LOCAL_SIZE, NUMA nodes)
            f"Skipping test because not enough GPUs are available: {num_procs} required, "
            f"{accelerator.device_count()} available",
            _use_item_location=True,
        )
    if exec_.non_daemonic_procs and exec_.reuse_dist_env:
        raise AssertionError("Cannot reuse distributed environment with non-daemonic processes")
    _extensions_built_once(item.config, accelerator)
    _picklable(exec_)
    deepspeed_file = getattr(sys.modules.get("deepspeed"), "__file__", None)
    with _held_port() as port:
        args = (exec_, num_procs, port, store_dir, deepspeed_file)
        timeout = _timeout(item, exec_)
        adopter.run(item, num_procs, ranks.run_exec, type(exec_), *args, timeout=timeout)


MAX_BUILDS = 4  # ops one test may JIT-build (cpu_adam, fused_adam, ...), each built once
_NOT_BUILT = "ExtensionNotBuilt"
_BUILDER = re.compile(r"\(([\w.]+:[\w.]+)\)")


def builders_asked(outcomes: list[RankOutcome]) -> list[str]:
    """The DeepSpeed ops ("module:qualname" of their builders) the ranks found not built."""
    asked = []
    for o in outcomes:
        found = _BUILDER.search(o.message) if o.exc_type.endswith(_NOT_BUILT) else None
        if found is not None and found.group(1) not in asked:
            asked.append(found.group(1))
    return asked


def _build(config: pytest.Config, builder: str) -> tuple[str, str]:
    """JIT-build one DeepSpeed op here, once (torch's cache keeps it for every rank); its
    name and the file it was loaded from. In torch's cache already (this copy of DeepSpeed,
    these flags), it only loads."""
    module_name, _, qualname = builder.partition(":")
    start = time.monotonic()
    try:
        found: Any = importlib.import_module(module_name)
        for part in qualname.split("."):
            found = getattr(found, part)
        op = found()
        build_lock.wait_for_build_lock(str(op.name))
        with contextlib.redirect_stdout(sys.stderr), _cpu_described_once(config):
            loaded = op.load()
    except SpecError:
        raise
    except Exception as exc:
        raise SpecError(
            f"building DeepSpeed's {qualname} op for the ranks failed: {type(exc).__name__}: "
            f"{exc}; build it once by hand (python -c 'from {module_name} import {qualname}; "
            f"{qualname}().load()') and read its compiler output"
        ) from None
    _said(config, f"built DeepSpeed's {qualname} op once for the session's ranks", start)
    return str(op.name), _file_of(loaded)


def _file_of(module: Any) -> str:
    """The file a loaded op came from, for the ranks to import it from ("" if none)."""
    found = getattr(module, "__file__", None)
    return found if isinstance(found, str) and os.path.isfile(found) else ""


def _said(config: pytest.Config, what: str, start: float) -> None:
    took = time.monotonic() - start
    reporter = config.pluginmanager.get_plugin("terminalreporter")
    if reporter is not None and took > 5:
        reporter.write_line(f"harness: {what} ({took:.0f} s; kept in TORCH_EXTENSIONS_DIR)")


def _timeout(item: pytest.Item, exec_: Any) -> float:
    """The harness's bound (--rank-timeout, a timeout marker, pytest-timeout's); DeepSpeed's
    own (DS_UNITTEST_TIMEOUT, the class's exec_timeout) where the user set it."""
    own = os.environ.get("DS_UNITTEST_TIMEOUT")
    bound = getattr(exec_, "exec_timeout", None) if own else None
    default = float(bound) if isinstance(bound, int | float) and bound > 0 else DEFAULT_TIMEOUT_S
    return session_timeout(settings_of(item.config), item, default)


def _picklable(exec_: Any) -> None:
    """The instance travels to the ranks as DeepSpeed's pool sends it (pickled): say which
    value cannot, before any rank starts."""
    try:
        pickle.dumps(exec_)
    except Exception as exc:
        values = vars(exec_).get("_fixture_kwargs", {})
        names = [name for name, value in values.items() if not packing.pickles(value)]
        which = f" (fixture values that cannot: {', '.join(names)})" if names else ""
        raise SpecError(
            f"{type(exec_).__qualname__}: the test instance cannot be sent to its ranks{which}: "
            f"{type(exc).__name__}: {exc}; DeepSpeed's own pool pickles it too: make the "
            f"fixture values picklable"
        ) from None


@contextlib.contextmanager
def _held_port() -> Iterator[str]:
    """A port for MASTER_PORT, held (bound on loopback) while the test runs. DeepSpeed's ranks
    rendezvous over the file store, so the port is only what they see in their environment;
    but its shared-memory all-reduce names its buffers after it: two runs at once (xdist,
    two sessions) with the same port would write into each other's. Held with SO_REUSEADDR
    and never listening, so a test whose own store binds it (env://) still can; a plain bind
    elsewhere, a port picked by another process, cannot."""
    with socket.socket() as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        s.bind(("127.0.0.1", 0))
        yield str(s.getsockname()[1])


def _extensions_built_once(config: pytest.Config, accelerator: Any) -> None:
    """DeepSpeed's TorchBackend JIT-builds its shared-memory all-reduce op on a CPU accelerator
    at every init_distributed (minutes, the first time). Built or loaded here once per session,
    outside every test's bound: each rank then loads the cached build (TORCH_EXTENSIONS_DIR)."""
    session = _session(config)
    if session.extensions_ready:
        return
    session.extensions_ready = True
    build = getattr(sys.modules.get("deepspeed.comm.torch"), "build_shm_op", None)
    if accelerator.device_name() != "cpu" or build is None:
        return
    start = time.monotonic()
    builder = accelerator.create_op_builder(SHM_BUILDER)
    name = "" if builder is None else str(builder.name)
    if name:
        build_lock.wait_for_build_lock(name)
    with contextlib.redirect_stdout(sys.stderr), _cpu_described_once(config):  # "built" line
        built = build()
    if built is not None:  # None: not compatible here, and the ranks do not build it either
        session.ops_built[name] = _file_of(built)
    _said(config, f"built DeepSpeed's {SHM_BUILDER} op once for the session's ranks", start)


@contextlib.contextmanager
def _cpu_described_once(config: pytest.Config) -> Iterator[None]:
    """While the pytest process builds or loads DeepSpeed's ops: py-cpuinfo's get_cpu_info
    answers from the first answer this CPU gave. DeepSpeed's builders ask it twice an op for
    their compiler flags, and each ask runs a Python subprocess that times the CPU (about a
    second, on the first test's path); the CPU does not change within a session, nor from
    one session to the next on the same CPU (kept beside torch's builds, with what
    identifies the CPU it came from: cpu_description.py). Put back after, for the tests'
    own calls."""
    try:
        cpuinfo: Any = importlib.import_module("cpuinfo")
    except ImportError:  # DeepSpeed's builders then ask lscpu, as they would
        yield
        return
    asked = getattr(cpuinfo, "get_cpu_info", None)
    if not callable(asked):
        yield
        return
    session = _session(config)

    def described() -> Any:
        if session.cpu_info is None:
            session.cpu_info = cpu_description.kept(cpuinfo)
            if session.cpu_info is None:
                session.cpu_info = asked()
                cpu_description.keep(cpuinfo, session.cpu_info)
        return copy.deepcopy(session.cpu_info)  # each caller its own, as py-cpuinfo gives

    cpuinfo.get_cpu_info = described
    try:
        yield
    finally:
        cpuinfo.get_cpu_info = asked
