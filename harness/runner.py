"""Running one test, or one run_on_ranks call, on its ranks and judging how every rank ended.

The ranks are the session's (``seam.ranks_of``: warm rank processes, or the launch's under
torchrun); what follows a body (warnings, leftovers, output, the verdict) is written once,
here. Loaded with the plugin; imports no torch.
"""

from __future__ import annotations

import contextlib
import warnings
from collections.abc import Callable, Iterator
from dataclasses import dataclass, replace
from typing import Any, TypeGuard

import pytest

from harness import hypothesis_search, packing
from harness.common import expect as expectations
from harness.common import faults as fault_specs
from harness.common import rank_warnings
from harness.common.errors import HarnessError
from harness.common.faults import Fault
from harness.common.hygiene import CHECKS
from harness.common.outcome import (
    Ending,
    RankOutcome,
    ReportStyle,
    diagnose,
    failed_ranks,
    failure_text,
    ranks_phrase,
    set_up_failure_text,
    without_cpp_frames,
)
from harness.common.protocol import RankSpec
from harness.seam import ranks_of
from harness.settings import settings_of
from harness.specs import spec_for_call
from harness.warm.session import WarmRanks, take_import_output, take_preload_output

_leftovers_key = pytest.StashKey[str]()
# Set when a rank's fault never fired: the test is written wrong, which no xfail expects.
_no_xfail_key = pytest.StashKey[bool]()
FAULT_NOT_REACHED = "harness.common.faults.FaultNotReached"


class RankLeftovers(Exception):
    """A rank test left a process group, threads or environment changes behind."""


class RanksReplacedWarning(pytest.PytestWarning):
    """A passing test's ranks were replaced before the next test (a start of new ranks):
    it left daemon threads running (``@pytest.mark.allow_leftovers("threads")`` keeps
    them), or something still held its torn-down group, or the like; the warning says."""


# ---- a ranks-marked test ------------------------------------------------------------------


def run_marked_test(item: pytest.Function, spec: RankSpec) -> None:
    """Run `item`'s body on every rank of `spec` and pass, skip or fail it by their endings,
    whichever ranks the session runs on."""
    ranks = ranks_of(item.config)
    spec = with_fixture_faults(item, spec)
    if hypothesis_search.is_search(item) and ranks.drives_examples:
        _search_on_ranks(item, spec)
        return
    outcomes = ranks.run_test(item, spec)
    after_body(item, spec, outcomes, ranks.reports_output)


def _search_on_ranks(item: pytest.Function, spec: RankSpec) -> None:
    """A hypothesis test: the search here, each example on every rank and judged as a
    test (a failing one raises the report for hypothesis to shrink); the last example's
    output, replaced ranks and leftovers on the test's report."""
    ranks = ranks_of(item.config)
    last: list[list[RankOutcome]] = []

    def example(drawn: dict[str, Any]) -> list[RankOutcome]:
        outcomes = ranks.run_test(item, spec, drawn)
        last[:] = [outcomes]
        return outcomes

    def judged(outcomes: list[RankOutcome]) -> None:
        stop_if_a_rank_did(outcomes)
        rank_warnings.reemit(outcomes)
        judge(item, spec, outcomes)

    try:
        hypothesis_search.search(item, example, judged)
        raise_warnings_made_errors(item)
    except pytest.fail.Exception as failed:
        notes = getattr(failed, "__notes__", [])  # hypothesis's falsifying example, shown
        if not notes:
            raise
        raise pytest.fail.Exception(f"{failed.msg}\n" + "\n".join(notes), pytrace=False) from None
    finally:
        if ranks.reports_output:
            attach_import_output(item)
        if last:
            warn_of_replaced_ranks(item, last[0])
            record_leftovers(item, last[0])
            if ranks.reports_output:
                attach_output(item, last[0])


Judge = Callable[[pytest.Item, RankSpec, list[RankOutcome]], None]


