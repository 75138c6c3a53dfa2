"""Settings and markers: parsing, the one timeout precedence, validation. Starts no rank."""

from __future__ import annotations

import logging

import pytest

from harness.common.errors import SpecError
from harness.common.expect import ExpectationError, Expected, Wanted
from harness.common.outcome import Ending, RankOutcome
from harness.common.protocol import LogCapture
from harness.plan.seeds import SessionSeed
from harness.plan.settings import DEFAULT_TIMEOUT_S, Settings, settings_of, timeout_for
from harness.plan.specs import spec_for, spec_for_call

TIMEOUTS = """
import pytest

@pytest.mark.ranks(2, timeout=7)
@pytest.mark.timeout(9)
def test_own():
    pass

@pytest.mark.ranks(2)
@pytest.mark.timeout(9)
def test_timeout_marker():
    pass

@pytest.mark.ranks(2)
def test_configured():
    pass
"""


def _items(pytester: pytest.Pytester, source: str, *args: str) -> dict[str, pytest.Function]:
    """The collected items by name, under a configured harness; no test runs."""
    module = pytester.getmodulecol(source, configargs=("-p", "harness", *args))
    return {item.name: item for item in pytester.genitems([module])}  # type: ignore[misc]


def test_the_command_line_wins_over_the_ini_and_values_are_checked_once(
    pytester: pytest.Pytester,
) -> None:
    pytester.makeini(
        "[pytest]\nranks = 3\nrank_timeout = 12\nrank_start_method = spawn\nrank_seed = 7\n"
    )
    config = pytester.parseconfigure("-p", "harness", "--ranks", "5", "--rank-seed", "8")
    settings = settings_of(config)
    assert settings == Settings(
        ranks=5,
        rank_timeout_s=12.0,
        start_method="spawn",
        backend="gloo",
        log_capture=settings.log_capture,  # pytest's own settings: see the next test
        seed=SessionSeed(8, "--rank-seed"),
    )


def test_ranks_capture_logs_with_pytests_log_settings(pytester: pytest.Pytester) -> None:
    pytester.makeini("[pytest]\nlog_level = INFO\nlog_format = %(message)s\n")
    config = pytester.parseconfigure("-p", "harness", "--log-date-format", "%H")
    assert settings_of(config).log_capture == LogCapture(
        level=logging.INFO, fmt="%(message)s", datefmt="%H", auto_indent=None
    )
    off = pytester.parseconfigure("-p", "harness", "-p", "no:logging")
    assert settings_of(off).log_capture is None


@pytest.mark.parametrize(
    ("args", "expected"),
    [
        ((), {"test_own": 7, "test_timeout_marker": 9, "test_configured": DEFAULT_TIMEOUT_S}),
        (("--timeout", "13"), {"test_timeout_marker": 9, "test_configured": 13}),
        (("--timeout", "13", "--rank-timeout", "11"), {"test_configured": 11}),
    ],
    ids=["default", "pytest-timeout", "rank-timeout"],
)
def test_markers_and_run_on_ranks_share_one_timeout_precedence(
    pytester: pytest.Pytester, args: tuple[str, ...], expected: dict[str, float]
) -> None:
    items = _items(pytester, TIMEOUTS, *args)
    for name, seconds in expected.items():
        item = items[f"{name}[ranks2]"]
        settings = settings_of(item.config)
        assert spec_for(item, settings).timeout_s == seconds, name
        own = 7 if name == "test_own" else None  # run_on_ranks(timeout=7) in that test
        assert (
            spec_for_call(item.config, settings, item, 2, own, False, None, ()).timeout_s == seconds
        )


def test_an_explicit_timeout_is_checked_where_it_came_from() -> None:
    with pytest.raises(SpecError, match=r"invalid timeout -1 from run_on_ranks\(timeout=...\)"):
        timeout_for(Settings(), -1, "run_on_ranks(timeout=...)")
    assert timeout_for(Settings(pytest_timeout_s=5.0), None, "") == 5.0


BAD_MARKERS = {
    "ranks(0)": "invalid world size 0 from @pytest.mark.ranks on *: use an int >= 1",
    "ranks(2, timout=3)": "invalid option(s) [[]'timout'[]] from @pytest.mark.ranks on *: use *",
    "ranks(2, backend='mpi')": "invalid backend 'mpi' from @pytest.mark.ranks on *: choose one of*",
    "ranks(2, launch='yes')": "invalid launch 'yes' from @pytest.mark.ranks on *: use True or *",
    "ranks(2, timeout=0)": "invalid timeout 0 from @pytest.mark.ranks on *: use seconds > 0",
}


