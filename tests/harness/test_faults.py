"""Every fault kind at every kind of point, each inner test declaring how every rank ends."""

from __future__ import annotations

import pytest

# How the body passes each kind of point (rank 1 is the faulted rank in every case).
BODIES = {
    "start": ("start", "dist.barrier()"),
    "fault_point": ("load", "harness.fault_point('load')\n    dist.barrier()"),
    "all_reduce": ("all_reduce:step", "rw.all_reduce('step', lambda: 1, sum)"),
    "broadcast_from": ("cfg", "rw.broadcast_from('cfg', lambda: 1)"),
    "run_entry": (
        "distributed_run:enter",
        "with rw.distributed_run(device='cpu'):\n        pass\n    dist.barrier()",
    ),
    "run_exit": (
        "distributed_run:exit",
        "with rw.distributed_run(device='cpu'):\n        pass\n    dist.barrier()",
    ),
    "nth": (
        "all_reduce:step",
        "for _ in range(3):\n        rw.all_reduce('step', lambda: 1, sum)",
    ),
}

LABELLED = ("all_reduce", "broadcast_from", "nth")

# fault fields -> (rank 1's expected end, the others' expected end)
KINDS = {
    "raise": ("kind='raise', exc=KeyError('injected')", "raises(KeyError, match='injected')"),
    "exit": ("kind='exit', code=3", "exits(3)"),
    "hard_exit": ("kind='hard_exit', code=4", "exits(4)"),
    "sigkill": ("kind='signal', signal='SIGKILL'", "killed(signal.SIGKILL)"),
    "sigsegv": ("kind='signal', signal='SIGSEGV'", "killed(signal.SIGSEGV)"),
    "sigterm": ("kind='signal', signal='SIGTERM'", "killed(signal.SIGTERM)"),
    "hang": ("kind='hang'", "hangs()"),
}

HEADER = """
import signal, time, pytest, torch.distributed as dist
import harness, rankwise as rw
from harness import raises, exits, killed, hangs, returns
"""

TEST = """
@pytest.mark.ranks(2, timeout=3)
@pytest.mark.fault(rank=1, at={at!r}, nth={nth}, {fields})
@pytest.mark.expect(rank=1, does={does}, others={others})
def test_{kind}(rank):
    {body}
"""


@pytest.mark.parametrize("point", list(BODIES))
def test_every_fault_kind_at_this_kind_of_point(inner: pytest.Pytester, point: str) -> None:
    at, body = BODIES[point]
    nth = 2 if point == "nth" else 1
    tests = []
    for kind, (fields, does) in KINDS.items():
        # A peer of a rank that hangs waits with it; a peer of one that fails fails after it.
        # At a labelled collective a raise or exit is that rank's fn failing: its peers raise
        # rankwise's RuntimeError naming it, or exit with its code; a receiver of
        # broadcast_from fails alone, after the value has moved.
        others = "hangs()" if kind == "hang" else "raises(RuntimeError)"
        if point in LABELLED and kind == "exit":
            others = "exits(3)"
        if point == "broadcast_from" and kind in ("raise", "exit"):
            others = "returns()"
        tests.append(
            TEST.format(
                at=at, nth=nth, fields=fields, does=does, others=others, kind=kind, body=body
            )
        )
    inner.makepyfile(HEADER + "".join(tests))
    result = inner.runpytest("-p", "harness", "-v")
    result.assert_outcomes(passed=len(KINDS))


def test_a_delay_makes_a_straggler_and_the_test_still_passes(inner: pytest.Pytester) -> None:
    inner.makepyfile(
        HEADER
        + """
@pytest.mark.ranks(2)
@pytest.mark.fault(rank=1, kind="delay", seconds=0.5, at="load")
def test_straggler(rank):
    start = time.monotonic()
    harness.fault_point("load")
    waited = time.monotonic() - start
    assert (waited >= 0.5) == (rank == 1)
    rw.all_reduce("after", lambda: rank, sum)
"""
    )
    inner.runpytest("-p", "harness").assert_outcomes(passed=1)


def test_the_nth_pass_only(inner: pytest.Pytester) -> None:
    inner.makepyfile(
        HEADER
        + """
@pytest.mark.ranks(2)
@pytest.mark.fault(rank=0, at="tick", nth=3)
@pytest.mark.expect(
    rank=0, does=raises(RuntimeError, match="fault injected by the harness on rank 0 at point:tick")
)
def test_third(rank):
    for i in range(5):
        open(f"r{rank}-{i}", "w").close()  # the ranks run in the pytest process's cwd
        harness.fault_point("tick")
"""
    )
    inner.runpytest("-p", "harness").assert_outcomes(passed=1)
    made = sorted(p.name for p in inner.path.glob("r0-*"))
    assert made == ["r0-0", "r0-1", "r0-2"]  # it fired on the third pass, not before


def test_faults_from_the_fixture_and_for_several_ranks(inner: pytest.Pytester) -> None:
    inner.makepyfile(
        HEADER
        + """
from harness import Fault

@pytest.fixture
def rank_faults():
    return [Fault(rank=[0, 2], kind="exit", code=5)]

@pytest.mark.ranks(4)
@pytest.mark.expect({0: exits(5), 1: raises(RuntimeError), 2: exits(5), 3: raises(RuntimeError)})
def test_two_exit(rank):
    dist.barrier()
"""
    )
    inner.runpytest("-p", "harness").assert_outcomes(passed=1)


