"""The code that runs inside a rank process.

Self-contained on purpose: it imports nothing from the pytest side (``harness.warm``,
``harness.plugin``), only the message and outcome types both sides share. The forkserver
preloads this module, so torch is imported once in the server and every rank starts with it
already loaded.

A worker serves one slot (rank) of one pool for many tests: it waits for a ``RUN`` message,
sets the test's process group up (or torchrun's environment in launch mode), runs the target,
tears the group down and answers with a ``RESULT``. Its stdout and stderr go to two files
the pytest process reads after each run, even if the rank died; ``SIGUSR1`` dumps every
thread's Python stack to a second file, also while the rank is blocked in a C++ collective.
"""

from __future__ import annotations

import ast
import contextlib
import faulthandler
import gc
import importlib
import importlib.abc
import importlib.machinery
import importlib.util
import mmap
import os
import pickle
import random
import signal
import socket
import sys
import time
import traceback
import types
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path
from typing import Any

import _pytest.outcomes
import pytest
import torch
import torch.distributed as dist

from harness.common import endings, environment, hygiene, loopback, rank_warnings, reaper, signing
from harness.common.faults import Fault, Injector, rankwise_points
from harness.common.launch_detect import IN_RANK_WORKER
from harness.common.outcome import Ending, RankOutcome, exit_code
from harness.common.protocol import (
    CURRENT_TEST,
    DUMP_STACKS_SIGNAL,
    SIMULATED_SET_UP_FAILURES,
    WHERE_SIZE,
    FixturePlan,
    Kind,
    Message,
    RankFiles,
    RankSpec,
    Ready,
    RequestInfo,
    RunTask,
    Settled,
    Target,
    decode_args,
    encode_where,
)
from harness.common.torchrun_env import torchrun_env
from harness.rank import (
    group_release,
    kept_group,
    logs,
    raw_threads,
    state,
    stdin,
)
from harness.rank.fixtures import RankFixtures
from harness.rank.private_store import PrivateStore

endings.skip_frames_of(__file__)
# The group's own timeout stays well past the harness's deadline, so a hang is always caught
# and reported by the harness (stacks, the collective) before gloo unwinds it.
GROUP_TIMEOUT_MARGIN_S = 120.0


def main(conn: Any, files: RankFiles) -> None:
    """Process entry point: serve runs until the pytest side goes away or kills the rank."""
    _release_forkserver()
    _default_ending_signals()
    reaper.die_with_parent()  # no rank outlives pytest
    reaper.become_subreaper()  # what a test starts stays below this rank, to be found
    os.setpgrp()  # our own process group: the pool kills the rank and anything it started
    _redirect_output(files)
    logs.use_file(files.log)
    _watch_stacks(files.stacks)
    where = _WhereBoard(str(files.where))
    where.install()
    kept_group.watch_operations()
    kept_group.share_issued_count(str(files.issued))
    raw_threads.install()
    group_release.watch_made_groups()
    stdin.install(lambda: _serving_rank)
    global _baseline, _worker_pid
    _worker_pid = os.getpid()
    _baseline = state.take(skip_signals=(DUMP_STACKS_SIGNAL,))
    gc.freeze()  # what the rank starts with (torch) is never garbage: no collection walks it
    conn.send(Message(Kind.READY, Ready(os.getpid())))
    while True:
        try:
            message = conn.recv()
        except (EOFError, OSError):
            os._exit(0)  # the pytest process is gone
        if message.kind is Kind.DROP_GROUP:
            dropped = kept_group.kept_after(message.payload.key)
            if dropped:
                _teardown_group()  # peers still waiting on this rank fail now
            _settle(conn, message.payload.key, check=dropped)
            continue
        logs.empty()  # its output files the pytest side empties before sending the task
        outcome = _serve(message.payload)
        _end_if_a_forked_copy(None)  # one made in a fixture's teardown, say: it never reports
        _flush()
        conn.send_bytes(pickle.dumps(Message(Kind.RESULT, outcome), pickle.HIGHEST_PROTOCOL))
        if outcome.ending is not Ending.RETURNED or outcome.settles:
            _settle(conn, outcome.key, check=True, strict=outcome.settles)


