from deepspeed.comm.comm import (
    all_reduce,
    barrier,
    destroy_process_group,
    get_rank,
    get_world_size,
    init_distributed,
    is_initialized,
)

__all__ = [
    "all_reduce",
    "barrier",
    "destroy_process_group",
    "get_rank",
    "get_world_size",
    "init_distributed",
    "is_initialized",
]
