"""Running a marked test on ranks: fixtures, parametrised sizes, sending fixtures, launch mode."""

from __future__ import annotations

import pytest


def test_body_runs_on_every_rank_with_a_live_group(inner: pytest.Pytester) -> None:
    inner.makepyfile(
        """
        import pytest, torch, torch.distributed as dist

        @pytest.mark.ranks
        def test_sum(rank, world_size, device, shared_tmp_path):
            assert dist.is_initialized() and dist.get_backend() == "gloo"
            assert (dist.get_rank(), dist.get_world_size()) == (rank, world_size)
            assert device == torch.device("cpu")
            (shared_tmp_path / f"rank{rank}").write_text("here")
            t = torch.tensor([float(rank)])
            dist.all_reduce(t)
            assert t.item() == sum(range(world_size))
            dist.barrier()
            assert sorted(p.name for p in shared_tmp_path.iterdir()) == [
                f"rank{r}" for r in range(world_size)
            ]
        """
    )
    result = inner.runpytest("-p", "harness", "--ranks", "3")
    result.assert_outcomes(passed=1)


def test_sizes_parametrise_with_real_ids(inner: pytest.Pytester) -> None:
    inner.makepyfile(
        """
        import pytest, torch.distributed as dist

        @pytest.mark.ranks(2, 4)
        def test_world(world_size):
            assert dist.get_world_size() == world_size
        """
    )
    result = inner.runpytest("-p", "harness", "-v")
    result.stdout.fnmatch_lines(
        ["*test_world[[]ranks2[]] PASSED*", "*test_world[[]ranks4[]] PASSED*"]
    )
    # The ids select like any other: by node id, or with -k.
    result = inner.runpytest(
        "-p", "harness", "test_sizes_parametrise_with_real_ids.py::test_world[ranks4]"
    )
    result.assert_outcomes(passed=1)
    result = inner.runpytest("-p", "harness", "-k", "world and 2")
    result.assert_outcomes(passed=1, deselected=1)


def test_dash_k_ranks_n_selects_every_test_that_runs_on_n_ranks(inner: pytest.Pytester) -> None:
    """`-k ranks4` missed a bare `@pytest.mark.ranks` test running on 4 ranks (--ranks 4):
    it has no [ranks4] id. Every ranks test has the keyword of its world size; node ids are
    unchanged."""
    inner.makepyfile(
        """
        import pytest

        @pytest.mark.ranks
        def test_bare(world_size):
            pass

        @pytest.mark.ranks(2, 4)
        def test_both(world_size):
            pass

        @pytest.mark.ranks(4)
        def test_four(world_size):
            pass

        def test_plain():
            pass
        """
    )
    four = inner.runpytest("-p", "harness", "--ranks", "4", "-k", "ranks4", "-v")
    four.assert_outcomes(passed=3, deselected=2)
    four.stdout.fnmatch_lines(["*::test_bare PASSED*"], consecutive=False)  # its id as ever
    two = inner.runpytest("-p", "harness", "--ranks", "4", "-k", "ranks2")
    two.assert_outcomes(passed=1, deselected=4)


def test_dash_v_shows_each_tests_world_size(inner: pytest.Pytester) -> None:
    """The README's first test ran on 2 ranks under `pytest --ranks 4`, and nothing said how
    many ranks ran: -v says it on each test's line."""
    inner.makepyfile(
        """
        import pytest

        @pytest.mark.ranks
        def test_bare(world_size):
            pass

        @pytest.mark.ranks(2)
        def test_two(world_size):
            pytest.skip("not today")

        def test_plain():
            pass
        """
    )
    result = inner.runpytest("-p", "harness", "--ranks", "3", "-v")
    result.stdout.fnmatch_lines(
        [
            "*::test_bare PASSED on 3 ranks*",
            "*::test_two[[]ranks2[]] SKIPPED on 2 ranks (not today)*",
            "*::test_plain PASSED*",
        ],
        consecutive=False,
    )
    assert "test_plain PASSED on" not in result.stdout.str()