def _settle(conn: Any, key: str, check: bool, strict: bool = False) -> None:
    """After a group was torn down because a test failed or a peer lags: a group something
    still holds (an FSDP model's mesh, say) keeps its sockets open, and a peer waiting on
    this rank would wait until its timeout instead of failing at once. The rank then ends:
    the kernel closes them. Either way it tells the pytest side first, which waits for this
    before the next run (a rank ending once that run is sent would fail it) and replaces a
    rank that ends. Only after the result is sent: collecting garbage takes tenths of a
    second. `strict` for a group the test set up itself: one still being freed at the
    bound counts as held (its store may still listen on a port the next test wants)."""
    leaving = check and group_release.held_after_test(strict)
    with contextlib.suppress(OSError):
        conn.send(Message(Kind.SETTLED, Settled(key, leaving)))
    if leaving:
        _flush()
        os._exit(0)


def _draw_own_random_numbers() -> None:
    """Seed this rank's generators afresh, as a new process's are, before each test: warm
    ranks share the forkserver's generator state, and a test that seeds every rank alike
    leaves them so, and every rank then drew the same numbers (a test of gradient averaging
    passed with no averaging). A test that seeds its generators is not affected. ~20 us."""
    seed = int.from_bytes(os.urandom(8), "little")
    torch.default_generator.manual_seed(seed)
    if state.cuda_device() is not None:  # CUDA in use here
        torch.cuda.manual_seed_all(seed)
    random.seed(seed)
    numpy = sys.modules.get("numpy")
    if numpy is not None:
        numpy.random.seed(seed % 2**32)


def _end_if_a_forked_copy(error: BaseException | None) -> None:
    """A copy of this rank made by os.fork that returned (or raised) out of the test into
    the harness ends as its own process would, never serving as the rank: it would report
    to the pytest side as the rank, and take later tests."""
    if os.getpid() == _worker_pid:
        return
    code = 0
    if isinstance(error, SystemExit):
        code = exit_code(error)
    elif error is not None:
        traceback.print_exception(error)
        code = 1
    _flush()
    os._exit(code)


def _default_ending_signals() -> None:
    """SIGTERM and SIGHUP as in any new process: a rank is forked with the handlers the
    fork server set for itself (forkserver_guard), which kill the caller's whole tree."""
    guard = sys.modules.get("harness.rank.forkserver_guard")
    for signum in getattr(guard, "ENDING_SIGNALS", ()):
        if signal.getsignal(signum) is getattr(guard, "_end_with_the_tree", None):
            signal.signal(signum, signal.SIG_DFL)


def _release_forkserver() -> None:
    """Drop the forkserver's liveness pipe that forkserver children inherit.

    While any rank holds that pipe's write end, the server never sees pytest die, so it
    never exits and PDEATHSIG never fires. Without it, a rank that uses the forkserver start
    method itself (a DataLoader, say) starts a server of its own.
    """
    from multiprocessing import forkserver

    server: Any = forkserver._forkserver  # private: no public way to drop the pipe
    fd = getattr(server, "_forkserver_alive_fd", None)
    if fd is not None:
        with contextlib.suppress(OSError):
            os.close(fd)
        server._forkserver_alive_fd = None
        server._forkserver_address = None


def _redirect_output(files: RankFiles) -> None:
    """fds 1 and 2 into the rank's files, which the pytest side reads even after a death.

    Opened O_APPEND: the pytest side empties them before each task, and the rank's next
    write then lands at the start. fds 1 and 2 are restored after every test (from
    state.py's copies).
    """
    for target, path in ((1, files.stdout), (2, files.stderr)):
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND | os.O_TRUNC, 0o600)
        os.dup2(fd, target)
        os.close(fd)
    sys.stdout, sys.stderr = state.open_streams()


def _watch_stacks(path: Path) -> None:
    """Have SIGUSR1 dump every thread's stack to `path`, and remember it to do so again."""
    global _stack_file, _stack_path, _stack_id
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
    # Never closed by the object: a test may have closed an earlier one's fd, whose number
    # can belong to something else by now.
    _stack_file = open(fd, "a", closefd=False)  # noqa: SIM115 - must outlive this frame
    _stack_path, _stack_id = path, state.file_id(fd)
    faulthandler.register(DUMP_STACKS_SIGNAL, file=_stack_file, all_threads=True)


def _stacks_still_watched() -> bool:
    """Whether the stack dump still goes to the stacks file (a test may have closed it, or
    taken the signal)."""
    if signal.getsignal(DUMP_STACKS_SIGNAL) != signal.SIG_DFL:
        return False
    try:
        return state.file_id(_stack_file.fileno()) == _stack_id
    except (OSError, ValueError):
        return False


def _flush() -> None:
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(Exception):
            stream.flush()


