"""Where this launched rank is in the session: the collected tests, the current one, and the
runs and groups it has started in it. Every rank walks the same order, so a place names the
same thing on every rank; the store keys of a test's runs are made from it."""

from __future__ import annotations


class Position:
    """This rank's place: `stage` is 2 * index in a test and 2 * index + 1 finishing it."""

    def __init__(self) -> None:
        self.collected: list[str] = []  # every rank's, once agreed (see agreements.py)
        self.done: set[str] = set()
        self.current = ""  # the node id of the test running now
        self.index = -1  # its place in the collected order
        self.stage = -1
        self._calls = 0  # run_on_ranks calls so far in the current test
        self._own_groups = 0  # groups the current test set up from the environment so far

    def collect(self, nodeids: list[str]) -> None:
        self.collected = list(nodeids)

    def begin(self, nodeid: str) -> int:
        """A test starts (whether it will run, skip or fail); its stage."""
        self.current = nodeid
        self.done.add(nodeid)
        self.index = self.collected.index(nodeid) if nodeid in self.collected else self.index
        self._calls = 0
        self._own_groups = 0
        return 2 * self.index

    def reach(self, stage: int) -> None:
        """This rank is at `stage` now (said to the others by the session)."""
        self.stage = stage

    def finishing(self) -> int:
        """The stage past the current test's body and calls: only its verdict is left."""
        return 2 * self.index + 1

    def past_every_test(self) -> int:
        """The stage past every test (a rank whose session ended early is there)."""
        return 2 * max(len(self.collected), self.index + 1)

    def at_the_end(self) -> None:
        """The session's end: past every test, so the end's keys are kept (see Keys)."""
        self.index = len(self.collected)

    def test_key(self) -> str:
        return f"t{self.index}"

    def call_key(self) -> str:
        """The store keys' prefix of the next run_on_ranks call in the current test."""
        self._calls += 1
        return f"t{self.index}/c{self._calls}"

    def own_group_key(self) -> str:
        """The key of the next group the current test sets up from the launch's environment."""
        self._own_groups += 1
        return f"own_groups/t{self.index}/{self._own_groups}"

    def name_of(self, stage: int) -> str:
        """What a rank at `stage` is doing, in words."""
        index, finishing = divmod(stage, 2)
        if not 0 <= index < len(self.collected):
            return "the end of the session" if index >= 0 else "no test yet"
        return f"the end of {self.collected[index]}" if finishing else self.collected[index]

    def not_run(self) -> list[str]:
        return [nodeid for nodeid in self.collected if nodeid not in self.done]