def after_body(
    item: pytest.Item,
    spec: RankSpec,
    outcomes: list[RankOutcome],
    reports_output: bool = True,
    judged_by: Judge | None = None,
) -> None:
    """The one sequence after a body ran on every rank (a ranks test's, an adopted test's):
    what the ranks printed and warned, returned and left behind, then the verdict
    (`judged_by`, by default :func:`judge`). `reports_output`: this process attaches the
    ranks' output to the report (under torchrun only the rank that reports does)."""
    if reports_output:  # first: what the imports printed is kept whatever comes next
        attach_import_output(item)
    stop_if_a_rank_did(outcomes)  # pytest.exit() on one rank ends every rank's session
    rank_warnings.reemit(outcomes)
    _warn_of_returned_values(item, outcomes)
    warn_of_replaced_ranks(item, outcomes)
    record_leftovers(item, outcomes)  # a thread or process left: an error at teardown
    if reports_output:  # every rank's, passing or not, as pytest keeps a plain test's
        attach_output(item, outcomes)
    (judged_by or judge)(item, spec, outcomes)
    raise_warnings_made_errors(item)


def stop_if_a_rank_did(outcomes: list[RankOutcome]) -> None:
    """pytest.exit() or KeyboardInterrupt in a rank stops the session, as in a plain test."""
    for o in outcomes:
        if o.ending is not Ending.RAISED:
            continue
        if o.exc_type == "_pytest.outcomes.Exit":
            code = o.exit_code if o.exit_code is not None else pytest.ExitCode.INTERRUPTED
            pytest.exit(f"[rank {o.rank}] {o.message}", returncode=code)
        if o.exc_type == "builtins.KeyboardInterrupt":
            raise KeyboardInterrupt(f"in rank {o.rank}")


def _warn_of_returned_values(item: pytest.Item, outcomes: list[RankOutcome]) -> None:
    """pytest's warning for a test function that returns a value, from its ranks."""
    returned = [o for o in outcomes if o.ending is Ending.RETURNED and o.value_repr]
    if returned:
        ranks = ranks_phrase([o.rank for o in returned])
        _warn(
            item,
            pytest.PytestReturnNotNoneWarning(
                f"test functions should return None, but {item.nodeid} returned "
                f"{returned[0].value_repr} on {ranks}; use assert (or run_on_ranks to get "
                f"values back)"
            ),
        )


def warn_of_replaced_ranks(item: pytest.Item, outcomes: list[RankOutcome]) -> None:
    """Say why ranks were replaced after a test that passed: each replacement costs a start
    of new ranks (a failed test's report says why already)."""
    why = [f"rank {o.rank} {o.replace_after}" for o in outcomes if o.replace_after]
    if not why or not all(o.ok or o.ending is Ending.SKIPPED for o in outcomes):
        return
    threads = any("thread" in o.replace_after for o in outcomes)
    hint = (
        " (a thread that would act in a later test; one a library keeps for the process: "
        "@pytest.mark.allow_leftovers('threads') keeps the ranks)"
        if threads
        else ""
    )
    _warn(item, RanksReplacedWarning(f"{item.nodeid}: {'; '.join(why)}{hint}"))


_warning_errors_key = pytest.StashKey[list[str]]()


def _warn(item: pytest.Item, warning: Warning) -> None:
    """Warn as the harness, on the test's behalf. Where the session's filters make the
    warning an error (-W error, filterwarnings), the test fails with its words alone, as
    pytest fails a plain test on its own warnings, once its ranks' output is attached."""
    try:
        warnings.warn(warning, stacklevel=1)
    except Warning as exc:
        text = (
            f"{type(exc).__name__} (an error under this session's warning filters: -W "
            f"error or filterwarnings): {exc}"
        )
        item.stash.setdefault(_warning_errors_key, []).append(text)


def raise_warnings_made_errors(item: pytest.Item) -> None:
    """Fail the test with the harness's warnings that the filters made errors, if any."""
    texts = item.stash.get(_warning_errors_key, [])
    if texts:
        del item.stash[_warning_errors_key]
        raise pytest.fail.Exception("\n".join(texts), pytrace=False)


def with_fixture_faults(item: pytest.Function, spec: RankSpec) -> RankSpec:
    extra = _fixture_faults(item)
    if not extra:
        return spec
    origin = f"the rank_faults fixture of {item.nodeid}"
    try:
        more = tuple(fault_specs.validate(f, spec.world_size, origin) for f in extra)
    except fault_specs.FaultError as exc:
        pytest.fail(str(exc), pytrace=False)
    return replace(spec, faults=spec.faults + more)


