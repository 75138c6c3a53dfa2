"""A rank test's fixtures that each rank makes itself, chosen and described in the pytest process.

A fixture that uses one only a rank has (its `rank` or `device`, or what captures inside it:
`capsys`, `capfd`, `caplog`, `recwarn`), directly or through another fixture, means
something else in each rank: run in the pytest process it would see placeholders, and
`if rank == 1:` would quietly be false. The pytest process therefore skips it and sends a
recipe (where its function is, what it is called with); the rank calls it before the test
and tears it down after. A fixture using only `monkeypatch` or `tmp_path` still runs here,
as before: the environment it sets travels to the ranks and reaches the fixtures made here;
one that must patch inside the ranks asks for `rank` too. Imports no torch.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from typing import Any

import pytest

from harness.common.protocol import RANK_SIDE_FIXTURES, FixturePlan, FixtureRecipe

# Fixtures that are per rank themselves and mean nothing here: one that uses any of them is
# made in each rank. (monkeypatch, tmp_path and tmpdir are made per rank too, but a fixture
# of the pytest process may use them as ever.)
PER_RANK = frozenset(RANK_SIDE_FIXTURES) - {"request", "monkeypatch", "tmp_path", "tmpdir"}

_made_key = pytest.StashKey[frozenset[int]]()  # ids of the FixtureDefs the ranks make

# (name, depth): a fixture's definition; depth 1 is the one an override of it requests.
_Def = tuple[str, int]


class MadeInRanks:
    """What a fixture each rank makes is in the pytest process: a placeholder."""

    def __init__(self, name: str) -> None:
        self.name = name

    def __repr__(self) -> str:
        return f"<{self.name}: made in each rank>"


def note_test(item: pytest.Item) -> None:
    """Note which of `item`'s fixtures the ranks make, for skip_in_pytest to find."""
    made = _made_in_ranks(item) if isinstance(item, pytest.Function) else {}
    if made:
        item.stash[_made_key] = frozenset(id(fixturedef) for fixturedef, _ in made.values())


def made_for(item: pytest.Function) -> frozenset[str]:
    """The names of the fixtures the ranks make for `item` (anew for every run)."""
    return frozenset(key.partition("#")[0] for key in _made_in_ranks(item))


def skip_in_pytest(fixturedef: Any, request: Any) -> MadeInRanks | None:
    """A placeholder, cached as pytest caches a value, for a fixture the ranks make; None
    for any other (pytest then runs it as usual)."""
    item = getattr(request, "_pyfuncitem", None)
    made = item.stash.get(_made_key, None) if item is not None else None
    if made is None or id(fixturedef) not in made:
        return None
    value = MadeInRanks(fixturedef.argname)
    fixturedef.cached_result = (value, fixturedef.cache_key(request), None)
    return value


def plan(item: pytest.Function, sent_value: Callable[[str, int], Any]) -> FixturePlan | None:
    """The recipes of the fixtures `item`'s ranks make, in the order pytest would make them
    (each after those it uses), and the values they use beyond the test's own arguments.
    `sent_value(name, depth)` is what the pytest process sends for a fixture it made."""
    made = _made_in_ranks(item)
    if not made:
        return None
    recipes: dict[str, FixtureRecipe] = {}
    values: dict[str, Any] = {}

    def visit(name: str, depth: int) -> str:
        key = _key(name, depth)
        if key in recipes or key in values:
            return key
        if key not in made:
            if name not in item._fixtureinfo.argnames or depth:
                values[key] = sent_value(name, depth)
            return key
        fixturedef, uses = made[key]
        args = tuple((arg, visit(arg, _depth(arg, name, depth))) for arg in fixturedef.argnames)
        recipes[key] = _recipe(item, key, fixturedef, uses, args)
        return key

    for name in item.fixturenames:  # pytest's order: autouse ones first
        if name in made:
            visit(name, 0)
    return FixturePlan(tuple(recipes.values()), values)


def _key(name: str, depth: int) -> str:
    return name if depth == 0 else f"{name}#{depth}"


def _recipe(
    item: pytest.Function,
    key: str,
    fixturedef: Any,
    uses: str,
    args: tuple[tuple[str, str], ...],
) -> FixtureRecipe:
    func = fixturedef.func
    module = getattr(func, "__module__", None)
    qualname = getattr(func, "__qualname__", "")
    code = getattr(inspect.unwrap(func), "__code__", None)
    file = code.co_filename if code is not None else None  # conftests may share a name
    name = fixturedef.argname
    if not module or not qualname or "<" in qualname:
        pytest.fail(
            f"fixture {name!r} uses {uses!r}, so each rank makes it, but a rank cannot find its "
            f"function ({qualname or repr(func)}): define it at the top level of a module (or a "
            f"conftest), or in the test's class",
            pytrace=False,
        )
    callspec = getattr(item, "callspec", None)
    params = callspec.params if callspec is not None else {}  # an override sees it too
    return FixtureRecipe(key, module, qualname, args, name in params, params.get(name), file)


_cache: dict[int, tuple[object, dict[str, tuple[Any, str]]]] = {}


def _made_in_ranks(item: pytest.Function) -> dict[str, tuple[Any, str]]:
    """The fixture definitions the ranks make for `item`, by key, each with the per-rank
    fixture it uses (for messages). Parametrized copies of a test share the answer."""
    info = item._fixtureinfo
    cached = _cache.get(id(info))
    if cached is not None and cached[0] is info:
        return cached[1]
    defs = info.name2fixturedefs
    found: dict[str, tuple[Any, str]] = {}
    seen: dict[_Def, str | None] = {}

    def uses(name: str, depth: int) -> str | None:
        """The per-rank fixture this definition uses, if any (itself, for one of them)."""
        if (name, depth) in seen:
            return seen[(name, depth)]
        seen[(name, depth)] = None  # pytest refuses cycles; this only stops a walk over one
        chain = defs.get(name, ())
        per_rank = name in PER_RANK and (depth >= len(chain) or is_builtin(chain[-1 - depth]))
        if per_rank or depth >= len(chain):
            answer = name if per_rank else None
        else:
            fixturedef = chain[-1 - depth]
            answer = next(
                (u for arg in fixturedef.argnames if (u := uses(arg, _depth(arg, name, depth)))),
                None,
            )
            if answer is not None:
                found[_key(name, depth)] = (fixturedef, answer)
        seen[(name, depth)] = answer
        return answer

    for name in info.names_closure:
        uses(name, 0)
    if len(_cache) > 10_000:  # a session of many test functions: start over
        _cache.clear()
    _cache[id(info)] = (info, found)
    return found


def is_builtin(fixturedef: Any) -> bool:
    """Whether a fixture definition is the harness's or pytest's own (not a project's own
    fixture of the same name, such as a `device` fixture parametrized over devices)."""
    if fixturedef is None:  # no definition to tell by: the name's own meaning
        return True
    module = getattr(fixturedef.func, "__module__", "") or ""
    return module.startswith(("harness.", "_pytest."))


def _depth(arg: str, name: str, depth: int) -> int:
    """The depth of the definition `arg` names, from a definition of `name` at `depth`."""
    return depth + 1 if arg == name else 0
