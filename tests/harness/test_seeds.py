"""The ranks' generators are seeded from one session seed by one rule (harness/plan/seeds.py):
session seed + crc32(node id) + rank, before each test. A failure that depends on random
values comes back: pytest-randomly's seed reaches the ranks, or --rank-seed, or the drawn
seed the header and the failure report print."""

from __future__ import annotations

import re
import zlib

import pytest


def _drawn(text: str, tag: str) -> dict[int, tuple[str, str]]:
    found = re.findall(rf"{tag} (\d) (\S+) (\S+)", text)
    return {int(rank): (py, pt) for rank, py, pt in found}


@pytest.fixture
def seeded(inner: pytest.Pytester) -> pytest.Pytester:
    inner.makepyfile(
        test_seeded="""
        import random, zlib
        import pytest, torch

        def seed_of(nodeid, rank, session_seed):
            return session_seed + zlib.crc32(nodeid.encode()) + rank

        @pytest.mark.ranks(2)
        def test_each_rank_its_own(rank):
            print("OWN", rank, random.random(), torch.rand(1).item())

        @pytest.mark.ranks(2, same_seed=True)
        def test_alike(rank):
            print("ALIKE", rank, random.random(), torch.rand(1).item())

        @pytest.mark.ranks(2)
        def test_rule(rank, request):
            session_seed = int(request.config.getoption("rank_seed") or -1)
            seed = seed_of(request.node.nodeid, rank, session_seed)
            expected = random.Random(seed).random()
            assert random.random() == expected, "seeded by seeds.py's rule"
            alone = torch.Generator().manual_seed(seed)
            assert torch.rand(1).item() == torch.rand(1, generator=alone).item()
        """
    )
    return inner


def test_a_given_seed_gives_the_same_numbers_every_session_and_each_rank_its_own(
    seeded: pytest.Pytester,
) -> None:
    first = seeded.runpytest("-p", "harness", "-s", "--rank-seed", "123")
    first.assert_outcomes(passed=3)
    again = seeded.runpytest("-p", "harness", "-s", "--rank-seed", "123")
    other = seeded.runpytest("-p", "harness", "-s", "--rank-seed", "124", "-k", "own")
    own, alike = _drawn(first.stdout.str(), "OWN"), _drawn(first.stdout.str(), "ALIKE")
    assert own == _drawn(again.stdout.str(), "OWN") and len(own) == 2
    assert own[0] != own[1]  # rank-distinct by default
    assert alike[0] == alike[1]  # same_seed=True
    assert _drawn(other.stdout.str(), "OWN") != own
    first.stdout.fnmatch_lines(["harness: ranks seeded from 123 (--rank-seed)*"])


@pytest.mark.plugins  # pytest-randomly is in the plugins lane's venv
def test_pytest_randomlys_seed_seeds_the_ranks(seeded: pytest.Pytester) -> None:
    """With pytest-randomly a plain test drew the same numbers every run and the ranks
    different ones every run: its seed is now the session seed."""
    randomly = seeded.runpytest(
        "-p", "harness", "-p", "randomly", "--randomly-seed=123", "-s", "-k", "not rule"
    )
    randomly.assert_outcomes(passed=2)
    given = seeded.runpytest("-p", "harness", "-s", "--rank-seed", "123")
    assert _drawn(randomly.stdout.str(), "OWN") == _drawn(given.stdout.str(), "OWN")
    randomly.stdout.fnmatch_lines(
        ["harness: ranks seeded from 123 (pytest-randomly)*-p randomly --randomly-seed=123*"]
    )


@pytest.mark.plugins
def test_rank_0_draws_what_a_plain_test_draws_under_pytest_randomly(
    inner: pytest.Pytester,
) -> None:
    inner.makepyfile(
        """
        import random, zlib
        import pytest

        @pytest.mark.ranks(2)
        def test_ranks(rank, request):
            if rank == 0:
                seed = 123 + zlib.crc32(request.node.nodeid.encode())
                assert random.random() == random.Random(seed).random()

        def test_plain(request):
            seed = 123 + zlib.crc32(request.node.nodeid.encode())
            assert random.random() == random.Random(seed).random()  # pytest-randomly's rule
        """
    )
    result = inner.runpytest("-p", "harness", "-p", "randomly", "--randomly-seed=123")
    result.assert_outcomes(passed=2)


def test_a_drawn_seed_is_in_the_header_and_the_failure_and_repeats_the_run(
    inner: pytest.Pytester,
) -> None:
    inner.makepyfile(
        """
        import random
        import pytest

        @pytest.mark.ranks(2)
        def test_depends_on_chance(rank):
            value = random.random()
            print("VALUE", rank, value)
            assert value < 0
        """
    )
    result = inner.runpytest("-p", "harness", "-rA")
    result.assert_outcomes(failed=1)
    text = result.stdout.str()
    header = re.search(r"harness: ranks seeded from (\d+) \(drawn\)", text)
    assert header is not None, text
    seed = header[1]
    assert f"ranks seeded from {seed} (drawn; --rank-seed {seed} repeats it)" in text
    again = inner.runpytest("-p", "harness", "-rA", "--rank-seed", seed)
    assert re.findall(r"VALUE \d \S+", again.stdout.str()) == re.findall(r"VALUE \d \S+", text)


def test_a_bad_seed_is_a_usage_error(inner: pytest.Pytester) -> None:
    inner.makepyfile("def test_x():\n    pass\n")
    result = inner.runpytest("-p", "harness", "--rank-seed", "soon")
    assert result.ret == pytest.ExitCode.USAGE_ERROR
    result.stderr.fnmatch_lines(["*invalid seed 'soon' from --rank-seed: use an int >= 0*"])


def test_the_rule_is_what_the_docs_say() -> None:
    from harness.plan import seeds

    session = seeds.SessionSeed(123, "--rank-seed")
    assert seeds.for_test(session, "t.py::test_x") == 123 + zlib.crc32(b"t.py::test_x")
