"""What the session and each test ask of the ranks, read by the pytest side, the warm ranks
and a launch alike: the settings, a test's spec and seed, how a test is packed for the ranks,
and the pytest features that travel with it (fixtures made in ranks, hypothesis's examples,
coverage, pytest-timeout's bound), and what the adopters asked for give the warm layer.

Below ``warm/`` and ``launched/``: imports only ``plan/`` and ``common/``, and no torch.
"""
