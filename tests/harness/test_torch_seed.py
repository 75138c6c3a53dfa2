"""The ranks' torch seeding (harness/rank/torch_seed.py), tested directly: what torch.manual_seed
gives, without the stack text torch keeps for an accelerator this build cannot have."""

from __future__ import annotations

import sys
import threading
import traceback
from typing import Any

import pytest
import torch

from harness.rank import torch_seed

pytestmark = pytest.mark.unit

_LAZY = ("cuda", "xpu", "mtia")


def _compiled() -> list[str]:
    return [name for name in _LAZY if getattr(torch, name)._is_compiled()]


def test_the_generators_are_seeded_as_torch_manual_seed_seeds_them() -> None:
    torch.manual_seed(1234)
    expected = torch.rand(4)
    torch.manual_seed(99)
    torch_seed.manual_seed(1234)
    assert torch.equal(torch.rand(4), expected)
    assert torch.initial_seed() == 1234


def test_no_stack_is_written_out_for_an_accelerator_this_build_cannot_have(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Each accelerator compiled in (none in a CPU build) is seeded as torch seeds it, its
    stack text taken once; one not compiled in costs nothing, and its seeding is put back."""
    taken: list[int] = []
    real = traceback.format_stack

    def counted(*args: Any, **kwargs: Any) -> Any:
        taken.append(1)
        return real(*args, **kwargs)

    monkeypatch.setattr(traceback, "format_stack", counted)
    before = {name: getattr(torch, name).manual_seed_all for name in _LAZY}
    torch_seed.manual_seed(7)
    uninitialised = [n for n in _compiled() if not getattr(torch, n).is_initialized()]
    assert len(taken) == len(uninitialised)
    assert {name: getattr(torch, name).manual_seed_all for name in _LAZY} == before
    taken.clear()
    torch.manual_seed(7)  # what the harness called before: a stack for each of them
    assert len(taken) == len([n for n in _LAZY if not getattr(torch, n).is_initialized()]), (
        "torch no longer queues its seedings: torch_seed may go"
    )


def test_a_seed_torch_refuses_leaves_torch_as_it_was() -> None:
    before = {name: getattr(torch, name).manual_seed_all for name in _LAZY}
    with pytest.raises((RuntimeError, ValueError), match="verflow"):
        torch_seed.manual_seed(2**64)  # torch's own error: out of range, raised at the end
    assert {name: getattr(torch, name).manual_seed_all for name in _LAZY} == before


def test_two_threads_seeding_at_once_leave_torchs_seedings_in_place() -> None:
    """Each call puts back what it found: without one call at a time, the second to start
    found the first's stand-in and put that back, for good."""
    before = {name: getattr(torch, name).manual_seed_all for name in _LAZY}
    interval = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)  # switch threads as often as Python can
    try:
        threads = [
            threading.Thread(target=lambda i=i: [torch_seed.manual_seed(i) for _ in range(1500)])
            for i in range(2)
        ]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
    finally:
        sys.setswitchinterval(interval)
    assert {name: getattr(torch, name).manual_seed_all for name in _LAZY} == before
