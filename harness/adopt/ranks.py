"""What runs inside a rank for adopted suites, ``harness.spawn`` and the ``rank_pool`` fixture:
the entry points every adopter shares (a base's own rank half, such as torch/ranks.py, is
entered through `run_with_class`).

Each function here is a run's target: the worker calls it on every rank with the rank (and
world size) filled in, and it calls the user's own code as the original launcher would have.
Runs only in ranks.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from harness.common import endings
from harness.common.protocol import Target
from harness.rank import loader

endings.skip_frames_of(__file__)  # a rank's traceback starts in the test's code


def named(target: Target) -> Any:
    """The class or function `target` names, from its module as the worker loads it."""
    holder: Any = loader.load_module(target.module, target.file)
    for part in target.qualname.split("."):
        holder = getattr(holder, part)
    return holder


def run_with_class(case: Target, entry: Target, *args: Any, rank: int) -> Any:
    """An adopter's entry point on a warm rank (Adopter.run): `entry(cls, *args, rank=rank)`,
    the test class as this rank imported its module, as pytest did."""
    return named(entry)(named(case), *args, rank=rank)


# ---- harness.spawn and rank_pool ------------------------------------------------------------


def run_spawned(fn: Target | Callable[..., Any], args: tuple[Any, ...], *, rank: int) -> Any:
    """``fn(rank, *args)``, as torch.multiprocessing.spawn calls it in each process."""
    return _callable(fn)(rank, *args)


def run_pooled(
    fn: Target | Callable[..., Any],
    args: tuple[Any, ...],
    kwargs: dict[str, Any],
    *,
    rank: int,
    world_size: int,
) -> Any:
    """``fn(rank, world_size, *args, **kwargs)`` in the run's process group."""
    return _callable(fn)(rank, world_size, *args, **kwargs)


def _callable(fn: Target | Callable[..., Any]) -> Callable[..., Any]:
    """A function named by its Target, or a bound method that came whole."""
    found: Callable[..., Any] = named(fn) if isinstance(fn, Target) else fn
    return found
