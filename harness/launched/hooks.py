"""The hooks of a session torchrun launched, as one plugin object, and its ranks.

``plugin.py`` registers :class:`LaunchedPlugin` at configure time only when the session is
a launch (as xdist registers its DSession), and the plugin puts :class:`LaunchedRanks` in
the session's place (``seam.use``): ``plugin.py``'s own hooks never ask whether the session
is launched, and a warm-rank session never loads this package (it imports torch).
"""

from __future__ import annotations

import contextlib
import os
import stat
import sys
import warnings
from collections.abc import Callable, Generator, Iterator
from pathlib import Path
from typing import Any

import pytest

from harness import seam
from harness.common import faults, torch_import_warnings
from harness.common.launch_detect import Launch
from harness.common.outcome import RankOutcome
from harness.common.protocol import RankSpec
from harness.common.report_text import without_cpp_frames
from harness.launched import agreements, body, coverage, error_files, terminal, verdicts
from harness.launched.rendezvous import give_each_set_up_its_keys
from harness.launched.session import LaunchedSession, start
from harness.launched.watch import FixtureTimer
from harness.plan import hypothesis_search, timeout_interop
from harness.plan.settings import settings_of
from harness.plan.specs import SPEC_KEY


class LaunchedPlugin:
    """pytest's hooks for this rank of a launched session (see the session's module)."""

    def __init__(
        self, config: pytest.Config, launch: Launch, kept: list[warnings.WarningMessage]
    ) -> None:
        workers = config.getoption("numprocesses", None)
        if workers not in (None, 0, "0"):
            raise pytest.UsageError(
                f"harness: under {launch.launcher} every launched process is one rank (this is "
                f"rank {launch.rank} of {launch.world_size}); drop -n {workers}: pytest-xdist's "
                f"workers would each run the tests as another set of ranks"
            )
        self.launched = start(config, launch, settings_of(config).backend)
        seam.use(config, LaunchedRanks(self.launched))
        self.kept_warnings = kept  # raised as this process imported torch: said at collection
        self.restore_rendezvous: Callable[[], None] = lambda: None  # torch's env:// handler

    @pytest.hookimpl(tryfirst=True)  # inside pytest's capture of the collection's warnings
    def pytest_collection(self, session: pytest.Session) -> None:
        torch_import_warnings.raise_again(self.kept_warnings)

    @pytest.hookimpl(tryfirst=True)  # before a conftest's: a pytest.exit() there reaches peers
    def pytest_sessionstart(self, session: pytest.Session) -> None:
        launched = self.launched
        launched.connect()
        self.restore_rendezvous = give_each_set_up_its_keys(launched.link.own_group_prefix)
        launched.watch.catch_sigterm()
        faults.call_before_fatal(launched.note_death)
        agreements.agree_on_backend(launched)

    def pytest_collection_finish(self, session: pytest.Session) -> None:
        stopping = sys.exc_info()[1]  # pytest reports the collection on its way out too
        if isinstance(stopping, (KeyboardInterrupt, pytest.exit.Exception)):
            ended_early(self.launched, stopping)  # a conftest hook ended the session here
            return
        specs = [item.stash[SPEC_KEY] for item in session.items if SPEC_KEY in item.stash]
        longest = max((spec.timeout_s for spec in specs), default=0.0)
        self.launched.group.bound(longest)
        agreements.agree_on_collection(self.launched, session.items)

    @pytest.hookimpl(wrapper=True, tryfirst=True)  # around plugin.py's set-up
    def pytest_runtest_setup(self, item: pytest.Item) -> Any:
        """Every test starts here on every rank, in the same order: say where this rank is."""
        launched = self.launched
        launched.link.begin(item.nodeid)
        if launched.link.peers.stopping:
            launched.fate.stop("the launcher is stopping the job", item.session)
            pytest.skip("not run: the launcher is stopping the job")
        return (yield)

    # The innermost wrappers (pytest reads only attributes named pytest_*, hence the names):
    # the timers bound the fixtures alone. What the harness does after them (freeing the
    # group a failed set-up leaves, agreeing with the peers) has bounds of its own, and may
    # be in torch.distributed as pytest-timeout's bound passes: not a fixture's hang.
    @pytest.hookimpl(wrapper=True, trylast=True, specname="pytest_runtest_setup")
    def pytest_runtest_setup_of_fixtures(self, item: pytest.Item) -> Any:
        with _fixtures_bounded(self.launched, item, "set-up"):
            return (yield)

    @pytest.hookimpl(wrapper=True, trylast=True, specname="pytest_runtest_teardown")
    def pytest_runtest_teardown_of_fixtures(
        self, item: pytest.Item, nextitem: pytest.Item | None
    ) -> Any:
        with _fixtures_bounded(self.launched, item, "teardown"):
            return (yield)

    @pytest.hookimpl(wrapper=True, tryfirst=True)  # after plugin.py's own changes to the report
    def pytest_runtest_makereport(self, item: pytest.Item, call: pytest.CallInfo[None]) -> Any:
        report = yield
        report.sections = [  # c10's warnings (a store that went away) carry C++ backtraces
            (title, without_cpp_frames(text) if title.startswith("Captured stderr") else text)
            for title, text in report.sections
        ]
        verdict_phase = call.when == "call" or (call.when == "setup" and not report.passed)
        if verdict_phase and SPEC_KEY not in item.stash:
            verdicts.plain_verdict(self.launched, item, report)
        if call.when == "teardown":
            verdicts.teardown_verdict(self.launched, item, report)
        error_files.note(self.launched, item, report)
        return report

    @pytest.hookimpl(wrapper=True, trylast=True)  # inside pytest-cov's: before it finishes
    def pytest_runtestloop(self, session: pytest.Session) -> Any:
        result = yield
        launched = self.launched
        coverage.hand_to_rank_0(
            launched.link if launched.connected else None, launched.rank, session
        )
        return result

    def pytest_sessionfinish(self, session: pytest.Session) -> None:
        launched = self.launched
        if launched.connected:
            self.restore_rendezvous()
            agreements.agree_on_exit(launched, session)
            error_files.write(launched, int(session.exitstatus))

    def pytest_keyboard_interrupt(self, excinfo: pytest.ExceptionInfo[BaseException]) -> None:
        """This rank's session ends now (pytest.exit() or KeyboardInterrupt): tell the peers
        why, so that those waiting for it in a test end theirs alike instead of waiting."""
        ended_early(self.launched, excinfo.value)

    def pytest_internalerror(self, excrepr: Any, excinfo: Any) -> None:
        """A quiet rank's INTERNALERROR still reaches the terminal: rank 0 cannot report it."""
        launched = self.launched
        if launched.voice.quiet:
            terminal.loud(
                launched.config, f"harness: INTERNALERROR on rank {launched.rank}:\n{excrepr}"
            )

    def pytest_terminal_summary(self, terminalreporter: Any) -> None:
        launched = self.launched
        peers = launched.link.peers if launched.connected else None
        launched.voice.summary(terminalreporter, launched.fate, peers, launched.position.not_run())


