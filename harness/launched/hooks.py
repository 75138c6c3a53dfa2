"""The hooks of a session torchrun launched, as one plugin object, and its ranks.

``plugin.py`` registers :class:`LaunchedPlugin` at configure time only when the session is
a launch (as xdist registers its DSession), and the plugin puts :class:`LaunchedRanks` in
the session's place (``ranks.use``): ``plugin.py``'s own hooks never ask whether the session
is launched, and a warm-rank session never loads this package (it imports torch).
"""

from __future__ import annotations

import contextlib
import json
import os
import stat
import sys
import time
from collections.abc import Callable, Generator, Iterator
from pathlib import Path
from typing import Any

import pytest
from _pytest.outcomes import Exit

from harness import ranks, runner
from harness.common import faults
from harness.common.launch_detect import Launch
from harness.common.outcome import RankOutcome, ranks_phrase, report_looks_collateral
from harness.common.protocol import RankSpec
from harness.launched import body, records, terminal
from harness.launched.rendezvous import give_each_set_up_its_keys
from harness.launched.session import GROUP_TIMEOUT_MARGIN_S, LaunchedSession, start
from harness.launched.watch import FixtureTimer, Watch
from harness.settings import SPEC_KEY, settings_of, timeout_for


class LaunchedPlugin:
    """pytest's hooks for this rank of a launched session (see the session's module)."""

    def __init__(self, config: pytest.Config, launch: Launch) -> None:
        workers = config.getoption("numprocesses", None)
        if workers not in (None, 0, "0"):
            raise pytest.UsageError(
                f"harness: under torchrun every launched process is one rank (this is rank "
                f"{launch.rank} of {launch.world_size}); drop -n {workers}: pytest-xdist's "
                f"workers would each run the tests as another set of ranks"
            )
        self.launched = start(config, launch, settings_of(config).backend)
        self.launched.watch = Watch(self.launched)
        ranks.use(config, LaunchedRanks(self.launched))

    @pytest.hookimpl(tryfirst=True)  # before a conftest's: a pytest.exit() there reaches peers
    def pytest_sessionstart(self, session: pytest.Session) -> None:
        launched = self.launched
        launched.connect()
        launched.restore_rendezvous = give_each_set_up_its_keys(launched.own_group_prefix)
        launched.watch.install()
        faults.before_fatal = launched.note_death
        launched.agree_on_backend()

    def pytest_collection_finish(self, session: pytest.Session) -> None:
        stopping = sys.exc_info()[1]  # pytest reports the collection on its way out too
        if isinstance(stopping, (KeyboardInterrupt, Exit)):
            ended_early(self.launched, stopping)  # a conftest hook ended the session here
            return
        specs = [item.stash[SPEC_KEY] for item in session.items if SPEC_KEY in item.stash]
        longest = max((spec.timeout_s for spec in specs), default=0.0)
        self.launched.group_timeout_s = longest + GROUP_TIMEOUT_MARGIN_S
        self.launched.agree_on_collection(session.items)

    @pytest.hookimpl(wrapper=True, tryfirst=True)  # around plugin.py's set-up
    def pytest_runtest_setup(self, item: pytest.Item) -> Any:
        """Every test starts here on every rank, in the same order: say where this rank is."""
        launched = self.launched
        launched.begin(item.nodeid)
        if launched.stopping:
            launched.stop("the launcher is stopping the job", item.session)
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
        verdict_phase = call.when == "call" or (call.when == "setup" and not report.passed)
        if verdict_phase and SPEC_KEY not in item.stash:
            plain_verdict(self.launched, item, report)
        if call.when == "teardown":
            teardown_verdict(self.launched, item, report)
        return report

    def pytest_sessionfinish(self, session: pytest.Session) -> None:
        launched = self.launched
        if launched.peers is not None:
            launched.restore_rendezvous()
            launched.agree_on_exit(session)

    def pytest_keyboard_interrupt(self, excinfo: pytest.ExceptionInfo[BaseException]) -> None:
        """This rank's session ends now (pytest.exit() or KeyboardInterrupt): tell the peers
        why, so that those waiting for it in a test end theirs alike instead of waiting."""
        ended_early(self.launched, excinfo.value)

    def pytest_internalerror(self, excrepr: Any, excinfo: Any) -> None:
        """A quiet rank's INTERNALERROR still reaches the terminal: rank 0 cannot report it."""
        launched = self.launched
        if launched.real_writer is not None:
            terminal.loud(
                launched.config, f"harness: INTERNALERROR on rank {launched.rank}:\n{excrepr}"
            )

    def pytest_terminal_summary(self, terminalreporter: Any) -> None:
        terminal.summary(self.launched, terminalreporter)


