"""pytest's own fixtures, outputs and outcomes inside ranks, as in plain tests."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest


def test_pytests_fixtures_are_made_in_each_rank(inner: pytest.Pytester) -> None:
    inner.makepyfile(
        """
        import logging, os, sys, warnings, pytest

        @pytest.mark.ranks(2)
        def test_capsys(rank, capsys):
            print(f"hello from {rank}")
            print("to err", file=sys.stderr)
            captured = capsys.readouterr()
            assert (captured.out, captured.err) == (f"hello from {rank}\\n", "to err\\n")

        @pytest.mark.ranks(2)
        def test_capfd(rank, capfd):
            os.write(1, f"fd {rank}\\n".encode())
            assert capfd.readouterr().out == f"fd {rank}\\n"

        @pytest.mark.ranks(2)
        def test_caplog(rank, caplog):
            with caplog.at_level(logging.INFO):
                logging.getLogger("train").info("step on rank %d", rank)
            assert caplog.messages == [f"step on rank {rank}"]
            assert caplog.record_tuples[0][:2] == ("train", logging.INFO)

        @pytest.mark.ranks(2)
        def test_recwarn(rank, recwarn):
            warnings.warn(f"w{rank}", UserWarning)
            assert [str(w.message) for w in recwarn] == [f"w{rank}"]

        FINALIZED = []

        @pytest.mark.ranks(2)
        @pytest.mark.parametrize("lr", [0.5])
        @pytest.mark.slowish("x", n=1)
        def test_request(rank, request, lr):
            assert request.node.name == "test_request[ranks2-0.5]"
            assert request.node.nodeid.endswith("::test_request[ranks2-0.5]")
            assert "slowish" in request.node.keywords
            assert request.node.get_closest_marker("slowish").kwargs == {"n": 1}
            assert {"rank", "request", "lr"} <= set(request.fixturenames)
            assert request.config.getoption("ranks") is None
            assert request.config.getini("rank_timeout") == "30"
            request.addfinalizer(lambda: FINALIZED.append(rank))

        @pytest.mark.ranks(2)
        def test_finalizer_ran_in_the_rank(rank):
            assert FINALIZED == [rank]
        """
    )
    result = inner.runpytest("-p", "harness", "-v", "-W", "ignore::pytest.PytestUnknownMarkWarning")
    result.assert_outcomes(passed=6)


def test_each_rank_has_its_own_tmp_path(inner: pytest.Pytester) -> None:
    inner.makepyfile(
        """
        import pytest, torch.distributed as dist

        @pytest.mark.ranks(3)
        def test_tmp(rank, tmp_path, tmpdir, shared_tmp_path):
            assert tmp_path.is_dir() and str(tmpdir) == str(tmp_path)
            (tmp_path / "mine").write_text(str(rank))
            paths = [None] * 3
            dist.all_gather_object(paths, (str(tmp_path), str(shared_tmp_path)))
            assert len({p for p, _ in paths}) == 3  # one each
            assert len({s for _, s in paths}) == 1  # one for all
        """
    )
    inner.runpytest("-p", "harness").assert_outcomes(passed=1)


@pytest.mark.slow
def test_dash_s_streams_rank_output_live_with_a_prefix(inner: pytest.Pytester) -> None:
    inner.makepyfile(
        """
        import sys, pytest

        @pytest.mark.ranks(2)
        def test_talks(rank):
            print(f"working on {rank}")
            print(f"careful on {rank}", file=sys.stderr)
        """
    )
    result = inner.runpytest_subprocess("-p", "harness", "-s")
    result.assert_outcomes(passed=1)
    result.stdout.fnmatch_lines_random(["[[]rank 0[]] working on 0", "[[]rank 1[]] working on 1"])
    result.stderr.fnmatch_lines_random(["[[]rank 0[]] careful on 0", "[[]rank 1[]] careful on 1"])
    result.stdout.no_fnmatch_line("*careful on*")  # stderr stays stderr, as a plain test's


def test_no_capture_plugin_shows_rank_output_live_as_dash_s_does(inner: pytest.Pytester) -> None:
    inner.makepyfile(
        """
        import pytest, harness

        @pytest.mark.ranks(2)
        def test_talks(rank):
            print(f"working on {rank}")

        def spawned(i):
            print(f"spawned {i}")

        def test_spawns():
            harness.spawn(spawned, nprocs=2)
        """
    )
    result = inner.runpytest("-p", "harness", "-p", "no:capture")
    result.assert_outcomes(passed=2)
    result.stdout.fnmatch_lines_random(["[[]rank 1[]] working on 1", "[[]rank 1[]] spawned 1"])


def test_tee_sys_shows_rank_output_live_and_keeps_it(inner: pytest.Pytester) -> None:
    # Live, as a plain test's under tee-sys: stdout to pytest's stdout, stderr to its stderr;
    # kept once, in the ranks' own report sections (not again as the test's own output).
    inner.makepyfile(
        """
        import sys, pytest

        @pytest.mark.ranks(2)
        def test_talks(rank):
            print(f"working on {rank}")
            print(f"careful on {rank}", file=sys.stderr)
        """
    )
    result = inner.runpytest("-p", "harness", "--capture=tee-sys", "-rP")
    result.assert_outcomes(passed=1)
    live = result.stdout.str().split("= PASSES =")[0]  # before the report's sections
    assert "[rank 0] working on 0" in live and "[rank 1] working on 1" in live, live
    assert "[rank 1] careful on 1" in result.stderr.str()
    assert "careful on 1" not in live
    result.stdout.fnmatch_lines(["*Captured stdout [[]rank 1[]] call*", "working on 1"])
    result.stdout.fnmatch_lines(["*Captured stderr [[]rank 1[]] call*", "careful on 1"])
    assert result.stdout.str().count("working on 1") == 2, result.stdout.str()


def test_output_a_test_left_in_a_stream_it_then_replaced_is_in_its_report(
    inner: pytest.Pytester,
) -> None:
    inner.makepyfile(
        """
        import io, sys, pytest

        @pytest.mark.ranks(2)
        def test_swaps(rank):
            print(f"half a line from {rank}", end="")  # still in the stream's buffer
            sys.stdout = io.StringIO()
        """
    )
    result = inner.runpytest("-p", "harness", "-rP")
    result.assert_outcomes(passed=1)
    result.stdout.fnmatch_lines(["*Captured stdout [[]rank 1[]] call*", "half a line from 1"])


def test_passing_tests_keep_every_ranks_output(inner: pytest.Pytester) -> None:
    inner.makepyfile(
        """
        import sys, pytest

        @pytest.mark.ranks(2)
        def test_talks(rank):
            print(f"out of {rank}")
            print(f"err of {rank}", file=sys.stderr)
        """
    )
    result = inner.runpytest(
        "-p", "harness", "-rP", "--junitxml=out.xml", "-o", "junit_logging=all"
    )
    result.assert_outcomes(passed=1)
    result.stdout.fnmatch_lines(
        [
            "*Captured stdout [[]rank 0[]] call*",
            "out of 0",
            "*Captured stderr [[]rank 0[]] call*",
            "err of 0",
            "*Captured stdout [[]rank 1[]] call*",
            "out of 1",
        ]
    )
    # junit's <system-out> joins the sections without their titles: each line says its rank.
    xml = (inner.path / "out.xml").read_text()
    for line in ("[rank 0] out of 0", "[rank 1] out of 1", "[rank 1] err of 1"):
        assert line in xml, xml
    assert "\nout of 0" not in xml, xml
    # ... while the terminal's sections, titled with the rank, show the lines as printed.
    result.stdout.no_fnmatch_line("*[[]rank 0[]] out of 0*")


def test_a_warning_the_filters_make_an_error_fails_the_test_in_its_own_words(
    inner: pytest.Pytester,
) -> None:
    """Under -W error, RanksReplacedWarning failed a passing test with a 53-line traceback
    through the harness: it fails it as pytest fails a test on a warning, in one message."""
    inner.makepyfile(
        """
        import threading, pytest

        @pytest.mark.ranks(2)
        def test_leaves_a_daemon_thread(rank):
            print(f"output of {rank}")
            threading.Thread(target=threading.Event().wait, daemon=True).start()

        @pytest.mark.ranks(2)
        def test_returns_a_value(rank):
            return rank
        """
    )
    result = inner.runpytest("-p", "harness", "-W", "error", "-rP")
    result.assert_outcomes(failed=2)
    result.stdout.fnmatch_lines(
        [
            "*RanksReplacedWarning (an error under this session's warning filters: -W error or "
            "filterwarnings): *test_leaves_a_daemon_thread*: rank 0 left daemon threads*",
            "*Captured stdout [[]rank 0[]] call*",
            "output of 0",
        ]
    )
    result.stdout.fnmatch_lines(["*PytestReturnNotNoneWarning (an error under*"])
    text = result.stdout.str()
    assert "harness/pytest_side/runner.py" not in text and "warnings.warn" not in text, text
    result = inner.runpytest("-p", "harness", "-W", "error", "-W",
                             "ignore::harness.RanksReplacedWarning", "-k", "daemon")  # fmt: skip
    result.assert_outcomes(passed=1)


def test_xfail_in_ranks_is_reported_as_plain_pytest_does(inner: pytest.Pytester) -> None:
    inner.makepyfile(
        """
        import pytest

        @pytest.mark.ranks(2)
        def test_imperative(rank):
            pytest.xfail("not ready")

        @pytest.mark.ranks(2)
        @pytest.mark.xfail(raises=KeyError, reason="known")
        def test_expected_error(rank):
            if rank == 1:
                raise KeyError("k")

        @pytest.mark.ranks(2)
        @pytest.mark.xfail(raises=KeyError)
        def test_other_error_fails(rank):
            if rank == 1:
                raise ValueError("v")

        @pytest.mark.ranks(2)
        @pytest.mark.xfail(reason="flaky")
        def test_xpass(rank):
            pass

        @pytest.mark.ranks(2)
        @pytest.mark.xfail(strict=True)
        def test_strict_xpass(rank):
            pass
        """
    )
    result = inner.runpytest("-p", "harness", "-rxX")
    result.assert_outcomes(xfailed=2, failed=2, xpassed=1)


def test_a_skip_on_some_ranks_says_which(inner: pytest.Pytester) -> None:
    inner.makepyfile(
        """
        import pytest

        @pytest.mark.ranks(3)
        def test_partly(rank):
            if rank == 1:
                pytest.skip("no data here")
        """
    )
    result = inner.runpytest("-p", "harness")
    result.assert_outcomes(failed=1)
    result.stdout.fnmatch_lines(
        ["rank 1 skipped (no data here) while ranks 0, 2 ran: skip on every rank or on none*"]
    )


def test_xunit_setup_method_state_reaches_the_rank(inner: pytest.Pytester) -> None:
    inner.makepyfile(
        """
        import threading, pytest

        class TestModel:
            depth = 2
            lock = threading.Lock()  # in the class body: the rank's own import has it

            @classmethod
            def setup_class(cls):
                cls.vocab = ["a", "b"]
                cls.depth = 3

            def setup_method(self, method):
                self.width = 8

            @pytest.mark.ranks(2)
            def test_sees_setup(self, rank):
                assert self.width == 8
                assert (self.vocab, self.depth, type(self).vocab) == (["a", "b"], 3, ["a", "b"])
        """
    )
    inner.runpytest("-p", "harness").assert_outcomes(passed=1)


@pytest.mark.slow
@pytest.mark.parametrize("package", [True, False], ids=["package", "rootdir-relative"])
def test_importlib_mode_and_rootdir_packages(pytester: pytest.Pytester, package: bool) -> None:
    pytester.makeini("[pytest]\nrank_timeout = 30\n")
    pkg = pytester.mkdir("suite")
    (pkg / "conftest.py").write_text(
        "import pytest\n\nclass Settings:\n    lr = 0.5\n\n"
        "@pytest.fixture\ndef settings():\n    return Settings()\n"
    )
    (pkg / "helpers.py").write_text("LR = 0.5\n")
    if package:
        (pkg / "__init__.py").write_text("")
    lr = "from .helpers import LR" if package else "LR = 0.5"
    (pkg / "test_in_pkg.py").write_text(
        f"import pytest\n{lr}\n\n@pytest.mark.ranks(2)\ndef test_lr(rank, settings):\n"
        "    assert settings.lr == LR\n"
    )
    # The console script, as users run it: the rootdir is not on sys.path then.
    script = Path(sys.executable).with_name("pytest")
    result = pytester.run(script, "-p", "harness", "--import-mode=importlib", timeout=120)
    result.assert_outcomes(passed=1)


def test_select_by_world_size_with_k(inner: pytest.Pytester) -> None:
    inner.makepyfile(
        """
        import pytest

        @pytest.mark.ranks(2, 3)
        def test_world(world_size):
            pass
        """
    )
    result = inner.runpytest("-p", "harness", "-v", "-k", "ranks3")
    result.assert_outcomes(passed=1, deselected=1)
    result.stdout.fnmatch_lines(["*test_world[[]ranks3[]] PASSED*"])


def test_a_fixture_that_cannot_exist_in_a_rank_says_so(inner: pytest.Pytester) -> None:
    inner.makepyfile(
        """
        import pytest

        @pytest.mark.ranks(2)
        def test_records(rank, record_property):
            pass
        """
    )
    result = inner.runpytest("-p", "harness")
    result.assert_outcomes(failed=1)
    result.stdout.fnmatch_lines(
        [
            "*fixture 'record_property' of *test_records* lives in the pytest process and "
            "cannot be used inside ranks: *"
        ]
    )
    result.stdout.no_fnmatch_line("*During handling of the above exception*")


def test_a_fixture_that_uses_a_rank_fixture_is_made_in_each_rank(inner: pytest.Pytester) -> None:
    inner.makeconftest(
        """
        import pytest

        @pytest.fixture(scope="session")
        def settings():
            return {"width": 4}

        @pytest.fixture
        def width(settings):
            return settings["width"]
        """
    )
    inner.makepyfile(
        """
        import sys, pytest, torch

        LIMIT = 1
        SEEN, CLOSED = [], []

        @pytest.fixture(autouse=True)
        def seen(rank):
            SEEN.append(rank)

        @pytest.fixture
        def model(device, settings):
            return torch.nn.Linear(settings["width"], 2).to(device)

        @pytest.fixture
        def batch(rank, model):
            yield torch.full((1, model.in_features), float(rank))
            CLOSED.append(rank)

        @pytest.fixture
        def width(width, rank):  # overrides the conftest's, and uses it
            return width + rank

        @pytest.fixture
        def limit(monkeypatch, rank):  # rank: made in each rank, so it patches there
            monkeypatch.setattr(sys.modules[__name__], "LIMIT", 5)

        @pytest.fixture(params=[1, 2])
        def scaled(request, rank):
            return request.param * 10 + rank

        @pytest.fixture
        def data_file(tmp_path, rank):
            path = tmp_path / "data"
            path.write_text(str(rank))
            return path

        @pytest.mark.ranks(2)
        def test_made_per_rank(rank, device, model, batch, width):
            assert model.weight.device == device and batch[0, 0].item() == rank
            assert width == 4 + rank
            assert SEEN == [rank]

        @pytest.mark.ranks(2)
        def test_teardown_ran_in_the_rank(rank):
            assert CLOSED == [rank]

        @pytest.mark.ranks(2)
        def test_patched_in_the_rank(limit):
            assert LIMIT == 5

        @pytest.mark.ranks(2)
        def test_patch_undone_in_the_rank():
            assert LIMIT == 1

        @pytest.mark.ranks(2)
        def test_parametrized(request, rank, scaled):
            assert scaled == int(request.node.name.split("[")[1][0]) * 10 + rank

        @pytest.mark.ranks(2)
        def test_tmp_path_is_the_ranks(tmp_path, data_file, rank):
            assert data_file.parent == tmp_path and data_file.read_text() == str(rank)

        class TestInAClass:
            @pytest.fixture
            def offset(self, rank):
                return self.base + rank

            def setup_method(self, method):
                self.base = 100

            @pytest.mark.ranks(2)
            def test_method_fixture(self, rank, offset):
                assert offset == 100 + rank
        """
    )
    result = inner.runpytest("-p", "harness", "-v")
    result.assert_outcomes(passed=8)


def test_a_rank_fixture_that_raises_fails_the_rank_that_raised(inner: pytest.Pytester) -> None:
    inner.makepyfile(
        """
        import pytest

        @pytest.fixture
        def loader(rank):
            if rank == 1:
                raise RuntimeError("no shard for rank 1")
            return rank

        @pytest.mark.ranks(2)
        def test_loads(loader):
            pass

        def make_fixture():
            @pytest.fixture
            def local(rank):
                return rank
            return local

        local = make_fixture()

        @pytest.mark.ranks(2)
        def test_local(local):
            pass
        """
    )
    result = inner.runpytest("-p", "harness")
    result.assert_outcomes(failed=2)
    result.stdout.fnmatch_lines(
        [
            "*rank 1 failed: raised RuntimeError: no shard for rank 1*",
            "*fixture 'local' uses 'rank', so each rank makes it, but a rank cannot find its "
            "function (make_fixture.<locals>.local): define it at the top level of a module*",
        ]
    )


def test_xfail_raises_is_matched_against_the_root_cause_as_pytest_matches(
    inner: pytest.Pytester,
) -> None:
    inner.makepyfile(
        """
        import pytest, torch.distributed as dist

        class ShapeError(ValueError):
            pass

        @pytest.mark.ranks(2)
        @pytest.mark.xfail(raises=ValueError, strict=True)
        def test_a_subclass_is_expected(rank):
            if rank == 1:
                raise ShapeError("bad shape")

        @pytest.mark.ranks(2)
        @pytest.mark.xfail(raises=ValueError, strict=True)
        def test_another_ranks_later_error_is_not_the_root_cause(rank):
            if rank == 1:
                raise TypeError("the root cause")
            try:
                dist.barrier()  # fails once rank 1 is gone
            except Exception:
                raise ValueError("after rank 1 failed")
        """
    )
    result = inner.runpytest("-p", "harness", "-rxX")
    result.assert_outcomes(xfailed=1, failed=1)
    result.stdout.fnmatch_lines(["*rank 1 failed: raised TypeError: the root cause*"])


def test_xfail_raises_holds_for_every_ranks_own_failure_whichever_came_first(
    inner: pytest.Pytester,
) -> None:
    """xfail(raises=E) is checked against each rank's own failure, not only the first in
    time: rank 0's expected ValueError came first, and rank 1's KeyError (no peer's doing)
    made no difference, an XFAIL that hid it. Plain pytest fails a test whose exception is
    not in `raises`; so does a rank test, naming the rank, whichever rank failed first."""
    inner.makepyfile(
        """
        import time
        import pytest

        def wait_for(path):
            deadline = time.monotonic() + 60  # a bound, should rank 0 never write it
            while not path.exists() and time.monotonic() < deadline:
                time.sleep(0.01)

        @pytest.mark.ranks(2)
        @pytest.mark.xfail(raises=ValueError)
        def test_expected_first(rank, shared_tmp_path):
            if rank == 0:
                (shared_tmp_path / "raised").touch()
                raise ValueError("expected")
            wait_for(shared_tmp_path / "raised")
            raise KeyError("unrelated")

        @pytest.mark.ranks(2)
        @pytest.mark.xfail(raises=ValueError)
        def test_unexpected_first(rank, shared_tmp_path):
            if rank == 1:
                (shared_tmp_path / "raised").touch()
                raise KeyError("unrelated")
            wait_for(shared_tmp_path / "raised")
            raise ValueError("expected")

        @pytest.mark.ranks(2)
        @pytest.mark.xfail(raises=(ValueError, KeyError))
        def test_each_own_failure_expected(rank, shared_tmp_path):
            if rank == 0:
                (shared_tmp_path / "raised").touch()
                raise ValueError("expected")
            wait_for(shared_tmp_path / "raised")
            raise KeyError("also expected")
        """
    )
    result = inner.runpytest("-p", "harness", "-rxXf")
    result.assert_outcomes(failed=2, xfailed=1)
    result.stdout.fnmatch_lines(
        [
            "*xfail(raises=ValueError) does not expect rank 1's failure: raised KeyError: "
            "'unrelated'*",
        ]
    )
    assert result.stdout.str().count("does not expect rank 1's failure") >= 2


def test_a_peer_slower_than_the_failure_grace_is_judged_on_its_own_ending(
    inner: pytest.Pytester, monkeypatch: pytest.MonkeyPatch
) -> None:
    """No time decides a verdict: rank 1's KeyError, raised after rank 0's expected
    ValueError and later than the failure grace (shortened to 0.2 s here, 5 s by default),
    fails the strict xfail as it does when it comes sooner. A rank outside any collective is
    not waiting on its failed peer, so it is not cut at the grace and called its collateral."""
    monkeypatch.setenv("_HARNESS_TEST_FAILURE_GRACE_S", "0.2")
    inner.makepyfile(
        """
        import time
        import pytest

        def wait_for(path):
            deadline = time.monotonic() + 60  # a bound, should rank 0 never write it
            while not path.exists() and time.monotonic() < deadline:
                time.sleep(0.01)

        @pytest.mark.ranks(2, timeout=30)
        @pytest.mark.xfail(raises=ValueError, strict=True)
        def test_late_other_error(rank, shared_tmp_path):
            if rank == 0:
                (shared_tmp_path / "raised").touch()
                raise ValueError("expected")
            wait_for(shared_tmp_path / "raised")
            time.sleep(1.0)  # slow work after the peer failed: five times the grace
            raise KeyError("late")

        @pytest.mark.ranks(2, timeout=30)
        def test_late_own_failure(rank, shared_tmp_path):
            if rank == 0:
                (shared_tmp_path / "raised").touch()
                raise ValueError("first")
            wait_for(shared_tmp_path / "raised")
            time.sleep(1.0)
            raise KeyError("its own")
        """
    )
    result = inner.runpytest("-p", "harness", "-rxXf")
    result.assert_outcomes(failed=2)
    result.stdout.fnmatch_lines(
        ["*xfail(raises=ValueError) does not expect rank 1's failure: raised KeyError: 'late'*"]
    )
    text = result.stdout.str()
    assert "raised KeyError: 'its own'" in text, text
    assert "hung outside any collective" not in text and "after a peer failed" not in text


def test_only_pytests_own_outcomes_skip_or_xfail(inner: pytest.Pytester) -> None:
    inner.makepyfile(
        """
        import pytest

        class Skipped(Exception):
            pass

        class XFailed(Exception):
            pass

        @pytest.mark.ranks(2)
        def test_own_skipped(rank):
            raise Skipped("an application error that happens to be named Skipped")

        @pytest.mark.ranks(2)
        def test_own_xfailed(rank):
            if rank == 1:
                raise XFailed("an application error that happens to be named XFailed")
        """
    )
    result = inner.runpytest("-p", "harness")
    result.assert_outcomes(failed=2)


def test_a_unittest_method_marked_for_ranks_is_refused_not_run_here(
    inner: pytest.Pytester,
) -> None:
    inner.makepyfile(
        """
        import unittest, pytest, torch.distributed as dist

        class TestModel(unittest.TestCase):
            @pytest.mark.ranks(2)
            def test_sum(self):
                self.assertTrue(dist.is_initialized())
        """
    )
    result = inner.runpytest("-p", "harness")
    result.assert_outcomes(errors=1)
    result.stdout.fnmatch_lines(
        ["*@pytest.mark.ranks on *test_sum* cannot run a unittest.TestCase method on ranks*"]
    )


def test_an_xfail_on_one_rank_xfails_though_its_peers_lost_it(inner: pytest.Pytester) -> None:
    inner.makepyfile(
        """
        import pytest, torch, torch.distributed as dist

        @pytest.mark.ranks(2)
        def test_known_bug(rank):
            if rank == 0:
                pytest.xfail("known bug seen on rank 0")
            dist.all_reduce(torch.ones(1))  # rank 0 never joins: rank 1 fails for it
        """
    )
    result = inner.runpytest("-p", "harness", "-rx")
    result.assert_outcomes(xfailed=1)


def test_capsys_disabled_in_a_rank_lets_output_through(inner: pytest.Pytester) -> None:
    inner.makepyfile(
        """
        import pytest

        @pytest.mark.ranks(2)
        def test_through(rank, capsys):
            print("captured")
            with capsys.disabled():
                print(f"through from {rank}")
            assert capsys.readouterr().out == "captured\\n"
        """
    )
    result = inner.runpytest("-p", "harness", "-rP")
    result.assert_outcomes(passed=1)
    result.stdout.fnmatch_lines(["*stdout [[]rank 1[]]*", "through from 1"], consecutive=False)


def test_a_teardown_error_after_a_failing_body_is_reported_too(inner: pytest.Pytester) -> None:
    inner.makepyfile(
        """
        import pytest

        @pytest.fixture
        def resource(rank):
            yield rank
            raise OSError(f"could not release on rank {rank}")

        @pytest.mark.ranks(2)
        def test_fails_then_teardown_fails(resource):
            assert resource < 0, "the body's failure"
        """
    )
    result = inner.runpytest("-p", "harness")
    result.assert_outcomes(failed=1)
    result.stdout.fnmatch_lines(
        [
            "*the body's failure*",
            "*then, tearing its fixtures down: OSError: could not release on rank 1*",
        ],
        consecutive=False,
    )


def test_caplog_in_a_rank_captures_at_the_configured_log_level(inner: pytest.Pytester) -> None:
    inner.makeini("[pytest]\nrank_timeout = 30\nlog_level = INFO\n")
    inner.makepyfile(
        """
        import logging, pytest

        @pytest.mark.ranks(2)
        def test_info(rank, caplog):
            logging.getLogger("train").info("step on rank %d", rank)
            assert caplog.messages == [f"step on rank {rank}"]
        """
    )
    inner.runpytest("-p", "harness").assert_outcomes(passed=1)


def test_caplog_in_a_rank_keeps_each_phase_apart_as_in_pytest(inner: pytest.Pytester) -> None:
    # As pytest's caplog: records shows the current phase's records only, and get_records
    # gives each phase's (a fixture's set-up and teardown records are not the call's).
    inner.makepyfile(
        """
        import logging, pytest

        LOG = logging.getLogger("app")

        @pytest.fixture
        def thing(rank):
            LOG.warning("set up on rank %d", rank)
            yield 1
            LOG.warning("torn down on rank %d", rank)

        @pytest.fixture
        def checks_teardown(caplog, rank):
            yield
            assert [r.getMessage() for r in caplog.get_records("teardown")] == [
                f"torn down on rank {rank}"
            ]

        @pytest.mark.ranks(2)
        def test_phases(rank, checks_teardown, thing, caplog):
            assert [r.getMessage() for r in caplog.get_records("setup")] == [
                f"set up on rank {rank}"
            ]
            assert caplog.records == []
            LOG.warning("called on rank %d", rank)
            assert caplog.messages == [f"called on rank {rank}"]
            assert caplog.get_records("call") == caplog.records
        """
    )
    inner.runpytest("-p", "harness").assert_outcomes(passed=1)


def test_reading_stdin_in_a_rank_says_why_it_cannot(inner: pytest.Pytester) -> None:
    # As a plain test's read under capture raises, not an empty line; breakpoint() included
    # (it quit at once with a bare BdbQuit).
    inner.makepyfile(
        """
        import sys, pytest

        @pytest.mark.ranks(2)
        def test_reads(rank):
            with pytest.raises(OSError, match=f"rank {rank}: reading from stdin"):
                sys.stdin.readline()
            with pytest.raises(OSError, match="no terminal"):
                input("? ")
            assert not sys.stdin.isatty()

        @pytest.mark.ranks(2)
        def test_debugs(rank):
            breakpoint()

        @pytest.mark.ranks(2)
        def test_closes_it(rank):
            sys.stdin.close()  # as pytest's stand-in does, nothing: the next test reads it
            assert sys.stdin.buffer is not None and sys.stdin.name == "<stdin>"
            with pytest.raises(OSError, match="reading from stdin"):
                sys.stdin.buffer.read()

        @pytest.mark.ranks(2)
        def test_after_a_close(rank):
            with pytest.raises(OSError, match="reading from stdin"):
                for line in sys.stdin:
                    pass
        """
    )
    result = inner.runpytest("-p", "harness")
    result.assert_outcomes(passed=3, failed=1)
    result.stdout.fnmatch_lines(["*rank ? failed: raised OSError: rank ?: reading from stdin*"])
    result.stdout.fnmatch_lines(["*breakpoint() and pdb*print what you need*"])


def test_runxfail_makes_pytest_xfail_in_a_rank_a_no_op_as_in_pytest(
    inner: pytest.Pytester,
) -> None:
    inner.makepyfile(
        """
        import pytest

        def test_plain():
            pytest.xfail("not yet")

        @pytest.mark.ranks(2)
        def test_ranked(rank):
            pytest.xfail("not yet")
            print(f"went on on rank {rank}")
            assert rank < 2
        """
    )
    result = inner.runpytest("-p", "harness", "--runxfail", "-rP")
    result.assert_outcomes(passed=2)
    result.stdout.fnmatch_lines(["*went on on rank 1*"])
    inner.runpytest("-p", "harness").assert_outcomes(xfailed=2)


def test_runxfail_reaches_an_xfail_imported_while_a_spawn_run_loaded_the_module(
    inner: pytest.Pytester,
) -> None:
    # `from pytest import xfail` binds whatever pytest.xfail is when the module is loaded:
    # here by a harness.spawn run on the same ranks, before the ranks test.
    inner.makepyfile(
        """
        import harness, pytest
        from pytest import xfail

        def noop(i):
            pass

        def test_a_spawn_loads_this_module_on_the_ranks():
            harness.spawn(noop, nprocs=2)

        @pytest.mark.ranks(2)
        def test_b_xfail_bound_at_import(rank):
            xfail("not yet")
        """
    )
    inner.runpytest("-p", "harness", "--runxfail").assert_outcomes(passed=2)


@pytest.mark.parametrize(
    ("plugin", "noise", "said"),
    [
        ("unraisableexception", "Noisy(); gc.collect()", "noisy __del__"),
        ("threadexception", "t = threading.Thread(target=divide); t.start(); t.join()", "by zero"),
    ],
    ids=["unraisable", "thread"],
)
def test_stray_exceptions_in_a_rank_follow_pytests_plugins(
    inner: pytest.Pytester, plugin: str, noise: str, said: str
) -> None:
    # With pytest's plugin for them off, a stray exception is printed, as in a plain test,
    # not turned into a warning (which filterwarnings = error would make a failure).
    inner.makeini("[pytest]\nrank_timeout = 30\nfilterwarnings = error\n")
    inner.makepyfile(
        f"""
        import gc, threading, pytest

        class Noisy:
            def __del__(self):
                raise RuntimeError("noisy __del__")

        def divide():
            1 / 0

        @pytest.mark.ranks(2)
        def test_ranked(rank):
            {noise}
        """
    )
    result = inner.runpytest("-p", "harness", "-p", f"no:{plugin}", "-rP")
    result.assert_outcomes(passed=1)
    result.stdout.fnmatch_lines(["*Captured stderr [[]rank 1[]] call*", f"*{said}*"])
    inner.runpytest("-p", "harness").assert_outcomes(failed=1)  # the plugin on: a warning


@pytest.mark.parametrize("how", ["exit", "interrupt"])
def test_pytest_exit_or_an_interrupt_in_a_rank_stops_the_session(
    inner: pytest.Pytester, how: str
) -> None:
    stop = 'pytest.exit("enough", returncode=3)' if how == "exit" else "raise KeyboardInterrupt"
    inner.makepyfile(
        f"""
        import pytest

        @pytest.mark.ranks(2)
        def test_stops(rank):
            if rank == 1:
                {stop}

        def test_never_runs():
            raise AssertionError("the session went on")
        """
    )
    result = inner.runpytest("-p", "harness", no_reraise_ctrlc=True)
    assert result.ret == (3 if how == "exit" else pytest.ExitCode.INTERRUPTED)
    result.stdout.no_fnmatch_line("*the session went on*")


def test_an_autouse_patch_made_here_still_reaches_the_fixtures_made_here(
    inner: pytest.Pytester,
) -> None:
    """monkeypatch alone does not move a fixture into the ranks: its environment reaches the
    pytest process's fixtures and travels to the ranks, as before."""
    inner.makeconftest(
        """
        import os, pytest

        @pytest.fixture(autouse=True)
        def _env(monkeypatch):
            monkeypatch.setenv("MODE", "test")

        @pytest.fixture
        def settings():
            return {"mode": os.environ.get("MODE", "UNSET")}
        """
    )
    inner.makepyfile(
        """
        import os, pytest

        @pytest.mark.ranks(2)
        def test_ranked(settings):
            assert settings["mode"] == "test" and os.environ["MODE"] == "test"
        """
    )
    inner.runpytest("-p", "harness").assert_outcomes(passed=1)


def test_fixtures_of_two_conftests_with_one_module_name_stay_apart(
    pytester: pytest.Pytester,
) -> None:
    pytester.makeini("[pytest]\nrank_timeout = 30\n")
    for side in ("a", "b"):
        folder = pytester.mkdir(side)
        (folder / "conftest.py").write_text(
            f"import pytest\n\n@pytest.fixture\ndef shard(rank):\n    return ({side!r}, rank)\n"
        )
        (folder / f"test_{side}.py").write_text(
            f"import pytest\n\n@pytest.mark.ranks(2)\ndef test_{side}(shard, rank):\n"
            f"    assert shard == ({side!r}, rank)\n"
        )
    pytester.runpytest_subprocess("-p", "harness", timeout=120).assert_outcomes(passed=2)


def test_a_collective_in_a_fixture_teardown_does_not_hide_the_bodys_failure(
    inner: pytest.Pytester,
) -> None:
    inner.makepyfile(
        """
        import pytest, torch, torch.distributed as dist

        @pytest.fixture
        def synced(rank):
            yield rank
            dist.barrier()  # every rank meets here after the test

        @pytest.mark.ranks(2, timeout=20)
        def test_one_fails(synced):
            if synced == 1:
                raise ValueError("rank 1 broke")
            dist.all_reduce(torch.ones(1))
        """
    )
    result = inner.runpytest("-p", "harness")
    result.assert_outcomes(failed=1)
    result.stdout.fnmatch_lines(["rank 1 failed: raised ValueError: rank 1 broke*"])
    result.stdout.no_fnmatch_line("*still running at the 20 s timeout*")


def test_an_override_of_a_parametrized_fixture_made_in_ranks_has_its_param(
    inner: pytest.Pytester,
) -> None:
    inner.makeconftest(
        """
        import pytest

        @pytest.fixture(params=[1, 2])
        def model(request, rank):
            return request.param * 10 + rank
        """
    )
    inner.makepyfile(
        """
        import pytest

        @pytest.fixture
        def model(model, request):
            return (model, request.param)

        @pytest.mark.ranks(2)
        def test_model(model, rank):
            value, param = model
            assert value == param * 10 + rank
        """
    )
    inner.runpytest("-p", "harness").assert_outcomes(passed=2)


def test_options_by_flag_and_rank_values_used_in_the_pytest_process_say_so(
    inner: pytest.Pytester,
) -> None:
    inner.makeconftest(
        """
        import threading, pytest

        def pytest_addoption(parser):
            parser.addoption("--big", action="store_true")

        @pytest.fixture
        def is_leader(request):  # made in the pytest process: rank is not known there
            return request.getfixturevalue("rank") == 0

        @pytest.fixture(params=[threading.Lock()])
        def locked(request, rank):
            return request.param
        """
    )
    inner.makepyfile(
        """
        import pytest

        @pytest.mark.ranks(2)
        def test_flag(request):
            assert request.config.getoption("--big") is True
            assert request.config.getoption("big") is True
            with pytest.raises(ValueError, match="no option named 'nope'"):
                request.config.getoption("nope")

        @pytest.mark.ranks(2)
        def test_leader(is_leader):
            pass

        @pytest.mark.ranks(2)
        def test_unpicklable_param(locked):
            pass
        """
    )
    result = inner.runpytest("-p", "harness", "--big")
    result.assert_outcomes(passed=1, failed=1, errors=1)
    result.stdout.fnmatch_lines(
        [
            "*'rank' is known only inside each rank*ask for 'rank' as an argument*",
            "*fixture 'locked' (its param) of *test_unpicklable_param* cannot be sent*",
        ],
        consecutive=False,
    )


def test_verbose_runs_show_a_ranks_full_assertion_diff(
    inner: pytest.Pytester, monkeypatch: pytest.MonkeyPatch
) -> None:
    # pytest never shortens diffs on CI (CI or BUILD_NUMBER set): clear both so the
    # quiet run shortens here and on CI alike; the ranks inherit this environment.
    monkeypatch.delenv("CI", raising=False)
    monkeypatch.delenv("BUILD_NUMBER", raising=False)
    inner.makepyfile(
        """
        import pytest

        @pytest.mark.ranks(2)
        def test_lists(rank):
            assert list(range(30)) == list(range(29)) + [99]
        """
    )
    quiet = inner.runpytest("-p", "harness")
    quiet.stdout.fnmatch_lines(["*Use -v to get more diff*"])
    loud = inner.runpytest("-p", "harness", "-vv")
    loud.stdout.fnmatch_lines(["*Full diff:*"])
    loud.stdout.no_fnmatch_line("*Use -v to get more diff*")


def test_a_projects_own_device_fixture_is_not_replaced_by_the_ranks(
    inner: pytest.Pytester,
) -> None:
    inner.makeconftest(
        """
        import pytest, torch

        @pytest.fixture(params=["cpu", "meta"])
        def device(request):
            return torch.device(request.param)

        @pytest.fixture
        def weights(device):
            return torch.zeros(2, device=device)
        """
    )
    inner.makepyfile(
        """
        import pytest

        @pytest.mark.ranks(2)
        def test_on(device, weights, request):
            wanted = request.node.name.split("[")[1].split("-")[0]
            assert device.type == wanted and weights.device.type == wanted
        """
    )
    inner.runpytest("-p", "harness", "-v").assert_outcomes(passed=2)


def test_starting_ranks_leaves_multiprocessing_default_start_method_unset(
    inner: pytest.Pytester,
) -> None:
    # CPython sets the default start method as a side effect of starting a forkserver or
    # spawn child; a later plain test's own mp.set_start_method then raised.
    import multiprocessing

    saved = multiprocessing.get_start_method(allow_none=True)
    multiprocessing.set_start_method(None, force=True)
    inner.makepyfile(
        """
        import multiprocessing, pytest

        @pytest.mark.ranks(2)
        def test_on_ranks(rank):
            pass

        def test_plain_sets_its_start_method():
            assert multiprocessing.get_start_method(allow_none=True) is None
            multiprocessing.set_start_method("spawn")
            multiprocessing.set_start_method(None, force=True)
        """
    )
    try:
        inner.runpytest("-p", "harness").assert_outcomes(passed=2)
    finally:
        multiprocessing.set_start_method(saved, force=True)


def test_a_conftest_sets_its_own_start_method_in_the_ranks_too(inner: pytest.Pytester) -> None:
    # A rank was started with its parent's default start method set (multiprocessing's
    # preparation data): the conftest's set_start_method("spawn"), imported again in the
    # rank, raised there "context has already been set", or read back another method.
    inner.makeconftest(
        """
        import multiprocessing

        multiprocessing.set_start_method("spawn")
        """
    )
    inner.makepyfile(
        """
        import multiprocessing, pytest

        @pytest.mark.ranks(2)
        def test_on_ranks(rank):
            assert multiprocessing.get_start_method() == "spawn"

        def test_plain():
            assert multiprocessing.get_start_method() == "spawn"
        """
    )
    inner.makepyfile(
        test_its_module_sets_it="""
        import multiprocessing, pytest

        multiprocessing.set_start_method("spawn", force=True)  # imported again in the rank

        @pytest.mark.ranks(2)
        def test_on_ranks_too(rank):
            assert multiprocessing.get_start_method() == "spawn"
        """
    )
    inner.runpytest_subprocess("-p", "harness").assert_outcomes(passed=3)


def test_a_ranks_log_records_reach_the_reports_captured_log(inner: pytest.Pytester) -> None:
    inner.makeini("[pytest]\nrank_timeout = 30\nlog_level = INFO\n")
    inner.makepyfile(
        """
        import logging, pytest

        QUIET = logging.getLogger("quiet")  # made when the ranks load this module
        QUIET.propagate = False

        @pytest.mark.ranks(2)
        def test_logs(rank):
            logging.getLogger("train").info("step on rank %d", rank)
            logging.getLogger("train").warning("careful on rank %d", rank)
            logging.getLogger("torch.distributed").warning("torch says %d", rank)
            QUIET.warning("quietly on rank %d", rank)
            assert rank == 0
        """
    )
    result = inner.runpytest("-p", "harness", "-o", "log_format=%(levelname)s %(message)s")
    result.assert_outcomes(failed=1)
    result.stdout.fnmatch_lines(
        [
            "*Captured log [[]rank 0[]] call*",
            "INFO step on rank 0",
            "WARNING careful on rank 0",
            "WARNING torch says 0",  # a logger that does not propagate, as pytest does
            "WARNING quietly on rank 0",  # one the test's module made, on a rank's first test
            "*Captured log [[]rank 1[]] call*",
            "INFO step on rank 1",
            "WARNING careful on rank 1",
        ]
    )
    # Captured, as pytest captures a plain test's: no longer on a rank's stderr (torch's
    # own handler still writes there, as in a plain test).
    stderr = result.stdout.str().split("Captured stderr [rank 1] call")[1].split("Captured")[0]
    assert "torch says 1" in stderr and "careful" not in stderr


def test_records_outside_a_captured_test_go_where_logging_sends_them(
    inner: pytest.Pytester,
) -> None:
    # A harness.spawn run captures nothing, as under torch.multiprocessing.spawn: with no
    # handler configured, logging's last resort writes a warning to the rank's stderr. The
    # ranks captured a test's records just before, on the same ranks.
    inner.makeini("[pytest]\nrank_timeout = 30\nlog_level = ERROR\n")
    inner.makepyfile(
        """
        import logging, pytest, harness

        QUIET = logging.getLogger("quiet")
        QUIET.propagate = False

        @pytest.mark.ranks(2)
        def test_a_captured(rank):
            logging.getLogger("train").error("logged in a test on rank %d", rank)
            QUIET.error("quietly logged in a test on rank %d", rank)

        def spawned(i):
            logging.getLogger("train").warning("uncaptured on rank %d", i)
            QUIET.warning("quietly uncaptured on rank %d", i)
            logging.getLogger("train").info("below the last resort's level %d", i)
            raise ValueError(f"rank {i} fails")

        def test_b_spawned():
            with pytest.raises(Exception) as info:
                harness.spawn(spawned, nprocs=2)
            report = info.value.report
            assert "uncaptured on rank 1" in report and "quietly uncaptured on rank 1" in report
            assert "below the last resort" not in report and "in a test" not in report
            assert report.count("quietly uncaptured on rank 1") == 1, report

        @pytest.mark.ranks(2)
        def test_c_lets_a_quiet_logger_propagate_again(rank):
            QUIET.propagate = True  # left so

        def test_d_spawned_once_more():
            with pytest.raises(Exception) as info:
                harness.spawn(spawned, nprocs=2)
            assert info.value.report.count("quietly uncaptured on rank 1") == 1, info.value.report
        """
    )
    inner.runpytest("-p", "harness").assert_outcomes(passed=4)


def test_a_rank_that_hangs_or_dies_keeps_its_captured_log(inner: pytest.Pytester) -> None:
    inner.makepyfile(
        """
        import logging, os, threading, pytest

        @pytest.mark.ranks(2, timeout=2)
        def test_hangs(rank):
            logging.warning("about to wait on rank %d", rank)
            if rank == 1:
                threading.Event().wait()

        @pytest.mark.ranks(2)
        def test_dies(rank):
            logging.error("fatal state on rank %d", rank)
            if rank == 1:
                os._exit(3)
        """
    )
    result = inner.runpytest("-p", "harness")
    result.assert_outcomes(failed=2)
    result.stdout.fnmatch_lines(["*rank 1*hung*", "*about to wait on rank 1*"])
    result.stdout.fnmatch_lines(["*rank 1*exited with status 3*", "*fatal state on rank 1*"])


def test_a_ranks_captured_log_keeps_its_tail_as_its_streams_do(inner: pytest.Pytester) -> None:
    inner.makeini("[pytest]\nrank_timeout = 30\nlog_format = %(message)s\n")
    inner.makepyfile(
        """
        import logging, pytest

        @pytest.mark.ranks(2)
        def test_chatty(rank):
            for i in range(20000):
                logging.warning("line %06d", i)
        """
    )
    result = inner.runpytest("-p", "harness", "-rP")
    result.assert_outcomes(passed=1)
    result.stdout.fnmatch_lines(["*bytes cut ...]*", "line 019999"])
    result.stdout.no_fnmatch_line("line 000000")


def test_without_pytests_logging_plugin_a_ranks_records_stay_on_its_stderr(
    inner: pytest.Pytester,
) -> None:
    inner.makepyfile(
        """
        import logging, pytest

        @pytest.mark.ranks(2)
        def test_logs(rank):
            logging.getLogger("train").warning("careful on rank %d", rank)
        """
    )
    result = inner.runpytest("-p", "harness", "-p", "no:logging", "-rP")
    result.assert_outcomes(passed=1)
    result.stdout.fnmatch_lines(["*Captured stderr [[]rank 1[]] call*", "careful on rank 1"])
    result.stdout.no_fnmatch_line("*Captured log*")


def test_dash_s_shows_a_ranks_last_line_even_without_its_newline(
    inner: pytest.Pytester,
) -> None:
    inner.makepyfile(
        """
        import pytest, sys

        @pytest.mark.ranks(2)
        def test_talks(rank):
            print(f"step 1 on {rank}")
            print(f"almost done on {rank}", end="", flush=True)
        """
    )
    result = inner.runpytest("-p", "harness", "-s")
    result.assert_outcomes(passed=1)
    result.stdout.fnmatch_lines_random(
        ["[[]rank 0[]] step 1 on 0", "[[]rank 1[]] almost done on 1*"]
    )


def test_showlocals_adds_a_ranks_locals_to_its_traceback(inner: pytest.Pytester) -> None:
    inner.makepyfile(
        """
        import pytest

        @pytest.mark.ranks(2)
        def test_locals(rank):
            shard = f"shard-{rank}"
            big = "x" * 1000
            assert rank == 0
        """
    )
    plain = inner.runpytest("-p", "harness")
    plain.stdout.no_fnmatch_line("*shard = 'shard-1'*")
    result = inner.runpytest("-p", "harness", "-l")
    result.assert_outcomes(failed=1)
    result.stdout.fnmatch_lines(["*rank 1*root cause*", "*rank = 1", "*shard = 'shard-1'"])
    assert max(len(line) for line in result.stdout.lines if "big = " in line) < 300  # cut
    result.stdout.no_fnmatch_line("*@py_assert*")  # assertion rewriting's helpers hidden
    whole = inner.runpytest("-p", "harness", "-l", "-vv")
    assert any("x" * 1000 in line for line in whole.stdout.lines)


def test_a_ranks_request_knows_its_path_module_class_function_and_scope(
    inner: pytest.Pytester,
) -> None:
    inner.makepyfile(
        """
        import pytest

        SETTING = "from the module"

        @pytest.fixture
        def seen(rank, request):
            return (request.path.name, request.module.SETTING, request.cls, request.scope)

        @pytest.mark.ranks(2)
        def test_plain(rank, seen, request):
            assert seen[0] == __file__.rsplit("/", 1)[1]
            assert seen[1:] == ("from the module", None, "function")
            assert request.function is test_plain and request.instance is None

        class TestGroup:
            @pytest.mark.ranks(2)
            def test_in_class(self, rank, seen, request):
                assert seen[2] is TestGroup and request.cls is TestGroup
                assert request.instance is self
                assert request.function is TestGroup.test_in_class
        """
    )
    inner.runpytest("-p", "harness").assert_outcomes(passed=2)