@contextlib.contextmanager
def _fixtures_bounded(launched: LaunchedSession, item: pytest.Item, phase: str) -> Iterator[None]:
    """pytest-timeout's bound on this phase's fixtures, also where its signal cannot act."""
    bound = timeout_interop.pytest_timeout_of_fixtures(item)
    if bound is None or not launched.connected:
        yield
        return
    with FixtureTimer(launched.watch, verdicts.fixtures_key(launched), bound, phase):
        yield


class LaunchedRanks:
    """The ranks of a launched session: this process and its peers, each running the body
    in-process; every rank reads every rank's outcome and reaches the same verdict."""

    def __init__(self, launched: LaunchedSession) -> None:
        self.launched = launched

    @property
    def reports_output(self) -> bool:
        """Rank 0 reports for every rank (and a rank speaking for a lost rank 0)."""
        return self.launched.rank == 0 or not self.launched.voice.quiet

    def set_up(
        self, item: pytest.Item, spec: RankSpec | None, gpu_marked: bool
    ) -> Generator[None, Any, Any]:
        if spec is not None:
            result = yield from set_up(self.launched, item, spec, gpu_marked)
            if isinstance(item, pytest.Function):  # before hypothesis's own checks of it
                hypothesis_search.prepare(item, fixtures_per_example=False)
                hypothesis_search.seed_in_process(item)
            return result
        # A test without ranks sees none of the harness's process group, as in a plain
        # session (the next ranks test sets one up again); a group its fixtures set up stays.
        self.launched.group.set_aside()
        if gpu_marked:
            seam.skip_without_gpus(1)
        return (yield)

    drives_examples = False  # each launched rank runs a hypothesis search itself, seeded alike

    def run_test(
        self, item: pytest.Function, spec: RankSpec, drawn: dict[str, Any] | None = None
    ) -> list[RankOutcome]:
        try:
            return body.run_test(item, self.launched, spec)
        finally:
            self.launched.watch.catch_sigterm_again()  # after a test that took SIGTERM for itself

    def run_call(
        self,
        node: pytest.Item | None,
        spec: RankSpec,
        fn: Callable[..., Any],
        args: tuple[Any, ...],
        kwargs: dict[str, Any],
    ) -> list[RankOutcome]:
        assert node is not None  # runner runs a call outside a test on warm ranks
        try:
            return body.run_call(self.launched, node, spec, fn, args, kwargs)
        finally:
            self.launched.watch.catch_sigterm_again()

    def rank_here(self) -> int | None:
        return self.launched.rank

    def device_here(self) -> Any:
        return self.launched.group.device()

    def shared_path(
        self, request: pytest.FixtureRequest, make: Callable[[], Path], timeout_s: float
    ) -> Path:
        """Rank 0's new directory, on every rank (shared across nodes only if the filesystem
        is)."""
        launched = self.launched
        key = f"{launched.position.test_key()}/shared_tmp_path"
        if launched.rank == 0:
            path = make()
            launched.link.put(key, str(path))
            return path
        found = launched.link.get(key, timeout_s)
        if found is None:
            pytest.fail(f"rank 0 did not make the shared_tmp_path of {request.node.nodeid}")
        path = Path(found.decode(errors="replace"))
        why = untrusted_directory(path)
        if why is not None:
            pytest.fail(
                f"harness: the shared_tmp_path read from the launch's store ({path}) {why}: it "
                f"was not used (another process writes to this job's store; give the job a "
                f"secret, see docs/security.md)",
                pytrace=False,
            )
        return path


