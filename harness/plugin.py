"""The pytest side's hooks and fixtures, and nothing else.

Options and markers are read by ``settings``; running and judging a test on ranks is
``runner``'s job. Imports no torch and starts no process until a test needs ranks.
"""

from __future__ import annotations

import atexit
import gc
import sys
import warnings
from pathlib import Path
from typing import Any

import pytest

from harness import hookspecs, seam
from harness.common import torch_import_warnings
from harness.common.errors import HarnessError, SpecError
from harness.common.faults import Fault
from harness.common.protocol import RankSpec
from harness.plan import made_in_ranks, packing, seeds, settings, specs, timeout_interop
from harness.plan.specs import SPEC_ERROR_KEY, SPEC_KEY
from harness.pytest_side import junit_labels, runner, verdict, versions
from harness.pytest_side.run_on_ranks import RankRunner
from harness.seam import ranks_of
from harness.warm import preload
from harness.warm import session as warm

MARKERS = (
    "ranks(*sizes, timeout=None, launch=False, backend=None, fresh_group=False, "
    "same_seed=False): run the test body on every rank of a world of each size (default "
    "--ranks); launch=True gives torchrun's environment and no process group; timeout in "
    "seconds overrides --rank-timeout; fresh_group=True never runs on a group kept from an "
    "earlier test; same_seed=True seeds every rank alike (default: the session seed + rank)",
    "gpu: needs CUDA GPUs (one per rank); skipped where there are too few",
    "fault(rank=1, kind='raise', at='start', nth=1, exc=None, code=1, signal='SIGKILL', "
    "seconds=1.0): inject a fault on a rank of a ranks test (repeatable; or Fault objects)",
    "expect(...): how each rank must end: expect(returns()), expect(rank=1, does=raises(E), "
    "others=returns()) or expect({rank: outcome}); see the harness docs (docs/harness.md)",
    "allow_leftovers(*kinds): let the test leave 'group', 'threads', 'env' or 'processes' "
    "behind in its ranks (no arguments: all four; processes are killed all the same)",
)


def pytest_addhooks(pluginmanager: pytest.PytestPluginManager) -> None:
    """pytest_harness_adopters: a project registers its own test base's adopter."""
    pluginmanager.add_hookspecs(hookspecs)


def pytest_addoption(parser: pytest.Parser) -> None:
    group = parser.getgroup("harness", "run tests on real torch.distributed ranks")
    for name, help_text, metavar in settings.OPTIONS:
        group.addoption(
            f"--{name.replace('_', '-')}", dest=name, default=None, metavar=metavar, help=help_text
        )
        parser.addini(name, help_text, default=None)
    fresh = "set every rank test's group up afresh (default: reuse the last clean test's group)"
    group.addoption("--rank-fresh-group", action="store_true", dest="rank_fresh_group", help=fresh)
    parser.addini("rank_fresh_group", fresh, type="bool", default=False)
    check = (
        "do not compare the ranks' collectives on the harness's group (default: a collective "
        "one rank calls differently, an op, shape or dtype, fails the test naming that rank)"
    )
    group.addoption(
        "--rank-no-collective-check",
        action="store_true",
        dest="rank_no_collective_check",
        help=check,
    )
    parser.addini(
        "rank_collective_check",
        "compare the ranks' collectives on the harness's group (default: true)",
        type="bool",
        default=True,
    )


@pytest.hookimpl(tryfirst=True)
def pytest_load_initial_conftests(early_config: pytest.Config) -> None:
    preload.before_conftests(early_config)
    warm.start_server_before_conftests(early_config)


_sessions: set[pytest.Config] = set()  # the harness's sessions now configured in this process


@pytest.hookimpl(trylast=True)  # after pytest-timeout has read its own settings
def pytest_configure(config: pytest.Config) -> None:
    versions.check()
    _sessions.add(config)
    for line in MARKERS:
        config.addinivalue_line("markers", line)
    kept: list[warnings.WarningMessage] = []
    with torch_import_warnings.held(kept):  # a launch imports torch here: said at collection
        session_settings = settings.configure(config)
        launch = session_settings.launched
        own = warm.WarmRanks(config)
        seam.use(config, own)
        seam.use_own(config, own)
        if launch is not None:  # the one question asked: the launch's hooks answer the rest
            from harness.launched.hooks import LaunchedPlugin

            plugin = LaunchedPlugin(config, launch, kept)
            config.pluginmanager.register(plugin, "harness-launched")
    if launch is None:
        torch_import_warnings.raise_again(kept)  # shown now, as if never held
    junit_labels.register(config)
    _register_adopters(config)
    if config.pluginmanager.hasplugin("xdist"):  # its workers seed from this process's seed
        config.pluginmanager.register(seeds.XdistHooks(session_settings.seed), "harness-seeds")