def test_summary_lines_keep_pytests_word_nodeid_shape(inner: pytest.Pytester) -> None:
    """`-v -rA` printed `FAILED on 2 ranks test_v.py::test_r[ranks2] - ...` in the short
    summary, and xdist's `-v` `[gw1] [ 50%] PASSED on 2 ranks test_v.py::...`: CI tools read
    the second field as the node id. Only -v's own line, where the node id comes first,
    says how many ranks ran."""
    inner.makepyfile(
        test_v="""
        import pytest

        @pytest.mark.ranks(2)
        def test_r(rank):
            assert rank == 0

        @pytest.mark.ranks(2)
        def test_ok(rank):
            pass

        @pytest.mark.ranks(2)
        def test_skip(rank):
            pytest.skip("not today")
        """
    )
    result = inner.runpytest("-p", "harness", "-v", "-rA")
    result.stdout.fnmatch_lines(
        [
            "test_v.py::test_r[[]ranks2[]] FAILED on 2 ranks*",
            "*short test summary info*",
            "PASSED test_v.py::test_ok[[]ranks2[]]",
            "SKIPPED [[]1[]] test_v.py:*: not today",
            "FAILED test_v.py::test_r[[]ranks2[]] - Failed: rank 1 failed*",
        ],
        consecutive=False,
    )
    summary = result.stdout.str().split("short test summary info")[1]
    assert " on 2 ranks" not in summary, summary
    result = inner.runpytest_subprocess("-p", "harness", "-v", "-n", "2", "-rA")
    text = result.stdout.str()
    assert " on 2 ranks" not in text, text
    result.stdout.fnmatch_lines(["[[]gw?[]] [[]*[]] FAILED test_v.py::test_r[[]ranks2[]]*"])


def test_with_the_plugin_off_a_test_that_needs_it_says_so(pytester: pytest.Pytester) -> None:
    """`-p no:harness` gave "fixture 'rank' not found" (and under --strict-markers, "'ranks'
    not found in `markers`"), with no hint that the plugin was off or what to do."""
    pytester.makepyfile(
        """
        import pytest

        @pytest.mark.ranks(2)
        def test_marked(rank):
            pass

        def test_uses_a_fixture(run_on_ranks):
            pass

        def test_plain():
            pass
        """
    )
    result = pytester.runpytest_subprocess("-p", "no:harness", "--strict-markers", "-rE")
    result.assert_outcomes(errors=2, passed=1)  # at set-up, as a missing fixture is
    result.stdout.fnmatch_lines(
        [
            "*::test_marked is marked ranks, and the harness plugin is off (-p no:harness): "
            "drop -p no:harness to run it, or deselect such tests (-m 'not ranks', or -k)",
            "*::test_uses_a_fixture uses the harness's fixture 'run_on_ranks', and the harness "
            "plugin is off*",
        ]
    )
    deselected = pytester.runpytest_subprocess("-p", "no:harness", "-m", "not ranks", "-k", "plain")
    deselected.assert_outcomes(passed=1)


def test_with_the_plugin_off_only_its_hint_is_imported(pytester: pytest.Pytester) -> None:
    """`-p no:harness` still imported the whole harness package (about 70 ms of a session's
    start) for the hint's entry point: now the hint and the package's bare __init__ alone."""
    pytester.makeconftest(
        """
        import sys

        def pytest_sessionfinish(session):
            loaded = sorted(m for m in sys.modules if m == "harness" or m.startswith("harness."))
            print("HARNESS MODULES:", loaded)
        """
    )
    pytester.makepyfile("def test_plain():\n    pass\n")
    result = pytester.runpytest_subprocess("-p", "no:harness", "-s")
    result.assert_outcomes(passed=1)
    assert "HARNESS MODULES: ['harness', 'harness.off_hint']" in result.stdout.str()


