"""The fork server imports what the tests import once (--rank-preload): ranks start as forks
with it loaded, the project's own modules stay per rank, and a preload that fails, prints or
hangs is reported as what it is."""

from __future__ import annotations

import contextlib
import functools
import signal
import sys
import types
from pathlib import Path

import pytest

from harness.warm import preload
from tests.harness.conftest import wait_until

# A folder the inner session's conftest declares installed (as site-packages are), holding
# modules that record which process imported them.
CONFTEST = """
import os, sys
from pathlib import Path
import harness.warm.preload

SITE = Path(__file__).parent / "site"
sys.path.insert(0, str(SITE))
harness.warm.preload.installed_roots = lambda: (str(SITE) + os.sep,)
os.environ["TEST_PYTEST_PID"] = str(os.getpid())
"""
INSTALLED = """
import os
print("loading installed_mod")
IMPORTED_IN = os.getpid()
"""
OWN = """
import os
IMPORTED_IN = os.getpid()
"""
TESTS = """
import os, pytest
import installed_mod, own_helper


@pytest.mark.ranks(2)
def test_where_modules_were_imported(rank):
    assert installed_mod.IMPORTED_IN {installed} os.getpid()
    assert installed_mod.IMPORTED_IN {server} os.getppid()  # the fork server
    assert own_helper.IMPORTED_IN == os.getpid()  # the project's own: in each rank
    assert not any(name.startswith("_HARNESS_PRELOAD") for name in os.environ)


@pytest.mark.ranks(4)
def test_another_world_size(rank):
    assert installed_mod.IMPORTED_IN {installed} os.getpid()
"""


def _project(inner: pytest.Pytester, installed: str = INSTALLED, **more: str) -> None:
    inner.makeconftest(CONFTEST)
    site = inner.mkdir("site")
    (site / "installed_mod.py").write_text(installed)
    for name, source in more.items():
        (site / f"{name}.py").write_text(source)
    (inner.path / "own_helper.py").write_text(OWN)


def test_installed_modules_the_tests_import_are_imported_once_in_the_fork_server(
    inner: pytest.Pytester,
) -> None:
    _project(inner)
    inner.makepyfile(TESTS.format(installed="!=", server="=="))
    result = inner.runpytest_subprocess("-p", "harness", "-rA", "-v")
    result.assert_outcomes(passed=2)
    result.stdout.fnmatch_lines(
        [
            "*Captured output [[]fork server[]] preloading the tests' imports*",
            "loading installed_mod",
            "harness: the fork server preloaded * modules the tests import in * s*",
        ]
    )
    assert result.stdout.str().count("loading installed_mod") == 1  # once, not per rank
    # The line says what was done, and how to turn it off, without reading as its opposite.
    result.stdout.fnmatch_lines(
        ["*preloaded * s, so that ranks start with them (--rank-preload none turns it off)"]
    )


def test_with_rank_preload_none_each_rank_imports_them(inner: pytest.Pytester) -> None:
    _project(inner)
    inner.makepyfile(TESTS.format(installed="==", server="!="))
    result = inner.runpytest_subprocess("-p", "harness", "--rank-preload", "none")
    result.assert_outcomes(passed=2)


# Fails, dies or hangs only in the fork server (whose parent is the pytest process).
IN_THE_SERVER_ONLY = """
import os, time
if os.getppid() == int(os.environ["TEST_PYTEST_PID"]):
    {action}
IMPORTED_IN = os.getpid()
"""
FAILING_TESTS = """
import os, pytest
import installed_mod, troublesome


@pytest.mark.ranks(2)
def test_first(rank):
    assert installed_mod.IMPORTED_IN != os.getpid()
    assert troublesome.IMPORTED_IN == os.getpid()  # the rank imported it itself


@pytest.mark.ranks(2)
def test_second(rank):
    assert troublesome.IMPORTED_IN == os.getpid()
"""


def test_a_module_that_fails_in_the_server_is_left_to_the_ranks(inner: pytest.Pytester) -> None:
    _project(inner, troublesome=IN_THE_SERVER_ONLY.format(action="raise RuntimeError('no')"))
    inner.makepyfile(FAILING_TESTS)
    result = inner.runpytest_subprocess("-p", "harness")
    result.assert_outcomes(passed=2)
    result.stdout.fnmatch_lines(
        [
            "harness: 1 of the modules the tests import could not be preloaded in the fork "
            "server; each rank imported them itself:",
            "  troublesome: RuntimeError: no",
        ]
    )


