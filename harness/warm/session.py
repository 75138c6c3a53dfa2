"""The session's warm ranks: :class:`WarmRanks` (the seam's default side, see seam.py),
the pools in the session's stash, the test module's import ahead of its first test, and the
fork server's start, hand-over and report.

Loaded with the plugin; imports no torch: the pools are imported when a test first needs
ranks.
"""

from __future__ import annotations

import atexit
import os
import sys
import weakref
from collections.abc import Callable, Generator
from dataclasses import replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

import pytest

from harness.common import rank_warnings
from harness.common.outcome import Ending, RankOutcome
from harness.common.protocol import RankSpec, Target, encode_args
from harness.plan import adopter_needs, hypothesis_search, made_in_ranks, measured, packing
from harness.seam import skip_without_gpus
from harness.warm import conftest_environ, preload

if TYPE_CHECKING:
    from harness.seam import Cut
    from harness.warm.forkserver import Preloaded
    from harness.warm.live_output import LiveStreams
    from harness.warm.pools import Pools


class WarmRanks:
    """Rank processes this pytest process starts and keeps warm between tests."""

    reports_output = True
    drives_examples = True

    def __init__(self, config: pytest.Config) -> None:
        self._config = config

    def set_up(
        self, item: pytest.Item, spec: RankSpec | None, gpu_marked: bool
    ) -> Generator[None, Any, Any]:
        if gpu_marked or (spec is not None and spec.backend == "nccl"):
            skip_without_gpus(spec.world_size if spec is not None else 1)
        if spec is not None:
            made_in_ranks.note_test(item)
        result = yield
        if spec is not None and isinstance(item, pytest.Function):
            hypothesis_search.prepare(item, fixtures_per_example=True)
        return result

    def run_test(
        self, item: pytest.Function, spec: RankSpec, drawn: dict[str, Any] | None = None
    ) -> list[RankOutcome]:
        target = packing.test_target(item, unwrap="hypothesis" if drawn is not None else "")
        failed = import_ahead(self._config, item, spec, target)
        if failed:
            return failed
        blob = packing.sendable_funcargs(item, drawn or {})
        return on_warm_ranks(self._config, spec, target, blob)

    def run_call(
        self,
        node: pytest.Item | None,
        spec: RankSpec,
        fn: Callable[..., Any],
        args: tuple[Any, ...],
        kwargs: dict[str, Any],
    ) -> list[RankOutcome]:
        target = packing.function_target(fn)
        if spec.backend == "nccl":
            skip_without_gpus(spec.world_size)
        return on_warm_ranks(self._config, spec, target, encode_args(args, kwargs))

    def rank_here(self) -> int | None:
        return None

    def device_here(self) -> Any:
        return None

    def shared_path(
        self, request: pytest.FixtureRequest, make: Callable[[], Path], timeout_s: float
    ) -> Path:
        return make()  # every rank runs on this machine: one directory serves them all

    def import_ahead(
        self, item: pytest.Item | None, spec: RankSpec, target: Target
    ) -> list[RankOutcome]:
        return import_ahead(self._config, item, spec, target)

    def run_target(
        self,
        spec: RankSpec,
        target: Target,
        args_blob: bytes,
        on_start: Callable[[list[int]], None] | None = None,
        cut: Cut | None = None,
    ) -> list[RankOutcome]:
        return on_warm_ranks(self._config, spec, target, args_blob, on_start, cut)

    def failure_grace_s(self) -> float:
        from harness.warm.run_loop import failure_grace_s

        return failure_grace_s()

    def take_start_output(
        self, item: pytest.Item
    ) -> tuple[str, tuple[str, list[RankOutcome]] | None]:
        return take_preload_output(item.config), take_import_output(item)


_pools_key = pytest.StashKey["Pools"]()


def on_warm_ranks(
    config: pytest.Config,
    spec: RankSpec,
    target: Target,
    args_blob: bytes,
    on_start: Callable[[list[int]], None] | None = None,
    cut: Cut | None = None,
) -> list[RankOutcome]:
    """Run `target` with the encoded (args, kwargs) on every rank of a warm pool for `spec`;
    `on_start` is told the rank processes as the run starts, `cut` may end it early."""
    from harness.warm.pools import RunRequest

    live = _live_streams(config)
    return pools_of(config).run(RunRequest(spec, target, args_blob, live, on_start, cut))


