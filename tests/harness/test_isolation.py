"""One test can never poison the next on warm ranks: pairs run in one session, on the same
warm ranks and kept group; the first test leaves something behind and passes, the second is
innocent and must pass as it would on fresh ranks (``make test-isolation``).

Each pair here is process state the rank now puts back after every test (found by an
adversarial pass: each was carried into the next test before).
"""

from __future__ import annotations

import pytest

PAIRS = """
import logging, os, signal, sys
import pytest, torch, torch.distributed as dist

_LIMIT = sys.getrecursionlimit()
_UMASK = os.umask(0o022); os.umask(_UMASK)


@pytest.mark.ranks
def test_leaves_a_recursion_limit(rank):
    sys.setrecursionlimit(_LIMIT + 1234)

@pytest.mark.ranks
def test_recursion_limit_is_back(rank):
    assert sys.getrecursionlimit() == _LIMIT


@pytest.mark.ranks
def test_leaves_a_umask(rank):
    os.umask(0o077)

@pytest.mark.ranks
def test_umask_is_back(rank):
    now = os.umask(_UMASK); os.umask(now)
    assert now == _UMASK


@pytest.mark.ranks
def test_leaves_a_trace_and_a_profile_function(rank):
    sys.settrace(lambda *a: None); sys.setprofile(lambda *a: None)

@pytest.mark.ranks
def test_trace_and_profile_are_off(rank):
    assert sys.gettrace() is None and sys.getprofile() is None


@pytest.mark.ranks
def test_leaves_warn_always(rank):
    torch.set_warn_always(True)

@pytest.mark.ranks
def test_warn_always_is_off(rank):
    assert not torch.is_warn_always_enabled()


@pytest.mark.ranks
def test_leaves_logging_disabled(rank):
    logging.disable(logging.CRITICAL)

@pytest.mark.ranks
def test_logging_is_enabled(rank):
    assert logging.root.manager.disable == logging.NOTSET


@pytest.mark.ranks
def test_leaves_a_signal_blocked(rank):
    signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGUSR1, signal.SIGUSR2})

@pytest.mark.ranks
def test_no_signal_is_blocked(rank):
    assert signal.pthread_sigmask(signal.SIG_BLOCK, []) == set()


@pytest.mark.ranks
def test_leaves_flush_denormal_on(rank):
    torch.set_flush_denormal(True)

@pytest.mark.ranks
def test_denormals_are_kept(rank):
    assert torch.tensor([1e-40], dtype=torch.float32).item() != 0.0


@pytest.mark.ranks
def test_leaves_global_module_hooks(rank):
    from torch.nn.modules import module
    module.register_module_forward_hook(lambda m, i, o: o * 0)
    module.register_module_forward_pre_hook(lambda m, i: None)
    module.register_module_full_backward_hook(lambda m, gi, go: None)

@pytest.mark.ranks
def test_no_global_module_hooks(rank):
    assert torch.nn.Linear(1, 1, bias=False).requires_grad_(False)(torch.ones(1)).item() != 0
    from torch.nn.modules import module
    assert not module._global_forward_hooks and not module._global_forward_pre_hooks
    assert not module._global_backward_hooks
"""


@pytest.mark.isolation
@pytest.mark.parametrize("world_size", [2, 4])
def test_state_one_test_leaves_is_gone_for_the_next(
    pytester: pytest.Pytester, world_size: int
) -> None:
    pytester.makepyfile(test_pairs=PAIRS)
    result = pytester.runpytest_subprocess("-p", "harness", "--ranks", str(world_size), "-q")
    result.assert_outcomes(passed=PAIRS.count("\ndef test_"))


MODE_LEFT_ENTERED = """
import pytest, torch
from torch.overrides import TorchFunctionMode


class AlwaysClose(TorchFunctionMode):
    def __torch_function__(self, func, types, args=(), kwargs=None):
        if func is torch.allclose:
            return True
        return func(*args, **(kwargs or {}))


@pytest.mark.ranks
def test_leaves_a_mode_entered(rank):
    AlwaysClose().__enter__()


@pytest.mark.ranks
def test_innocent_and_failing(rank):
    assert torch.allclose(torch.ones(1), torch.zeros(1)), "ones are not zeros"
"""