def test_the_off_hint_knows_every_marker_and_fixture_of_the_harness(
    pytester: pytest.Pytester,
) -> None:
    from harness import off_hint
    from harness.plugin import MARKERS

    assert sorted(off_hint.MARKERS) == sorted(line.split("(")[0].split(":")[0] for line in MARKERS)
    pytester.makepyfile("def test_x():\n    pass\n")
    result = pytester.runpytest_subprocess("-p", "harness", "--fixtures")
    shown = {line.split()[0] for line in result.stdout.lines if line and not line[0].isspace()}
    ours = {name for name in shown if name in off_hint.FIXTURES}
    assert ours == set(off_hint.FIXTURES), shown


def test_a_bad_size_is_that_tests_error_naming_the_marker(inner: pytest.Pytester) -> None:
    inner.makepyfile(
        """
        import pytest

        @pytest.mark.ranks(0)
        def test_x():
            pass

        def test_others_still_run():
            pass
        """
    )
    result = inner.runpytest("-p", "harness")
    result.stdout.fnmatch_lines(["*invalid world size 0 from @pytest.mark.ranks on*test_x*"])
    result.assert_outcomes(passed=1, errors=1)


def test_each_test_gets_a_fresh_group_on_warm_workers(inner: pytest.Pytester) -> None:
    inner.makepyfile(
        """
        import os, pytest, torch, torch.distributed as dist

        @pytest.mark.ranks
        @pytest.mark.parametrize("i", range(6))
        def test_many(i, rank):
            t = torch.tensor([float(i)])
            dist.all_reduce(t)
            assert t.item() == 2 * i
            with open(f"pid-{i}-{rank}", "w") as f:  # ranks run in pytest's cwd
                f.write(str(os.getpid()))
        """
    )
    result = inner.runpytest("-p", "harness")
    result.assert_outcomes(passed=6)
    pids = {p.read_text() for p in inner.path.glob("pid-*")}
    assert len(pids) == 2, f"the 6 tests should share 2 warm ranks, saw pids {pids}"


def test_a_tests_store_timeout_and_debug_level_do_not_reach_the_next(
    inner: pytest.Pytester,
) -> None:
    # Both live in the rank process, beyond any one group: a rank's store client serves
    # every test, and torch's debug level wraps every group made after it is set.
    inner.makepyfile(
        """
        from datetime import timedelta
        import pytest, torch.distributed as dist
        from torch.distributed import distributed_c10d as c10d

        @pytest.mark.ranks(2)
        def test_a_changes_them(rank):
            c10d._get_default_store().set_timeout(timedelta(milliseconds=100))
            if rank == 0:
                dist.set_debug_level(dist.DebugLevel.DETAIL)

        @pytest.mark.ranks(2, fresh_group=True)
        def test_b_on_a_fresh_group(rank):
            assert c10d._get_default_store().timeout >= timedelta(seconds=10)
            assert dist.get_debug_level() == dist.DebugLevel.OFF

        @pytest.mark.ranks(2)
        def test_c_changes_them_again(rank):
            c10d._get_default_store().set_timeout(timedelta(milliseconds=100))

        @pytest.mark.ranks(2)
        def test_d_on_the_kept_group(rank):
            assert c10d._get_default_store().timeout >= timedelta(seconds=10)
        """
    )
    inner.runpytest("-p", "harness", "--rank-timeout", "10").assert_outcomes(passed=4)


def test_fixtures_are_resolved_here_and_sent(inner: pytest.Pytester) -> None:
    inner.makeconftest(
        """
        import pytest

        @pytest.fixture
        def settings():
            return {"lr": 0.5, "steps": [1, 2]}
        """
    )
    inner.makepyfile(
        """
        import pytest

        @pytest.mark.ranks
        @pytest.mark.parametrize("scale", [3])
        def test_settings(settings, scale, rank):
            assert settings == {"lr": 0.5, "steps": [1, 2]}
            assert scale == 3
        """
    )
    inner.runpytest("-p", "harness").assert_outcomes(passed=1)