def import_ahead(
    config: pytest.Config, item: pytest.Item | None, spec: RankSpec, target: Target
) -> list[RankOutcome]:
    """Have the warm ranks for `spec` import `target`'s module before `item` (a test, or a
    harness.spawn or rank_pool run) runs, once per ranks and module version: a phase with
    its own bound (--rank-import-timeout), so that a run's timeout bounds the run, not a big
    library's import. Empty when the module is loaded (what the ranks printed and warned
    importing it is kept for `item`'s report: take_import_output; without an item, the
    warnings are re-emitted); else every rank's outcome (an import that failed or ran past
    its bound is the run's failure, reported as what it is)."""
    from harness.common.stacks import fold_importlib
    from harness.plan.settings import settings_of
    from harness.rank import loader
    from harness.warm.processes import PoolKey

    pools = pools_of(config)
    try:  # a module not named like a test file is imported by name (no file: no stamp)
        stamp = None if target.file is None else Path(target.file).stat().st_mtime_ns
    except OSError:
        return []
    key = (tuple(pools.get(PoolKey.of(spec)).pids), target.module, target.file, stamp)
    if key in pools.modules_loaded:
        return []
    bound = settings_of(config).import_timeout_s
    load = replace(spec, timeout_s=bound, faults=(), expected=(), launch=False, hygiene=frozenset())
    outcomes = on_warm_ranks(config, load, packing.function_target(loader.load_test_module),
                             encode_args((target,), {}))  # fmt: skip
    if all(o.ok for o in outcomes):
        pools.modules_loaded.add(key)
        if item is None:
            rank_warnings.reemit(outcomes)
        else:
            item.stash[_import_output_key] = (target.module, outcomes)
        return []
    return [
        o.with_stack(fold_importlib(o.stack)).with_notes(
            f"rank {o.rank} still importing {target.module} after {bound:g} s "
            f"(--rank-import-timeout), apart from the test's own bound"
        )
        if o.ending is Ending.HUNG and not o.after_failure
        else o
        for o in outcomes
    ]


def _live_streams(config: pytest.Config) -> LiveStreams | None:
    """-s, -p no:capture and --capture=tee-sys: where rank output goes as it comes (None:
    kept only for the report). Under tee-sys, the streams its capture tees to: written to
    the capture itself, rank output would be shown again as the test's own (tee-sys keeps
    it in the ranks' report sections already)."""
    from harness.warm.live_output import LiveStreams

    method = config.getoption("capture", None)
    if method in ("no", None):  # -s, or -p no:capture (no capture plugin, no option)
        return LiveStreams()
    if method != "tee-sys":
        return None
    capman = config.pluginmanager.getplugin("capturemanager")
    capturing = getattr(capman, "_global_capturing", None)  # pytest's own: None if it changes
    return LiveStreams(
        getattr(getattr(capturing, "out", None), "_old", None),
        getattr(getattr(capturing, "err", None), "_old", None),
    )


def pools_of(config: pytest.Config) -> Pools:
    if _pools_key not in config.stash:
        from harness.warm.pools import Pools

        config.stash[_pools_key] = Pools(
            lambda: preload.plan_of(config), endings=lambda: adopter_needs.endings(config)
        )
    return config.stash[_pools_key]


_early_tried_key = pytest.StashKey[bool]()


def early_start_pending(config: pytest.Config) -> bool:
    """Whether the fork server's early start was not tried yet this session."""
    return not config.stash.get(_early_tried_key, False)


_environ_before_conftests_key = pytest.StashKey[dict[str, str]]()


# Sessions whose pools started before configure: a conftest that fails to import ends pytest
# before it, and no unconfigure closes them then (closing is idempotent). Weak: a session
# run inside another (pytester) is not kept alive until the process exits.
_closed_at_exit: weakref.WeakSet[pytest.Config] = weakref.WeakSet()


@atexit.register
def _close_pools_left() -> None:
    for config in list(_closed_at_exit):
        close_pools(config)


def start_server_before_conftests(config: pytest.Config) -> None:
    """For a session that adopts suites (all its tests run on ranks), start the fork server
    before the conftests load: its import of torch overlaps theirs (an adopted suite's
    conftest imports torch, and its test modules the library under test). It starts in the
    environment the conftests will likely leave; start_server_early checks that they did."""
    if not preload.before_conftests_wanted(config):
        return
    config.stash[_environ_before_conftests_key] = dict(os.environ)
    _closed_at_exit.add(config)
    try:
        pools_of(config).start_server_before_conftests(conftest_environ.predicted(config))
    except Exception:  # TMPDIR too long, say: started at collection, or by the first pool
        return


def start_server_early(config: pytest.Config, ranks_collected: bool = False) -> None:
    """Start the ranks' fork server while pytest collects, where ranks will likely be
    needed (see preload.start_early_wanted): torch's import overlaps the collection. Tried
    once a session: as collection starts, or at its first ranks test (a fresh clone has no
    cache that says the last session started ranks)."""
    if config.stash.get(_early_tried_key, False):
        return
    early = preload.start_early_wanted(config, ranks_collected)
    if early is None and not ranks_collected:
        return  # asked again at the first ranks test
    config.stash[_early_tried_key] = True
    before = config.stash.get(_environ_before_conftests_key, None)
    if before is not None:
        conftest_environ.record(config, before)
    if early is None:
        return
    try:
        if before is not None and pools_of(config).give_early(early):
            return
        pools_of(config).start_server_early(early)
    except Exception:  # TMPDIR too long, say: the first pool then says so, as it would have
        return


