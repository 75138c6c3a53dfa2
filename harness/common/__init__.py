"""What both kinds of process use: the pytest process and the ranks it runs tests on.

The contract between them (protocol), how a rank ended and the report of it (outcome,
endings), faults, expected outcomes, hygiene, warnings, and the small helpers both sides
need (environment, reaper, signing, loopback, torchrun's variables). Nothing here imports
the pytest side or the rank side (``harness/rank``), nor torch at import time; this
package's ``__init__`` imports nothing.
"""