class _WhereBoard:
    """A shared-memory note of the labelled collective this rank is in, for hang reports."""

    def __init__(self, path: str) -> None:
        with open(path, "w+b") as f:
            f.truncate(WHERE_SIZE)
            self._map = mmap.mmap(f.fileno(), WHERE_SIZE)
        self._stack: list[str] = []

    def install(self) -> None:
        points = rankwise_points()
        if points is not None:  # harness used without rankwise: nothing to observe
            points.add_observer(self.observe)

    def observe(self, phase: str, kind: str, label: str) -> None:
        if phase == "enter":
            self._stack.append(f"{kind}({label!r})")
        elif self._stack:
            self._stack.pop()
        self._map[:] = encode_where(self._stack)


def _serve(task: RunTask) -> RankOutcome:
    """Run one task on this rank and undo what the test did to the process; never raises.

    What cannot be undone fails the test on this rank (a leftover the pytest side reports),
    and the pool then replaces its ranks, so the next test is not hurt.
    """
    global _serving_rank
    _serving_rank = task.rank
    saved_env = environment.snapshot()
    cuda_device = state.cuda_device()
    outcome, test_env = _run_task(task)
    try:
        environment.restore(saved_env if test_env is None else test_env)
        _restore(cuda_device)  # the default device's mode (set_default_device) included
        _note_modes_left(outcome, _MODES_AT_START)
    except Exception as exc:
        outcome.leftovers[hygiene.UNDONE] = (
            f"changed its process in a way the harness could not undo "
            f"({type(exc).__name__}: {exc}); the ranks are replaced for the next test"
        )
        outcome.kept_group = None
    return outcome


def _why_replaced(daemons: list[str], unwaited_before: int | None) -> str:
    """Why this rank must not serve another test, though the test may pass: what it left
    that the process keeps for its life ("" when nothing)."""
    replaced = "the ranks are replaced for the next test"
    if daemons:
        return f"left daemon threads running ({', '.join(daemons)}); {replaced}"
    if _rpc_was_initialized():
        return (
            f"set torch.distributed.rpc up (its RRef context keeps the first agent for the "
            f"process's life: RPC cannot be set up again in it); {replaced}"
        )
    unwaited = kept_group.unwaited_functional()
    if unwaited is not None and unwaited_before is not None and unwaited > unwaited_before:
        n = unwaited - unwaited_before
        return (
            f"left {n} functional collective{'s' if n > 1 else ''} unwaited (torch's work "
            f"registry keeps it, and its group, for the process's life); wait for its result "
            f"(.wait(), or use the tensor); {replaced}"
        )
    return ""


def _rpc_was_initialized() -> bool:
    """Whether torch.distributed.rpc was ever set up in this process (init_rpc records the
    workers' names; shutdown leaves them)."""
    api = sys.modules.get("torch.distributed.rpc.api")
    return bool(getattr(api, "_ALL_WORKER_NAMES", None))


def _function_modes() -> int:
    """How many torch function modes are entered (`with torch.device(...)` is one)."""
    return int(torch._C._len_torch_function_stack())


_MODES_AT_START = _function_modes()  # as the rank came up: none, normally


def _note_modes_left(outcome: RankOutcome, before: int) -> None:
    """A torch function mode, autocast or a DeviceMesh the test left entered would act in
    every later test (a mode that forced torch.allclose to True made a failing test pass):
    it is the test's hygiene error, and the rank is replaced (popping a function mode here
    made ranks hang)."""
    left = []
    modes = _function_modes() - before
    if modes > 0:
        left.append(f"a torch function mode entered ({_mode_names(modes)})")
    devices = _autocast_devices()
    if devices:
        left.append(f"autocast entered ({', '.join(devices)})")
    meshes = _meshes_entered()
    if meshes:
        left.append(f"a DeviceMesh entered ({meshes})")
    if not left:
        return
    what = "; left ".join(left)
    earlier = outcome.leftovers.get(hygiene.UNDONE)
    outcome.leftovers[hygiene.UNDONE] = (earlier + "; " if earlier else "") + (
        f"left {what}; exit it (use it in a with block); the ranks are replaced for the next test"
    )
    outcome.replace_after = f"left {what}"


_AUTOCAST_DEVICES = ("cpu", "cuda", "xpu", "hpu", "mps")


