"""What the user asked for of the session: its settings from the command line and ini, the
one timeout precedence, and each value checked where it comes from (specs.py builds a
test's spec from its markers over these). Testable without starting a process; imports no
torch.

The session's values are resolved once, in ``pytest_configure``, into a frozen
:class:`Settings` kept in ``config.stash``; a bad one is a usage error naming its origin.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field, replace
from typing import Any, cast

import pytest

from harness.common import launch_detect, pytest_internals
from harness.common.endings import SHORT_LOCALS
from harness.common.errors import SpecError, invalid
from harness.common.launch_detect import Launch
from harness.common.protocol import (
    BACKENDS,
    START_METHODS,
    Backend,
    LogCapture,
    StartMethod,
)
from harness.plan import seeds

DEFAULT_RANKS = 2
DEFAULT_TIMEOUT_S = 60.0
# A rank's import of a test's module, bounded apart from the test: a big library (transformers,
# torch.distributed.tensor) imported by four ranks at once on a busy machine takes minutes.
DEFAULT_IMPORT_TIMEOUT_S = 600.0

# (name, help, metavar) of each command-line option; each has an ini key of the same name.
OPTIONS: list[tuple[str, str, str]] = [
    ("ranks", f"world size for @pytest.mark.ranks without sizes (default {DEFAULT_RANKS})", "N"),
    ("rank_timeout", f"seconds a multi-rank test may run (default {DEFAULT_TIMEOUT_S:g})", "S"),
    (
        "rank_import_timeout",
        f"seconds a rank may take to import a test's module, apart from the test's own bound "
        f"(default {DEFAULT_IMPORT_TIMEOUT_S:g})",
        "S",
    ),
    (
        "rank_preload",
        "what the fork server imports once before starting ranks: auto (default: the "
        "installed and standard-library modules the collected tests import) or none",
        "MODE",
    ),
    ("rank_start_method", "how rank processes start: forkserver (default), spawn, fork", "M"),
    ("rank_backend", "process group backend for rank tests: gloo (default) or nccl", "B"),
    (
        "rank_threads",
        "torch intra-op threads per rank (default: usable cores // world size, at least 1; "
        "left alone when OMP_NUM_THREADS is set)",
        "N",
    ),
    (
        "rank_adopt",
        "run existing multi-rank suites on warm ranks: torch (MultiProcessTestCase and its "
        "family), deepspeed (DeepSpeed's DistributedTest), a project's own registered base, "
        "or several: torch,deepspeed",
        "KIND",
    ),
    (
        "rank_seed",
        "the session seed every rank's generators are seeded from, per test (default: "
        "pytest-randomly's seed when it runs, else one drawn and printed in the header)",
        "N",
    ),
    (
        "rank_secret_file",
        "under torchrun: a file only you can read (mode 0600) holding the secret that signs "
        "the harness's values in torchrun's store (or set HARNESS_SECRET)",
        "PATH",
    ),
]
PRELOAD_MODES = ("auto", "none")  # --rank-preload (see preload.py)


@dataclass(frozen=True)
class Settings:
    """The session's harness settings, each already checked."""

    ranks: int = DEFAULT_RANKS
    rank_timeout_s: float | None = None  # --rank-timeout or the ini key
    import_timeout_s: float = DEFAULT_IMPORT_TIMEOUT_S  # --rank-import-timeout or the ini key
    preload: str = "auto"  # --rank-preload: what the fork server imports (see preload.py)
    pytest_timeout_s: float | None = None  # pytest-timeout's --timeout, ini or env, when loaded
    start_method: StartMethod = "forkserver"
    backend: Backend = "gloo"
    rank_threads: int | None = None  # --rank-threads or the ini key
    fresh_group: bool = False  # --rank-fresh-group: no test runs on a group kept from another
    # Compare the ranks' collectives on the harness's group (off: --rank-no-collective-check).
    collective_check: bool = True
    adopt: frozenset[str] = frozenset()  # --rank-adopt: the bases whose tests run on warm ranks
    launched: Launch | None = None  # torchrun started this process as one rank of a job
    assert_verbosity: int = 0  # -v / verbosity_assertions: how much an assert diff shows
    log_capture: LogCapture | None = None  # how pytest captures log records; None: it does not
    show_locals: int | None = None  # --showlocals in rank tracebacks (see endings.LocalsShown)
    stray_warnings: frozenset[str] = frozenset({"thread", "unraisable"})  # see RankSpec
    runxfail: bool = False
    # Under torchrun: the secret the user gave (HARNESS_SECRET or --rank-secret-file) that
    # signs the harness's values in torchrun's store; None runs unsigned (and says so).
    secret: bytes | None = field(default=None, repr=False)
    # The seed the ranks' generators are seeded from, test by test (see plan/seeds.py).
    seed: seeds.SessionSeed = field(default_factory=lambda: seeds.SessionSeed(0, "drawn"))

    def threads_for(self, world_size: int) -> int | None:
        """Intra-op threads for each rank of a world: None leaves torch's own choice.

        Ranks share the machine's cores: with torch's default (every core per rank) a
        4-rank compute test on 2 cores runs 14-40x slower. OMP_NUM_THREADS wins, as in torch.
        """
        if self.rank_threads is not None:
            return self.rank_threads
        if os.environ.get("OMP_NUM_THREADS"):
            return None
        return max(1, usable_cores() // world_size)


def usable_cores() -> int:
    """The cores this process may run on (its affinity), not the machine's count."""
    if hasattr(os, "sched_getaffinity"):
        return len(os.sched_getaffinity(0))
    return os.cpu_count() or 1


_settings_key = pytest.StashKey[Settings]()


def configure(config: pytest.Config) -> Settings:
    """Resolve and keep the session's settings; a bad value is a pytest.UsageError."""
    try:
        launched = launch_detect.detect()
    except launch_detect.LaunchError as exc:
        raise pytest.UsageError(f"harness: {exc}") from None
    if launched is not None:
        launch_detect.export(launched)
    try:
        settings = Settings(
            ranks=_from_option(
                config,
                "ranks",
                launched.world_size if launched else DEFAULT_RANKS,
                world_size_value,
            ),
            rank_timeout_s=_from_option(config, "rank_timeout", None, _seconds),
            import_timeout_s=_from_option(
                config, "rank_import_timeout", DEFAULT_IMPORT_TIMEOUT_S, _seconds
            ),
            preload=_from_option(config, "rank_preload", "auto", _preload_mode),
            pytest_timeout_s=_pytest_timeout(config),
            start_method=_from_option(config, "rank_start_method", "forkserver", _start_method),
            backend=_from_option(config, "rank_backend", _default_backend(launched), backend_value),
            rank_threads=_from_option(config, "rank_threads", None, _threads),
            fresh_group=bool(config.getoption("rank_fresh_group", False))
            or bool(config.getini("rank_fresh_group")),
            collective_check=not config.getoption("rank_no_collective_check", False)
            and bool(config.getini("rank_collective_check")),
            adopt=_from_option(config, "rank_adopt", frozenset(), _adopters),
            launched=launched,
            assert_verbosity=_assert_verbosity(config),
            log_capture=_log_capture(config),
            show_locals=_show_locals(config),
            stray_warnings=_stray_warnings(config),
            runxfail=bool(config.getoption("runxfail", False)),
            secret=_secret(config) if launched is not None else None,
            seed=seeds.resolve(config, _from_option(config, "rank_seed", None, _seed)),
        )
    except SpecError as exc:
        raise pytest.UsageError(str(exc)) from None
    config.stash[_settings_key] = settings
    return settings


def _stray_warnings(config: pytest.Config) -> frozenset[str]:
    """The stray exceptions pytest turns into warnings in this session: those whose plugin
    (threadexception, unraisableexception) is loaded."""
    plugins = {"thread": "threadexception", "unraisable": "unraisableexception"}
    return frozenset(k for k, name in plugins.items() if config.pluginmanager.has_plugin(name))


def _show_locals(config: pytest.Config) -> int | None:
    """pytest's --showlocals for a rank's tracebacks: reprs cut as pytest cuts them (whole
    from -vv on), or None when off."""
    if not config.getoption("showlocals", False):
        return None
    get = getattr(config, "get_verbosity", None)
    verbosity = int(get()) if get is not None else int(config.getoption("verbose", 0) or 0)
    return 0 if verbosity > 1 else SHORT_LOCALS


def _log_capture(config: pytest.Config) -> LogCapture | None:
    """pytest's log capture settings, for ranks to capture as a plain test would; None when
    its logging plugin is off (-p no:logging)."""
    if not config.pluginmanager.has_plugin("logging"):
        return None
    return LogCapture(
        level=pytest_internals.log_level(config, "log_level"),
        fmt=pytest_internals.log_ini(config, "log_format"),
        datefmt=pytest_internals.log_ini(config, "log_date_format"),
        auto_indent=pytest_internals.log_ini(config, "log_auto_indent"),
    )


def _default_backend(launched: Launch | None) -> Backend:
    """gloo; under a launch, nccl where this rank has its GPU (the only place torch is
    imported at configure time)."""
    if launched is None:
        return "gloo"
    return cast(Backend, launch_detect.auto_backend(launched))


# A ranks test's RankSpec, or the error its markers gave, on its item (set at collection).


def settings_of(config: pytest.Config) -> Settings:
    """The session's settings (resolved on first use where configure has not run)."""
    found = config.stash.get(_settings_key, None)
    return found if found is not None else configure(config)


SECRET_VARIABLE = "HARNESS_SECRET"


def _secret(config: pytest.Config) -> bytes | None:
    """The launch's secret: HARNESS_SECRET, else the file --rank-secret-file names (which no
    one else may read: a secret in a world-readable file is none)."""
    given = os.environ.pop(SECRET_VARIABLE, None)  # read once: no test or child sees it
    if given:
        return _long_enough(given.encode(), SECRET_VARIABLE)
    path = _from_option(config, "rank_secret_file", None, lambda value, _: str(value))
    if path is None:
        return None
    try:
        with open(path, "rb") as f:
            mode = os.fstat(f.fileno()).st_mode  # the file read, not one swapped in after
            secret = f.read().strip()
    except OSError as exc:
        raise SpecError(f"harness: --rank-secret-file {path}: {exc}") from None
    if mode & 0o077:
        raise SpecError(
            f"harness: --rank-secret-file {path} can be read by others (mode "
            f"{mode & 0o777:o}); make it yours alone: chmod 600 {path}"
        )
    return _long_enough(secret, f"--rank-secret-file {path}")


_SECRET_MIN_BYTES = 16


def _long_enough(secret: bytes, where: str) -> bytes:
    if len(secret) < _SECRET_MIN_BYTES:
        raise SpecError(
            f"harness: the secret in {where} has {len(secret)} bytes; give at least "
            f"{_SECRET_MIN_BYTES} (python -c 'import secrets; print(secrets.token_hex(32))')"
        )
    return secret


def _from_option(config: pytest.Config, name: str, default: Any, check: Any) -> Any:
    """An option's checked value: the command line first, then the ini file, else `default`."""
    value = config.getoption(name, None)
    if value is not None:
        return check(value, f"--{name.replace('_', '-')}")
    value = config.getini(name)
    if value not in (None, ""):
        return check(value, f"ini option {name!r}")
    return default


def _assert_verbosity(config: pytest.Config) -> int:
    """pytest's verbosity for assertion diffs (verbosity_assertions, else -v's count)."""
    get = getattr(config, "get_verbosity", None)
    if get is not None:
        return int(get("assertions"))
    return int(config.getoption("verbose", 0) or 0)


def _pytest_timeout(config: pytest.Config) -> float | None:
    """pytest-timeout's session timeout (its private attribute: the one place it is read)."""
    value = getattr(config, "_env_timeout", None)
    return float(value) if value else None


# ---- checked values ---------------------------------------------------------------------


def world_size_value(value: Any, origin: str) -> int:
    try:
        number = int(value)
    except (TypeError, ValueError):
        number = 0
    if number < 1 or isinstance(value, bool) or str(number) != str(value).strip():
        raise SpecError(invalid("world size", value, origin, "use an int >= 1"))
    return number


def _seed(value: Any, origin: str) -> int:
    try:
        seed = int(value)
    except (TypeError, ValueError):
        seed = -1
    if seed < 0 or isinstance(value, bool | float):
        raise SpecError(invalid("seed", value, origin, "use an int >= 0"))
    return seed


def use_seed(config: pytest.Config, seed: seeds.SessionSeed) -> None:
    """Seed the ranks from `seed` from now on (under torchrun: rank 0's, agreed at the
    session's start, before any test is collected)."""
    config.stash[_settings_key] = replace(settings_of(config), seed=seed)


def _threads(value: Any, origin: str) -> int:
    try:
        return world_size_value(value, origin)
    except SpecError:
        raise SpecError(invalid("thread count", value, origin, "use an int >= 1")) from None


def _seconds(value: Any, origin: str) -> float:
    try:
        seconds = float(value)
    except (TypeError, ValueError):
        seconds = 0.0
    if not seconds > 0 or isinstance(value, bool):
        raise SpecError(invalid("timeout", value, origin, "use seconds > 0"))
    return seconds


def backend_value(value: Any, origin: str) -> Backend:
    if value not in BACKENDS:
        raise SpecError(invalid("backend", value, origin, f"choose one of {', '.join(BACKENDS)}"))
    return cast(Backend, value)


def _start_method(value: Any, origin: str) -> StartMethod:
    if value not in START_METHODS:
        fix = f"choose one of {', '.join(START_METHODS)}"
        raise SpecError(invalid("start method", value, origin, fix))
    return cast(StartMethod, value)


def _preload_mode(value: Any, origin: str) -> str:
    if value not in PRELOAD_MODES:
        raise SpecError(invalid("rank_preload", value, origin, "use auto or none"))
    return str(value)


def _adopters(value: Any, origin: str) -> frozenset[str]:
    """The adopters' names; checked against those registered (adopt.register_adopters)."""
    return frozenset(part.strip() for part in str(value).split(",") if part.strip())


def launch_value(value: Any, origin: str) -> bool:
    if not isinstance(value, bool):
        raise SpecError(invalid("launch", value, origin, "use True or False"))
    return value


def flag_value(name: str, mark: pytest.Mark, origin: str) -> bool:
    value = mark.kwargs.get(name, False)
    if not isinstance(value, bool):
        raise SpecError(invalid(name, value, origin, "use True or False"))
    return value


# ---- the one timeout precedence -----------------------------------------------------------


def timeout_for(
    settings: Settings,
    own: Any,
    own_origin: str,
    node: pytest.Item | None = None,
    default: float = DEFAULT_TIMEOUT_S,
) -> float:
    """A run's bound, the same for markers and run_on_ranks.

    First the run's own value (the ranks marker's ``timeout=``, or ``run_on_ranks(timeout=)``),
    then pytest-timeout's marker on the test, ``--rank-timeout`` (or its ini key),
    pytest-timeout's session timeout, and last `default` (60 s; an adopted suite's own).
    """
    if own is not None:
        return _seconds(own, own_origin)
    mark = node.get_closest_marker("timeout") if node is not None else None
    value = None if mark is None else mark.kwargs.get("timeout", (mark.args or [None])[0])
    if value is not None and _turns_pytest_timeout_off(value):
        # timeout(0): no pytest-timeout bound for this test, as pytest-timeout reads it; the
        # harness's own bound still holds.
        return default if settings.rank_timeout_s is None else settings.rank_timeout_s
    if value is not None:
        return _seconds(value, f"the timeout marker on {node.nodeid}")  # type: ignore[union-attr]
    if settings.rank_timeout_s is not None:
        return settings.rank_timeout_s
    if settings.pytest_timeout_s is not None:
        return settings.pytest_timeout_s
    return default


def session_timeout(
    settings: Settings, node: pytest.Item | None = None, default: float = DEFAULT_TIMEOUT_S
) -> float:
    """The bound of a run that names none of its own (an adopted test, the session's waits
    on launched peers): `node`'s timeout marker, then the session's options, then `default`
    (see timeout_for)."""
    return timeout_for(settings, None, "", node, default)


def _turns_pytest_timeout_off(value: Any) -> bool:
    """Whether a timeout marker's value means no timeout to pytest-timeout (0 or less)."""
    try:
        return not isinstance(value, bool) and float(value) <= 0
    except (TypeError, ValueError):
        return False
