"""Warm ranks, seen from the pytest process: the processes (start, keep, kill, replace),
the loop that waits on one run, their live output, the fork server they are forks of and
what it preloads, and the session's helpers around them.

Runs in the pytest process only; imports no torch until a test first needs ranks. This
package's ``__init__`` imports nothing.
"""