def _register_adopters(config: pytest.Config) -> None:
    """torch's and DeepSpeed's adopters, and the projects' (imported here: pytest imports
    the adoption module itself, from the package's pytest_plugins, to rewrite it first)."""
    from harness.adopt.core import register_adopters
    from harness.adopt.deepspeed.adopter import DeepSpeedAdopter
    from harness.adopt.torch.adopter import TorchAdopter

    register_adopters(config, [TorchAdopter(), DeepSpeedAdopter()])


# ---- collection ----------------------------------------------------------------------------


def pytest_generate_tests(metafunc: pytest.Metafunc) -> None:
    mark = metafunc.definition.get_closest_marker("ranks")
    if mark is None or not mark.args:
        return
    try:
        sizes = specs.marked_sizes(metafunc.definition, mark)
    except SpecError:
        return  # left unparametrized: the test errors at set-up with the message
    metafunc.fixturenames.append(specs.WORLD_PARAM)
    metafunc.parametrize(specs.WORLD_PARAM, sizes, ids=[f"ranks{n}" for n in sizes])


@pytest.hookimpl(tryfirst=True)  # before -k deselects: each test has its world's keyword
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    session_settings = settings.settings_of(config)
    for item in items:
        stray = specs.stray_marker(item)
        if stray is not None:
            item.stash[SPEC_ERROR_KEY] = stray
        if item.get_closest_marker("ranks") is None or not isinstance(item, pytest.Function):
            continue
        try:
            item.stash[SPEC_KEY] = spec = specs.spec_for(item, session_settings)
        except SpecError as exc:
            item.stash[SPEC_ERROR_KEY] = str(exc)
            continue
        # `-k ranks4` selects every test that runs on 4 ranks, [ranks4] in its id or not.
        item.extra_keyword_matches.add(f"ranks{spec.world_size}")
        if item.cls is not None:
            packing.remember_class(item.cls)  # what setup_class adds later travels


@pytest.hookimpl(tryfirst=True)
def pytest_collection(session: pytest.Session) -> None:
    """Where ranks will likely be needed, their fork server starts now: torch's import (and
    what the last session preloaded) overlaps the collection."""
    warm.start_server_early(session.config)


def pytest_collect_file(file_path: Path, parent: pytest.Collector) -> None:
    """A test module whose text names the ranks marker or fixtures, before pytest imports it
    (a new clone has no cache that says ranks were started): the fork server starts now, so
    torch's import there overlaps this module's import of torch here."""
    config = parent.config
    if warm.early_start_pending(config) and preload.names_ranks(file_path, config):
        warm.start_server_early(config, ranks_collected=True)


def pytest_itemcollected(item: pytest.Item) -> None:
    """At the session's first ranks test, if its server has not started yet: the rest of
    the collection (every later test module) overlaps torch's import in the server."""
    if item.get_closest_marker("ranks") is not None:
        warm.start_server_early(item.config, ranks_collected=True)


def pytest_collection_finish(session: pytest.Session) -> None:
    """What the fork server will import before starting ranks: what the tests imported."""
    session_settings = settings.settings_of(session.config)
    if session_settings.launched is None:
        preload.note_collected(session, session_settings.preload, session_settings.import_timeout_s)
        warm.hand_preload_over(session.config)


@pytest.hookimpl(wrapper=True)
def pytest_runtest_setup(item: pytest.Item) -> Any:
    error = item.stash.get(SPEC_ERROR_KEY, None)
    if error is not None:
        pytest.fail(error, pytrace=False)  # this test's error; the others run
    spec = item.stash.get(SPEC_KEY, None)
    gpu = item.get_closest_marker("gpu") is not None
    return (yield from ranks_of(item.config).set_up(item, spec, gpu))


@pytest.hookimpl(tryfirst=True)
def pytest_fixture_setup(fixturedef: Any, request: Any) -> object | None:
    """A fixture that uses a rank's own fixtures is made in each rank, not here."""
    return made_in_ranks.skip_in_pytest(fixturedef, request)


# ---- running -------------------------------------------------------------------------------


