"""DeepSpeed's DistributedTest protocol (tests/unit/common.py at DeepSpeed commit edaa722),
in our words: the same class attributes, the same launch, the same per-rank entry point."""

import inspect
import os
import tempfile
import time

import deepspeed
import deepspeed.comm as dist
import pytest
import torch.multiprocessing as mp
from _pytest.fixtures import FixtureFunctionMarker, FixtureLookupError
from _pytest.outcomes import Skipped
from deepspeed.accelerator import get_accelerator

EXEC_TIMEOUT = int(os.environ.get("DS_UNITTEST_TIMEOUT", "600"))


class DistributedExec:
    world_size = 2
    backend = get_accelerator().communication_backend_name()
    init_distributed = True
    set_dist_env = True
    requires_cuda_env = True
    reuse_dist_env = False
    non_daemonic_procs = False
    _pool_cache = {}
    exec_timeout = EXEC_TIMEOUT

    def run(self):
        raise NotImplementedError

    def __call__(self, request):
        self._fixture_kwargs = self._get_fixture_kwargs(request, self.run)
        if self.requires_cuda_env and not get_accelerator().is_available():
            pytest.skip("only supported in accelerator environments.")
        self._launch_with_file_store(request, self.world_size)

    def _get_fixture_kwargs(self, request, func):
        kwargs = {}
        for name in inspect.getfullargspec(func).args[1:]:
            try:
                kwargs[name] = request.getfixturevalue(name)
            except FixtureLookupError:
                pass
        return kwargs

    def _launch_daemonic_procs(self, num_procs, init_method):
        if self.reuse_dist_env:
            if num_procs not in self._pool_cache:
                self._pool_cache[num_procs] = mp.Pool(processes=num_procs)
            pool = self._pool_cache[num_procs]
        else:
            pool = mp.Pool(processes=num_procs)
        args = [(rank, num_procs, "29500", init_method) for rank in range(num_procs)]
        pending = pool.starmap_async(self._dist_run, args)
        try:
            skip_msgs = pending.get(self.exec_timeout)
        except mp.TimeoutError:
            pytest.exit("Test hanged, exiting", returncode=1)
        finally:
            self._close_pool(pool, num_procs)
        if any(skip_msgs):
            assert len(set(skip_msgs)) == 1, "Multiple different skip messages received"
            pytest.skip(skip_msgs[0])

    def _launch_non_daemonic_procs(self, num_procs, init_method):
        assert not self.reuse_dist_env, (
            "Cannot reuse distributed environment with non-daemonic processes"
        )
        skip_msg = mp.Queue()
        before = mp.get_start_method()
        mp.set_start_method("spawn", force=True)
        procs = [
            mp.Process(
                target=self._dist_run, args=(rank, num_procs, "29500", init_method, skip_msg)
            )
            for rank in range(num_procs)
        ]
        for p in procs:
            p.start()
        mp.set_start_method(before, force=True)
        start = time.time()
        while not any(not p.is_alive() for p in procs) and time.time() - start < self.exec_timeout:
            time.sleep(0.1)
        for p in procs:
            p.join(self.exec_timeout)
        for rank, p in enumerate(procs):
            if p.exitcode is None:
                p.terminate()
                pytest.fail(f"Worker {rank} hung.", pytrace=False)
            if p.exitcode != 0:
                pytest.fail(f"Worker {rank} exited with code {p.exitcode}", pytrace=False)
        if not skip_msg.empty():
            pytest.skip(skip_msg.get())

    def _launch_procs(self, num_procs, init_method):
        accelerator = get_accelerator()
        if accelerator.is_available() and accelerator.device_count() < num_procs:
            pytest.skip(
                f"Skipping test because not enough GPUs are available: {num_procs} required, "
                f"{accelerator.device_count()} available"
            )
        mp.set_start_method("forkserver", force=True)
        if self.non_daemonic_procs:
            self._launch_non_daemonic_procs(num_procs, init_method)
        else:
            self._launch_daemonic_procs(num_procs, init_method)

    def _dist_run(self, local_rank, num_procs, master_port, init_method, skip_msg=""):
        if not dist.is_initialized():
            if self.set_dist_env:
                os.environ["MASTER_ADDR"] = "127.0.0.1"
                os.environ["MASTER_PORT"] = str(master_port)
                os.environ["LOCAL_RANK"] = os.environ["RANK"] = str(local_rank)
                os.environ["LOCAL_SIZE"] = os.environ["WORLD_SIZE"] = str(num_procs)
            if self.init_distributed:
                deepspeed.init_distributed(
                    dist_backend=self.backend,
                    init_method=init_method,
                    rank=local_rank,
                    world_size=num_procs,
                )
                dist.barrier()
        try:
            self.run(**self._fixture_kwargs)
        except Skipped as e:
            if self.non_daemonic_procs:
                skip_msg.put(e.msg)
            else:
                skip_msg = e.msg
        return skip_msg

    def _launch_with_file_store(self, request, world_size):
        tmpdir = request.getfixturevalue("tmpdir")
        for procs in [world_size] if isinstance(world_size, int) else world_size:
            with tempfile.NamedTemporaryFile(
                delete=False, dir=str(tmpdir), suffix="_filestore"
            ) as f:
                init_method = f"file://{f.name}"
            self._launch_procs(procs, init_method)
            time.sleep(0.5)

    def _dist_destroy(self):
        if dist.is_initialized():
            dist.barrier()
            dist.destroy_process_group()

    def _close_pool(self, pool, num_procs, force=False):
        if force or not self.reuse_dist_env:
            pool.starmap(self._dist_destroy, [() for _ in range(num_procs)])
            pool.close()
            pool.join()


class DistributedFixture(DistributedExec):
    is_dist_fixture = True
    _pytestfixturefunction = FixtureFunctionMarker(scope="function", params=None)
    __name__ = ""

    def __init__(self):
        assert isinstance(self.world_size, int), (
            "Only one world size is allowed for distributed fixtures"
        )
        self.__name__ = type(self).__name__


class DistributedTest(DistributedExec):
    is_dist_test = True

    @pytest.fixture(autouse=True, scope="class")
    def class_tmpdir(self, tmpdir_factory):
        return tmpdir_factory.mktemp(self.__class__.__name__)

    def run(self, **fixture_kwargs):
        self._current_test(**fixture_kwargs)

    def __call__(self, request):
        self._current_test = getattr(self, request.function.__name__)
        self._fixture_kwargs = self._get_fixture_kwargs(request, self._current_test)
        if self.requires_cuda_env and not get_accelerator().is_available():
            pytest.skip("only supported in accelerator environments.")
        for mark in getattr(request.function, "pytestmark", []):
            if mark.name == "world_size":
                world_size = mark.args[0]
                break
        else:
            world_size = self._fixture_kwargs.get("world_size", self.world_size)
        self._launch_with_file_store(request, world_size)