@pytest.mark.parametrize(
    ("action", "expected"),
    [
        (
            "time.sleep(3600)",
            "*the fork server was still preloading the test modules' imports, in "
            "'troublesome' after 3 s (--rank-import-timeout)*",
        ),
        (
            "os._exit(7)",
            "*the fork server died preloading the test modules' imports, in 'troublesome'*",
        ),
    ],
    ids=["hangs", "dies"],
)
def test_a_preload_that_hangs_or_kills_the_server_fails_one_test_only(
    inner: pytest.Pytester, action: str, expected: str
) -> None:
    _project(inner, troublesome=IN_THE_SERVER_ONLY.format(action=action))
    inner.makepyfile(
        FAILING_TESTS.replace("    assert installed_mod.IMPORTED_IN != os.getpid()\n", "")
    )
    result = inner.runpytest_subprocess("-p", "harness", "--rank-import-timeout", "3", "-v")
    result.stdout.fnmatch_lines([expected, "*--rank-preload none*"])
    # The preload is given up; the next test's ranks come from a plain server.
    result.stdout.fnmatch_lines(["*test_second*PASSED*"])
    result.assert_outcomes(passed=1, errors=1)  # the harness's error, not the test's failure


EARLY = """
import multiprocessing, os, pytest
import installed_mod
from harness.warm import forkserver


def test_a_plain_test_first():  # in the pytest process, before any rank test
    running = forkserver._server._forkserver_pid is not None  # the harness's own server
    assert running == (os.environ["EXPECT_EARLY"] == "1")
    # the test's own children come from a server of its own, started now
    child = multiprocessing.get_context("forkserver").Process(target=os.getpid)
    child.start()
    child.join(60)
    assert child.exitcode == 0
    theirs = multiprocessing.forkserver._forkserver._forkserver_pid  # the module's global one
    assert theirs is not None and forkserver._server._forkserver_pid != theirs


@pytest.mark.ranks(2)
def test_ranks(rank):
    preloaded = os.environ.get("EXPECT_PRELOADED", "1") == "1"
    assert installed_mod.IMPORTED_IN == (os.getppid() if preloaded else os.getpid())
"""


