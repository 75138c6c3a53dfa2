"""Existing suites on warm ranks: a test base's own spawning replaced, its tests kept.

``core.py`` holds the :class:`Adopter` base, the registry (``--rank-adopt``'s names), the hooks
that hand each test to the adopters asked for, and the steps every adopter shares
(``Adopter.run``). Each built-in base has a package with its adopter and the half that runs in
the ranks: ``torch/`` (``MultiProcessTestCase``, ``MultiProcContinuousTest``) and ``deepspeed/``
(``DistributedTest``, with its shared-memory cleanup and JIT-build lock). ``spawn.py`` and
``pool.py`` are the drop-ins for ``torch.multiprocessing.spawn`` and a hand-written pool;
``ranks.py`` is the rank-side entry every one of them shares.

Nothing here is imported by the warm layer: what an adopter gives it (libraries to preload,
cleanups) goes through ``plan/adopter_needs.py``. Imports no torch.
"""
