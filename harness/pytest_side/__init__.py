"""What only the pytest process does with a ranks test: run it through the session's ranks
(``seam.Ranks``) and the one sequence after a body (``runner``), judge it (``verdict``),
``run_on_ranks``, junit labels, and the versions check. Never imported by ``warm/``,
``launched/``, ``plan/`` or a rank.
"""
