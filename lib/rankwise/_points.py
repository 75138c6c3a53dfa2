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


class Held:
    """An error an observer raised on entering a point, held for the collective to raise.

    A labelled collective raises it where it runs the rank's `fn`, so an injected fault
    travels to the other ranks as that rank's failure instead of leaving them waiting.
    """

    def __init__(self) -> None:
        self.error: BaseException | None = None

    def raise_if_any(self) -> None:
        if self.error is not None:
            error, self.error = self.error, None
            raise error


@contextlib.contextmanager
def point(kind: str, label: str, *, hold_errors: bool = False) -> Iterator[Held]:
    """Mark the block as the point `kind(label)`: observers see it entered and left.

    An observer's error on entry is raised at once, or with `hold_errors` kept in the
    yielded :class:`Held` for the block to raise. Observers that saw the entry always see
    the exit.
    """
    held = Held()
    if not _observers:
        yield held
        return
    entered: list[Observer] = []
    try:
        for observer in tuple(_observers):
            entered.append(observer)
            observer("enter", kind, label)
    except BaseException as exc:
        if not hold_errors:
            _leave(entered, kind, label)
            raise
        held.error = exc
    try:
        yield held
    finally:
        _leave(entered, kind, label)


def _leave(entered: list[Observer], kind: str, label: str) -> None:
    for observer in entered:
        observer("exit", kind, label)


def passed(kind: str, label: str) -> None:
    """Mark an instant point, such as a run's entry or exit."""
    for observer in tuple(_observers):
        observer("enter", kind, label)
        observer("exit", kind, label)
