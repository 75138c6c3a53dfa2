"""What runs inside a rank for a DeepSpeed test adopted with ``--rank-adopt deepspeed``.

Each rank calls the test instance's own ``_dist_run`` as DeepSpeed's pool worker does (its
environment variables, ``deepspeed.init_distributed`` over the test's file store, a barrier,
the test), then its ``_dist_destroy`` (a barrier, the group destroyed) as DeepSpeed's pool
does after each test. DeepSpeed keeps its distributed state in module globals (the backend in
``deepspeed.comm.comm``, the groups in ``deepspeed.utils.groups``, the accelerator); they are
put back as they were before the test, so the next test on this warm rank starts as on a
fresh one. What cannot be put back (a backend that sets itself up once per process) has the
ranks replaced. Runs only in ranks; imports no torch until it runs.
"""

from __future__ import annotations

import contextlib
import importlib.util
import sys
from collections.abc import Iterator
from dataclasses import dataclass, field
from types import ModuleType
from typing import Any

import pytest

from harness.common import endings

endings.skip_frames_of(__file__)  # a rank's traceback starts in the test's code

# DeepSpeed keeps its state in module globals, every module's put back (its dicts, lists
# and sets too): the backend in deepspeed.comm.comm, the groups in deepspeed.utils.groups,
# registries such as deepspeed.utils.debug's (keyed by the engine's modules, which hold its
# process groups). These modules' classes keep some as class attributes: put back too.
PACKAGE = "deepspeed"
CLASS_STATE_MODULES = (
    "deepspeed.comm.comm",
    "deepspeed.comm.torch",
    "deepspeed.utils.groups",
    "deepspeed.accelerator.real_accelerator",
    "deepspeed.runtime.zero.partition_parameters",
)
# What zero.Init replaces outside DeepSpeed's modules ("module" or "module:Class" -> names):
# F.linear and the layers' state-dict loading for good (memory_efficient_linear, quantized
# initialization), the rest while it is entered. Each put back as it was before the test.
TORCH_PATCHED = {
    "torch": ("tensor", "empty", "zeros", "ones", "full", "arange", "eye", "randn"),
    "torch.nn.functional": ("linear", "embedding"),
    "torch:Tensor": ("__new__", "__old_new__"),
    "torch.nn.modules.module:Module": (
        "__init_subclass__",
        "apply",
        "_old_init_subclass",
        "_old_apply",
    ),
    "torch.nn:Linear": ("_load_from_state_dict",),
    "torch.nn:Embedding": ("_load_from_state_dict",),
}
_ABSENT = object()  # an attribute the owner's own namespace did not hold
# Backends whose native side sets itself up once per process (oneCCL's and MPI's keep their
# first communicator): a later test's init_distributed would silently reuse it.
ONCE_PER_PROCESS = ("ccl", "mpi", "hccl")


class ExtensionNotBuilt(RuntimeError):
    """A test asked for a DeepSpeed op that is not built yet: the pytest process builds it
    once, outside the test's bound, and runs the test again (adopter.py)."""

    def __init__(self, builder: type) -> None:
        self.builder = f"{builder.__module__}:{builder.__qualname__}"
        super().__init__(
            f"DeepSpeed's {builder.__qualname__} op is not built yet ({self.builder}); "
            f"the harness builds it once in the pytest process and runs the test again"
        )


@contextlib.contextmanager
def _no_build_in_ranks(ready: dict[str, str], unbuilt: list[ExtensionNotBuilt]) -> Iterator[None]:
    """A JIT build in a rank would take minutes under the test's bound: an op the pytest
    process has not built (or found built) in this session is raised as ExtensionNotBuilt
    instead. One it has is imported from the file the pytest process loaded (`ready`: name
    -> path), not through torch's load: that takes a lock file in the build folder to run
    ninja's check, and a rank killed while holding it (a test cut at its bound) left every
    later load, in any session, waiting on it for ever. (A build in torch's cache may be
    another copy's: torch rebuilds it when the sources' paths or flags differ.)"""
    originals: dict[type, Any] = {base: vars(base)["jit_load"] for base in _op_builders()}

    def jit_load(self: Any, *args: Any, **kwargs: Any) -> Any:
        name = str(self.name)
        if name not in ready:
            unbuilt.append(ExtensionNotBuilt(type(self)))
            raise unbuilt[-1]
        owner = next(base for base in type(self).__mro__ if base in originals)
        if not ready[name]:  # the pytest process's load gave no file: torch's own way
            return originals[owner](self, *args, **kwargs)
        module = _import_built(name, ready[name])
        loaded = vars(owner).get("_loaded_ops")
        if isinstance(loaded, dict):  # as DeepSpeed's jit_load keeps it for the next load
            loaded[name] = module
        return module

    for base in originals:
        base.jit_load = jit_load  # type: ignore[attr-defined]
    try:
        yield
    finally:
        for base, original in originals.items():
            base.jit_load = original  # type: ignore[attr-defined]