def hand_preload_over(config: pytest.Config) -> None:
    """Give a fork server started early the session's list, once the tests are collected."""
    server = sys.modules.get("harness.warm.forkserver")
    if server is None or not server.early_server_waiting():
        return
    plan = preload.plan_of(config)
    if plan is not None:
        server.hand_over_early(plan)


def pools_were_started(config: pytest.Config) -> bool:
    pools = config.stash.get(_pools_key, None)
    return pools is not None and bool(pools.started_pids)


def _preloaded(config: pytest.Config) -> Preloaded | None:
    """What the session's fork server preloaded (None: it preloaded nothing)."""
    pools = config.stash.get(_pools_key, None)
    return None if pools is None else pools.preloaded


def start_timeline(config: pytest.Config) -> dict[str, float]:
    """When (time.time()) the session's fork server was started ("launched"), had done its
    own imports ("started"), was handed each list and had imported it ("early-handed",
    "early-done", "modules-handed", "modules-done"), and when its first pool was asked
    for and had its ranks ready ("ranks-asked", "ranks-ready"); what happened only. Read
    by benchmarks/adopt_start.py for the breakdown of a session's start."""
    pools = config.stash.get(_pools_key, None)
    if pools is None:
        return {}
    server = dict(pools.preloaded.timeline) if pools.preloaded is not None else {}
    return {**server, **pools.timeline}


def slowest_preloads(config: pytest.Config) -> list[tuple[str, float]]:
    """The fork server's slowest imports this session: (module, seconds), slowest first."""
    done = _preloaded(config)
    return [] if done is None else list(done.slowest)


def preload_failures(config: pytest.Config) -> list[str]:
    """The modules the fork server could not preload this session (by name)."""
    done = _preloaded(config)
    return [] if done is None else [line.split(":", 1)[0] for line in done.failed]


_import_output_key = pytest.StashKey[tuple[str, list[RankOutcome]]]()


def take_import_output(item: pytest.Item) -> tuple[str, list[RankOutcome]] | None:
    """The module `item`'s ranks imported before it and their outcomes (with what they
    printed), once; None when they had it loaded already."""
    found = item.stash.get(_import_output_key, None)
    if found is not None:
        del item.stash[_import_output_key]
    return found


def take_preload_output(config: pytest.Config) -> str:
    """What the fork server printed preloading the tests' imports, once (see preload.py)."""
    pools = config.stash.get(_pools_key, None)
    return "" if pools is None else pools.take_preload_output()


def preload_summary(config: pytest.Config, verbose: bool) -> list[str]:
    """Lines for the terminal summary about what the fork server preloaded: the imports it
    could not do, and threads it was left running (always); its figures (under -v)."""
    done = _preloaded(config)
    if done is None:
        return []
    lines = []
    if verbose:
        lines.append(
            f"harness: the fork server preloaded {done.modules} modules the tests import in "
            f"{done.seconds:.1f} s, so that ranks start with them (--rank-preload none turns "
            f"it off)"
        )
    if done.failed:
        shown = done.failed if verbose else done.failed[:3]
        lines.append(
            f"harness: {len(done.failed)} of the modules the tests import could not be "
            f"preloaded in the fork server; each rank imported them itself:"
        )
        lines += [f"  {line}" for line in shown]
        if len(shown) < len(done.failed):
            lines.append(f"  ... {len(done.failed) - len(shown)} more (-v lists them)")
    if done.cuda:
        lines.append(
            f"harness: importing {done.cuda} initialised CUDA in the fork server, whose forks "
            f"could not use it: the ranks start from a server without the tests' imports "
            f"(they import them themselves)"
        )
    if done.threads:
        lines.append(
            f"harness: preloading the tests' imports left {done.threads} thread(s) running in "
            f"the fork server; ranks are forks of it (a rank that hangs at start: run with "
            f"--rank-preload none)"
        )
    return lines


def fold_ranks_coverage(config: pytest.Config) -> None:
    """Fold what the session's ranks measured into the Coverage measuring this process."""
    pools = config.stash.get(_pools_key, None)
    if pools is not None:
        measured.fold_ranks_data(pools.coverage_dir)


def close_pools(config: pytest.Config) -> list[int]:
    """Kill every rank of the session; the pids still alive after that (there should be none)."""
    pools = config.stash.get(_pools_key, None)
    return [] if pools is None else pools.close()


def stop_forkserver_if_started() -> None:
    """End the fork server ranks came from, if this process started ranks."""
    server = sys.modules.get("harness.warm.forkserver")
    if server is not None:
        server.stop_forkserver()
