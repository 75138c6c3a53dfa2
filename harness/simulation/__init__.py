"""Worlds simulated in one process, behind the fixtures of ``harness.simulation.fixtures``.

- ``fake_world``: FakeWorld (one rank of a world of any size, its mesh and nodes) and the
  record of the collectives it would run (``collective_log``).
- ``threaded_world``: threads as ranks over a process group of our own (``thread_group``),
  with each thread-rank's ending and the origin of a failure.

torch is imported only when a world is made.
"""