@contextlib.contextmanager
def _fixtures_bounded(launched: LaunchedSession, item: pytest.Item, phase: str) -> Iterator[None]:
    """pytest-timeout's bound on this phase's fixtures, also where its signal cannot act."""
    bound = runner.pytest_timeout_of_fixtures(item)
    if bound is None or launched.peers is None:
        yield
        return
    with FixtureTimer(launched.watch, fixtures_key(launched), bound, phase):
        yield


def fixtures_key(launched: LaunchedSession) -> str:
    """Where a rank's record of a hang in the current test's fixtures goes."""
    return f"{launched.test_key()}/fixtures"


class LaunchedRanks:
    """The ranks of a launched session: this process and its peers, each running the body
    in-process; every rank reads every rank's outcome and reaches the same verdict."""

    def __init__(self, launched: LaunchedSession) -> None:
        self.launched = launched

    @property
    def reports_output(self) -> bool:
        """Rank 0 reports for every rank (and a rank speaking for a lost rank 0)."""
        return self.launched.rank == 0 or self.launched.real_writer is None

    def set_up(
        self, item: pytest.Item, spec: RankSpec | None, gpu_marked: bool
    ) -> Generator[None, Any, Any]:
        if spec is not None:
            return (yield from set_up(self.launched, item, spec, gpu_marked))
        # A test without ranks sees none of the harness's process group, as in a plain
        # session (the next ranks test sets one up again); a group its fixtures set up stays.
        self.launched.set_own_group_aside()
        if gpu_marked:
            ranks.skip_without_gpus(1)
        return (yield)

    def run_test(self, item: pytest.Function, spec: RankSpec) -> list[RankOutcome]:
        try:
            return body.run_test(item, self.launched, spec)
        finally:
            self.launched.watch.reinstall()  # after a test that took SIGTERM for itself

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
            self.launched.watch.reinstall()

    def rank_here(self) -> int | None:
        return self.launched.rank

    def device_here(self) -> Any:
        return self.launched.device()

    def shared_path(
        self, request: pytest.FixtureRequest, make: Callable[[], Path], timeout_s: float
    ) -> Path:
        """Rank 0's new directory, on every rank (shared across nodes only if the filesystem
        is)."""
        launched = self.launched
        key = f"{launched.test_key()}/shared_tmp_path"
        if launched.rank == 0:
            path = make()
            launched.put(key, str(path))
            return path
        found = launched.get(key, timeout_s)
        if found is None:
            pytest.fail(f"rank 0 did not make the shared_tmp_path of {request.node.nodeid}")
        path = Path(found.decode(errors="replace"))
        why = untrusted_directory(path)
        if why is not None:
            pytest.fail(
                f"harness: the shared_tmp_path read from torchrun's store ({path}) {why}: it "
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
    if launched.peers is not None:  # a test bounded longer than the session's default
        launched.peers.silent_elsewhere_s = max(launched.peers.silent_elsewhere_s, spec.timeout_s)
    try:
        result = yield
    except (KeyboardInterrupt, Exit) as exc:
        ended_early(launched, exc)  # the session ends here: no set-up to agree on
        raise
    except BaseException as exc:
        body.agree_on_set_up(item, launched, spec, exc)
        raise
    body.agree_on_set_up(item, launched, spec, None)
    return result


# How long a rank waits for the others to finish a test without ranks (each runs it on its
# own): a test that much slower on one rank than on another reads as ranks out of step.
PLAIN_WAIT_S = 600.0


def ended_early(launched: LaunchedSession, exc: BaseException) -> None:
    """Tell the peers this rank's session ends now (pytest.exit() or KeyboardInterrupt)."""
    if launched.peers is None:
        return
    if isinstance(exc, KeyboardInterrupt):
        text, code = "KeyboardInterrupt", int(pytest.ExitCode.INTERRUPTED)
    else:
        returncode = getattr(exc, "returncode", None)
        text = str(getattr(exc, "msg", exc))
        code = returncode if isinstance(returncode, int) else int(pytest.ExitCode.INTERRUPTED)
    with contextlib.suppress(Exception):
        launched.ended_early(text, code)


def plain_verdict(launched: LaunchedSession, item: pytest.Item, report: pytest.TestReport) -> None:
    """One verdict for a test without ranks too: every rank ran it on its own; a failure on
    any rank fails it everywhere (naming the rank), so -x and the exit status agree."""
    if launched.peers is None:
        return
    launched.finishing()
    mine = {
        "outcome": report.outcome,
        "text": report.longreprtext[-4000:],
        "xfail": getattr(report, "wasxfail", None),  # an xfail is reported as a skip
        "reason": _skip_reason(report),
        "sections": [(title, text[-4000:]) for title, text in report.sections],
    }
    # pytest-timeout off while this rank waits: a slow peer's own timer fails its own test,
    # and this rank then reports it (not a timeout in the harness's wait).
    with runner.pytest_timeout_paused(item):
        key = f"{launched.test_key()}/plain"
        found = _gather_releasing_peers(launched, key, report.failed, json.dumps(mine))
    if launched.absent:
        absent = "; ".join(f"rank {r}: {why}" for r, why in sorted(launched.absent.items()))
        launched.lost.update(launched.absent)
        if 0 in launched.lost:
            launched.speak_for_rank_0()  # rank 0 cannot report this test: the lowest rank left does
        launched.stop(f"ranks out of step at {item.nodeid} ({absent})", item.session)
        if report.outcome != "failed":  # a rank that never finished the test: no pass here
            report.outcome = "failed"
            report.longrepr = f"not every rank finished this test: {absent}"
    failed = [(r, t) for r, t in _others(launched, found, key) if t["outcome"] == "failed"]
    if report.outcome != "failed" and failed:
        rank, theirs = failed[0]
        report.outcome = "failed"
        here = f"it did not fail on rank {launched.rank}"
        report.longrepr = f"rank {rank} failed this test ({here}):\n{theirs['text']}"
        _add_sections(report, rank, theirs)
        _also_failed(report, failed, rank)
        return
    if report.outcome == "failed" and report_looks_collateral(report.longreprtext):
        causes = [(r, t) for r, t in failed if not report_looks_collateral(t["text"])]
        if causes:  # this rank failed because a peer did: report the peer's failure
            rank, theirs = causes[0]
            here = _error_line(report.longreprtext)
            report.longrepr = (
                f"rank {rank} failed this test (root cause); rank {launched.rank} collateral "
                f"({here}):\n{theirs['text']}"
            )
            _add_sections(report, rank, theirs)
            _also_failed(report, causes, rank)
        return
    if report.outcome == "failed":
        _also_failed(report, failed, launched.rank)
        return
    published = {r: _published(b, f"{key}/{r}") for r, b in enumerate(found) if b is not None}
    _agree_on_skips(report, published)


def _also_failed(report: pytest.TestReport, failed: list[tuple[int, Any]], shown: int) -> None:
    """Every other rank's own failure, each in a section of the report: one rank's report
    would hide the others' errors (each rank runs a test without ranks on its own)."""
    for rank, theirs in failed:
        if rank != shown:
            report.sections.append((f"rank {rank} failed this test too", theirs["text"]))


# How often a rank whose test failed looks at the peers it still waits for: one blocked in
# torch.distributed (a collective on this rank, which will never come) makes it leave its
# process group, so the peer fails at once instead of at the group's timeout.
RELEASE_CHECK_S = 1.0


def _gather_releasing_peers(
    launched: LaunchedSession, key: str, failed: bool, mine: str
) -> list[bytes | None]:
    """Every rank's `mine` under `key`; where this rank `failed`, a peer still blocked in
    torch.distributed (on this rank, most likely) is released by leaving the group."""
    if not failed:
        return launched.gather(key, mine, PLAIN_WAIT_S)
    assert launched.peers is not None
    peers, start = launched.peers, time.monotonic()
    blocked_since: float | None = None
    found = launched.gather(key, mine, RELEASE_CHECK_S)
    while launched.absent and time.monotonic() - start < PLAIN_WAIT_S:
        waiting = [r for r in launched.absent if peers.still_in_this_test(r)]
        if not waiting:
            break
        blocked = [r for r in waiting if peers.in_torch_distributed(r)]
        if blocked and launched.has_default_group():
            launched.drop_group()
            return launched.gather(key, None, PLAIN_WAIT_S - (time.monotonic() - start))
        # Blocked with no group here to leave (a set-up that failed before the rendezvous
        # the peer waits in): after the test's timeout it is hung, and the session ends.
        blocked_since = (blocked_since or time.monotonic()) if blocked else None
        if blocked_since is not None and time.monotonic() - blocked_since > _timeout(launched):
            for rank in blocked:
                launched.absent[rank] = "blocked in torch.distributed, waiting on this rank"
            break
        found = launched.gather(key, None, RELEASE_CHECK_S)
    return found


def _timeout(launched: LaunchedSession) -> float:
    return timeout_for(settings_of(launched.config), None, "", None)


# What each rank publishes of a test without ranks, and of a teardown.
_Fields = dict[str, type | tuple[type, ...]]
_PLAIN: _Fields = {
    "outcome": str, "text": str, "reason": str, "sections": list, "xfail": (str, type(None)),
}  # fmt: skip
_TEARDOWN: _Fields = {"failed": bool, "text": str}


def _others(
    launched: LaunchedSession, found: list[bytes | None], key: str
) -> list[tuple[int, Any]]:
    """The other ranks' published values, decoded, with their ranks."""
    return [
        (r, _published(blob, f"{key}/{r}"))
        for r, blob in enumerate(found)
        if blob is not None and r != launched.rank
    ]


def _published(blob: bytes, key: str) -> dict[str, Any]:
    """A rank's published verdict under `key`, checked; one that is not the harness's record
    reads as that rank's failure, naming the key (never believed, never run)."""
    fields = _TEARDOWN if key.rsplit("/", 2)[-2] == "teardown" else _PLAIN
    try:
        said = records.read_json(blob, key, fields)
        sections = said.get("sections", [])
        if not all(isinstance(x, list) and [type(y) for y in x] == [str, str] for x in sections):
            raise records.RecordError(f"the value under {key!r} has sections not of the harness")
        return said
    except records.RecordError as exc:
        text = f"harness error: {exc}; it was ignored"
        return {
            "outcome": "failed", "failed": True, "text": text, "reason": "", "sections": [],
            "xfail": None,
        }  # fmt: skip


def teardown_verdict(
    launched: LaunchedSession, item: pytest.Item, report: pytest.TestReport
) -> None:
    """A teardown that failed on any rank is the test's error on every rank, naming the
    rank and showing its failure (rank 0 alone reports, and its own may have passed)."""
    if launched.peers is None:
        return
    mine = {"failed": report.failed, "text": report.longreprtext[-4000:] if report.failed else ""}
    lost_before = set(launched.lost) | {launched.rank}
    with runner.pytest_timeout_paused(item):  # as for the verdict: a slow peer times itself
        key = f"{launched.test_key()}/teardown"
        found = _gather_releasing_peers(launched, key, report.failed, json.dumps(mine))
    gone = {r: why for r, why in launched.absent.items() if r not in lost_before}
    if gone:  # a rank that died in its teardown (even with status 0), or hangs there
        absent = "; ".join(f"rank {r}: {why}" for r, why in sorted(gone.items()))
        launched.lost.update(gone)
        if 0 in launched.lost:
            launched.speak_for_rank_0()
        launched.stop(f"ranks out of step at {item.nodeid}'s teardown ({absent})", item.session)
        if not report.failed:
            report.outcome = "failed"
            hung = launched.hang_reports(fixtures_key(launched), sorted(gone))
            report.longrepr = f"not every rank finished this test's teardown: {absent}{hung}"
        return
    failed = [(r, t["text"]) for r, t in _others(launched, found, key) if t["failed"]]
    if failed or report.failed:  # a fixture's collective may have broken the group
        launched.set_own_group_aside()  # the next test sets a fresh one up
    if failed and not report.failed:
        rank, text = failed[0]
        report.outcome = "failed"
        report.longrepr = (
            f"rank {rank}'s teardown failed (it did not fail on rank {launched.rank}):\n{text}"
        )
    elif report.failed and report_looks_collateral(report.longreprtext):
        causes = [(r, text) for r, text in failed if not report_looks_collateral(text)]
        if causes:  # this rank's teardown failed because a peer's did: show the peer's
            rank, text = causes[0]
            here = _error_line(report.longreprtext)
            report.longrepr = (
                f"rank {rank}'s teardown failed (root cause); rank {launched.rank} "
                f"collateral ({here}):\n{text}"
            )


def _agree_on_skips(report: pytest.TestReport, outcomes: dict[int, dict[str, Any]]) -> None:
    """As for a ranks test: a skip on some ranks only fails the test on every rank (it ran
    on the others), and an xfail on some ranks while the others passed xfails it."""
    xfailed = sorted(r for r, o in outcomes.items() if o["xfail"] is not None)
    skipped = sorted(
        r for r, o in outcomes.items() if o["outcome"] == "skipped" and o["xfail"] is None
    )
    if skipped and len(skipped) < len(outcomes):
        ran = sorted(set(outcomes) - set(skipped))
        report.outcome = "failed"
        with contextlib.suppress(AttributeError):
            del report.wasxfail
        report.longrepr = (
            f"{ranks_phrase(skipped)} skipped this test ({outcomes[skipped[0]]['reason']}) "
            f"while {ranks_phrase(ran)} ran it: skip on every rank or on none (decide from "
            f"something every rank sees alike; to act on one rank, test the rank instead)"
        )
    elif xfailed and report.outcome == "passed":
        report.outcome = "skipped"
        report.wasxfail = outcomes[xfailed[0]]["xfail"]


def _add_sections(report: pytest.TestReport, rank: int, theirs: dict[str, Any]) -> None:
    """The failing rank's captured output and logs, beside this rank's own."""
    for title, text in theirs.get("sections", []):
        report.sections.append((f"{title} [rank {rank}]", text))


def _error_line(text: str) -> str:
    """The first "E   ..." line of a pytest failure report: the exception, in a line."""
    for line in text.splitlines():
        if line.startswith("E "):
            return line[1:].strip()[:300]
    return text.strip().splitlines()[-1][:300] if text.strip() else "failed"


def _skip_reason(report: pytest.TestReport) -> str:
    """A skipped report's reason, without pytest's "Skipped: " prefix."""
    longrepr = report.longrepr
    if report.outcome != "skipped" or not isinstance(longrepr, tuple):
        return ""
    return str(longrepr[2]).removeprefix("Skipped: ")
