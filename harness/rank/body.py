"""The one way a test body runs on a rank, for both kinds of rank: a warm rank's worker
(rank/worker.py) and a pytest process torchrun launched (launched/body.py).

:func:`run_body` takes a snapshot for hygiene, records warnings under the test's filters,
arms the rank's faults, calls the body, turns how it ended into a :class:`RankOutcome`
(``endings``), and checks what the body left behind (processes, threads, a group,
environment). What differs between the kinds of rank comes in as a :class:`Body`: a warm
rank loads the test's module, makes the rank's fixtures, captures log records and stray
exceptions; a launched rank's pytest does those itself, and a hang timer bounds its body.
"""

from __future__ import annotations

import contextlib
import os
import random
import sys
import time
from collections.abc import Iterator
from dataclasses import replace
from typing import Any, Protocol

from harness.common import endings, hygiene, rank_warnings, reaper
from harness.common.faults import Fault, Injector
from harness.common.outcome import RankOutcome
from harness.common.protocol import RankSpec
from harness.rank import raw_threads, torch_seed

endings.skip_frames_of(__file__)
DAEMONIC_END_WAIT_S = 1.0


class Body(Protocol):
    """What one kind of rank does around the body (see the module's docstring)."""

    # Exceptions that leave the body as they are instead of becoming its outcome (a launched
    # rank's Ctrl-C stops its own pytest session).
    reraised: tuple[type[BaseException], ...]

    def load(self) -> tuple[Fault, ...]:
        """Load what the call needs, under the test's warning filters (a warm rank imports
        the test's module); return this rank's faults (their exceptions may be its classes)."""
        ...

    def around(self) -> contextlib.AbstractContextManager[Any]:
        """What else wraps the call: a warm rank's log capture and stray exceptions, a
        launched rank's hang timer."""
        ...

    def call(self, injector: Injector) -> Any:
        """Make what the body needs, fire the faults due at its start, call it; raise
        whatever it raised."""
        ...

    def finish(self) -> None:
        """After a return: what must still happen on this rank (a fixture's finalizers); an
        error here is the rank's failure."""
        ...

    def after_raise(self, outcome: RankOutcome) -> RankOutcome:
        """After the body raised (its outcome made, its frames cleared): let go of what peers
        wait on, tear down what remains; `outcome` with a note of what failed doing so."""
        ...

    def after_body(self, outcome: RankOutcome) -> tuple[RankOutcome, bool]:
        """Right after the body, before what it left is looked for: what this kind of rank
        does then (a launched rank takes the body's captured output into the outcome, and
        lets a group the body left go). Returns the outcome, and whether the body left a
        process group of its own initialised (the test's hygiene error, never the next
        test's group)."""
        ...

    def children_before(self) -> set[int]:
        """The processes below this rank that are not the body's to leave (a launched rank's
        session fixtures'); any other is a leftover, killed."""
        ...

    def env_before(self, env: dict[str, str]) -> dict[str, str]:
        """The environment the body started with, as the hygiene check should see it."""
        ...


def run_body(
    key: str, rank: int, spec: RankSpec, body: Body, bound_from: float | None = None
) -> tuple[RankOutcome, hygiene.Snapshot]:
    """Run one test body (or run_on_ranks function) on this rank, and return how it ended
    with what it left behind, and the hygiene snapshot taken before it (the caller puts
    back what its kind of rank restores). `bound_from`: when the run's bound began (its
    time.monotonic(); by default now). Raises only what `body.reraised` names, and what the
    harness's own `body.load` raised."""
    seed_generators(spec.seed, rank, spec.same_seed)
    before = hygiene.before_test()
    raw_before = raw_threads.running().keys()
    # The test's threads may end until its bound (the pytest side's deadline for this run).
    start = time.monotonic() if bound_from is None else bound_from
    threads_until = start + spec.timeout_s - hygiene.REPORT_MARGIN_S
    with rank_warnings.recording(spec.warning_filters) as log:
        faults = body.load()
        with body.around(), Injector(rank, faults).installed() as injector:
            outcome = _ending(key, rank, spec, body, injector)
    warnings = rank_warnings.collected(log)
    outcome, group_left = body.after_body(outcome)
    children = body.children_before()
    if spec.bare:
        _end_daemonic_children()
    left = reaper.settled_leftovers(os.getpid(), children, threads_until)
    reaper.kill(list(left))  # whatever the test allows: the next test must not meet them
    raw = [f for serial, f in raw_threads.running().items() if serial not in raw_before]
    seen = replace(before, env=body.env_before(before.env))
    leftovers = hygiene.findings(seen, spec.hygiene, group_left, left, raw, threads_until)
    return outcome.with_findings(warnings, leftovers), before


def _ending(key: str, rank: int, spec: RankSpec, body: Body, injector: Injector) -> RankOutcome:
    """The body called, and how it ended as a RankOutcome."""
    try:
        value = body.call(injector)
        endings.refuse_awaitable(value)
        body.finish()
    except body.reraised:
        raise
    except BaseException as exc:
        outcome = endings.ended_by(key, rank, exc, spec.show_locals)  # before frames clear
        endings.free_frames(exc)
        del exc
        return body.after_raise(outcome)
    missed = injector.unreached()
    if missed is not None:
        return endings.not_reached(key, rank, missed)
    return endings.returned(key, rank, value, spec.keep_value)


def seed_generators(seed: int | None, rank: int, same: bool) -> None:
    """Seed this rank's random, torch (CPU and CUDA) and numpy generators for the body: with
    `seed` + `rank` (`seed` alone when `same`), by plan/seeds.py's rule; from os.urandom when no
    seed is given (warm ranks share the fork server's generator state: unseeded, every rank
    drew the same numbers, and a test of gradient averaging passed with no averaging)."""
    if seed is None:
        value = int.from_bytes(os.urandom(8), "little")
    else:
        value = (seed + (0 if same else rank)) % 2**64
    random.seed(value)
    torch_seed.manual_seed(value)  # the CPU generator, and every accelerator's there can be
    numpy = sys.modules.get("numpy")
    if numpy is not None:
        numpy.random.seed(value % 2**32)


def _end_daemonic_children() -> None:
    """For a run that stands for a process of its own (an adopted test, harness.spawn): end
    its daemonic multiprocessing children as multiprocessing does at that process's exit;
    they are not leftovers there. Others (and one that outlives SIGTERM) stay leftovers."""
    import multiprocessing

    daemonic = [child for child in multiprocessing.active_children() if child.daemon]
    for child in daemonic:
        child.terminate()
    for child in daemonic:
        child.join(DAEMONIC_END_WAIT_S)


@contextlib.contextmanager
def nothing_around() -> Iterator[None]:
    """For a Body with nothing else around its call."""
    yield
