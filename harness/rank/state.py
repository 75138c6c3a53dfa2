"""What a warm rank puts back after each test, so the next test starts as the first one did.

Runs inside ranks only (imports torch). The worker takes a :class:`Baseline` once it is set
up and restores it after every test: the standard streams and file descriptors 0-2 (a test
may close or replace them; a later socket would then take fd 1 and a print would write into
it), signal handlers, blocked signals and pending alarms (interval timers), the recursion
limit, umask, trace and profile functions and logging.disable's level, torch's default
dtype, device and thread count, its print options, anomaly detection, matmul precision,
cuDNN flags, warn-always, flush-denormal and global module hooks, and the CUDA device. The
working directory, ``sys.path`` and the environment are set afresh from each run's task.
"""

from __future__ import annotations

import contextlib
import faulthandler
import io
import logging
import os
import signal
import sys
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed
from torch.nn.modules import module as nn_module

STANDARD_FDS = (0, 1, 2)
# The C function signal.getsignal wraps, without its enum lookup per signal (~1 us each).
getsignal: Callable[[int], Any] = getattr(sys.modules.get("_signal"), "getsignal", signal.getsignal)
_distributed: Any = torch.distributed  # its debug-level functions are not in torch's stubs
_UNCATCHABLE = {signal.SIGKILL, signal.SIGSTOP}
_TIMERS = (signal.ITIMER_REAL, signal.ITIMER_VIRTUAL, signal.ITIMER_PROF)
_PRINT_OPTIONS: Any = torch._tensor_str.PRINT_OPTS  # what torch.set_printoptions sets


@dataclass(frozen=True)
class Baseline:
    fds: dict[int, int]  # each standard fd -> a private duplicate of what it was
    streams: tuple[Any, Any, Any]  # sys.stdin, sys.stdout, sys.stderr
    handlers: dict[signal.Signals, Any]  # each catchable signal's handler, as _signal reports it
    dtype: torch.dtype
    threads: int
    grad: bool  # torch.is_grad_enabled()
    deterministic: tuple[bool, bool]  # use_deterministic_algorithms(mode, warn_only=...)
    debug_level: Any  # torch.distributed's: DETAIL on one rank would wrap its next groups only
    torch_modes: tuple[Any, ...]  # the process-wide settings of _torch_modes
    process: tuple[Any, ...]  # the interpreter's and the process's settings of _process
    module_hooks: dict[str, Any]  # torch.nn's global module hooks, by registry


def _process() -> tuple[Any, ...]:
    """What a test may set for the whole process, a new one would not have: the recursion
    limit, the umask, trace and profile functions, the blocked signals, torch's
    warn-always flag and logging.disable's level."""
    mask = os.umask(0o022)
    os.umask(mask)
    return (
        sys.getrecursionlimit(),
        mask,
        sys.gettrace(),
        sys.getprofile(),
        frozenset(signal.pthread_sigmask(signal.SIG_BLOCK, [])),
        torch.is_warn_always_enabled(),
        logging.root.manager.disable,
    )


def _restore_process(saved: tuple[Any, ...]) -> None:
    if _process() == saved:
        return
    limit, mask, trace, profile, blocked, warn_always, disabled = saved
    sys.setrecursionlimit(limit)
    os.umask(mask)
    sys.settrace(trace)
    sys.setprofile(profile)
    signal.pthread_sigmask(signal.SIG_SETMASK, blocked)
    torch.set_warn_always(warn_always)
    logging.disable(disabled)


# torch.nn's registries of hooks every module runs (register_module_forward_hook, ...).
_MODULE_HOOKS = tuple(name for name in vars(nn_module) if name.startswith("_global_"))


def _module_hooks() -> dict[str, Any]:
    """Each registry's hooks (a copy), and its flags as they are (whether the backward hooks
    are full ones)."""
    found = {name: getattr(nn_module, name) for name in _MODULE_HOOKS}
    return {name: dict(v) if isinstance(v, dict) else v for name, v in found.items()}


def _restore_module_hooks(saved: dict[str, Any]) -> None:
    for name, hooks in saved.items():
        registry = getattr(nn_module, name)
        if registry == hooks:
            continue
        if isinstance(registry, dict):
            registry.clear()
            registry.update(hooks)
        else:
            setattr(nn_module, name, hooks)