def _autocast_devices() -> list[str]:
    """The device types autocast is enabled for (none, as a rank starts)."""
    if not torch._C._is_any_autocast_enabled():
        return []
    found = []
    for device in _AUTOCAST_DEVICES:
        with contextlib.suppress(Exception):  # a device type this torch does not know
            if torch.is_autocast_enabled(device):
                found.append(device)
    return found or ["a device"]


def _meshes_entered() -> str:
    """The DeviceMeshes entered as the current mesh and not exited (taken off the stack)."""
    module = sys.modules.get("torch.distributed.device_mesh")  # not imported: none entered
    stack = getattr(getattr(module, "_mesh_resources", None), "mesh_stack", None)
    if not stack:
        return ""
    names = ", ".join(repr(mesh) for mesh in stack)
    stack.clear()
    return names


def _mode_names(count: int) -> str:
    try:
        from torch.overrides import _get_current_function_mode_stack

        stack = _get_current_function_mode_stack()  # type: ignore[no-untyped-call]
        return ", ".join(type(mode).__name__ for mode in stack[-count:])
    except Exception:  # another torch's internals: the count says enough
        return f"{count} mode(s)"


DAEMONIC_END_WAIT_S = 1.0


def _end_daemonic_children() -> None:
    """For a run that stands for a process of its own (an adopted test, harness.spawn): end
    its daemonic multiprocessing children as multiprocessing does at that process's exit;
    they are not leftovers there. Others (and one that outlives SIGTERM) stay leftovers."""
    import multiprocessing

    daemonic = [child for child in multiprocessing.active_children() if child.daemon]
    for child in daemonic:
        child.terminate()
    for child in daemonic:
        child.join(DAEMONIC_END_WAIT_S)


def _run_task(task: RunTask) -> tuple[RankOutcome, environment.Snapshot | None]:
    """How the task ended here, and the environment it started with (None: not set yet)."""
    test_env: environment.Snapshot | None = None
    kept: str | None = None
    outcome: RankOutcome | None = None
    # The test's threads may end until its bound (the pytest side's deadline for this run).
    threads_until = time.monotonic() + task.spec.timeout_s - hygiene.REPORT_MARGIN_S
    try:
        test_env = _apply_environment(task)  # mostly already so: going back costs nothing
        _enter_test_context(task)
        before = hygiene.before_test()
        raw_before = raw_threads.running().keys()
        unwaited = kept_group.unwaited_functional()
        _xfail_as_pytest_has_it(task.spec.runxfail)
        with rank_warnings.recording(task.spec.warning_filters) as log:
            call = _prepare_call(task)  # the test's module is loaded: its loggers exist
            with (
                logs.capturing(task.spec.log_capture),
                Injector(task.rank, call.faults).installed() as injector,
                rank_warnings.stray_exceptions(task.spec.stray_warnings) as stray,
            ):
                outcome = _run_target(task, call, injector, stray)
        outcome.warnings = rank_warnings.collected(log)
        group_left = (task.launch_port is not None or task.spec.bare) and dist.is_initialized()
        if task.spec.bare:
            _end_daemonic_children()
        left = reaper.leftovers(os.getpid())
        reaper.kill(list(left))  # whatever the test allows: the next test must not meet them
        raw = [f for serial, f in raw_threads.running().items() if serial not in raw_before]
        outcome.leftovers = hygiene.findings(
            before, task.spec.hygiene, group_left, left, raw, threads_until
        )
        hygiene.put_back_native_env(before)
        daemons = hygiene.daemons_left(before) if "threads" in task.spec.hygiene else []
        outcome.replace_after = outcome.replace_after or _why_replaced(daemons, unwaited)
        kept_ok = not (outcome.leftovers or outcome.replace_after)
        if task.keep_group and outcome.ending is Ending.RETURNED and kept_ok:
            kept = outcome.kept_group = kept_group.keep(task.key)
            outcome.point_to_point = kept_group.point_to_point()
            outcome.kept_counts = kept_group.counts()
        return outcome, test_env
    except BaseException as exc:  # the harness's own set-up failed on this rank
        outcome = _raised(task, exc, note="while setting the rank up for the test")
        outcome.setup_failed = isinstance(exc, _SetUpFailed)
        return outcome, test_env
    finally:
        if kept is None:
            _teardown_group()
        global _torn_down_test_group
        # Groups a spawned or launched run made on its own store stay alive if something
        # holds them (a subgroup in a module's cache), and with them the port it listens on.
        own_store = task.spec.bare or task.launch_port is not None
        if outcome is not None and (
            _torn_down_test_group or (own_store and group_release.made_alive())
        ):
            outcome.settles = True
        _torn_down_test_group = False


