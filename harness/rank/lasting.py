"""What a test leaves in a warm rank that nothing can undo (torch keeps it for the process's
life): a torch function mode, autocast or a DeviceMesh left entered, RPC set up, daemon
threads running, a functional collective left unwaited. Each is a reason the ranks are
replaced before the next test (state.py restores what can be restored).

Runs only in ranks.
"""

from __future__ import annotations

import contextlib
import sys

import torch

from harness.common import hygiene
from harness.common.outcome import RankOutcome
from harness.rank import kept_group

_asked: list[str] = []  # an adapter's reasons this test gave (see replace_after_this_test)


def replace_after_this_test(why: str) -> None:
    """What an adapter found this test left that it cannot put back (`why`, said as what the
    test did): the ranks are replaced before the next test."""
    _asked.append(why)


def why_replaced(daemons: list[str], unwaited_before: int | None) -> str:
    """Why this rank must not serve another test, though the test may pass: what it left
    that the process keeps for its life ("" when nothing)."""
    replaced = "the ranks are replaced for the next test"
    if _asked:
        asked = "; ".join(_asked)
        _asked.clear()
        return f"{asked}; {replaced}"
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


MODES_AT_START = _function_modes()  # as the rank came up: none, normally


def note_modes_left(outcome: RankOutcome, before: int = MODES_AT_START) -> RankOutcome:
    """`outcome`, with what the test left entered: a torch function mode, autocast or a
    DeviceMesh would act in every later test (a mode that forced torch.allclose to True made
    a failing test pass): it is the test's hygiene error, and the rank is replaced (popping a
    function mode here made ranks hang)."""
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
        return outcome
    what = "; left ".join(left)
    finding = (
        f"left {what}; exit it (use it in a with block); the ranks are replaced for the next test"
    )
    return outcome.with_leftover(hygiene.UNDONE, finding).replaced(f"left {what}")


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
