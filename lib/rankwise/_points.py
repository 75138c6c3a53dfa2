"""Named points (collective labels) that a test harness can observe or hook.

rankwise never imports a harness. Code that wants to watch rankwise's labelled collectives
registers an observer with :func:`add_observer`; each observer is called as
``observer(phase, kind, label)`` with ``phase`` ``"enter"`` when a point is reached and
``"exit"`` when it is left. An observer may raise (that is how a harness injects a fault at a
point); the error then surfaces where the point was passed. With no observer registered a
point costs one truth test.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator

Observer = Callable[[str, str, str], None]

_observers: list[Observer] = []


def add_observer(observer: Observer) -> None:
    """Call `observer(phase, kind, label)` at every point passed from now on."""
    if observer not in _observers:
        _observers.append(observer)


def remove_observer(observer: Observer) -> None:
    """Stop calling `observer`; unknown observers are ignored."""
    with contextlib.suppress(ValueError):
        _observers.remove(observer)


@contextlib.contextmanager
def point(kind: str, label: str) -> Iterator[None]:
    """Mark the block as the point `kind(label)`: observers see it entered and left."""
    if not _observers:
        yield
        return
    for observer in tuple(_observers):
        observer("enter", kind, label)
    try:
        yield
    finally:
        for observer in tuple(_observers):
            observer("exit", kind, label)


def passed(kind: str, label: str) -> None:
    """Mark an instant point, such as a run's entry or exit."""
    for observer in tuple(_observers):
        observer("enter", kind, label)
        observer("exit", kind, label)