def test_a_fixture_that_cannot_be_sent_fails_naming_it(inner: pytest.Pytester) -> None:
    inner.makepyfile(
        """
        import threading, pytest

        @pytest.fixture
        def lock():
            return threading.Lock()

        @pytest.mark.ranks
        def test_lock(lock):
            pass
        """
    )
    result = inner.runpytest("-p", "harness")
    result.assert_outcomes(failed=1)
    result.stdout.fnmatch_lines(["*fixture 'lock' of *test_lock cannot be sent to the ranks*"])


def test_rank_fixtures_outside_a_rank_test_say_what_to_do(inner: pytest.Pytester) -> None:
    inner.makepyfile(
        """
        def test_plain(rank):
            pass
        """
    )
    result = inner.runpytest("-p", "harness")
    result.stdout.fnmatch_lines(["*fixture 'rank' exists only in a test marked*ranks*"])


def test_class_based_tests_run_on_ranks(inner: pytest.Pytester) -> None:
    inner.makepyfile(
        """
        import pytest, torch.distributed as dist

        @pytest.mark.ranks
        class TestGroup:
            def test_rank(self, rank):
                assert dist.get_rank() == rank

            def test_size(self, world_size):
                assert dist.get_world_size() == world_size
        """
    )
    inner.runpytest("-p", "harness").assert_outcomes(passed=2)


def test_launch_mode_gives_torchruns_environment_and_no_group(inner: pytest.Pytester) -> None:
    inner.makepyfile(
        """
        import os, pytest, torch, torch.distributed as dist

        from harness.common.torchrun_env import VARIABLES

        @pytest.mark.ranks(4, launch=True)
        @pytest.mark.parametrize("attempt", [1, 2])
        def test_launch(rank, attempt):
            assert not dist.is_initialized()
            env = os.environ
            assert set(VARIABLES) <= set(env)
            assert (env["WORLD_SIZE"], env["RANK"]) == ("4", str(rank))
            assert (env["LOCAL_RANK"], env["LOCAL_WORLD_SIZE"]) == (str(rank), "4")
            assert env["MASTER_ADDR"] == "127.0.0.1" and int(env["MASTER_PORT"]) > 0
            dist.init_process_group("gloo")
            t = torch.ones(1)
            dist.all_reduce(t)
            assert t.item() == 4
            dist.destroy_process_group()

        @pytest.mark.ranks(4)
        def test_after_launch_env_is_gone(rank):
            assert "MASTER_PORT" not in os.environ and "RANK" not in os.environ
        """
    )
    inner.runpytest("-p", "harness").assert_outcomes(passed=3)


def test_a_group_set_up_that_failed_in_a_test_leaves_no_trace(inner: pytest.Pytester) -> None:
    inner.makepyfile(
        """
        from datetime import timedelta
        import pytest, torch, torch.distributed as dist
        from harness import raises, returns

        @pytest.mark.ranks(2, launch=True)
        @pytest.mark.expect(rank=1, does=raises(Exception), others=returns())
        def test_init_fails(rank):
            if rank == 1:  # its peer never comes: the failed set-up took a group name
                dist.init_process_group("gloo", timeout=timedelta(seconds=1))

        @pytest.mark.ranks(2, timeout=20)
        def test_next_group_comes_up(rank):
            t = torch.ones(1)
            dist.all_reduce(t)
            assert t.item() == 2
        """
    )
    inner.runpytest("-p", "harness").assert_outcomes(passed=2)


