"""A test's process group on a warm rank: set up through the session's private store (every
rank agreeing that every rank's set-up worked before the body starts), the group the last
clean test kept reused, torchrun's environment for a launch-mode test, and the teardown.

Runs only in ranks.
"""

from __future__ import annotations

import contextlib
import os
import socket
from collections.abc import Iterator
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from harness.common import endings, loopback, signing
from harness.common.protocol import SIMULATED_SET_UP_FAILURES, RankSpec, RunTask
from harness.common.torchrun_env import torchrun_env
from harness.rank import group_release, kept_group
from harness.rank.private_store import PrivateStore

endings.skip_frames_of(__file__)
# The group's own timeout stays well past the harness's deadline, so a hang is always caught
# and reported by the harness (stacks, the collective) before gloo unwinds it.
GROUP_TIMEOUT_MARGIN_S = 120.0


def enter(task: RunTask) -> None:
    """Give the test its group (fresh, or the kept one), or torchrun's environment in launch
    mode, or nothing for a bare run (it sets its own up, as under spawn); raises SetUpFailed
    where any rank's set-up failed."""
    spec = task.spec
    kept_group.fingerprinting = spec.collective_check
    reuse = kept_group.reusable(task.reuse_group)
    if not reuse:
        teardown()  # a kept group this test does not run on
    if task.launch_port is not None:
        os.environ.update(_launch_env(task))
        return
    if spec.bare:  # as under torch.multiprocessing.spawn: the target makes its own group
        return
    # The store client serves every test of this rank: a timeout one test set is not the next's.
    _client_store(task).set_timeout(group_timeout(spec))
    if task.reuse_group is not None:
        _check_kept(task, reuse)
    else:
        _set_up(task)


def tore_down_the_tests_own() -> bool:
    """Whether a teardown since the last call destroyed a default group the test had set up
    itself (its store may still listen on a port the next test asks for)."""
    torn, _TornDown.test_group = _TornDown.test_group, False
    return torn


def _set_up(task: RunTask) -> None:
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


def _check_kept(task: RunTask, held: bool) -> None:
    """Start the body on the kept group, which the pytest side found in step on every rank
    after the last test; raise if this rank no longer holds it.

    Nothing runs on a rank between tests, so that should never happen; if it does, the rank
    tears its group down (peers blocked on it fail at once) and the pytest side tries the
    test again on a fresh group.
    """
    if not held:  # torn down here already, so peers waiting on it fail at once
        raise SetUpFailed(f"rank {task.rank}: the kept process group is gone on this rank")
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
            timeout=group_timeout(spec),
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


class SetUpFailed(Exception):
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
        raise SetUpFailed("; ".join(failed))


_stores: dict[str, PrivateStore] = {}


def _client_store(task: RunTask) -> PrivateStore:
    """One store object per store for the worker's life; tests differ by key prefix."""
    if task.store_path not in _stores:
        _stores[task.store_path] = PrivateStore(task.store_path, group_timeout(task.spec))
    return _stores[task.store_path]


def group_timeout(spec: RankSpec) -> timedelta:
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


class _TornDown:
    test_group = False  # whether this run tore down a default group the test set up itself


def teardown() -> None:
    """Tear this rank's process groups down (peers blocked on this rank then fail at once)."""
    if not dist.is_available():
        kept_group.forget()
        return
    _TornDown.test_group |= kept_group.test_made_default_group()
    kept_group.forget()
    if dist.is_initialized():
        with contextlib.suppress(Exception):
            group_release.destroy_all()
    else:  # an init_process_group that failed (a peer gone mid-connect) took a group name
        group_release.forget_failed_init()