def _fixture_faults(item: pytest.Function) -> Any:
    """The rank_faults fixture's value for `item`, without pytest's fixture machinery (~0.1 ms a
    test) where only the plugin's own definition, which returns none, is visible to it."""
    if "rank_faults" in item.funcargs:  # the test asked for it: pytest has it already
        return item.funcargs["rank_faults"]
    try:
        defs = item.session._fixturemanager.getfixturedefs("rank_faults", item) or ()
        only_ours = len(defs) == 1 and defs[0].func.__module__ == "harness.plugin"
    except Exception:  # another pytest's internals: ask pytest
        only_ours = False
    return [] if only_ours else item._request.getfixturevalue("rank_faults")


def attach_output(item: pytest.Item, outcomes: list[RankOutcome], during: str = "") -> None:
    """Every rank's output and log on the report, one section per rank and stream, as pytest
    keeps a plain test's (-rP, -rA, junit xml), passing or not; `during` names a phase other
    than the test's own in the sections' titles."""
    for o in outcomes:
        for stream, text in (("stdout", o.stdout), ("stderr", o.stderr), ("log", o.log)):
            if text:
                title = f"{stream} [rank {o.rank}]{f' {during}' if during else ''}"
                item.add_report_section("call", title, without_cpp_frames(text))


def attach_import_output(item: pytest.Item) -> None:
    """What the imports ahead of the test printed and warned (a library's load warnings),
    each on the first test it came before, the output in sections of its own: the fork
    server's preload of the tests' imports, then the ranks' import of the test's module."""
    text = take_preload_output(item.config)
    if text:
        item.add_report_section("call", "output [fork server] preloading the tests' imports", text)
    found = take_import_output(item)
    if found is not None:
        module, outcomes = found
        rank_warnings.reemit(outcomes)
        attach_output(item, outcomes, during=f"importing {module}")


def record_leftovers(item: pytest.Item, outcomes: list[RankOutcome]) -> None:
    """What the ranks left behind, for raise_leftovers to raise at teardown."""
    text = leftovers_text(outcomes, allow_hint=True)
    if text is not None:
        item.stash[_leftovers_key] = text


def leftovers_text(outcomes: list[RankOutcome], allow_hint: bool = False) -> str | None:
    """'hygiene: rank 1 left ...', a line per finding; None when the ranks left nothing."""
    lines = [f"rank {o.rank} {finding}" for o in outcomes for finding in o.leftovers.values()]
    if not lines:
        return None
    kinds = sorted({k for o in outcomes for k in o.leftovers if k in CHECKS})
    listed = ", ".join(f"'{kind}'" for kind in kinds)
    hint = allow_hint and kinds
    hints = [f"(a test that means it: @pytest.mark.allow_leftovers({listed}))"] if hint else []
    return "\n".join(["hygiene: " + lines[0], *lines[1:], *hints])


def raise_leftovers(item: pytest.Item) -> None:
    """At teardown: a test that left things behind in a rank errors, naming the rank."""
    text = item.stash.get(_leftovers_key, None)
    if text is not None:
        raise RankLeftovers(text)


def judge(item: pytest.Item, spec: RankSpec, outcomes: list[RankOutcome]) -> None:
    """Pass only if every rank ended as expected; otherwise fail with the root cause first.

    pytest's own outcomes raised in ranks count as in a plain test: a skip or an xfail on
    every rank (the others returning, for an xfail) skips or xfails the test.
    """
    if all(o.setup_failed for o in outcomes):
        raise HarnessError(set_up_failure_text(outcomes), pytrace=False)
    if all(o.ending is Ending.SKIPPED for o in outcomes):  # reported where rank 0 skipped
        if outcomes[0].skipped_at is not None:
            item.stash[_skipped_at_key] = outcomes[0].skipped_at
        raise pytest.skip.Exception(outcomes[0].message, _use_item_location=True)
    note_missed_faults(item, outcomes)
    _xfail_if_ranks_did(outcomes)
    _fail_a_partial_skip(outcomes)
    style = ReportStyle(
        verbose=item.config.getoption("verbose", 0) > 0,
        streams=not ranks_of(item.config).reports_output,  # else pytest shows them, once
    )
    text = failure_text(outcomes, spec.expected, style)
    if text is not None:
        first, _, rest = text.partition("\n")
        ranks = f"{spec.world_size} rank{'s' if spec.world_size != 1 else ''}"
        seeded = settings_of(item.config).seed.report_line()
        message = f"{first}  [{ranks}, {item.nodeid}]\n{rest}\n{seeded}"
        raise _as_the_xfail_marker_expects(item, outcomes, spec, message)


_skipped_at_key = pytest.StashKey[tuple[str, int]]()