def _torch_modes() -> tuple[Any, ...]:
    """torch's process-wide settings a test may change and a new process would not have:
    the default device (torch.set_default_device), print options, anomaly detection, float32
    precision (the legacy and the per-backend settings) and the cuDNN flags. A few
    microseconds."""
    cudnn: Any = torch.backends.cudnn
    return (
        getattr(torch._GLOBAL_DEVICE_CONTEXT, "device_context", None),
        tuple(vars(_PRINT_OPTIONS).items()),
        (torch.is_anomaly_enabled(), torch.is_anomaly_check_nan_enabled()),
        _legacy_precision(),
        tuple(_backend_precision(path) for path in _PRECISIONS),
        (cudnn.enabled, cudnn.benchmark, cudnn.deterministic, cudnn.allow_tf32),
    )


# torch's per-backend float32 precision settings (torch.backends.<path>.fp32_precision).
_PRECISIONS: tuple[str, ...] = ("", "cuda.matmul", "cudnn", "cudnn.conv", "cudnn.rnn", "mkldnn")
_PRECISIONS += ("mkldnn.matmul", "mkldnn.conv", "mkldnn.rnn")


def _backend(path: str) -> Any:
    """torch.backends.<path> ("" for torch.backends itself)."""
    holder: Any = torch.backends
    for part in filter(None, path.split(".")):
        holder = getattr(holder, part)
    return holder


def _backend_precision(path: str) -> str | None:
    try:
        return str(_backend(path).fp32_precision)
    except Exception:  # this torch has no such setting
        return None


def _legacy_precision() -> str | None:
    try:  # raises once legacy and per-backend settings were mixed
        return torch.get_float32_matmul_precision()
    except Exception:
        return None


def _set_backend_precisions(values: tuple[str | None, ...]) -> None:
    for path, value in zip(_PRECISIONS, values, strict=True):
        if value is not None and _backend_precision(path) != value:
            _backend(path).fp32_precision = value


def _restore_torch_modes(base: tuple[Any, ...]) -> None:
    device, printing, anomaly, legacy, precisions, flags = base
    now = _torch_modes()
    if now[0] is not device:  # the rank starts with none: set_default_device(None) ends one
        torch.set_default_device(None if device is None else device.device)
    if now[1] != printing:
        vars(_PRINT_OPTIONS).update(dict(printing))
    if now[2] != anomaly:
        torch.set_anomaly_enabled(*anomaly)
    if now[3:5] != (legacy, precisions):
        _set_backend_precisions(precisions)  # first: the legacy getter raises while mixed
        if legacy is not None and _legacy_precision() != legacy:
            torch.set_float32_matmul_precision(legacy)
            _set_backend_precisions(precisions)  # the legacy setter writes them too
    if now[5] != flags:  # torch's test utilities forbid setting them (then never changed)
        cudnn: Any = torch.backends.cudnn
        cudnn.enabled, cudnn.benchmark, cudnn.deterministic, cudnn.allow_tf32 = flags


@contextlib.contextmanager
def torch_globals_kept() -> Iterator[None]:
    """Put back torch's process-wide settings that imports in the block changed (torch's test
    utilities freeze the cuDNN flags when imported): ranks forked from the fork server after
    it preloaded the tests' imports start as a new process would."""
    saved = (torch.get_default_dtype(), torch.is_grad_enabled(), _deterministic(), _torch_modes())
    backends: Any = torch.backends
    frozen = backends.flags_frozen()
    try:
        yield
    finally:
        if not frozen and backends.flags_frozen():
            # torch.backends is a wrapper module: the flag lives in its functions' globals.
            backends.flags_frozen.__globals__["__allow_nonbracketed_mutation_flag"] = True
        _put_back_torch_settings(*saved)


def open_streams() -> tuple[Any, Any]:
    """Line-buffered stdout and stderr over fds 1 and 2: output survives a hard death."""
    out = io.TextIOWrapper(os.fdopen(1, "wb", closefd=False), line_buffering=True)
    err = io.TextIOWrapper(os.fdopen(2, "wb", closefd=False), line_buffering=True)
    return out, err


class _Taken:
    baseline: Baseline | None = None  # the last one taken: the rank's own, once it starts