def test_run_on_ranks_takes_faults(inner: pytest.Pytester) -> None:
    inner.makepyfile(
        HEADER
        + """
from harness import Ending, Fault

def work():
    return rw.all_reduce("step", lambda: dist.get_rank(), sum)

def test_outside(run_on_ranks):
    out = run_on_ranks(work, world_size=3, faults=[Fault(rank="all", kind="delay", seconds=0)])
    assert out.values == [3, 3, 3]
    out = run_on_ranks(work, world_size=3, faults=[Fault(rank=2, kind="exit", code=9, at="step")])
    out.expect(rank=2, does=exits(9), others=exits(9))  # as if its fn had called sys.exit
"""
    )
    inner.runpytest("-p", "harness").assert_outcomes(passed=1)


def test_each_run_raises_its_own_fault_exception(inner: pytest.Pytester) -> None:
    inner.makepyfile(
        """
        import pytest, harness

        class DiskFull(Exception):  # a class of the test module: the rank's own import of it
            pass

        @pytest.mark.parametrize("catch", [True, False])
        @pytest.mark.ranks(2)
        @pytest.mark.fault(rank=1, kind="raise", exc=OSError("disk full"), at="load")
        def test_instance(rank, catch):
            if catch:
                try:
                    harness.fault_point("load")
                except OSError as exc:
                    exc.add_note("noted by the first run")
            else:
                harness.fault_point("load")

        @pytest.mark.parametrize("step", [0, 1, 2])
        @pytest.mark.ranks(2)
        @pytest.mark.fault(rank=1, kind="raise", exc=DiskFull, at="load")
        def test_class(rank, step):
            try:
                harness.fault_point("load")
            except DiskFull:
                pass
        """
    )
    result = inner.runpytest("-p", "harness")
    result.assert_outcomes(passed=4, failed=1)
    assert "OSError: disk full" in result.stdout.str()
    assert "noted by the first run" not in result.stdout.str()


@pytest.mark.parametrize(
    ("marker", "message"),
    [
        (
            "fault(rank=1, kind='explode')",
            "invalid fault kind 'explode' from the fault marker on *test_bad*: "
            "choose one of raise, exit, hard_exit, signal, hang, delay",
        ),
        (
            "fault(rank=7)",
            "invalid fault rank 7 from the fault marker on *test_bad*: use a rank in 0..1*",
        ),
        (
            "fault(rank=1, kind='signal', signal='SIGFOO')",
            "invalid fault signal 'SIGFOO'*choose one of SIGKILL*",
        ),
        ("fault(rank=1, nth=0)", "invalid fault nth 0*use an int >= 1"),
        (
            "fault(rank=1, when='later')",
            "unknown fault field(s) when: use at, code, *in the fault marker on *test_bad*",
        ),
    ],
    ids=["kind", "rank", "signal", "nth", "field"],
)
def test_bad_fault_declarations_say_where_they_came_from(
    inner: pytest.Pytester, marker: str, message: str
) -> None:
    inner.makepyfile(
        f"""
        import pytest

        @pytest.mark.ranks(2)
        @pytest.mark.{marker}
        def test_bad(rank):
            pass

        def test_others_still_run():
            pass
        """
    )
    result = inner.runpytest("-p", "harness")
    result.assert_outcomes(passed=1, errors=1)  # that test's error, not the session's
    result.stdout.fnmatch_lines(["*ERROR at setup of test_bad*", f"*{message}*"])


def test_a_fault_exception_that_cannot_reach_a_rank_is_a_declaration_error(
    inner: pytest.Pytester,
) -> None:
    inner.makepyfile(
        """
        import pytest, harness

        class TwoArgs(Exception):  # pickled as TwoArgs("1-2"), which its __init__ refuses
            def __init__(self, a, b):
                super().__init__(f"{a}-{b}")

        @pytest.mark.ranks(2)
        @pytest.mark.fault(rank=1, exc=TwoArgs(1, 2), at="p")
        def test_bad(rank):
            harness.fault_point("p")

        def test_local_class(run_on_ranks):
            class Local(Exception):
                pass

            run_on_ranks(print, world_size=2, faults=[harness.Fault(rank=1, exc=Local)])
        """
    )
    result = inner.runpytest("-p", "harness")
    result.assert_outcomes(failed=1, errors=1)
    result.stdout.fnmatch_lines(
        [
            "*ERROR at setup of test_bad*",
            "*invalid fault exception TwoArgs('1-2') from the fault marker on *test_bad*: it "
            "must survive pickling to reach a rank (TypeError: *",
        ]
    )
    result.stdout.fnmatch_lines(["*invalid fault exception <class *Local'>*define it at*"])


def test_a_shared_exception_instance_is_raised_afresh_each_time() -> None:
    from harness.common.faults import Fault, Injector, fault_point

    shared = OSError("disk full")
    caught: list[OSError] = []
    for _ in range(2):  # one Injector per run, the same Fault object (under torchrun)
        with Injector(1, (Fault(rank=1, exc=shared, at="load"),)).installed():
            try:
                fault_point("load")
            except OSError as exc:
                exc.add_note("seen by this run")
                caught.append(exc)
    assert shared not in caught and caught[0] is not caught[1]
    assert str(caught[1]) == "disk full" and caught[1].__notes__ == ["seen by this run"]


def test_rankwise_points_cost_nothing_without_an_observer() -> None:
    from rankwise import _points

    assert _points._observers == []  # the pytest process never registers one
    with _points.point("all_reduce", "x"):
        pass