def _import_built(name: str, path: str) -> ModuleType:
    """The built op at `path` imported as torch's load imports it once built."""
    spec = importlib.util.spec_from_file_location(name, path)
    if spec is None or spec.loader is None:
        raise ImportError(f"DeepSpeed's {name} op: no module at {path}, where it was built")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _op_builders() -> list[type]:
    """DeepSpeed's OpBuilder base as loaded here: deepspeed.ops.op_builder in a wheel, the
    top-level op_builder package in a source checkout."""
    found = []
    for name in ("deepspeed.ops.op_builder.builder", "op_builder.builder"):
        base = getattr(sys.modules.get(name), "OpBuilder", None)
        if isinstance(base, type) and callable(vars(base).get("jit_load")):
            found.append(base)
    return found


class _SkipBox:
    """The queue a non-daemonic DeepSpeed rank puts its skip message in."""

    def __init__(self) -> None:
        self.message = ""

    def put(self, message: Any, *args: Any, **kwargs: Any) -> None:
        self.message = str(message)


def run_exec(
    cls: type,
    exec_: Any,
    num_procs: int,
    master_port: str,
    init_method: str,
    deepspeed_file: str | None,
    ready_ops: tuple[tuple[str, str], ...],
    *,
    rank: int,
) -> None:
    """Run one world size of a DeepSpeed test (or DistributedFixture) on this rank, as
    DeepSpeed's pool worker runs it; a skip on this rank is a skip. `ready_ops`: the JIT
    ops the pytest process has built this session and the files it loaded them from ("" if
    none); any other raises ExtensionNotBuilt."""
    _same_deepspeed(deepspeed_file)
    __tracebackhide__ = True
    kept = state_before_test()
    skips: list[BaseException] = []
    exec_.run = _noting_skips(exec_.run, skips)  # the instance's: its class's stays
    unbuilt: list[ExtensionNotBuilt] = []
    try:
        with _no_build_in_ranks(dict(ready_ops), unbuilt):
            skipped = _dist_run(exec_, rank, num_procs, master_port, init_method)
            exec_._dist_destroy()  # DeepSpeed's pool does this on every rank after each test
    except BaseException:
        if not unbuilt:
            raise
    finally:
        kept.put_back()
    if unbuilt:  # even where the test caught it: its run is not the test's as DeepSpeed runs it
        raise unbuilt[0]
    if skipped:  # the test's own skip, reported where the test called it
        raise skips[-1] if skips else pytest.skip.Exception(skipped)


def _noting_skips(run: Any, skips: list[BaseException]) -> Any:
    """The test's ``run``, keeping the skip it raises (``_dist_run`` keeps only its text)."""

    def run_noting_skips(*args: Any, **kwargs: Any) -> Any:
        __tracebackhide__ = True
        try:
            return run(*args, **kwargs)
        except pytest.skip.Exception as exc:
            skips.append(exc)
            raise

    return run_noting_skips


def _dist_run(exec_: Any, rank: int, num_procs: int, master_port: str, init_method: str) -> str:
    """The instance's ``_dist_run``; the skip message it gives ("" when the test ran)."""
    if exec_.non_daemonic_procs:  # DeepSpeed's own processes report a skip in a queue
        box = _SkipBox()
        exec_._dist_run(rank, num_procs, master_port, init_method, box)
        return box.message
    return str(exec_._dist_run(rank, num_procs, master_port, init_method) or "")


def _same_deepspeed(expected: str | None) -> None:
    """The rank's deepspeed must be the pytest process's (a source checkout, not an installed
    copy the fork server imported first)."""
    found = getattr(sys.modules.get("deepspeed"), "__file__", None)
    if expected is not None and found is not None and found != expected:
        raise RuntimeError(
            f"this rank imported deepspeed from {found}, the pytest process from {expected}; "
            f"run with --rank-preload none, or install the checkout (pip install -e)"
        )


_first_seen: State | None = None  # DeepSpeed's state as this rank's first adopted test found it


def state_before_test() -> State:
    """DeepSpeed's state before a test on this rank: as its first adopted test found it, which
    every test puts back (taking it again copied the same 20,000 globals for every test, 10 to
    40 ms on each rank), with the modules imported since, or imported anew, taken as they are."""
    global _first_seen
    if _first_seen is None:
        _first_seen = State()
    _first_seen.take_new()
    return _first_seen