def take(skip_signals: tuple[int, ...] = ()) -> Baseline:
    """The rank's state now; `skip_signals` are handled at the C level and restored elsewhere."""
    handlers = {
        sig: getsignal(sig)
        for sig in signal.valid_signals()
        if isinstance(sig, signal.Signals) and sig not in _UNCATCHABLE and sig not in skip_signals
    }
    _Taken.baseline = Baseline(
        fds={fd: os.dup(fd) for fd in STANDARD_FDS},
        streams=(sys.stdin, sys.stdout, sys.stderr),
        handlers={sig: h for sig, h in handlers.items() if h is not None},
        dtype=torch.get_default_dtype(),
        threads=torch.get_num_threads(),
        grad=torch.is_grad_enabled(),
        deterministic=_deterministic(),
        debug_level=_distributed.get_debug_level(),
        torch_modes=_torch_modes(),
        process=_process(),
        module_hooks=_module_hooks(),
    )
    return _Taken.baseline


def fd_copies() -> set[int]:
    """The descriptors the rank restores fds 0-2 from after each test (empty before the
    rank took its baseline)."""
    base = _Taken.baseline
    return set() if base is None else set(base.fds.values())


def _deterministic() -> tuple[bool, bool]:
    return (
        torch.are_deterministic_algorithms_enabled(),
        torch.is_deterministic_algorithms_warn_only_enabled(),
    )


def _put_back_torch_settings(
    dtype: torch.dtype, grad: bool, deterministic: tuple[bool, bool], modes: tuple[Any, ...]
) -> None:
    """torch's default dtype, grad mode, deterministic algorithms and the settings of
    _torch_modes, each set only where it differs."""
    if torch.get_default_dtype() != dtype:
        torch.set_default_dtype(dtype)
    if torch.is_grad_enabled() != grad:
        torch.set_grad_enabled(grad)
    if _deterministic() != deterministic:
        mode, warn_only = deterministic
        torch.use_deterministic_algorithms(mode, warn_only=warn_only)
    _restore_torch_modes(modes)


def restore_baseline(base: Baseline, cuda_device: int | None) -> None:
    """Put back everything in `base` that the test changed, and the CUDA device it began on."""
    _restore_fds(base)
    _restore_streams(base)
    for sig, handler in base.handlers.items():
        if getsignal(sig) != handler:
            with contextlib.suppress(OSError, ValueError):
                signal.signal(sig, handler)
    _put_back_torch_settings(base.dtype, base.grad, base.deterministic, base.torch_modes)
    if torch.get_num_threads() != base.threads:
        torch.set_num_threads(base.threads)
    if _distributed.get_debug_level() != base.debug_level:
        _distributed.set_debug_level(base.debug_level)
    _restore_process(base.process)
    _restore_module_hooks(base.module_hooks)
    torch.set_flush_denormal(False)  # torch's default; it has no getter to compare with
    if _cuda_in_use():  # None: the test started CUDA, on the default device 0
        torch.cuda.set_device(0 if cuda_device is None else cuda_device)
    # A dump armed with faulthandler.dump_traceback_later (exit=True ends the process) would
    # go off in a later test; Python has no way to ask whether one is armed.
    faulthandler.cancel_dump_traceback_later()
    for timer in _TIMERS:  # an alarm the test set would go off in a later test
        if signal.getitimer(timer) != (0.0, 0.0):
            signal.setitimer(timer, 0)


def cuda_device() -> int | None:
    """The current CUDA device where CUDA is in use, else None."""
    return torch.cuda.current_device() if _cuda_in_use() else None


def _cuda_in_use() -> bool:
    cuda: Any = torch.cuda  # untyped in torch's stubs
    return bool(cuda.is_initialized())


def _restore_fds(base: Baseline) -> None:
    for fd, saved in base.fds.items():
        if not _same_file(fd, saved):
            os.dup2(saved, fd)


def _same_file(fd: int, saved: int) -> bool:
    try:
        return file_id(fd) == file_id(saved)
    except OSError:
        return False


def file_id(fd: int) -> tuple[int, int]:
    """Which file `fd` is open on (device, inode); raises OSError for a closed fd."""
    found = os.fstat(fd)
    return found.st_dev, found.st_ino


def _restore_streams(base: Baseline) -> None:
    stdin, stdout, stderr = base.streams
    if stdout.closed or stderr.closed:
        stdout, stderr = open_streams()
    sys.stdin, sys.stdout, sys.stderr = stdin, stdout, stderr