_real_xfail = _pytest.outcomes.xfail  # pytest.xfail itself may be a forked session's no-op


def _no_op_xfail(reason: str = "") -> None:
    pass


_no_op_xfail.Exception = _real_xfail.Exception  # type: ignore[attr-defined]


def _xfail_as_pytest_has_it(runxfail: bool) -> None:
    """Under --runxfail pytest makes pytest.xfail() a no-op for the session: so in the rank,
    which serves one session. Left so between runs: a module a run loads binds what it
    finds (`from pytest import xfail`), and a later test of the session calls that."""
    pytest.xfail = _no_op_xfail if runxfail else _real_xfail  # type: ignore[assignment]


_baseline: state.Baseline | None = None
_serving_rank = -1  # the rank of the task this process serves now
_worker_pid = 0  # this rank's own pid (a forked copy of it has another)
_stack_file: Any = None
_stack_path: Path | None = None
_stack_id: tuple[int, int] = (0, 0)


def _restore(cuda_device: int | None) -> None:
    """Undo what the test did to this process (see state.py), so the next test is not hurt."""
    if _baseline is not None:
        state.restore_baseline(_baseline, cuda_device)
    if _stack_path is not None and not _stacks_still_watched():
        signal.signal(DUMP_STACKS_SIGNAL, signal.SIG_DFL)  # Python's view: no handler
        faulthandler.unregister(DUMP_STACKS_SIGNAL)  # else register keeps what it thinks it has
        _watch_stacks(_stack_path)


def _apply_environment(task: RunTask) -> environment.Snapshot:
    """Give the rank the environment the test sees, as torchrun's children have theirs;
    returns it, for the rank to go back to after the test.

    The last test's is still there, so mostly only PYTEST_CURRENT_TEST changes.
    """
    if task.env is not None:
        environment.restore(environment.encoded(task.env), leave=_SET_PER_RUN)
    if task.current_test is None:
        os.environ.pop(CURRENT_TEST, None)
    else:
        os.environ[CURRENT_TEST] = task.current_test
    if os.environ.get(IN_RANK_WORKER) != "1":
        os.environ[IN_RANK_WORKER] = "1"  # a pytest started in here is no launched rank
    return environment.snapshot()


_SET_PER_RUN = (CURRENT_TEST, IN_RANK_WORKER)


def _enter_test_context(task: RunTask) -> None:
    _draw_own_random_numbers()
    if task.sys_path:
        sys.path[:] = task.sys_path
    os.chdir(task.cwd)
    spec = task.spec
    global _assert_verbosity
    _assert_verbosity = spec.assert_verbosity
    if spec.threads is not None:  # restored after the test (state.py)
        torch.set_num_threads(spec.threads)
    if spec.backend == "nccl":
        torch.cuda.set_device(torch.device(task.device))
    kept_group.fingerprinting = spec.collective_check
    reuse = kept_group.reusable(task.reuse_group)
    if not reuse:
        _teardown_group()  # a kept group this test does not run on
    if task.launch_port is not None:
        os.environ.update(_launch_env(task))
        return
    if spec.bare:  # as under torch.multiprocessing.spawn: the target makes its own group
        return
    # The store client serves every test of this rank: a timeout one test set is not the next's.
    _client_store(task).set_timeout(_group_timeout(spec))
    if task.reuse_group is not None:
        _check_kept_group(task, reuse)
    else:
        _set_up_group(task)


def _set_up_group(task: RunTask) -> None:
    store = dist.PrefixStore(  # type: ignore[attr-defined]
        task.store_prefix, _client_store(task)
    )
    error = ""
    try:
        _init_group(task, store)
    except Exception as exc:
        error = f"{type(exc).__name__}: {exc}"
    _agree_on_set_up(task, store, error)
    kept_group.made(task.store_prefix, keepable=task.keep_group)


def _check_kept_group(task: RunTask, held: bool) -> None:
    """Start the body on the kept group, which the pytest side found in step on every rank
    after the last test; raise if this rank no longer holds it.

    Nothing runs on a rank between tests, so that should never happen; if it does, the rank
    tears its group down (peers blocked on it fail at once) and the pytest side tries the
    test again on a fresh group.
    """
    if not held:  # torn down here already, so peers waiting on it fail at once
        raise _SetUpFailed(f"rank {task.rank}: the kept process group is gone on this rank")
    kept_group.reuse(task.store_prefix)


