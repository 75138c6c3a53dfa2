"""Bad arguments and BaseExceptions on one rank, outside the harness: where no harness frees
a peer, every rank must still raise at once instead of waiting for the group's timeout."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.lib import plain_ranks


@pytest.mark.slow
@pytest.mark.parametrize("scenario", sorted(plain_ranks.SCENARIOS))
def test_no_rank_waits_when_one_rank_cannot_take_part(scenario: str, tmp_path: Path) -> None:
    ended = plain_ranks.run(scenario, 3, tmp_path)
    assert [e["ending"] for e in ended] == ["raised"] * 3, ended
    assert ended[0]["type"] == ended[2]["type"] == "RuntimeError", ended