@dataclass
class State:
    """DeepSpeed's module globals, its classes' attributes there, and what zero.Init replaces
    in torch, as they were."""

    modules: dict[str, tuple[ModuleType, dict[str, Any], dict[str, Any]]] = field(
        default_factory=dict
    )
    classes: list[tuple[type, dict[str, Any], dict[str, Any]]] = field(default_factory=list)
    patched: list[tuple[Any, str, Any]] = field(default_factory=list)  # owner, name, value
    owners: dict[str, Any] = field(default_factory=dict)  # whose classes or names are taken

    def take_new(self) -> None:
        """Take what is not taken yet: a module (or class, or torch name) first imported, or
        imported anew, since the last take."""
        for name, module in _deepspeed_modules():
            if name not in self.modules or self.modules[name][0] is not module:
                values = dict(vars(module))
                self.modules[name] = (module, values, _contents(values))
        for name in CLASS_STATE_MODULES:
            holder = sys.modules.get(name)
            if holder is None or self.owners.get(name) is holder:
                continue
            self.owners[name] = holder
            for value in vars(holder).values():
                if isinstance(value, type) and value.__module__ == name:
                    own = dict(vars(value))  # the class's counters, backups
                    self.classes.append((value, own, _contents(own)))
        for where, owner, names in _torch_owners():
            if self.owners.get(where) is not owner:
                self.owners[where] = owner
                self.patched += [(owner, n, vars(owner).get(n, _ABSENT)) for n in names]

    def put_back(self) -> None:
        """Everything as it was; what cannot be set up again, or put back, replaces the
        ranks (a backend set up once per process, zero.Init left entered)."""
        self._replace_ranks_if_lasting()
        for module, values, contents in self.modules.values():
            now = vars(module)
            for key in [k for k in now if k not in values and not k.startswith("__")]:
                if not isinstance(now[key], ModuleType):  # a submodule imported: it stays
                    del now[key]
            now.update(values)
            for key, saved in contents.items():
                _refill(values[key], saved)
        for klass, own, contents in self.classes:
            _set_back(klass, own)
            for key, saved in contents.items():
                _refill(own[key], saved)
        for owner, name, value in self.patched:
            _set_back(owner, {name: value}, only=(name,))

    def _replace_ranks_if_lasting(self) -> None:
        from harness.rank import lasting

        comm = sys.modules.get("deepspeed.comm.comm")
        backend = getattr(comm, "cdb", None)
        name = str(getattr(backend, "name", "torch"))
        if backend is not None and name in ONCE_PER_PROCESS:
            lasting.replace_after_this_test(
                f"set DeepSpeed's {name} backend up (its native side keeps its first "
                f"communicator for the process's life)"
            )
        zero = sys.modules.get("deepspeed.runtime.zero.partition_parameters")
        if getattr(zero, "zero_init_context", 0):  # DeepSpeed's count of Inits entered
            lasting.replace_after_this_test(
                "left DeepSpeed's zero.Init entered (every torch.nn.Module subclass's "
                "__init__ replaced): use it as a context manager, with"
            )


def _deepspeed_modules() -> list[tuple[str, ModuleType]]:
    """DeepSpeed's modules this rank has imported."""
    prefix = PACKAGE + "."
    return [
        (name, module)
        for name, module in list(sys.modules.items())
        if (name == PACKAGE or name.startswith(prefix)) and isinstance(module, ModuleType)
    ]


def _torch_owners() -> list[tuple[str, Any, tuple[str, ...]]]:
    """TORCH_PATCHED's owners that are imported: where each is, the owner, its names."""
    found = []
    for where, names in TORCH_PATCHED.items():
        module_name, _, class_name = where.partition(":")
        owner = sys.modules.get(module_name)
        if owner is not None and class_name:
            owner = getattr(owner, class_name, None)
        if owner is not None:
            found.append((where, owner, names))
    return found


def _set_back(owner: Any, saved: dict[str, Any], only: tuple[str, ...] = ()) -> None:
    """The owner's own attributes (`only` those, else all) as `saved` has them: those added
    since removed, those replaced set back."""
    now = vars(owner)
    for name in only or [*now, *saved]:
        before, after = saved.get(name, _ABSENT), now.get(name, _ABSENT)
        if after is before:
            continue
        if before is _ABSENT:
            delattr(owner, name)
        else:
            setattr(owner, name, before)


def _contents(values: dict[str, Any]) -> dict[str, Any]:
    """Copies of the dicts, lists and sets among `values` (not dunders: a module's
    __builtins__ is every module's)."""
    copies = {k: _copy(v) for k, v in values.items() if not k.startswith("__")}
    return {k: v for k, v in copies.items() if v is not None}


def _copy(value: Any) -> Any:
    if type(value) in (dict, list, set):
        return type(value)(value)
    return None


def _refill(container: Any, saved: Any) -> None:
    if container == saved:
        return
    container.clear()
    if isinstance(container, list):
        container.extend(saved)
    else:
        container.update(saved)