def _init_group(task: RunTask, store: Any) -> None:
    spec = task.spec
    kwargs: dict[str, Any] = {}
    if spec.backend == "nccl":
        kwargs["device_id"] = torch.device(task.device)
    with _on_loopback(spec.backend):
        dist.init_process_group(
            spec.backend,
            store=store,
            rank=task.rank,
            world_size=spec.world_size,
            timeout=_group_timeout(spec),
            **kwargs,
        )
    failures = int(os.environ.get(SIMULATED_SET_UP_FAILURES, "0"))
    if task.rank == 1 and task.setup_attempt <= failures:  # the harness's own tests only
        raise RuntimeError(f"simulated set-up failure (attempt {task.setup_attempt})")


@contextlib.contextmanager
def _on_loopback(backend: str) -> Iterator[None]:
    """gloo listens where the host name resolves, and NCCL's bootstrap on its default
    interface, unless told one: the harness's own groups (every rank on this machine) listen
    on the loopback interface, out of reach of other hosts. A GLOO_SOCKET_IFNAME or
    NCCL_SOCKET_IFNAME the test's environment sets is left as it is."""
    name = "GLOO_SOCKET_IFNAME" if "gloo" in backend else "NCCL_SOCKET_IFNAME"
    if name in os.environ:
        yield
        return
    os.environ[name] = _LOOPBACK_INTERFACE
    try:
        yield
    finally:
        os.environ.pop(name, None)


def _loopback_interface() -> str:
    """The loopback interface's name ("lo" on Linux)."""
    names = [name for _, name in socket.if_nameindex() if name.startswith("lo")]
    return names[0] if names else "lo"


_LOOPBACK_INTERFACE = _loopback_interface()


class _SetUpFailed(Exception):
    """The harness could not set the test's group up, on this rank or on a peer."""


def _agree_on_set_up(task: RunTask, store: Any, error: str) -> None:
    """Start the body only where every rank's group came up; else every rank raises.

    Without this a rank whose peer failed to connect (gloo's connectFullMesh under load)
    would run the body and fail in its first collective, blamed on the test.
    """
    world = task.spec.world_size
    keys = [signing.key(task.secret, f"setup/{r}") for r in range(world)]
    where = [f"{task.store_prefix}{k}" for k in keys]
    store.set(keys[task.rank], signing.sign(task.secret, where[task.rank], error))
    store.wait(keys, timedelta(seconds=task.spec.timeout_s))
    failed = []
    for r, blob in enumerate(store.multi_get(keys)):
        status = signing.verify(task.secret, where[r], blob)
        if status is None:  # not this session's rank: named, never believed
            failed.append(
                f"rank {r}: harness error: unsigned value for {where[r]} in the store at "
                f"{task.store_path}, ignored (another process writes to the session's "
                f"store)"
            )
        elif status:
            failed.append(f"rank {r}: {status.decode(errors='replace')}")
    if failed:
        raise _SetUpFailed("; ".join(failed))


_stores: dict[str, PrivateStore] = {}


def _client_store(task: RunTask) -> PrivateStore:
    """One store object per store for the worker's life; tests differ by key prefix."""
    if task.store_path not in _stores:
        _stores[task.store_path] = PrivateStore(task.store_path, _group_timeout(task.spec))
    return _stores[task.store_path]


def _group_timeout(spec: RankSpec) -> timedelta:
    """The bound of a test's group and store: past the test's own, so the harness's timer
    names a hang before torch's timeout turns it into an error."""
    return timedelta(seconds=spec.timeout_s + GROUP_TIMEOUT_MARGIN_S)


def _launch_env(task: RunTask) -> dict[str, str]:
    """torchrun's environment; every rank rendezvouses as a client of the pytest-side store."""
    assert task.launch_port is not None
    return torchrun_env(
        task.spec.world_size,
        task.rank,
        master_addr=loopback.HOST,
        master_port=task.launch_port,
        agent_store=True,
        run_id=task.key,
        restart_count=task.attempt,
    )


# Whether the test's run tore down a default group the test had set up itself.
_torn_down_test_group = False


def _teardown_group() -> None:
    global _torn_down_test_group
    if not dist.is_available():
        kept_group.forget()
        return
    _torn_down_test_group |= kept_group.test_made_default_group()
    kept_group.forget()
    if dist.is_initialized():
        with contextlib.suppress(Exception):
            group_release.destroy_all()
    else:  # an init_process_group that failed (a peer gone mid-connect) took a group name
        group_release.forget_failed_init()


