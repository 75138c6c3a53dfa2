"""pytest under torchrun: every launched pytest process is one rank of the tests' world.

Nothing outside this package imports it but ``plugin.py``, which registers its hooks as one
plugin object only when the session is a launch (``harness/__init__.py`` also lists
``reports``, whose early ``pytest_configure`` turns report files off on ranks other than 0).
A warm-rank session never enters it. This package's ``__init__`` imports nothing.
"""