@pytest.hookimpl(wrapper=True, trylast=True)  # inside pytest-timeout's own wrapper
def pytest_runtest_call(item: pytest.Item) -> Any:
    """One timer for the body: the harness's, which kills the ranks and reports their stacks;
    pytest-timeout's still bounds the set-up and teardown around it."""
    if SPEC_KEY not in item.stash:
        return (yield)
    with timeout_interop.pytest_timeout_paused(item):
        return (yield)


@pytest.hookimpl(tryfirst=True)
def pytest_pyfunc_call(pyfuncitem: pytest.Function) -> bool | None:
    spec = pyfuncitem.stash.get(SPEC_KEY, None)
    if spec is None:
        return None
    runner.run_marked_test(pyfuncitem, spec)
    return True


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo[None]) -> Any:
    report = yield
    if call.excinfo is not None and call.excinfo.errisinstance(HarnessError):
        report.harness_error = True  # travels with the report (xdist serialises __dict__)
    if call.when == "call":
        verdict.refuse_xfail(item, report)
        verdict.place_skip(item, report)
    spec = item.stash.get(SPEC_KEY, None)
    if spec is not None:
        report.harness_world_size = spec.world_size  # -v's line says it (and travels, as above)
        _crash_line_only(report)
    return report


def _crash_line_only(report: pytest.TestReport) -> None:
    """The crash message is the report's headline: pytest prints it whole in the short
    summary on a CI runner, and a ranks report has every rank's section under it."""
    crash: Any = getattr(report.longrepr, "reprcrash", None)
    message = getattr(crash, "message", None)
    if isinstance(message, str) and "\n" in message:
        crash.message = message.split("\n", 1)[0]


# The reports pytest_runtest_logreport is handling now: the terminal's -v line for each.
_logging: list[pytest.TestReport] = []


@pytest.hookimpl(wrapper=True)
def pytest_runtest_logreport(report: pytest.TestReport) -> Any:
    _logging.append(report)
    try:
        return (yield)
    finally:
        _logging.pop()


@pytest.hookimpl(wrapper=True, specname="pytest_report_teststatus")
def pytest_report_teststatus_with_world(report: pytest.TestReport, config: pytest.Config) -> Any:
    """-v's word for a ranks test says how many ranks it ran on: "PASSED on 4 ranks", on
    the line pytest writes as the test ends, whose node id comes first. Everywhere else
    (the short summary, xdist's lines, rerunfailures' summary) the word stays pytest's
    own, followed by the node id as CI tools read it."""
    status = yield
    world = getattr(report, "harness_world_size", None)
    if world is None or not status or config.getoption("verbose", 0) <= 0:
        return status
    if report not in _logging or hasattr(report, "node"):  # `node`: xdist's controller
        return status
    category, letter, word = status
    if not word:
        return status
    on = f" on {world} rank{'s' if world != 1 else ''}"
    if isinstance(word, tuple):
        return category, letter, (word[0] + on, word[1])
    return category, letter, word + on


@pytest.hookimpl(tryfirst=True)
def pytest_report_teststatus(report: pytest.TestReport) -> tuple[str, str, str] | None:
    """The harness's own failure is an error, as a broken fixture is: not the test's fault."""
    if getattr(report, "harness_error", False) and report.failed:
        return "error", "E", "ERROR"
    return None


@pytest.hookimpl(trylast=True)
def pytest_runtest_teardown(item: pytest.Item) -> None:
    runner.raise_leftovers(item)


def pytest_sessionfinish(session: pytest.Session) -> None:
    """Close every pool and make sure no rank process outlived the session."""
    # What the next session's fork server imports while pytest collects, if it starts early.
    ran_tests = session.testscollected > 0 and not session.config.option.collectonly
    started = warm.pools_were_started(session.config)
    if started or ran_tests:
        preload.record(session.config, started, warm.preload_failures(session.config))
    left = warm.close_pools(session.config)
    if left:
        reporter = session.config.pluginmanager.get_plugin("terminalreporter")
        message = f"harness: rank processes still alive at session end: {left}"
        if reporter is not None:
            reporter.write_line(message, red=True)
        session.exitstatus = pytest.ExitCode.TESTS_FAILED


@pytest.hookimpl(wrapper=True, trylast=True)  # inside pytest-cov's: before it saves its data
def pytest_runtestloop(session: pytest.Session) -> Any:
    """Once the tests have run, what the ranks measured counts in the session's coverage."""
    try:
        return (yield)
    finally:
        warm.fold_ranks_coverage(session.config)