@dataclass
class _Call:
    """The test function and what it is called with, loaded in the rank."""

    fn: Callable[..., Any]
    args: tuple[Any, ...]
    kwargs: dict[str, Any]
    faults: tuple[Fault, ...]
    fixtures: FixturePlan | None  # the test's fixtures this rank makes


def load_test_module(target: Target) -> None:
    """Import `target`'s module as a test's run would (assertions rewritten), ahead of it:
    its own bound then times the body, not the import (see warm/session.py's load_test_module)."""
    _finder.learn(target)
    _load_module(target.module, target.file)  # by name where it has no test file


def _prepare_call(task: RunTask) -> _Call:
    """Load the test's module, then what may refer to its classes: the arguments, the faults."""
    _finder.learn(task.target)  # first: those classes may live in modules only pytest can find
    run = decode_args(task.args_blob)
    fn = _resolve(task, run.instance_state, run.class_state)
    return _Call(fn, run.args, run.kwargs, task.load_faults(), run.fixtures)


def _run_target(
    task: RunTask, call: _Call, injector: Injector, stray: rank_warnings.StrayExceptions
) -> RankOutcome:
    fn, args, kwargs, plan = call.fn, call.args, call.kwargs, call.fixtures
    made = kwargs if plan is None else {**plan.values, **kwargs}  # every fixture's value
    info = made.get("request")
    fixtures = RankFixtures(task.rank, info if isinstance(info, RequestInfo) else None)
    fixtures.bind(fn)
    group_release.test_begins()  # groups made from here on are the test's (fixtures too)
    try:
        made.update(_rank_side_values(task, made))
        made.update(fixtures.make(made))
        if plan is not None:
            fixtures.make_fixtures(plan, made, getattr(fn, "__self__", None), _load_module)
            kwargs = {name: made[name] for name in kwargs}
        fixtures.enter_phase("call")
        injector.at_start()
        value = fn(*args, **kwargs)
        _end_if_a_forked_copy(None)
        endings.refuse_awaitable(value)
        fixtures.close()  # finalizers and undoing, in the rank: an error there fails it
        _end_if_a_forked_copy(None)  # a fixture's teardown forked, and its copy came back
        stray.warn()  # exceptions in its threads or __del__, as pytest warns of them
    except BaseException as exc:
        _end_if_a_forked_copy(exc)
        # The traceback text, before its frames are cleared.
        outcome = endings.ended_by(task.key, task.rank, exc, task.spec.show_locals)
        endings.release(exc)
        del exc, args, kwargs, made, call
        # Peers blocked on us fail now instead of at their timeout, and so does a fixture's
        # teardown waiting in a collective (it would hang until the deadline, and the report
        # would show where ranks waited instead of this error).
        _teardown_group()
        try:
            fixtures.close()
            _end_if_a_forked_copy(None)
        except BaseException as also:  # reported with the body's error, not instead of it
            said = f"{type(also).__name__}: {endings.text_of(also)}"
            outcome.notes.append(f"then, tearing its fixtures down: {said}")
            del also
        return outcome
    missed = injector.unreached()
    if missed is not None:
        return endings.not_reached(task.key, task.rank, missed)
    return endings.returned(task.key, task.rank, value)


def _rank_side_values(task: RunTask, kwargs: dict[str, Any]) -> dict[str, Any]:
    """Fill the fixtures only a rank can know, where the test asked for them and the pytest
    process left them to the rank (None: a project's own `device` fixture has a value)."""
    known: dict[str, Callable[[], Any]] = {
        "rank": lambda: task.rank,
        "world_size": lambda: task.spec.world_size,
        "device": lambda: torch.device(task.device),
    }
    return {name: make() for name, make in known.items() if name in kwargs and kwargs[name] is None}


def _raised(task: RunTask, exc: BaseException, note: str = "") -> RankOutcome:
    return endings.raised(task.key, task.rank, exc, note)


# ---- finding the test function inside a rank ----------------------------------------------

_loaded: dict[str, tuple[str, int]] = {}


def _resolve(
    task: RunTask, instance_state: dict[str, Any] | None, class_state: dict[str, Any] | None
) -> Callable[..., Any]:
    target = task.target
    module = _load_module(target.module, target.file)
    holder: Any = module
    parts = target.qualname.split(".")
    for part in parts[:-1]:
        holder = getattr(holder, part)
    if isinstance(holder, type):
        for name, value in (class_state or {}).items():
            setattr(holder, name, value)  # what setup_class set in the pytest process
        holder = holder()  # a test class: pytest makes one instance per test too
        holder.__dict__.update(instance_state or {})  # what setup_method set on it
    return getattr(holder, parts[-1])  # type: ignore[no-any-return]


