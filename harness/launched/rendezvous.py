"""Groups a launched test sets up from torchrun's environment meet under keys of their own.

torchrun's agent store outlives every group of the job, and torch names a new default
group's keys as it named the last one's. A test (or fixture) calling
``init_process_group()`` after an earlier one did met in the same keys: a rank arriving first
read its late peer's old address, failed to connect and left the peer hung. Here each
``env://`` rendezvous gets a prefix naming the test and how many set-ups came before it in
that test, the same on every rank that sets up alike.

Imported only in a launched session (it imports torch).
"""

from __future__ import annotations

import importlib
from collections.abc import Callable, Iterator
from typing import Any

import torch.distributed as dist

ENV_SCHEME = "env"


def give_each_set_up_its_keys(prefix_of: Callable[[], str]) -> Callable[[], None]:
    """Wrap torch's ``env://`` handler so its store is seen under ``prefix_of()``; returns
    the undo. A torch without the handler table keeps its own rendezvous."""
    # The module, not the function torch.distributed exports under the same name.
    module = importlib.import_module("torch.distributed.rendezvous")
    handlers: dict[str, Any] | None = getattr(module, "_rendezvous_handlers", None)
    if handlers is None or ENV_SCHEME not in handlers:
        return lambda: None
    original = handlers[ENV_SCHEME]

    def env_under_own_keys(url: str, *args: Any, **kwargs: Any) -> Iterator[tuple[Any, int, int]]:
        for store, rank, world_size in original(url, *args, **kwargs):
            yield dist.PrefixStore(prefix_of(), store), rank, world_size  # type: ignore[attr-defined]

    handlers[ENV_SCHEME] = env_under_own_keys

    def undo() -> None:
        if handlers.get(ENV_SCHEME) is env_under_own_keys:
            handlers[ENV_SCHEME] = original

    return undo