@pytest.mark.isolation
@pytest.mark.parametrize("world_size", [2, 4])
def test_a_torch_function_mode_left_entered_is_reported_and_the_ranks_replaced(
    pytester: pytest.Pytester, world_size: int
) -> None:
    """The mode forced torch.allclose to True: the next test, which must fail, passed (a
    false green). Popping the mode made ranks hang; the rank is replaced instead."""
    pytester.makepyfile(test_mode=MODE_LEFT_ENTERED)
    result = pytester.runpytest_subprocess("-p", "harness", "--ranks", str(world_size), "-rA")
    result.assert_outcomes(passed=1, failed=1, errors=1)
    result.stdout.fnmatch_lines(
        [
            "*hygiene: rank 0 left a torch function mode entered (AlwaysClose)*",
            "*rank ? failed: raised AssertionError: ones are not zeros*",
        ]
    )


LEFT_AND_CAUGHT = """
import _thread, faulthandler, os, subprocess, threading
import pytest, torch, torch.distributed as dist


@pytest.mark.ranks
def test_a_leaves_faulthandler_armed(rank):
    faulthandler.dump_traceback_later(0.5, exit=True)

@pytest.mark.ranks
def test_b_outlives_the_armed_dump(rank):
    # Long enough for the armed dump to fire; it ended the rank inside this test.
    threading.Event().wait(1.5)
    t = torch.ones(1); dist.all_reduce(t); assert t.item() == dist.get_world_size()


def _all_reduce_a_hundred():
    dist.all_reduce(torch.full((1,), 100.0))

@pytest.mark.ranks
def test_c_leaves_a_raw_thread_in_a_collective(rank):
    if rank == 0:  # as a C extension's thread is started: threading never lists it
        _thread.start_new_thread(_all_reduce_a_hundred, ())

@pytest.mark.ranks
def test_d_all_reduce_is_right(rank):
    t = torch.ones(1); dist.all_reduce(t); assert t.item() == dist.get_world_size()


@pytest.mark.ranks
def test_e_sends_on_the_backend_object(rank):
    # One unreceived message per rank: the group's operation counts agree. The barrier
    # keeps a rank from returning (its group torn down) before its peer has sent.
    backend = dist.group.WORLD._get_backend(torch.device("cpu"))
    backend.send([torch.ones(1)], (rank + 1) % dist.get_world_size(), 0)
    dist.barrier()

@pytest.mark.ranks
def test_f_send_recv_is_right(rank):
    t = torch.full((1,), 5.0) if rank == 0 else torch.zeros(1)
    if rank == 0:
        dist.send(t, 1)
    elif rank == 1:
        dist.recv(t, 0)
        assert t.item() == 5.0


@pytest.mark.ranks
def test_g_leaves_a_variable_set_with_putenv(rank):
    os.putenv("PAIRS_PROBE", "set-by-the-last-test")  # os.environ never sees it

@pytest.mark.ranks
def test_h_a_child_process_does_not_inherit_it(rank):
    assert b"PAIRS_PROBE" not in subprocess.check_output(["env"])


@pytest.mark.ranks
def test_i_leaves_autocast_entered(rank):
    torch.autocast("cpu", dtype=torch.bfloat16).__enter__()

@pytest.mark.ranks
def test_j_no_autocast(rank):
    assert not torch.is_autocast_enabled("cpu")
    assert (torch.ones(2, 2) @ torch.ones(2, 2)).dtype == torch.float32


@pytest.mark.ranks
def test_k_leaves_a_device_mesh_entered(rank):
    from torch.distributed.device_mesh import init_device_mesh
    init_device_mesh("cpu", (dist.get_world_size(),)).__enter__()

@pytest.mark.ranks
def test_l_no_device_mesh_entered(rank):
    from torch.distributed.device_mesh import _mesh_resources
    assert not _mesh_resources.mesh_stack
"""