class _PytestsModules(importlib.abc.MetaPathFinder):
    """Finds, last of all finders, the modules pytest loaded under names sys.path cannot
    resolve (--import-mode=importlib, rootdir-relative packages): by the file pytest used."""

    def __init__(self) -> None:
        self._files: dict[str, str] = {}
        self._packages: dict[str, tuple[str, ...]] = {}

    def learn(self, target: Target) -> None:
        self._files.update(target.modules)
        self._packages.update(target.packages)
        if self not in sys.meta_path:
            sys.meta_path.append(self)

    def find_spec(self, name: str, path: Any = None, target: Any = None) -> Any:
        if name in self._files:
            loader = _RewritingLoader(self._files[name])
            return importlib.util.spec_from_file_location(name, self._files[name], loader=loader)
        if name in self._packages:
            spec = importlib.machinery.ModuleSpec(name, None, is_package=True)
            spec.submodule_search_locations = list(self._packages[name])
            return spec  # a namespace package over pytest's paths
        return None


class _RewritingLoader(importlib.abc.Loader):
    """Executes a test or conftest file as pytest does: with its asserts rewritten."""

    def __init__(self, file: str) -> None:
        self._file = file

    def create_module(self, spec: Any) -> None:
        return None

    def exec_module(self, module: types.ModuleType) -> None:
        exec(_rewritten_code(self._file), module.__dict__)


_finder = _PytestsModules()


def _load_module(name: str, file: str | None) -> types.ModuleType:
    """Import the target's module; a test file is compiled with pytest's assertion rewriting."""
    if file is None:
        return importlib.import_module(name)
    stamp = (file, os.stat(file).st_mtime_ns)
    if _loaded.get(name) == stamp and name in sys.modules:
        return sys.modules[name]
    code = _rewritten_code(file)
    module = types.ModuleType(name)
    module.__file__ = file
    module.__package__ = name.rpartition(".")[0]
    sys.modules[name] = module
    try:
        exec(code, module.__dict__)
    except BaseException:
        sys.modules.pop(name, None)
        raise
    _loaded[name] = stamp
    return module


def _rewritten_code(file: str) -> types.CodeType:
    """`file` compiled as pytest compiles a test module: with its asserts rewritten."""
    source = Path(file).read_bytes()
    tree = ast.parse(source, filename=file)
    _rewrite_asserts(tree, source, file)
    return compile(tree, file, "exec", dont_inherit=True)


def _rewrite_asserts(tree: ast.Module, source: bytes, file: str) -> None:
    try:
        from _pytest.assertion.rewrite import rewrite_asserts
    except ImportError:  # pragma: no cover - pytest is always there in a rank
        return
    rewrite_asserts(tree, source, file, None)
    _install_explanations()


_assert_verbosity = 0  # the running test's -v, for its asserts' diffs


def _install_explanations() -> None:
    """Give rewritten asserts pytest's detailed comparisons ('At index 1 diff: 2 != 3').

    pytest wires these up per test in its own process; in a rank we call its comparison
    helper directly, adapting to the helper's signature, which differs between versions.
    """
    import inspect

    from _pytest.assertion import util

    if util._reprcompare is not None:
        return
    params = inspect.signature(util.assertrepr_compare).parameters
    if "highlighter" in params:  # pytest >= 9

        def lines(op: str, left: object, right: object) -> Any:
            return util.assertrepr_compare(
                op,
                left,
                right,
                verbose=_assert_verbosity,
                highlighter=lambda source, lexer="python": source,
                assertion_text_diff_style="ndiff",
            )
    else:
        config = types.SimpleNamespace(
            get_verbosity=lambda *a: _assert_verbosity,
            getoption=lambda *a, **k: _assert_verbosity,
            getini=lambda *a: "",
        )

        def lines(op: str, left: object, right: object) -> Any:
            compare: Any = util.assertrepr_compare  # the pytest < 9 signature
            return compare(config, op, left, right)

    def explain(op: str, left: object, right: object) -> str | None:
        try:
            found = [line.replace("\n", "\\n") for line in lines(op, left, right) or ()]
        except Exception:
            return None
        return "\n~".join(found).replace("%", "%%") if found else None

    util._reprcompare = explain