def place_skip(item: pytest.Item, report: pytest.TestReport) -> None:
    """A skip on every rank is reported where the ranks skipped (file and line), as pytest
    reports a plain test's, not at the test's own line."""
    at = item.stash.get(_skipped_at_key, None)
    if at is not None and report.skipped and isinstance(report.longrepr, tuple):
        report.longrepr = (at[0], at[1], report.longrepr[2])


def note_missed_faults(item: pytest.Item | None, outcomes: list[RankOutcome]) -> None:
    """Remember, for refuse_xfail, that a rank's fault never fired in `item`."""
    if item is not None and any(o.exc_type == FAULT_NOT_REACHED for o in outcomes):
        item.stash[_no_xfail_key] = True


def refuse_xfail(item: pytest.Item, report: pytest.TestReport) -> None:
    """Fail a test an xfail marker would have xfailed, where a rank's fault never fired."""
    if item.stash.get(_no_xfail_key, False) and hasattr(report, "wasxfail"):
        report.outcome = "failed"
        del report.wasxfail


def _xfail_if_ranks_did(outcomes: list[RankOutcome]) -> None:
    """Xfail when ranks xfailed and every other rank returned, or failed only for it (a peer
    waiting on an xfailed rank in a collective)."""
    xfailed = [o for o in outcomes if o.ending is Ending.XFAILED]
    others = [o for o in outcomes if o.ending not in (Ending.XFAILED, Ending.RETURNED)]
    if xfailed and all(o.looks_collateral for o in others):
        pytest.xfail(xfailed[0].message)


def _fail_a_partial_skip(outcomes: list[RankOutcome]) -> None:
    skipped = [o.rank for o in outcomes if o.ending is Ending.SKIPPED]
    ran = [o.rank for o in outcomes if o.ending is Ending.RETURNED]
    if skipped and len(skipped) + len(ran) == len(outcomes):
        reason = next(o.message for o in outcomes if o.ending is Ending.SKIPPED)
        pytest.fail(
            f"{ranks_phrase(skipped)} skipped ({reason}) while {ranks_phrase(ran)} ran: skip on "
            f"every rank or on none (decide from something every rank sees alike)",
            pytrace=False,
        )


def _as_the_xfail_marker_expects(
    item: pytest.Item, outcomes: list[RankOutcome], spec: RankSpec, message: str
) -> BaseException:
    """The failure to raise: pytest.fail's; or, for xfail(raises=E) where every rank's own
    failure (the root cause and those that failed on their own account, not the collateral
    ones) raised an E (or a subclass), an E, which is what pytest's xfail checks. A rank
    whose own failure is no E fails the test naming it, whichever rank failed first."""
    mark = item.get_closest_marker("xfail")
    raises = mark.kwargs.get("raises") if mark is not None else None
    if raises is None:
        return pytest.fail.Exception(message, pytrace=False)
    wanted = [c for c in (raises if isinstance(raises, tuple) else (raises,)) if _is_error(c)]
    own = _own_failures(outcomes, spec)
    unexpected = [o for o in own if _expected_class(wanted, o) is None]
    if unexpected or not own:
        shown = (
            getattr(raises, "__name__", None)
            or "(" + ", ".join(getattr(c, "__name__", repr(c)) for c in wanted) + ")"
        )
        said = "; ".join(f"rank {o.rank}'s failure: {o.describe()}" for o in unexpected)
        first = f"xfail(raises={shown}) does not expect {said}\n" if said else ""
        return pytest.fail.Exception(first + message, pytrace=False)
    cls = _expected_class(wanted, own[0])
    assert cls is not None
    with contextlib.suppress(Exception):
        error: BaseException = cls.__new__(cls)
        error.args = (message,)
        return error
    return pytest.fail.Exception(message, pytrace=False)


def _is_error(cls: object) -> TypeGuard[type[BaseException]]:
    return isinstance(cls, type) and issubclass(cls, BaseException)


def _own_failures(outcomes: list[RankOutcome], spec: RankSpec) -> list[RankOutcome]:
    """The ranks that failed on their own account: the root cause first, then the others
    no peer caused (the collateral ones left out)."""
    failed = failed_ranks(outcomes, spec.expected)
    found = diagnose(outcomes, failed)
    by_rank = {o.rank: o for o in outcomes}
    ranks = ([] if found.root is None else [found.root]) + list(found.independent)
    return [by_rank[r] for r in ranks]