def test_two_ranks_markers_on_one_test_are_an_error_not_one_ignored(
    inner: pytest.Pytester,
) -> None:
    # Only the closest applied: a test stacked with ranks(2) and ranks(3) ran at 3 alone.
    # One on its class and one on the method is an override, as for any marker.
    inner.makepyfile(
        """
        import pytest

        @pytest.mark.ranks(2)
        @pytest.mark.ranks(3)
        def test_stacked(rank):
            pass

        @pytest.mark.ranks(3)
        class TestOverride:
            @pytest.mark.ranks(2)
            def test_method(self, world_size):
                assert world_size == 2
        """
    )
    result = inner.runpytest("-p", "harness")
    result.assert_outcomes(passed=1, errors=1)
    result.stdout.fnmatch_lines(
        [
            "*ERROR at setup of test_stacked*",
            "*@pytest.mark.ranks on *test_stacked has 2 ranks markers (ranks(2), ranks(3)), "
            "of which only one would apply: give one, with every world size to run it at "
            "(ranks(2, 3))*",
        ]
    )


@pytest.mark.parametrize("marker", list(BAD_MARKERS))
def test_a_bad_ranks_marker_errors_that_test_alone(inner: pytest.Pytester, marker: str) -> None:
    inner.makepyfile(
        f"""
        import pytest

        @pytest.mark.{marker}
        def test_bad(rank):
            pass

        def test_good():
            pass
        """
    )
    result = inner.runpytest("-p", "harness")
    result.assert_outcomes(passed=1, errors=1)
    result.stdout.fnmatch_lines(["*ERROR at setup of test_bad*", f"*{BAD_MARKERS[marker]}*"])
    # Deselected, the bad test costs nothing: before, one typo stopped every test.
    inner.runpytest("-p", "harness", "-k", "good").assert_outcomes(passed=1, deselected=1)


@pytest.mark.parametrize("marker", ["fault(rank=1)", "expect(1)", "allow_leftovers()"])
def test_a_rank_marker_without_ranks_is_an_error(inner: pytest.Pytester, marker: str) -> None:
    name = marker.split("(")[0]
    inner.makepyfile(
        f"""
        import pytest

        @pytest.mark.{marker}
        def test_forgot_ranks():
            pass
        """
    )
    result = inner.runpytest("-p", "harness")
    result.assert_outcomes(errors=1)
    result.stdout.fnmatch_lines(
        [f"*the {name} marker on *test_forgot_ranks applies only to a test marked *ranks*"]
    )


def test_an_unknown_expected_ending_is_refused_not_read_as_hangs() -> None:
    with pytest.raises(ExpectationError, match="must be one of returns, raises"):
        Expected("hang")  # type: ignore[arg-type]
    returned = RankOutcome("k", 0, 1, Ending.RETURNED)
    assert not Expected(Wanted.HANGS).matches(returned)
    assert Expected(Wanted.RETURNS).matches(returned)


def test_a_bad_option_stays_a_usage_error(pytester: pytest.Pytester) -> None:
    result = pytester.runpytest("-p", "harness", "--ranks", "two")
    result.stderr.fnmatch_lines(["ERROR: invalid world size 'two' from --ranks: use an int >= 1"])
    assert result.ret == pytest.ExitCode.USAGE_ERROR


def test_ranks_share_the_cores_unless_told_otherwise(monkeypatch: pytest.MonkeyPatch) -> None:
    from harness.plan.settings import usable_cores

    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    cores = usable_cores()
    assert Settings().threads_for(1) == cores
    assert Settings().threads_for(4 * cores) == 1  # at least one
    assert Settings(rank_threads=3).threads_for(8) == 3
    monkeypatch.setenv("OMP_NUM_THREADS", "2")
    assert Settings().threads_for(4) is None  # torch reads OMP_NUM_THREADS itself
    assert Settings(rank_threads=3).threads_for(4) == 3


def test_each_rank_gets_its_share_of_threads_and_the_worker_gets_its_own_back(
    inner: pytest.Pytester,
) -> None:
    inner.makepyfile(
        """
        import os, pytest, torch

        WORKER_DEFAULT = torch.get_num_threads()

        @pytest.mark.ranks(2)
        def test_alpha_default(rank):
            assert torch.get_num_threads() == max(1, len(os.sched_getaffinity(0)) // 2)

        def probe():
            return torch.get_num_threads()

        def test_beta_option(run_on_ranks):
            assert run_on_ranks(probe, world_size=2).values == [3, 3]
        """
    )
    # By default each rank gets its share of the cores...
    inner.runpytest("-p", "harness", "-k", "alpha").assert_outcomes(passed=1, deselected=1)
    # ...or what --rank-threads says, for run_on_ranks as for the marker.
    result = inner.runpytest("-p", "harness", "--rank-threads", "3", "-k", "beta")
    result.assert_outcomes(passed=1, deselected=1)
