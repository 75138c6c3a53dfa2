"""The launched session's own process group: made from the launch's store under each run's
keys when a rank lacks it (a test destroyed or replaced it, a plain test set it aside) or a
test asks for a fresh one, kept between tests otherwise, and told apart from a group the
test's own fixtures set up. Its timeout stays past every test's bound, so the harness's
timer fires first.

Built with the session (session.py); imports torch.
"""

from __future__ import annotations

import contextlib
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from harness.common.errors import HarnessError
from harness.common.launch_detect import Launch
from harness.launched.gathered import Gathered
from harness.launched.link import Link
from harness.rank import group_release

# The group's own timeout stays past every test's bound, so the harness's timer fires first.
GROUP_TIMEOUT_MARGIN_S = 120.0


class SessionGroup:
    """This rank's part of the session's default group."""

    def __init__(self, launch: Launch, backend: str) -> None:
        self._launch = launch
        self._backend = backend
        self._timeout_s = GROUP_TIMEOUT_MARGIN_S
        self._group: Any = None  # the session's own default group, to tell it from others
        # Every rank said, in the last exchange of a test's end, that it holds the group:
        # the next test's agreement is known without another exchange.
        self._held_everywhere = False

    def bound(self, longest_test_s: float) -> None:
        """The session's groups time out only past the longest test's bound."""
        self._timeout_s = longest_test_s + GROUP_TIMEOUT_MARGIN_S

    def device(self) -> torch.device:
        if self._backend == "nccl":
            return torch.device("cuda", cuda_index(self._launch))
        return torch.device("cpu")

    def agree(
        self, link: Link, key: str, seconds: float, fresh: bool, *, test_start: bool
    ) -> Gathered:
        """Every rank on the session's live group for run `key`: if any rank lacks it or
        `fresh` is asked, every rank sets a new one up, under this run's keys. Without every
        rank's value when a rank did not come (then no group is set up). At a test's start
        (not a run_on_ranks call inside one), known without an exchange where every rank
        said at the last test's end that it holds the group."""
        held, self._held_everywhere = self._held_everywhere, False
        if held and test_start and not fresh:
            if not self.is_default():  # every other rank goes on without an exchange
                raise HarnessError(
                    f"harness error: rank {self._launch.rank} lost the session's process group "
                    f"between tests (outside any test's fixtures, a hook destroyed it); the "
                    f"test body never ran: leave the session's group to the harness"
                )
            return Gathered([b"0"] * self._launch.world_size)
        need = "1" if fresh or not self.is_default() else "0"
        found = link.gather(f"{key}/group", need, seconds)
        if not found.has_every_value:
            return found
        if any(flag == b"1" for flag in found.values):
            self.drop()
            store = dist.PrefixStore(f"{key}/group", link.peers.store)  # type: ignore[attr-defined]
            self._init(store)
        return found

    def held_everywhere(self, every_rank_said: bool) -> None:
        """Whether every rank, this one included, said in the exchange that ends a test that
        it holds the session's group (is_default): then, until the group changes here, the
        next test's agreement needs no exchange of its own (three a test rather than four)."""
        self._held_everywhere = every_rank_said

    def is_default(self) -> bool:
        """Whether the session's own group is the default one now."""
        return dist.is_initialized() and dist.group.WORLD is self._group

    def any_default(self) -> bool:
        """Whether any default group is set up now (the session's, or a test's own)."""
        return dist.is_initialized()

    def _init(self, store: Any) -> None:
        self._held_everywhere = False
        kwargs: dict[str, Any] = {}
        backend = self._backend
        if backend == "nccl":
            torch.cuda.set_device(self.device())
            kwargs["device_id"] = self.device()
            backend = "cpu:gloo,cuda:nccl"  # CPU tensors in the same tests still work
        dist.init_process_group(
            backend,
            store=store,
            rank=self._launch.rank,
            world_size=self._launch.world_size,
            timeout=timedelta(seconds=self._timeout_s),
            **kwargs,
        )
        self._group = dist.group.WORLD

    def set_aside(self) -> None:
        """No harness group for the next test: destroy the session's own group if it is the
        default one; a group the test's fixtures set up is theirs and stays."""
        if self.is_default() or not dist.is_initialized():
            self.drop()

    def drop(self) -> None:
        self._held_everywhere = False
        if dist.is_initialized():
            with contextlib.suppress(Exception):
                dist.destroy_process_group()
        else:  # a test's init that failed here only: the next group must take the same name
            group_release.forget_failed_init()
        self._group = None


def cuda_index(launch: Launch) -> int:
    """This rank's GPU: LOCAL_RANK, or the one GPU a launcher made visible to each process."""
    count = torch.cuda.device_count()
    return launch.local_rank if count > launch.local_rank else 0
