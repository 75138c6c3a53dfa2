"""torch.manual_seed for every test on every rank, without the part that can never take effect.

torch.manual_seed also seeds the CUDA, XPU and MTIA generators. For one not yet initialised
it queues the seeding for when it is, with the caller's stack as text for an error message
(traceback.format_stack, which reads every frame's source line): under pytest's stack, a
third of a millisecond a test, on every rank. In a build without that accelerator compiled in
the queued seeding can never run, so its seeding function is skipped for the call (torch's
own manual_seed still does the rest: the CPU generator, MPS, a custom device). A build with
it compiled in seeds it exactly as torch.manual_seed does.
"""

from __future__ import annotations

import threading
from typing import Any

import torch

_QUEUED_WHEN_IDLE = ("cuda", "xpu", "mtia")  # seeded through torch's lazy call


_swapping = threading.Lock()  # two threads seeding at once: each puts back torch's own


def manual_seed(value: int) -> None:
    """torch.manual_seed(value), skipping the accelerators this build cannot have."""
    with _swapping:
        skipped = _not_compiled()
        kept = [(module, module.manual_seed_all) for module in skipped]
        for module in skipped:
            module.manual_seed_all = _nothing_to_seed
        try:
            torch.manual_seed(value)
        finally:
            for module, seeding in kept:
                module.manual_seed_all = seeding


def _not_compiled() -> tuple[Any, ...]:
    """The accelerator modules whose seeding torch would queue in vain in this build now
    (asked each time: MTIA counts as built once an out-of-tree library registers it)."""
    found = []
    for name in _QUEUED_WHEN_IDLE:
        module = getattr(torch, name, None)
        compiled: Any = getattr(module, "_is_compiled", None)
        seeds = callable(getattr(module, "manual_seed_all", None))
        if seeds and callable(compiled) and not compiled():
            found.append(module)
    return tuple(found)


def _nothing_to_seed(seed: int) -> None:
    """In place of a seeding that could never run (see the module's docstring)."""
