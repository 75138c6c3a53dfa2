# DeepSpeed's tests/conftest.py hooks (commit edaa722), as the protocol needs them.
import os
import sys

import pytest

# DeepSpeed's conftest puts its checkout first on sys.path: the tests import deepspeed from it.
sys.path.insert(1, os.environ["DEEPSPEED_LIKE_CHECKOUT"])


@pytest.hookimpl(tryfirst=True)
def pytest_runtest_call(item):
    # A DistributedTest launches itself; pytest's own call of the test is then a no-op.
    if getattr(item.cls, "is_dist_test", False):
        item.cls()(item._request)
        item.runtest = lambda: True


def pytest_runtest_teardown(item, nextitem):
    # The last test of the session closes the pools reuse_dist_env classes kept.
    if getattr(item.cls, "reuse_dist_env", False) and not nextitem:
        test = item.cls()
        for num_procs, pool in test._pool_cache.items():
            test._close_pool(pool, num_procs, force=True)


@pytest.hookimpl(tryfirst=True)
def pytest_fixture_setup(fixturedef, request):
    if getattr(fixturedef.func, "is_dist_fixture", False):
        fixturedef.func()(request)


def pytest_configure(config):
    # DeepSpeed registers its marker in tests/pytest.ini.
    config.addinivalue_line(
        "markers", "world_size: Change world size of individual tests in a class"
    )