def pytest_report_header(config: pytest.Config) -> str:
    return settings.settings_of(config).seed.header()


def pytest_terminal_summary(terminalreporter: Any) -> None:
    verbose = terminalreporter.config.getoption("verbose", 0) > 0
    for line in warm.preload_summary(terminalreporter.config, verbose):
        terminalreporter.write_line(line)


def pytest_unconfigure(config: pytest.Config) -> None:
    warm.close_pools(config)  # idempotent; covers an interrupted session
    _sessions.discard(config)
    if not _sessions:  # the last in this process (pytester runs sessions inside another)
        warm.stop_forkserver_if_started()
        if "torch" in sys.modules:
            # Run first at exit: Python's last collection would walk every object torch and
            # its kin made (0.8 s of a DeepSpeed session's 1.1 s end). They are still freed;
            # what a cycle holds goes with the process, as Python allows at exit.
            atexit.unregister(gc.freeze)  # once, however many sessions ran in this process
            atexit.register(gc.freeze)


# ---- fixtures ------------------------------------------------------------------------------


class _OnlyInRanks:
    """What a rank-side fixture is in the pytest process: a placeholder the rank replaces.
    Using it here (comparing, formatting, arithmetic) raises: a fixture made here that reads
    it would quietly compute with a placeholder."""

    def __init__(self, name: str) -> None:
        self.name = name

    def __repr__(self) -> str:
        return f"<{self.name}: set inside each rank>"

    def _used_here(self, *_: Any) -> Any:
        raise pytest.UsageError(
            f"{self.name!r} is known only inside each rank, but was used in the pytest process "
            f"(by a fixture made here, through request.getfixturevalue): ask for "
            f"{self.name!r} as an argument of that fixture, so each rank makes it"
        )

    __eq__ = __ne__ = __lt__ = __le__ = __gt__ = __ge__ = _used_here
    __bool__ = __int__ = __index__ = __float__ = __str__ = __format__ = _used_here
    __add__ = __radd__ = __sub__ = __rsub__ = __mul__ = __rmul__ = _used_here
    __truediv__ = __floordiv__ = __mod__ = __rmod__ = _used_here
    __hash__ = object.__hash__


def _rank_spec(request: pytest.FixtureRequest, name: str) -> RankSpec:
    spec = request.node.stash.get(SPEC_KEY, None)
    if spec is None:
        raise pytest.UsageError(
            f"fixture {name!r} exists only in a test marked @pytest.mark.ranks; "
            f"mark {request.node.nodeid} or use run_on_ranks"
        )
    return spec  # type: ignore[no-any-return]


@pytest.fixture
def rank(request: pytest.FixtureRequest) -> Any:
    """This rank's index in the test's world (0 .. world_size-1)."""
    _rank_spec(request, "rank")
    here = ranks_of(request.config).rank_here()
    return _OnlyInRanks("rank") if here is None else here


@pytest.fixture
def world_size(request: pytest.FixtureRequest) -> int:
    """The number of ranks the test runs on."""
    return _rank_spec(request, "world_size").world_size


@pytest.fixture
def device(request: pytest.FixtureRequest) -> Any:
    """This rank's torch.device: cpu with gloo, cuda:<rank> with nccl (cuda:<LOCAL_RANK>
    under torchrun)."""
    _rank_spec(request, "device")
    here = ranks_of(request.config).device_here()
    return _OnlyInRanks("device") if here is None else here


@pytest.fixture
def shared_tmp_path(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
) -> Path:
    """A temporary directory every rank of the test sees (the same path on all of them)."""
    spec = _rank_spec(request, "shared_tmp_path")

    def make() -> Path:
        return tmp_path_factory.mktemp(f"shared-ranks{spec.world_size}")

    return ranks_of(request.config).shared_path(request, make, spec.timeout_s)


@pytest.fixture
def rank_faults() -> list[Fault]:
    """Faults for the ranks of a ranks test; override it (or parametrize it) to inject some."""
    return []


@pytest.fixture
def run_on_ranks(request: pytest.FixtureRequest) -> RankRunner:
    """Call ``run_on_ranks(fn, *args, world_size=N, timeout=S, launch=False, **kwargs)``.

    Runs ``fn`` on every rank (with a fresh process group, or torchrun's environment and
    none when ``launch=True``) and returns a :class:`WorldOutcome` with every rank's ending,
    value, exception, exit code or signal. It never raises for what a rank did.
    """
    return RankRunner(request.config, request.node)