def _expected_class(
    wanted: list[type[BaseException]], outcome: RankOutcome
) -> type[BaseException] | None:
    """The first of `wanted` the rank raised (an instance of it: a subclass counts)."""
    if outcome.ending is not Ending.RAISED:
        return None
    return next((cls for cls in wanted if _named(cls, outcome)), None)


def _named(cls: type, root: RankOutcome) -> bool:
    return expectations.class_name(cls) in root.exc_classes


def pytest_timeout_of_fixtures(item: pytest.Item) -> float | None:
    """pytest-timeout's bound for `item`'s set-up and for its teardown (each is timed with
    the whole of it); None when pytest-timeout is not loaded, off, or times the call only."""
    timing = item.config.pluginmanager.get_plugin("timeout")
    settings_of_item = getattr(timing, "_get_item_settings", None)
    if settings_of_item is None:
        return None
    settings = settings_of_item(item)
    if not settings.timeout or settings.func_only:
        return None
    return float(settings.timeout)


@contextlib.contextmanager
def pytest_timeout_paused(item: pytest.Item) -> Iterator[None]:
    """pytest-timeout's timer off while the harness runs the body under its own bound, and
    set afresh for the teardown after it (pytest-timeout times the whole protocol)."""
    hooks = item.config.pluginmanager.hook
    timing = item.config.pluginmanager.get_plugin("timeout")
    settings_of_item = getattr(timing, "_get_item_settings", None)
    if settings_of_item is None:  # pytest-timeout not loaded (or another version of it)
        yield
        return
    settings = settings_of_item(item)
    if not settings.timeout:
        yield
        return
    hooks.pytest_timeout_cancel_timer(item=item)
    try:
        yield
    finally:
        if not settings.func_only:
            hooks.pytest_timeout_set_timer(item=item, settings=settings)


# ---- any function on ranks, from the pytest process --------------------------------------


@dataclass
class WorldOutcome:
    """Every rank's outcome of one `run_on_ranks` call, in rank order."""

    ranks: list[RankOutcome]

    def __getitem__(self, rank: int) -> RankOutcome:
        return self.ranks[rank]

    def __len__(self) -> int:
        return len(self.ranks)

    def __iter__(self) -> Iterator[RankOutcome]:
        return iter(self.ranks)

    @property
    def values(self) -> list[Any]:
        """Each rank's return value; raises if any rank did not return."""
        bad = [o for o in self.ranks if not o.ok]
        if bad:
            raise AssertionError(self.report())
        return [o.value for o in self.ranks]

    @property
    def endings(self) -> list[Ending]:
        """How each rank ended, in rank order."""
        return [o.ending for o in self.ranks]

    def report(self) -> str:
        """The failure report, root cause first, or 'every rank returned'."""
        return failure_text(self.ranks) or "every rank returned"

    def expect(self, *args: Any, **kwargs: Any) -> None:
        """Assert how each rank ended, in the expect marker's forms; the table on a mismatch."""
        wanted = expectations.from_marker(args, kwargs, len(self.ranks), "WorldOutcome.expect")
        text = failure_text(self.ranks, wanted)
        if text is not None:
            raise AssertionError(text)


class RankRunner:
    """Runs a module-level function on every rank of a world and returns every outcome."""

    def __init__(self, config: pytest.Config, node: pytest.Item | None = None) -> None:
        self._config = config
        self._node = node

    def __call__(
        self,
        fn: Callable[..., Any],
        *args: Any,
        world_size: int | None = None,
        timeout: float | None = None,
        launch: bool = False,
        backend: str | None = None,
        faults: list[Fault] | tuple[Fault, ...] = (),
        **kwargs: Any,
    ) -> WorldOutcome:
        packing.function_target(fn)  # a module-level function, whichever ranks run it
        settings = settings_of(self._config)
        spec = spec_for_call(
            self._config, settings, self._node, world_size, timeout, launch, backend, faults
        )
        # Outside a test (a session fixture's call) the launch has no test to agree on: such
        # a call runs on warm ranks, as in a plain session.
        ranks = ranks_of(self._config) if self._node is not None else WarmRanks(self._config)
        outcomes = ranks.run_call(self._node, spec, fn, args, kwargs)
        rank_warnings.reemit(outcomes)
        note_missed_faults(self._node, outcomes)
        return WorldOutcome(outcomes)