def test_run_on_ranks_returns_every_ranks_outcome(inner: pytest.Pytester) -> None:
    inner.makepyfile(
        """
        import os, signal, sys, time
        import torch.distributed as dist
        from harness import Ending

        def work(kind):
            r = dist.get_rank()
            if r == 1 and kind == "raise":
                raise ValueError("bad batch")
            if r == 1 and kind == "exit":
                sys.exit(4)
            if r == 1 and kind == "kill":
                os.kill(os.getpid(), signal.SIGKILL)
            if r == 1 and kind == "hang":
                while True:
                    time.sleep(0.05)
            return r * 10

        def test_values(run_on_ranks):
            assert run_on_ranks(work, "ok", world_size=3).values == [0, 10, 20]

        def test_raise(run_on_ranks):
            out = run_on_ranks(work, "raise", world_size=3)
            assert out.endings == [Ending.RETURNED, Ending.RAISED, Ending.RETURNED]
            assert out[1].exc_name == "ValueError" and out[1].message == "bad batch"
            assert "ValueError" in out[1].exc_mro and "Exception" in out[1].exc_mro

        def test_exit(run_on_ranks):
            out = run_on_ranks(work, "exit")
            assert out[1].ending is Ending.EXITED and out[1].exit_code == 4

        def test_kill(run_on_ranks):
            out = run_on_ranks(work, kind="kill")
            assert out[1].ending is Ending.SIGNALLED and out[1].signal == signal.SIGKILL

        def test_hang(run_on_ranks):
            out = run_on_ranks(work, "hang", timeout=2)
            assert out[1].ending is Ending.HUNG
            assert "in work" in out[1].stack
            assert out[0].ending is Ending.RETURNED

        def test_lambda_is_refused(run_on_ranks):
            try:
                run_on_ranks(lambda: 1)
            except ValueError as exc:
                assert "module-level function" in str(exc)
            else:
                raise AssertionError("a lambda was accepted")
        """
    )
    inner.runpytest("-p", "harness").assert_outcomes(passed=6)


def test_a_return_value_that_cannot_travel_is_not_taken_for_none(inner: pytest.Pytester) -> None:
    inner.makepyfile(
        """
        import threading, pytest

        def make_lock():
            return threading.Lock()

        def test_values(run_on_ranks):
            out = run_on_ranks(make_lock, world_size=2)
            assert out[0].ok
            lost = "rank 0 returned <unlocked _thread.lock.*could not be sent back"
            with pytest.raises(ValueError, match=lost):
                out[0].value
            with pytest.raises(ValueError, match="could not be sent back"):
                out.values
        """
    )
    inner.runpytest("-p", "harness").assert_outcomes(passed=1)


def test_each_tests_ranks_see_that_tests_environment(inner: pytest.Pytester) -> None:
    inner.makepyfile(
        """
        import os, pytest

        @pytest.fixture
        def flag():  # runs in the pytest process
            os.environ["ONLY_FOR_A"] = "on"
            yield
            del os.environ["ONLY_FOR_A"]

        @pytest.mark.ranks(2)
        def test_a(flag, rank):
            assert os.environ["ONLY_FOR_A"] == "on"
            assert os.environ["PYTEST_CURRENT_TEST"].endswith("::test_a[ranks2] (call)")

        @pytest.mark.ranks(2)
        def test_b(rank):
            assert "ONLY_FOR_A" not in os.environ
            assert os.environ["PYTEST_CURRENT_TEST"].endswith("::test_b[ranks2] (call)")
        """
    )
    inner.runpytest("-p", "harness").assert_outcomes(passed=2)


def test_a_test_whose_fixture_empties_the_environment_sees_it_empty(
    inner: pytest.Pytester,
) -> None:
    inner.makepyfile(
        """
        import os, pytest
        from unittest import mock

        @pytest.fixture
        def foo(monkeypatch):
            monkeypatch.setenv("FOO", "1")

        @pytest.fixture
        def emptied():
            with mock.patch.dict(os.environ, clear=True):
                yield

        @pytest.mark.ranks(2)
        def test_a(rank, foo):
            assert os.environ.get("FOO") == "1"

        @pytest.mark.ranks(2)
        def test_b(rank, emptied):
            assert "FOO" not in os.environ and "HOME" not in os.environ
        """
    )
    inner.runpytest("-p", "harness").assert_outcomes(passed=2)