def untrusted_directory(path: Path) -> str | None:
    """Why `path` is not a directory of this user's own that no one else may write or read
    (None: it is one). On another node than rank 0's it may not exist: then it is taken as
    named, as a shared filesystem may show it later."""
    try:
        found = os.lstat(path)
    except FileNotFoundError:
        return None
    except OSError as exc:
        return f"cannot be looked at ({exc})"
    if not stat.S_ISDIR(found.st_mode):
        return "is not a directory"
    if found.st_uid != os.getuid():
        return "belongs to another user"
    if found.st_mode & 0o077:
        return f"can be used by others (mode {found.st_mode & 0o777:o})"
    return None


def set_up(
    launched: LaunchedSession, item: pytest.Item, spec: RankSpec, gpu_marked: bool
) -> Generator[None, Any, Any]:
    """The set-up of a ranks test under a launch: skip it the same way everywhere, or set it
    up on every rank and start its body only where every rank did."""
    reason = body.skip_reason(launched, spec, gpu_marked)
    if reason is not None:
        raise pytest.skip.Exception(reason, _use_item_location=True)
    body.before_set_up(item, launched, spec)
    # A test bounded longer than the session's default: a peer may be silent that long.
    launched.link.peers.allow_silence(spec.timeout_s)
    try:
        result = yield
    except (KeyboardInterrupt, pytest.exit.Exception) as exc:
        ended_early(launched, exc)  # the session ends here: no set-up to agree on
        raise
    except BaseException as exc:
        body.agree_on_set_up(item, launched, spec, exc)
        raise
    body.agree_on_set_up(item, launched, spec, None)
    return result


def ended_early(launched: LaunchedSession, exc: BaseException) -> None:
    """Tell the peers this rank's session ends now (pytest.exit() or KeyboardInterrupt)."""
    if not launched.connected:
        return
    if isinstance(exc, KeyboardInterrupt):
        text, code = "KeyboardInterrupt", int(pytest.ExitCode.INTERRUPTED)
    else:
        returncode = getattr(exc, "returncode", None)
        text = str(getattr(exc, "msg", exc))
        code = returncode if isinstance(returncode, int) else int(pytest.ExitCode.INTERRUPTED)
    with contextlib.suppress(Exception):
        launched.ended_early(text, code)