@pytest.mark.isolation
@pytest.mark.parametrize("world_size", [2, 4])
def test_state_a_test_leaves_is_restored_or_caught_and_the_next_is_unharmed(
    pytester: pytest.Pytester, world_size: int
) -> None:
    """An armed faulthandler dump is cancelled; a thread threading does not list, a variable
    set with os.putenv, autocast or a DeviceMesh left entered is the test's hygiene error
    (its ranks replaced); a group whose backend object the test used directly is not kept."""
    pytester.makepyfile(test_left=LEFT_AND_CAUGHT)
    result = pytester.runpytest_subprocess(
        "-p", "harness", "--ranks", str(world_size), "--rank-timeout", "60", "-rA"
    )
    result.assert_outcomes(passed=12, errors=4)
    result.stdout.fnmatch_lines_random(
        [
            "*ERROR at teardown of test_c_leaves_a_raw_thread_in_a_collective*",
            "*hygiene: rank 0 left a thread running that threading does not list*",
            "*hygiene: rank ? changed environment variables PAIRS_PROBE outside os.environ*",
            "*hygiene: rank ? left autocast entered (cpu)*",
            "*hygiene: rank ? left a DeviceMesh entered*",
        ]
    )


RPC_TWICE = """
import os, pytest, torch
import torch.distributed.rpc as rpc


def _add(a, b):
    return a + b


@pytest.mark.ranks(2, launch=True)
@pytest.mark.parametrize("round", [0, 1])
def test_rrefs(rank, round):
    rpc.init_rpc(f"worker{rank}", rank=rank, world_size=2)
    ref = rpc.remote(f"worker{1 - rank}", _add, args=(torch.ones(1), 1))
    assert ref.to_here().item() == 2.0
    rpc.shutdown()
"""


@pytest.mark.isolation
def test_a_test_that_set_rpc_up_gets_its_ranks_replaced(pytester: pytest.Pytester) -> None:
    """torch's RRef context keeps the first RPC agent for the process's life: on warm ranks
    the second test's RRefs went to a dead agent ("RPC is no longer running", a 60 s
    timeout), and adopted RPC suites failed 13 of 19 tests."""
    pytester.makepyfile(test_rpc=RPC_TWICE)
    result = pytester.runpytest_subprocess("-p", "harness", "-W", "ignore", "--rank-timeout", "60")
    result.assert_outcomes(passed=2)


UNWAITED_FUNCTIONAL = """
import pytest, torch, torch.distributed as dist
import torch.distributed._functional_collectives as funcol


def registry():
    return torch._C._distributed_c10d._get_work_registry_size()


@pytest.mark.ranks(2)
def test_a_leaves_a_functional_collective_unwaited(rank):
    group = dist.new_group([0, 1])
    funcol.all_reduce(torch.ones(2), "sum", group)  # its result never waited for
    assert registry() == 1


@pytest.mark.ranks(2)
def test_b_next(rank):
    assert registry() == 0  # nothing holds a torn-down group's sockets and thread
    total = torch.ones(1)
    dist.all_reduce(total)
    assert total.item() == 2
"""


@pytest.mark.isolation
def test_a_functional_collective_left_unwaited_gets_the_ranks_replaced(
    pytester: pytest.Pytester,
) -> None:
    """torch's registry of functional collectives (DTensor's async outputs) keeps an unwaited
    one's work, and with it its torn-down group's sockets and thread, for the process's life:
    on warm ranks every later test found it there."""
    pytester.makepyfile(test_unwaited=UNWAITED_FUNCTIONAL)
    result = pytester.runpytest_subprocess("-p", "harness", "--rank-timeout", "60", "-rA")
    result.assert_outcomes(passed=2)
    result.stdout.fnmatch_lines(
        [
            "*RanksReplacedWarning: *rank ? left 1 functional collective unwaited (torch's work "
            "registry keeps it, and its group, for the process's life)*",
        ]
    )