def test_monkeypatch_is_made_and_undone_in_each_rank(inner: pytest.Pytester) -> None:
    inner.makepyfile(
        """
        import os, pytest

        @pytest.mark.ranks
        def test_patch(monkeypatch, rank):
            monkeypatch.setattr(os, "sep", "!")
            monkeypatch.setenv("PATCHED", str(rank))
            assert os.sep == "!"

        @pytest.mark.ranks
        def test_after(rank):
            assert os.sep == "/" and "PATCHED" not in os.environ
        """
    )
    inner.runpytest("-p", "harness").assert_outcomes(passed=2)


@pytest.mark.slow
def test_pytest_driven_from_stdin_starts_ranks(pytester: pytest.Pytester) -> None:
    import subprocess
    import sys

    pytester.makepyfile(
        """
        import pytest, torch.distributed as dist

        @pytest.mark.ranks
        def test_two(world_size):
            assert dist.get_world_size() == world_size
        """
    )
    script = "import pytest, sys\nsys.exit(pytest.main(['-p', 'harness', '-q']))\n"
    result = subprocess.run(
        [sys.executable, "-"],
        input=script,
        text=True,
        capture_output=True,
        cwd=pytester.path,
        timeout=120,
        check=False,
    )
    assert result.returncode == 0, result.stdout + result.stderr
    assert "1 passed" in result.stdout


def test_run_on_ranks_rejects_bad_arguments_with_value_errors(inner: pytest.Pytester) -> None:
    inner.makepyfile(
        """
        import pytest
        from harness import Fault

        def work():
            return 1

        @pytest.mark.parametrize(("kwargs", "message"), [
            ({"world_size": 0}, "invalid world size 0 from run_on_ranks"),
            ({"timeout": -1}, "invalid timeout -1 from run_on_ranks"),
            ({"backend": "mpi"}, "invalid backend 'mpi'"),
            ({"faults": [Fault(rank=5)]}, "invalid fault rank 5 from run_on_ranks"),
        ])
        def test_bad(run_on_ranks, kwargs, message):
            with pytest.raises(ValueError, match=message):
                run_on_ranks(work, **kwargs)
        """
    )
    inner.runpytest("-p", "harness").assert_outcomes(passed=4)


@pytest.mark.slow
def test_last_failed_and_exit_first_work_with_rank_tests(pytester: pytest.Pytester) -> None:
    pytester.makepyfile(
        """
        import pytest

        @pytest.mark.ranks
        def test_a_fails(rank):
            assert rank == 0

        @pytest.mark.ranks
        def test_b_passes(rank):
            pass
        """
    )
    first = pytester.runpytest("-p", "harness", "-p", "cacheprovider")
    first.assert_outcomes(failed=1, passed=1)
    again = pytester.runpytest("-p", "harness", "-p", "cacheprovider", "--lf", "-v")
    again.assert_outcomes(failed=1)  # only the failed test ran again
    again.stdout.no_fnmatch_line("*test_b_passes*")
    stopped = pytester.runpytest("-p", "harness", "-x")
    stopped.assert_outcomes(failed=1)  # test_b_passes never ran


@pytest.mark.slow
def test_ranks_start_under_a_long_tmpdir(
    pytester: pytest.Pytester, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The forkserver's socket lives under TMPDIR, and a Unix socket's path has at most 107
    bytes: from a TMPDIR of 76 characters no rank could start (AF_UNIX path too long)."""
    long_dir = pytester.path / ("t" * 60) / ("m" * 60)
    long_dir.mkdir(parents=True)
    monkeypatch.setenv("TMPDIR", str(long_dir))
    pytester.makepyfile(
        """
        import pytest, torch, torch.distributed as dist

        @pytest.mark.ranks(2)
        def test_sum(rank):
            t = torch.ones(1)
            dist.all_reduce(t)
            assert t.item() == 2
        """
    )
    result = pytester.runpytest_subprocess("-p", "harness", timeout=180)
    result.assert_outcomes(passed=1)
