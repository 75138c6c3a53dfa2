"""Frees destroyed gloo process groups on threads of their own, so the next test need not wait.

Freeing a gloo group blocks for about 20 ms whatever the world size (its transport's event
loop is joined between two polls), with the GIL released (torch frees process groups without
it). Done inline, every rank pays that at the end of each test with a fresh group, and the
next set-up waits for the slowest rank's; handed to a thread, the rank answers at once and
sets the next group up while the old one goes. Its sockets still close within milliseconds,
so peers blocked on a failed rank fail as fast. Other backends (NCCL) are freed inline, as
torch does. Runs inside ranks; the threads are daemons, which hygiene leaves alone.
"""

from __future__ import annotations

import contextlib
import gc
import threading
import time
import weakref
from typing import Any

import torch.distributed as dist


def forget_failed_init() -> None:
    """Free the group name an init_process_group that failed took, where no group is set up.

    torch names each new group from a count kept per process, and a failed init counts too:
    the next group here would take the next name, meet its peers under another store
    prefix, and hang until its timeout. destroy_process_group resets the count the same way.
    """
    if dist.is_initialized():
        return
    world: Any = dist.distributed_c10d._world
    with contextlib.suppress(Exception):
        world.group_count = 0


# The gloo groups destroy_all destroyed last, weakly: still alive once freed, something
# holds them (and their sockets, which a peer waiting on this rank would see close).
_destroyed: list[weakref.ref[Any]] = []
_RELEASE_THREAD = "harness-group-release"
# Every group made on this rank since the current test began (its fixtures too), weakly:
# one the test destroyed itself (DTensorTestBase's with_comms does, when the test raises)
# may still be held, by a device mesh say, and keep its sockets open as well.
_made: weakref.WeakSet[Any] = weakref.WeakSet()


def watch_made_groups() -> None:
    """Note each process group made on this rank from now on (once per rank process): every
    group, the default one and new_group's, is made by one function of torch's."""
    c10d: Any = dist.distributed_c10d
    original = getattr(c10d, "_new_process_group_helper", None)
    if original is None or getattr(original, "_harness_watches", False):
        return

    def noting(*args: Any, **kwargs: Any) -> Any:
        made = original(*args, **kwargs)
        with contextlib.suppress(Exception):  # not a group (a rank outside it): nothing
            _made.add(made[0])
        return made

    noting._harness_watches = True  # type: ignore[attr-defined]
    c10d._new_process_group_helper = noting


def made_alive() -> bool:
    """Whether a group made since the test began is still alive (or not yet freed)."""
    if _made:
        _release_what_torch_holds()
    return len(_made) > 0


def test_begins() -> None:
    """The groups made from here on are the test's own."""
    _made.clear()


def destroy_all() -> None:
    """dist.destroy_process_group() for every group, the gloo ones freed on threads."""
    groups = _gloo_groups(process_groups())
    _destroyed[:] = [weakref.ref(group) for group in groups]
    try:
        dist.destroy_process_group()
    finally:
        _hand_over(groups)


def destroy_each(groups: list[Any]) -> None:
    """dist.destroy_process_group(group) for each of `groups`, emptying the list so that the
    caller keeps no reference: the gloo ones are then freed on threads."""
    while groups:
        group = groups.pop()
        kept = _gloo_groups([group])
        try:
            dist.destroy_process_group(group)
        finally:
            del group
            _hand_over(kept)


def _hand_over(groups: list[Any]) -> None:
    """One thread per group: freed one after another, groups torn down faster than one per
    20 ms would pile up (with their sockets and threads); side by side their waits overlap."""
    while groups:
        box = [groups.pop()]  # the thread empties it: its reference is then the last
        threading.Thread(target=_free, args=(box,), name=_RELEASE_THREAD, daemon=True).start()


# How long a rank waits, after a test, for its release threads (freeing takes ~20 ms a
# group). The harness's group: past the first bound, a group still being freed is taken for
# free (nothing holds it). A group the test set up itself counts as held until freed (its
# store may listen on a port the next test wants): the second bound is a safety net for a
# destructor that never returns, not a guess (one took seconds on a saturated machine).
RELEASE_WAIT_S = 1.0
OWN_GROUP_RELEASE_WAIT_S = 60.0


def held_after_test(strict: bool) -> bool:
    """Whether a torn-down group is still held after a test (see still_held); `strict` for a
    group the test set up itself."""
    return still_held(OWN_GROUP_RELEASE_WAIT_S if strict else RELEASE_WAIT_S, strict)


def still_held(bound_s: float, strict: bool = False) -> bool:
    """Whether a group destroy_all destroyed last is still alive once garbage cycles are
    collected (an FSDP model's, a traceback's frames) and the release threads are done
    (waited for at most `bound_s`): held by something this rank cannot drop. A release
    thread still freeing at the bound (a loaded machine) means nothing holds it, unless
    `strict`: then the group, and any port its store listens on, is still there."""
    deadline = time.monotonic() + bound_s
    for thread in threading.enumerate():  # freeing takes about 20 ms a group
        if thread.name == _RELEASE_THREAD:
            thread.join(max(0.0, deadline - time.monotonic()))
            if thread.is_alive():
                return strict
    if not _any_alive():
        return False
    _release_what_torch_holds()
    gc.collect()  # tenths of a second with torch loaded: only for a group still alive
    return _any_alive()


def _release_what_torch_holds() -> None:
    """torch's DTensor caches and group.WORLD defaults keep a torn-down group (see
    torch_holders.py); asked only once a group is found alive, where the rank would
    otherwise end (emptying them after every test broke unwaited functional collectives)."""
    from harness.rank import torch_holders

    with contextlib.suppress(Exception):
        torch_holders.let_go()


def _any_alive() -> bool:
    """Whether a group destroy_all destroyed, or one the test made, is still alive (every
    group is torn down when this is asked)."""
    return any(ref() is not None for ref in _destroyed) or len(_made) > 0


def _free(box: list[Any]) -> None:
    group = box.pop()
    del group  # the destructor runs here, without the GIL


def _gloo_groups(groups: list[Any]) -> list[Any]:
    found = []
    for group in groups:
        try:
            if dist.get_backend(group) == "gloo":
                found.append(group)
        except Exception:  # a group torch no longer knows: left to torch
            continue
    return found


def process_groups() -> list[Any]:
    """Every process group torch knows on this rank now, the default one included."""
    world: Any = dist.distributed_c10d._world
    return list(world.pg_map)