def test_the_fork_server_starts_during_collection_where_ranks_are_needed(
    inner: pytest.Pytester, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Its imports (torch, the worker, what the last session preloaded) overlap the
    # collection: from the first module that names ranks. A session with no ranks test
    # starts none, whatever pytest's cache says of the last one (nor --collect-only).
    _project(inner)
    inner.makepyfile(test_early=EARLY, test_plain_only=EARLY.split("@pytest.mark.ranks")[0])
    run = functools.partial(inner.runpytest_subprocess, "-p", "harness", timeout=300)
    monkeypatch.setenv("EXPECT_EARLY", "0")
    run("test_plain_only.py").assert_outcomes(passed=1)
    run("--collect-only")
    monkeypatch.setenv("EXPECT_EARLY", "1")
    run("test_early.py").assert_outcomes(passed=2)  # at its ranks module's collection
    monkeypatch.setenv("EXPECT_EARLY", "0")
    run("test_plain_only.py").assert_outcomes(passed=1)  # the last one started ranks: none
    monkeypatch.setenv("EXPECT_PRELOADED", "0")
    run("--rank-preload", "none", "test_early.py").assert_outcomes(passed=2)


IMPORTED_AFTER_THE_START = """
import pytest
from harness.warm import forkserver

# The module's own imports (torch, here) would overlap the server's import of torch.
SERVER_AT_IMPORT = forkserver._server._forkserver_pid is not None


def test_the_server_was_there_as_the_module_was_imported():
    assert SERVER_AT_IMPORT


def test_ranks(run_on_ranks):
    pass
"""


def test_in_a_fresh_clone_the_server_starts_before_a_ranks_module_is_imported(
    inner: pytest.Pytester,
) -> None:
    """A one-test session in a fresh directory (a new clone, CI) was 1.70x a plain one: the
    server started at the first ranks test collected, after its module had imported torch
    here. It starts as pytest finds a test module whose text names the ranks marker or
    fixtures, before importing it (1.20x, benchmarks/first_test.py)."""
    _project(inner)
    inner.makepyfile(test_early=IMPORTED_AFTER_THE_START)
    inner.runpytest_subprocess("-p", "harness", "-p", "no:cacheprovider").assert_outcomes(passed=2)


def test_what_the_fork_server_prints_goes_into_a_report_or_nowhere(
    inner: pytest.Pytester, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The server started early wrote on the terminal (torch's "Failed to initialize NumPy"
    as it imported torch, inside the first test's -v line), in a session with no ranks test
    at that. Python's import-time profile stands for such output here: the server writes it
    for each module it imports, and only the server imports the worker."""
    _project(inner)
    inner.makepyfile(EARLY)
    run = functools.partial(inner.runpytest_subprocess, "-p", "harness", timeout=300)
    monkeypatch.setenv("EXPECT_EARLY", "1")  # started at the ranks test's collection
    run().assert_outcomes(passed=2)  # ranks started: the next session starts it at once
    monkeypatch.setenv("PYTHONPROFILEIMPORTTIME", "1")
    result = run("-k", "plain")
    result.assert_outcomes(passed=1)
    assert "harness.rank.worker" not in result.stdout.str() + result.stderr.str()


def test_an_early_server_imports_with_the_environment_the_conftests_set(
    inner: pytest.Pytester,
) -> None:
    # A conftest below the root runs while pytest collects, after the server started: a
    # library that reads a variable it sets at import must read it in the ranks too.
    _project(inner, installed="import os\nSEEN = os.environ.get('SET_WHILE_COLLECTING')\n")
    sub = inner.mkpydir("sub")
    (sub / "conftest.py").write_text("import os\nos.environ['SET_WHILE_COLLECTING'] = 'yes'\n")
    (sub / "test_env.py").write_text(
        "import pytest, installed_mod\n\n\n@pytest.mark.ranks(2)\ndef test_seen(rank):\n"
        "    assert installed_mod.SEEN == 'yes'\n"
    )
    for _ in range(2):  # the second starts its server early (the first started ranks)
        inner.runpytest_subprocess("-p", "harness", timeout=300).assert_outcomes(passed=1)


KEPT = """
import os, pytest
import installed_mod
from harness.warm import forkserver

SERVER_WHILE_COLLECTING = forkserver._server._forkserver_pid  # the harness's own


@pytest.mark.ranks(2)
def test_ranks(rank):
    assert installed_mod.IMPORTED_IN == os.getppid()


def test_the_server_started_early_ran_them():
    if os.environ["EXPECT_EARLY"] == "1":
        assert SERVER_WHILE_COLLECTING is not None
        assert forkserver._server._forkserver_pid == SERVER_WHILE_COLLECTING
"""


def test_an_early_server_is_kept_where_collection_set_only_what_its_imports_set(
    inner: pytest.Pytester, monkeypatch: pytest.MonkeyPatch
) -> None:
    # A library that sets a variable as it is imported (DeepSpeed sets torch's NVML check,
    # torch's inductor its cache directory) sets it in the pytest process while it collects,
    # and in the early server as it imports it: the same environment, the server is kept
    # (it was replaced, its early imports wasted, at every such session).
    _project(inner, installed="import os\nos.environ.setdefault('SET_BY_IMPORT', '1')\n"
             "IMPORTED_IN = os.getpid()\n")  # fmt: skip
    inner.makepyfile(test_kept=KEPT)
    run = functools.partial(inner.runpytest_subprocess, "-p", "harness", timeout=300)
    monkeypatch.setenv("EXPECT_EARLY", "0")  # the first: started at its ranks test
    run().assert_outcomes(passed=2)
    monkeypatch.setenv("EXPECT_EARLY", "1")  # the second: at once, installed_mod early
    run().assert_outcomes(passed=2)


SETS_TORCH_UP = """
import torch
torch.backends.disable_global_flags()  # as torch's test utilities do when imported
torch.set_default_dtype(torch.float64)
"""


def test_what_preloaded_imports_change_in_torch_is_put_back_for_the_ranks(
    inner: pytest.Pytester,
) -> None:
    # A module one test file imports is preloaded for every rank: its import-time settings
    # (torch's test utilities freeze the cuDNN flags) reached tests that never import it.
    _project(inner, sets_torch_up=SETS_TORCH_UP)
    inner.makepyfile(test_a="import sets_torch_up\n\ndef test_plain():\n    pass\n")
    inner.makepyfile(
        test_b="""
import pytest, torch


@pytest.mark.ranks(2)
def test_ranks_start_with_torchs_defaults(rank):
    assert torch.get_default_dtype() == torch.float32
    torch.backends.cudnn.enabled = False  # allowed in a new process
"""
    )
    inner.runpytest_subprocess("-p", "harness").assert_outcomes(passed=2)


def test_an_import_that_initialises_cuda_in_the_server_is_not_preloaded(
    inner: pytest.Pytester,
) -> None:
    # A fork of a process with CUDA initialised cannot use CUDA: every rank of a GPU suite
    # would fail. (Simulated: torch's flag set, as an import that calls into CUDA sets it.)
    touches = IN_THE_SERVER_ONLY.format(action="import torch; torch.cuda._initialized = True")
    _project(inner, touches_cuda=touches)
    inner.makepyfile(
        "import os, pytest, installed_mod, touches_cuda\n\n\n@pytest.mark.ranks(2)\n"
        "def test_plain_server(rank):\n    assert installed_mod.IMPORTED_IN == os.getpid()\n"
    )
    result = inner.runpytest_subprocess("-p", "harness", timeout=300)
    result.assert_outcomes(passed=1)
    result.stdout.fnmatch_lines(["harness: importing touches_cuda initialised CUDA in the fork*"])


def test_a_bad_preload_mode_is_a_usage_error(inner: pytest.Pytester) -> None:
    inner.makepyfile("def test_nothing():\n    pass\n")
    result = inner.runpytest_subprocess("-p", "harness", "--rank-preload", "everything")
    assert result.ret == pytest.ExitCode.USAGE_ERROR
    result.stderr.fnmatch_lines(["*rank_preload*everything*use auto or none*"])


def test_only_new_installed_modules_under_their_own_names_are_chosen(tmp_path: object) -> None:
    installed = types.ModuleType("pkg.sub")
    installed.__file__ = f"{preload.installed_roots()[0]}pkg/sub.py"
    elsewhere = types.ModuleType("mine")
    elsewhere.__file__ = f"{tmp_path}/mine.py"
    alias = types.ModuleType("real.name")
    alias.__file__ = installed.__file__
    plugin = types.ModuleType("pytest_plugin_x")
    plugin.__file__ = f"{preload.installed_roots()[0]}pytest_plugin_x.py"
    modules = {
        "sys": sys,  # imported before: not chosen
        "pkg.sub": installed,
        "mine": elsewhere,  # not installed
        "pkg.alias": alias,  # another module's name
        "pkg.missing": None,  # a failed import's marker
        "pytest_plugin_x": plugin,  # pytest's side
    }
    found = preload.chosen(frozenset({"sys"}), modules, frozenset({"pytest_plugin_x"}))
    assert found == ["pkg.sub"]


# An adopted suite's conftest: sets a variable a library reads at import (DeepSpeed's sets
# PROTOCOL_BUFFERS_PYTHON_IMPLEMENTATION), and says whether the fork server already ran.
ADOPTED_CONFTEST = (
    CONFTEST.replace('os.environ["TEST_PYTEST_PID"] = str(os.getpid())', "")
    + """
from harness.warm import forkserver

os.environ["SET_BY_CONFTEST"] = os.environ["CONFTEST_VALUE"]
Path("server-before-conftest").write_text(str(forkserver._server._forkserver_pid or ""))
"""
)
ADOPTED_TESTS = """
import os, pytest
import installed_mod


@pytest.mark.ranks(2)
def test_the_ranks_import_with_the_conftests_environment(rank):
    assert installed_mod.SEEN == os.environ["CONFTEST_VALUE"]
    assert installed_mod.IMPORTED_IN == os.getppid()  # preloaded, by the server
    kept = str(os.getppid()) == open("server-before-conftest").read()
    assert kept == (os.environ["EXPECT_KEPT"] == "1")


def test_the_server_started_before_the_conftests():
    started = bool(open("server-before-conftest").read())
    assert started == (os.environ["EXPECT_BEFORE"] == "1")
"""


@pytest.mark.parametrize("value_then", ["kept", pytest.param("changed", marks=pytest.mark.slow)])
def test_an_adopted_sessions_server_starts_before_its_conftests(
    inner: pytest.Pytester, monkeypatch: pytest.MonkeyPatch, value_then: str
) -> None:
    """With --rank-adopt the fork server starts before the conftests load (its torch import
    overlaps theirs), in the environment the last session's conftests left: the ranks still
    import with the value this session's conftest sets, the same as last time or not (the
    server is then replaced as collection starts)."""
    _project(
        inner,
        installed="import os\nSEEN = os.environ.get('SET_BY_CONFTEST')\n"
        "IMPORTED_IN = os.getpid()\n",
    )
    inner.makeconftest(ADOPTED_CONFTEST)
    inner.makepyfile(test_adopted=ADOPTED_TESTS)
    run = functools.partial(
        inner.runpytest_subprocess, "-p", "harness", "--rank-adopt", "torch", timeout=300
    )
    monkeypatch.setenv("CONFTEST_VALUE", "first")
    monkeypatch.setenv("EXPECT_BEFORE", "1")
    monkeypatch.setenv("EXPECT_KEPT", "0")
    run().assert_outcomes(passed=2)  # no prediction yet: replaced as collection starts
    monkeypatch.setenv("CONFTEST_VALUE", "first" if value_then == "kept" else "second")
    monkeypatch.setenv("EXPECT_KEPT", "1" if value_then == "kept" else "0")
    run().assert_outcomes(passed=2)
    monkeypatch.setenv("EXPECT_BEFORE", "0")  # not adopting: started as collection starts
    monkeypatch.setenv("EXPECT_KEPT", "0")
    inner.runpytest_subprocess("-p", "harness", timeout=300).assert_outcomes(passed=2)


def test_an_adopted_session_whose_conftest_fails_leaves_no_work_directory(
    inner: pytest.Pytester, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Its server started before the conftests; one that fails to import ends pytest before
    configure, so no unconfigure closes the pools: they are closed at exit."""
    tmp = inner.mkdir("tmp")
    monkeypatch.setenv("TMPDIR", str(tmp))
    inner.makeconftest("raise ImportError('a conftest that cannot import')\n")
    inner.makepyfile("def test_never():\n    pass\n")
    result = inner.runpytest_subprocess("-p", "harness", "--rank-adopt", "torch", timeout=300)
    assert result.ret != 0
    assert "a conftest that cannot import" in result.stderr.str() + result.stdout.str()
    assert [p.name for p in tmp.iterdir() if p.name.startswith(("harness-", "pymp-"))] == []


def _servers_of(directory: Path) -> list[int]:
    """The processes (this user's) started with a preload directory below `directory`."""
    found = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            with contextlib.suppress(OSError):
                if str(directory).encode() in (entry / "environ").read_bytes():
                    found.append(int(entry.name))
    return found


def test_a_server_whose_pytest_was_killed_as_it_started_does_not_outlive_it(
    inner: pytest.Pytester, monkeypatch: pytest.MonkeyPatch
) -> None:
    """pytest SIGKILLed before the conftests loaded (CI cancelling a job, the OOM killer):
    the server started before them, still importing torch, had not yet asked the kernel to
    end it with its parent; it then waited for its list for an hour, its parent gone."""
    tmp = inner.mkdir("tmp")
    monkeypatch.setenv("TMPDIR", str(tmp))
    inner.makeconftest("import os, signal\nos.kill(os.getpid(), signal.SIGKILL)\n")
    inner.makepyfile("def test_never():\n    pass\n")
    result = inner.runpytest_subprocess("-p", "harness", "--rank-adopt", "torch", timeout=300)
    assert result.ret == -signal.SIGKILL
    wait_until(lambda: not _servers_of(tmp), 120, "the server to end with its pytest")


@pytest.mark.parametrize("asked", ["ini", "command line"])
def test_under_xdist_servers_start_as_collection_starts(
    inner: pytest.Pytester, monkeypatch: pytest.MonkeyPatch, asked: str
) -> None:
    """Under xdist no process starts a server before its conftests: the controller runs no
    test, and a worker (started with the controller's arguments) cannot tell itself from a
    controller run by another worker's test that early. Each worker starts its own as
    collection starts, and the adopted tests run, --rank-adopt given in the ini file or on
    the command line."""
    _project(inner, installed="import os\nIMPORTED_IN = os.getpid()\n")
    inner.makeconftest(
        ADOPTED_CONFTEST.replace('"server-before-conftest"', 'f"server-{os.getpid()}"')
    )
    ini = "[pytest]\nrank_timeout = 30\n" + ("rank_adopt = torch\n" if asked == "ini" else "")
    inner.makeini(ini)
    inner.makepyfile(
        "import os, pytest, installed_mod\n\n@pytest.mark.ranks(2)\ndef test_ranks(rank):\n"
        "    assert installed_mod.IMPORTED_IN == os.getppid()\n"
    )
    monkeypatch.setenv("CONFTEST_VALUE", "same")
    args = ("-p", "harness", "-n", "2", *(("--rank-adopt", "torch") if asked != "ini" else ()))
    for _ in range(2):  # the second with the first's prediction
        inner.runpytest_subprocess(*args, timeout=300).assert_outcomes(passed=1)
    said = [p.read_text() for p in inner.path.glob("server-*")]
    assert len(said) == 6 and set(said) == {""}  # a controller and two workers, twice
