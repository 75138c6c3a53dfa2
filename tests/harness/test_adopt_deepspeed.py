"""DeepSpeed's DistributedTest suites on warm ranks (--rank-adopt deepspeed), tested on a base
that follows DeepSpeed's protocol (tests/harness/deepspeed_like: DeepSpeed is not on the index
with its test base, and CI has no network). The real suite runs in make test-deepspeed."""

from __future__ import annotations

import itertools
import os
import re
import shutil
import signal
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.harness.conftest import wait_until

LIKE = Path(__file__).parent / "deepspeed_like"


@pytest.fixture(scope="session")
def deepspeed_path(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Where the DeepSpeed-like package lives for the whole session, outside the project, as
    a source checkout of DeepSpeed does (in-process runs share this process's warm ranks,
    and a rank checks that its deepspeed is the pytest process's)."""
    where = tmp_path_factory.mktemp("deepspeed_checkout")
    shutil.copytree(LIKE / "deepspeed", where / "deepspeed")
    shutil.copy(LIKE / "deepspeed_shm_comm.py", where)
    shutil.copy(LIKE / "cpuinfo.py", where)  # py-cpuinfo, which DeepSpeed's builders ask
    return where


@pytest.fixture
def ds(inner: pytest.Pytester, tmp_path: Path, deepspeed_path: Path) -> Iterator[pytest.Pytester]:
    """A pytester directory holding the DeepSpeed-like base and its conftest (which puts the
    package's checkout on sys.path), with two CPU "devices" (DeepSpeed's LOCAL_SIZE) and a
    private extension cache. The shared-memory buffers its runs made are gone after it (as
    they are, DeepSpeed's runs leave theirs)."""
    shutil.copy(LIKE / "ds_common.py", inner.path)
    shutil.copy(LIKE / "conftest.py", inner.path)
    os.environ["DEEPSPEED_LIKE_CHECKOUT"] = str(deepspeed_path)
    os.environ["LOCAL_SIZE"] = "2"
    os.environ["TORCH_EXTENSIONS_DIR"] = str(tmp_path / "extensions")
    os.environ["BUILD_LOG"] = str(tmp_path / "builds.log")
    os.environ["CPUINFO_LOG"] = str(tmp_path / "cpuinfo.log")
    os.environ["STATE_DIR"] = str(tmp_path)
    os.environ["SHM_LOG"] = str(tmp_path / "shm.log")
    yield inner
    for name in _shm_made():
        Path(name).unlink(missing_ok=True)


def _shm_made() -> list[str]:
    """The shared-memory buffers the DeepSpeed-like op made (deepspeed_shm_comm.py)."""
    log = Path(os.environ["SHM_LOG"])
    return log.read_text().split() if log.exists() else []


PASSING = """
import os, pytest, torch
import deepspeed.comm as dist
import deepspeed.comm.comm as comm_state
from deepspeed.utils import debug, groups
from deepspeed.ops.op_builder import TinyAdamBuilder, TinyLionBuilder
from deepspeed.runtime.zero import Init
from deepspeed.runtime.zero.partition_parameters import _orig_torch_empty
from torch import nn
from torch.nn import functional as F
from ds_common import DistributedTest, DistributedFixture


@pytest.fixture(params=[3, 4])
def base_value(request):
    return request.param


class TestAllReduce(DistributedTest):
    def test_sum(self, base_value):
        t = torch.ones(1) * base_value
        dist.all_reduce(t)
        assert t.item() == 2 * base_value
        assert os.environ["WORLD_SIZE"] == "2" and os.environ["RANK"] == str(dist.get_rank())


class TestWorldSizes(DistributedTest):
    world_size = [1, 2]

    def test_list(self, class_tmpdir):
        (class_tmpdir / f"{dist.get_world_size()}-{dist.get_rank()}").write("x")

    @pytest.mark.world_size(1)
    def test_marker(self, class_tmpdir):
        assert dist.get_world_size() == 1
        assert sorted(os.listdir(class_tmpdir)) == ["1-0", "2-0", "2-1"]


class TestWorldSizeFixture(DistributedTest):
    @pytest.fixture(params=[1, 2])
    def world_size(self, request):
        return request.param

    def test_fixture(self, world_size):
        assert dist.get_world_size() == world_size


class TestSkips(DistributedTest):
    def test_skip_everywhere(self):
        pytest.skip("not on this machine")


class TestTooManyRanks(DistributedTest):
    world_size = 3

    def test_never_runs(self):
        raise AssertionError("DeepSpeed's rule skips it: 3 ranks, 2 devices")


class TestNoInit(DistributedTest):
    init_distributed = False

    def test_no_group(self):
        assert not dist.is_initialized() and os.environ["LOCAL_SIZE"] == "2"


class TestNoDistEnv(DistributedTest):
    world_size = 1
    set_dist_env = False

    def test_environment_left_alone(self):
        assert os.environ["LOCAL_SIZE"] == "2"  # _dist_run would set it to the world size, 1


class TestReuse(DistributedTest):
    reuse_dist_env = True

    def test_first(self):
        dist.barrier()

    def test_second(self):
        dist.barrier()


class TestNonDaemonic(DistributedTest):
    non_daemonic_procs = True

    def test_sum(self):
        t = torch.ones(1)
        dist.all_reduce(t)
        assert t.item() == 2

    def test_skip(self):
        pytest.skip("non-daemonic skip")


class WriteRanks(DistributedFixture):
    world_size = 2

    def run(self, tmpdir):
        (tmpdir / f"fixture-rank{dist.get_rank()}").write("1")


# DeepSpeed registers a DistributedFixture class as a fixture itself, which pytest 8.4 and
# later no longer read; the same launch, called from a fixture of today's pytest.
@pytest.fixture
def written(request):
    WriteRanks()(request)


class TestFixture(DistributedTest):
    world_size = 1

    def test_sees_every_fixture_rank(self, written, tmpdir):
        assert {"fixture-rank0", "fixture-rank1"} <= set(os.listdir(tmpdir))


class TestStateSet(DistributedTest):
    def test_leaves_state(self):
        groups._EXPERT_PARALLEL_GROUP["experts"] = "group"
        groups._WORLD_GROUP = "left behind"
        comm_state.comms_logger_calls.append("left behind")
        Init(module=torch.nn.Linear(2, 2))  # F.linear replaced for good, as DeepSpeed's does
        engine = torch.nn.Linear(2, 2)  # DeepSpeed's engine holds its groups
        engine.group = torch.distributed.distributed_c10d._get_default_group()
        debug.module_names[engine] = "engine"  # a DeepSpeed module global no test empties
        with Init(quantized=True):  # the layers' state-dict loading wrapped for good
            torch.empty(1)
        with open(os.path.join(os.environ["STATE_DIR"], f"pid{dist.get_rank()}"), "w") as f:
            f.write(str(os.getpid()))


class TestStateSeen(DistributedTest):
    def test_finds_it_put_back(self):
        with open(os.path.join(os.environ["STATE_DIR"], f"pid{dist.get_rank()}")) as f:
            assert f.read() == str(os.getpid())  # the same warm rank
        assert groups._EXPERT_PARALLEL_GROUP == {} and groups._WORLD_GROUP is None
        assert comm_state.comms_logger_calls == [] and comm_state.cdb is not None
        assert debug.module_names == {}
        assert F.linear is torch._C._nn.linear and not hasattr(Init, "linear_bk")
        assert Init.num_module_parameters == 0 and torch.empty is _orig_torch_empty
        assert "__new__" not in vars(torch.Tensor) and "_old_apply" not in vars(nn.Module)
        assert vars(nn.Module)["apply"].__module__ == "torch.nn.modules.module"
        for layer in (nn.Linear, nn.Embedding):
            assert layer._load_from_state_dict is nn.Module._load_from_state_dict


class TestBuildsOnce(DistributedTest):
    def test_first(self):
        TinyAdamBuilder().load()

    def test_second(self):
        TinyAdamBuilder().load()

    def test_caught(self):  # a test that falls back when the op fails to load
        try:
            TinyLionBuilder().load()
            loaded = True
        except Exception:
            loaded = False
        assert loaded
"""


def _line(text: str) -> int:
    """The line of PASSING that holds `text`, as pytester writes the file (its first, empty
    line left out)."""
    return next(n for n, line in enumerate(PASSING.splitlines()) if text in line)


def test_a_deepspeed_suite_runs_on_warm_ranks_with_deepspeeds_own_rules(
    ds: pytest.Pytester,
) -> None:
    """World sizes (int, list, marker, fixture), fixtures and parametrize resolved as DeepSpeed
    resolves them, its skip rule, init_distributed = False, reuse_dist_env and
    non_daemonic_procs classes, a DistributedFixture's launch, DeepSpeed's module state put
    back between tests on the same ranks, and an op JIT-built once in the pytest process."""
    ds.makepyfile(test_ds=PASSING)
    result = ds.runpytest("-p", "harness", "--rank-adopt", "deepspeed", "-rs", "-v")
    result.assert_outcomes(passed=17, skipped=3)
    result.stdout.fnmatch_lines_random(
        [
            # where the ranks skipped; DeepSpeed's own skip, where the test is
            f"SKIPPED [[]1[]] test_ds.py:{_line('not on this machine')}: not on this machine",
            f"SKIPPED [[]1[]] test_ds.py:{_line('non-daemonic skip')}: non-daemonic skip",
            f"SKIPPED [[]1[]] test_ds.py:{_line('def test_never_runs')}: Skipping test because "
            "not enough GPUs are available: 3 required, 2 available",
        ]
    )
    result.stdout.no_fnmatch_line("*not adopted*")
    builds = Path(os.environ["BUILD_LOG"]).read_text().split()
    assert builds == [str(os.getpid())] * 2  # each op built once, here, and never in a rank
    # DeepSpeed's builders ask py-cpuinfo twice an op (a second each, as a subprocess times
    # the CPU): asked once for the session's builds.
    assert Path(os.environ["CPUINFO_LOG"]).read_text().split() == [str(os.getpid())]


def test_the_cpus_description_is_asked_once_for_every_session_on_this_cpu(
    ds: pytest.Pytester,
) -> None:
    """py-cpuinfo's answer (a second's subprocess, asked as the first op is loaded) is kept
    beside torch's builds for the next sessions, a new clone's too, with what identifies
    the CPU: one that finds another CPU's answer (a folder shared between machines), or one
    another user could have written, asks again."""
    ds.makepyfile(test_op=LOADS_AN_OP)
    log = Path(os.environ["CPUINFO_LOG"])
    args = ("-p", "harness", "--rank-adopt", "deepspeed")
    for asked in (1, 1):  # asked in the first session only
        ds.runpytest_subprocess(*args, timeout=300).assert_outcomes(passed=2)
        assert len(log.read_text().split()) == asked
    shutil.rmtree(ds.path / ".pytest_cache")  # a new clone: still kept
    ds.runpytest_subprocess(*args, timeout=300).assert_outcomes(passed=2)
    assert len(log.read_text().split()) == 1
    kept = Path(os.environ["TORCH_EXTENSIONS_DIR"]) / "harness-cpuinfo.json"
    kept.write_text(kept.read_text().replace('"cpu": "', '"cpu": "another'))
    ds.runpytest_subprocess(*args, timeout=300).assert_outcomes(passed=2)
    assert len(log.read_text().split()) == 2
    kept.chmod(0o666)  # writable by anyone: not believed
    ds.runpytest_subprocess(*args, timeout=300).assert_outcomes(passed=2)
    assert len(log.read_text().split()) == 3


PRELOADED_EARLY = """
import os
from harness.warm import forkserver
import deepspeed
from ds_common import DistributedTest

SERVER_WHILE_COLLECTING = forkserver._server._forkserver_pid  # the harness's own


class TestRanks(DistributedTest):
    def test_deepspeed_came_with_the_fork(self):
        assert deepspeed.IMPORTED_IN == os.getppid()


def test_the_server_started_while_collecting_ran_them():
    assert SERVER_WHILE_COLLECTING is not None
    assert forkserver._server._forkserver_pid == SERVER_WHILE_COLLECTING
"""


def test_deepspeed_from_its_checkout_is_preloaded_while_pytest_collects(
    ds: pytest.Pytester,
) -> None:
    """With no pytest cache (a CI's fresh clone), the fork server starts as collection does
    and imports DeepSpeed from its checkout meanwhile (about 4 s of the first test, and its
    import sets variables): the server is kept for the ranks, not replaced once collected."""
    ds.makepyfile(test_early=PRELOADED_EARLY)
    args = ("-p", "harness", "--rank-adopt", "deepspeed", "-p", "no:cacheprovider")
    ds.runpytest_subprocess(*args, timeout=300).assert_outcomes(passed=2)


FROM_THE_CHECKOUT = """
import os
import deepspeed
from ds_common import DistributedTest


class TestRanks(DistributedTest):
    def test_deepspeed_is_the_checkouts(self):
        assert deepspeed.__file__.startswith(os.environ["DEEPSPEED_LIKE_CHECKOUT"])
        assert deepspeed.IMPORTED_IN == os.getppid()  # preloaded all the same
"""


def test_a_server_that_imported_another_deepspeed_early_is_replaced(
    ds: pytest.Pytester, tmp_path: Path, deepspeed_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """As collection starts, the server imports the deepspeed it can find then (here another
    copy, on PYTHONPATH); a conftest below the root then puts the checkout first, as
    DeepSpeed's does when pytest runs from above its tests/. The ranks get the checkout's."""
    other = tmp_path / "installed"
    shutil.copytree(deepspeed_path, other)  # deepspeed and the modules beside it
    monkeypatch.setenv("PYTHONPATH", str(other))
    inserts = 'sys.path.insert(1, os.environ["DEEPSPEED_LIKE_CHECKOUT"])\n'
    hooks = (LIKE / "conftest.py").read_text()
    assert inserts in hooks
    (ds.path / "conftest.py").write_text(hooks.replace(inserts, ""))  # the hooks only
    sub = ds.mkpydir("sub")
    (sub / "conftest.py").write_text(f"import os, sys\n{inserts}")
    (sub / "test_checkout.py").write_text(FROM_THE_CHECKOUT)
    args = ("-p", "harness", "--rank-adopt", "deepspeed", "-p", "no:cacheprovider")
    ds.runpytest_subprocess(*args, timeout=300).assert_outcomes(passed=1)


OPS_AND_BUFFERS = """
import os, torch
import deepspeed.comm as dist
from torch.utils import cpp_extension
from deepspeed.ops.op_builder import TinyAdamBuilder
from ds_common import DistributedTest


class TestOps(DistributedTest):
    def test_loads(self):
        dist.all_reduce(torch.ones(1))
        assert TinyAdamBuilder().load().NAME == "tiny_adam"

    def test_loads_past_a_build_killed_midway(self):
        folder = cpp_extension._get_build_directory("tiny_adam", verbose=False)
        open(os.path.join(folder, "lock"), "w").close()  # as a load killed in its check leaves
        assert TinyAdamBuilder().load().NAME == "tiny_adam"
"""


def test_a_rank_imports_the_built_op_past_torchs_lock_and_leaves_no_shared_memory(
    ds: pytest.Pytester,
) -> None:
    """A rank imports an op the pytest process built from the file it loaded, without
    torch's lock file: a rank killed in torch's check left that file, and every later load
    waited on it for ever. DeepSpeed's shared-memory all-reduce buffers (made once per rank
    process, never unlinked: 66 MB each in /dev/shm) are gone when the test's ranks are done."""
    ds.makepyfile(test_ops=OPS_AND_BUFFERS)
    result = ds.runpytest("-p", "harness", "--rank-adopt", "deepspeed", "--rank-timeout", "20")
    result.assert_outcomes(passed=2)
    made = _shm_made()
    assert len(made) == 2  # one a rank, the first time: the second test ran on the same ranks
    assert [name for name in made if os.path.exists(name)] == []


LOADS_AN_OP = """
from deepspeed.ops.op_builder import TinyAdamBuilder
from ds_common import DistributedTest


class TestOp(DistributedTest):
    def test_loads(self):
        TinyAdamBuilder().load()

    def test_loads_again(self):
        TinyAdamBuilder().load()
"""


def test_a_build_lock_left_over_fails_the_tests_saying_so_not_a_wait_for_ever(
    ds: pytest.Pytester, monkeypatch: pytest.MonkeyPatch
) -> None:
    """torch's lock file in an op's build folder, left by a build killed midway, with no
    process working there: torch would wait on it for ever; the harness waits its bound
    (one test), says what to remove, and fails the next test at once."""
    from harness.adopt.deepspeed import build_lock

    monkeypatch.setattr(build_lock, "STALE_S", 1.0)
    lock = build_lock.build_folder("tiny_adam") / "lock"
    lock.touch()
    ds.makepyfile(test_op=LOADS_AN_OP)
    result = ds.runpytest("-p", "harness", "--rank-adopt", "deepspeed", "--rank-timeout", "60")
    result.assert_outcomes(failed=2)
    result.stdout.fnmatch_lines(
        [f"*torch's build lock {lock} is held and no process has worked in * for 1 s*"] * 2
    )
    assert not Path(os.environ["BUILD_LOG"]).exists()  # never built past the lock


WAITS = """
import os, threading
from ds_common import DistributedTest


class TestWaits(DistributedTest):
    def test_waits(self):
        open(os.path.join(os.environ["STATE_DIR"], f"started{os.environ['RANK']}"), "w").close()
        threading.Event().wait()
"""


@pytest.mark.slow
def test_a_session_ended_by_sigterm_leaves_no_shared_memory(
    ds: pytest.Pytester, tmp_path: Path
) -> None:
    """CI cancels with SIGTERM: the buffers of the test running then go with its ranks."""
    ds.makepyfile(test_waits=WAITS)
    proc = subprocess.Popen(
        [sys.executable, "-m", "pytest", "-p", "harness", "--rank-adopt", "deepspeed"],
        cwd=ds.path,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        start_new_session=True,
    )
    try:
        started = lambda: len(list(tmp_path.glob("started*"))) == 2  # noqa: E731
        wait_until(started, 120, "both ranks to start the test")
        assert len(_shm_made()) == 2 and all(os.path.exists(n) for n in _shm_made())
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=60) == -signal.SIGTERM
        assert [name for name in _shm_made() if os.path.exists(name)] == []
    finally:
        proc.kill()
        proc.wait()


PRELOADED = """
import os
from ds_common import DistributedTest


class TestPreloaded(DistributedTest):
    def test_deepspeed_came_with_the_fork(self):
        import deepspeed  # from the checkout, imported once by the fork server

        assert deepspeed.IMPORTED_IN != os.getpid()
"""


def test_deepspeed_from_a_checkout_is_preloaded(ds: pytest.Pytester) -> None:
    """deepspeed imported from a checkout (not installed, not the project's) is imported
    once by the ranks' fork server, not by each rank. In a process of its own: in-process
    runs share this process's fork server, started for other tests."""
    ds.makepyfile(test_ds=PRELOADED)
    result = ds.runpytest_subprocess("-p", "harness", "--rank-adopt", "deepspeed", timeout=300)
    result.assert_outcomes(passed=1)


FAILING = """
import os, sys, threading, pytest, torch
import deepspeed.comm as dist
from ds_common import DistributedTest


class TestVerdicts(DistributedTest):
    def test_assert_while_peer_waits(self):
        if dist.get_rank() == 1:
            assert [dist.get_rank(), 2] == [1, 3]
        dist.all_reduce(torch.ones(1))

    def test_exit_on_one_rank(self):
        if dist.get_rank() == 1:
            sys.exit(0)

    def test_partial_skip(self):
        if dist.get_rank() == 1:
            pytest.skip("only rank 1 skips")

    @pytest.mark.timeout(4)
    def test_hang(self):
        if dist.get_rank() == 1:
            threading.Event().wait()


class TestNonDaemonicExit(DistributedTest):
    non_daemonic_procs = True

    def test_exit_on_one_rank(self):
        if dist.get_rank() == 1:
            sys.exit(0)


@pytest.fixture
def lock():
    return threading.Lock()


class TestUnpicklableFixture(DistributedTest):
    def test_gets_a_lock(self, lock):
        pass


class TestCclBackend(DistributedTest):
    def test_sets_a_backend_up_once_per_process(self):
        import deepspeed.comm.comm as comm_state

        comm_state.cdb.name = "ccl"  # as DeepSpeed's CCLBackend names itself


class TestZeroInitLeftEntered(DistributedTest):
    def test_enters_and_never_exits(self):
        from deepspeed.runtime.zero import Init

        Init().__enter__()  # every torch.nn.Module subclass's __init__ replaced in DeepSpeed's


class TestOwnLaunch(DistributedTest):
    def _launch_procs(self, num_procs, init_method):
        pass  # a class that launches its own way runs as it is

    def test_runs_as_before(self):
        raise AssertionError("never called: the class's own launch runs nothing")
"""


def test_deepspeed_tests_get_the_harness_verdicts(ds: pytest.Pytester) -> None:
    """A rank's assertion while its peer waits is the root cause at once (DeepSpeed's own
    pool waits 600 s, then blames its teardown barrier); sys.exit on one rank fails naming
    it (a false green under non_daemonic_procs); a partial skip fails, as DeepSpeed's
    "Multiple different skip messages" does; a hang is cut with every rank's stack. A class
    with its own launch runs as before, and the session says so."""
    ds.makepyfile(test_ds=FAILING)
    warned = ("-W", "always::harness.RanksReplacedWarning")
    result = ds.runpytest("-p", "harness", "--rank-adopt", "deepspeed", "-rs", *warned)
    result.assert_outcomes(passed=3, failed=6)
    result.stdout.fnmatch_lines_random(
        [
            "rank 1 failed: raised AssertionError: assert [[]1, 2[]] == [[]1, 3[]]; rank 0 *",
            "rank 1 failed: called sys.exit(0); rank 0 coll*TestVerdicts::test_exit_on_one_rank[]]",
            "rank 1 failed: called sys.exit(0); rank 0 coll*TestNonDaemonicExit::*",
            "*rank 1 skipped (only rank 1 skips) while rank 0 ran*",
            "rank 1 failed: hung *",
            "*threading.py*in wait*",
            "harness: not adopted, runs as before: test_ds.TestOwnLaunch: TestOwnLaunch "
            "overrides _launch_procs",
            "*TestUnpicklableFixture: the test instance cannot be sent to its ranks (fixture "
            "values that cannot: lock): TypeError: *DeepSpeed's own pool pickles it too*",
            "*RanksReplacedWarning: *set DeepSpeed's ccl backend up (its native side keeps its "
            "first communicator*the ranks are replaced for the next test*",
            "*RanksReplacedWarning: *left DeepSpeed's zero.Init entered (every torch.nn.Module "
            "subclass's __init__ replaced)*the ranks are replaced for the next test*",
        ]
    )


def test_rank_adopt_names_both_adopters_and_refuses_others(ds: pytest.Pytester) -> None:
    ds.makepyfile(test_ds=PASSING.split("class TestWorldSizes")[0])
    both = ds.runpytest("-p", "harness", "--rank-adopt", "torch,deepspeed")
    both.assert_outcomes(passed=2)
    both.stdout.no_fnmatch_line("*not adopted*")
    ini = ds.runpytest("-p", "harness", "-o", "rank_adopt=deepspeed")
    ini.assert_outcomes(passed=2)
    wrong = ds.runpytest("-p", "harness", "--rank-adopt", "torch,colossal")
    assert wrong.ret != 0
    wrong.stderr.fnmatch_lines(["*rank_adopt*colossal*use torch, deepspeed*"])


@pytest.mark.slow
def test_what_passes_as_it_is_passes_adopted(ds: pytest.Pytester) -> None:
    """The same suite under the DeepSpeed-like base's own process pools, then adopted: the
    same outcome for every test (the state and build tests are left out: their premise, one
    warm rank serving two tests, is the adoption's)."""
    ds.makepyfile(test_ds=PASSING)
    select = ("-k", "not TestState and not TestBuildsOnce", "-rs", "-p", "no:cacheprovider")
    as_it_is = ds.runpytest_subprocess("-p", "harness", *select, timeout=600)
    adopted = ds.runpytest_subprocess("-p", "harness", "--rank-adopt", "deepspeed", *select)
    crashed = _crashed_at_exit(as_it_is)
    as_it_is.assert_outcomes(passed=12 - crashed, failed=crashed, skipped=3, deselected=5)
    adopted.assert_outcomes(passed=12, skipped=3, deselected=5)
    skips = sorted(line for line in as_it_is.outlines if line.startswith("SKIPPED"))
    assert len(skips) == 3
    for line in skips:  # the same reasons (their places differ: the base's code, the test)
        assert any(line.split(": ", 1)[1] in other for other in adopted.outlines)


def _crashed_at_exit(result: pytest.RunResult) -> int:
    """How many tests the base's own run failed only because a spawned non-daemonic worker
    died of a signal: the base, as DeepSpeed's does, leaves gloo's group up as such a worker
    exits, and its teardown then aborts now and then ("terminate called without an active
    exception", exit code -6: about one run in four here). Any other failure of that run
    counts against the comparison."""
    header = re.compile(r"_+ TestNonDaemonic\.\S+ _+$")  # a failure's section (pytrace off)
    crash = re.compile(r"Worker \d+ exited with code -\d+$")
    pairs = itertools.pairwise(result.outlines)
    return sum(1 for line, next_line in pairs if header.match(line) and crash.match(next_line))
