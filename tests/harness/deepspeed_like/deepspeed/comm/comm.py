"""deepspeed.comm's module state: the backend (cdb) that init_distributed sets."""

import deepspeed_shm_comm as shm
import torch.distributed as td

cdb = None
comms_logger_calls = []


class TorchBackend:
    name = "torch"

    def __init__(self, backend, init_method, rank, world_size):
        td.init_process_group(backend, init_method=init_method, rank=rank, world_size=world_size)
        shm.initialize(world_size, rank)


def init_distributed(dist_backend=None, init_method=None, rank=-1, world_size=-1):
    global cdb
    if cdb is None or not td.is_initialized():
        cdb = TorchBackend(dist_backend, init_method, rank, world_size)


def is_initialized():
    return cdb is not None and td.is_initialized()


def barrier():
    td.barrier()


def all_reduce(tensor):
    comms_logger_calls.append("all_reduce")
    td.all_reduce(tensor)


def get_rank():
    return td.get_rank()


def get_world_size():
    return td.get_world_size()


def destroy_process_group(group=None):
    td.destroy_process_group(group)
