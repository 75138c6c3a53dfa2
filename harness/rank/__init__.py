"""What runs only inside a rank process: the worker and what it uses around a test's body.

Nothing here imports the pytest side (plugin, runner, settings, pool, spawning, adopt, ranks,
made_in_ranks, launched): a rank runs a test, the pytest process judges it. The modules here
import torch; this package's ``__init__`` imports nothing.
"""
