"""The failure matrix (slow lane: make test-faults, or -m slow): every way a rank can end
badly, at 2, 4 and 8 ranks. For each case: the verdict, the root-cause rank named in the
summary line, a time bound, and that the next test on the same pytest session passes."""

from __future__ import annotations

import textwrap

import pytest

pytestmark = pytest.mark.slow

HEADER = """
import ctypes, os, signal, subprocess, sys, threading, time
import pytest, torch, torch.distributed as dist

STOP = threading.Event()

def ones():
    t = torch.ones(1)
    dist.all_reduce(t)
    return t
"""

# case -> (body run by rank R, the last rank; or by every rank where it says ALL), outcome,
# summary pattern ({r}: the faulty rank). "error" outcomes are hygiene errors at teardown.
CASES: dict[str, tuple[str, str, str]] = {
    "raise": ("raise ValueError('boom')", "failed", "rank {r} failed: raised ValueError: boom*"),
    "exit3": ("sys.exit(3)", "failed", "rank {r} failed: called sys.exit(3)*"),
    "exit0": ("sys.exit(0)", "failed", "rank {r} failed: called sys.exit(0)*"),
    "exit3_all": ("ALL sys.exit(3)", "failed", "rank * failed: called sys.exit(3); rank* also*"),
    "exit0_all": ("ALL sys.exit(0)", "failed", "rank * failed: called sys.exit(0); rank* also*"),
    "os_exit0": ("os._exit(0)", "failed", "rank {r} failed: process exited with status 0*"),
    "os_exit3": ("os._exit(3)", "failed", "rank {r} failed: process exited with status 3*"),
    "sigkill": (
        "os.kill(os.getpid(), signal.SIGKILL)",
        "failed",
        "rank {r} failed: died of SIGKILL*",
    ),
    "sigsegv": ("ctypes.string_at(0)", "failed", "rank {r} failed: died of SIGSEGV*"),
    "sigterm": (
        "os.kill(os.getpid(), signal.SIGTERM)",
        "failed",
        "rank {r} failed: died of SIGTERM*",
    ),
    "sigabrt": ("os.abort()", "failed", "rank {r} failed: died of SIGABRT*"),
    "hang_outside": (
        "STOP.wait()",
        "failed",
        "rank {r} failed: hung outside any collective; rank* collateral*",
    ),
    "leave_early": ("return", "failed", "rank {r} returned while rank* waited in all_reduce*"),
    "destroy_group": (
        "dist.destroy_process_group(); return",
        "failed",
        "rank {r} returned while rank* waited in all_reduce*",
    ),
    "out_of_step": (
        "b = torch.ones(1); dist.broadcast(b, src=rank); dist.broadcast(b, src=rank)",
        "failed",
        # The collective check names it (without it: "ranks out of step", test_verdicts.py).
        "rank {r} failed: raised CollectiveMismatch: called broadcast on a tensor of shape "
        "[[]1[]] (float32) as collective 1 on the group*",
    ),
    "subgroup": (
        "raise KeyError('in subgroup')",
        "failed",
        "rank {r} failed: raised KeyError: 'in subgroup'*",
    ),
    "leaked_thread": (
        "threading.Thread(target=STOP.wait, name='leaked').start()",
        "error",
        "*hygiene: rank {r} left non-daemon threads running: leaked*",
    ),
    "leaked_child": (
        "subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(600)'])",
        "error",
        "*hygiene: rank {r} left processes running*time.sleep(600)*",
    ),
    "closed_streams": ("sys.stdout.close(); os.close(1); os.close(2)", "passed", ""),
    "big_output": (
        "sys.stdout.write('x' * (50 << 20) + '\\n'); raise ValueError('after 50 MB')",
        "failed",
        "rank {r} failed: raised ValueError: after 50 MB*",
    ),
}
HANGS = ("hang_outside", "out_of_step")
# Found at the test's bound, as a hang is: a non-daemon thread may run on until then.
AT_THE_BOUND = (*HANGS, "leaked_thread")
HANG_TIMEOUT_S = 3
OTHER_TIMEOUT_S = 120
# Each case must end before its own bound would have cut it (a failure reported at once, not
# at the timeout; a hang at its bound, then its stacks): derived from the bounds under test,
# never a guess of how fast the machine is (make test-loaded runs this on a saturated one).
BOUND_S = {"hang": HANG_TIMEOUT_S + 60.0, "other": float(OTHER_TIMEOUT_S)}


def _case_test(name: str, body: str, world: int) -> str:
    """The case's test (rank R, or every rank, runs `body`, then all meet in an all_reduce)
    and the test after it, which must pass on the same warm (or replaced) ranks."""
    everyone = body.startswith("ALL ")
    condition = "True" if everyone else f"rank == {world - 1}"
    timeout = HANG_TIMEOUT_S if name in AT_THE_BOUND else OTHER_TIMEOUT_S
    return f"""
@pytest.mark.ranks({world}, timeout={timeout})
def test_case_{name}(rank, world_size):
    sub = dist.new_group(list(range(world_size))) if {name == "subgroup"} else None
    if {condition}:
        {body.removeprefix("ALL ")}
    t = torch.ones(1)
    dist.all_reduce(t, group=sub)

@pytest.mark.ranks({world})
def test_next_after_{name}(rank, world_size):
    assert ones().item() == world_size
"""


@pytest.mark.parametrize("world", [2, 4, 8])
def test_the_failure_matrix(inner: pytest.Pytester, world: int) -> None:
    inner.makepyfile(
        HEADER + "\n" + "".join(_case_test(n, b, world) for n, (b, _, _) in CASES.items())
    )
    result = inner.runpytest("-p", "harness", "-v", "-p", "no:randomly")
    r = world - 1
    reports = {
        (rep.head_line or rep.nodeid).split("[")[0].split("::")[-1].split(".")[-1]: rep
        for rep in result.reprec.getreports("pytest_runtest_logreport")  # type: ignore[attr-defined]
        if rep.when == "call"
    }
    for name, (_, outcome, summary) in CASES.items():
        status = "ERROR" if outcome == "error" else outcome.upper()
        result.stdout.fnmatch_lines([f"*test_case_{name}[[]ranks{world}[]] {status}*"])
        result.stdout.fnmatch_lines([f"*test_next_after_{name}[[]ranks{world}[]] PASSED*"])
        if summary:
            result.stdout.fnmatch_lines([summary.format(r=r)])
        kind = "hang" if name in AT_THE_BOUND else "other"
        duration = reports[f"test_case_{name}"].duration
        assert duration < BOUND_S[kind], f"{name} at {world} ranks took {duration:.1f} s"
    result.assert_outcomes(
        passed=len(CASES) + sum(o == "passed" or o == "error" for _, o, _ in CASES.values()),
        failed=sum(o == "failed" for _, o, _ in CASES.values()),
        errors=sum(o == "error" for _, o, _ in CASES.values()),
    )


def test_the_matrix_cases_are_valid_python() -> None:
    for name, (body, _, _) in CASES.items():
        compile(textwrap.dedent(HEADER + _case_test(name, body, 2)), name, "exec")
