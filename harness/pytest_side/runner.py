"""Running one ranks test on its ranks, and the one sequence after a body on every rank.

The ranks are the session's (``seam.ranks_of``: warm rank processes, or the launch's under a
launcher); what follows a body (warnings, leftovers, output, then the verdict, verdict.py) is
written once, here, for ranks tests and adopted ones alike. run_on_ranks calls are
run_on_ranks.py's; pytest-timeout's part, plan/timeout_interop.py's. Loaded with the plugin;
imports no torch.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable
from dataclasses import replace
from typing import Any

import pytest

from harness import seam
from harness.common import faults as fault_specs
from harness.common import rank_warnings
from harness.common.hygiene import CHECKS
from harness.common.outcome import Ending, RankOutcome
from harness.common.protocol import RankSpec
from harness.common.report_text import ranks_phrase, without_cpp_frames
from harness.plan import hypothesis_search
from harness.pytest_side.verdict import judge
from harness.seam import ranks_of

_leftovers_key = pytest.StashKey[str]()


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
    text, found = seam.own_ranks_of(item.config).take_start_output(item)
    if text:
        item.add_report_section("call", "output [fork server] preloading the tests' imports", text)
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
