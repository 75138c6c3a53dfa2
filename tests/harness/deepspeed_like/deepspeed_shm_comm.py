"""As DeepSpeed's CPU shared-memory all-reduce op (csrc/cpu/comm/shm.cpp) sets itself up: once
per process, a buffer in /dev/shm named after the user, MASTER_ADDR, MASTER_PORT and the rank,
never unlinked. Each name made is logged in SHM_LOG. An extension module, as DeepSpeed's
built op is: outside the deepspeed package."""

import os

initialized = False  # the C op's static flag: not DeepSpeed's module state


def initialize(world_size, rank):
    global initialized
    if initialized or not os.path.isdir("/dev/shm"):
        return
    initialized = True
    name = "_".join(
        [
            "/dev/shm/deepspeed_allreduce_buffer",
            str(os.getuid()),
            os.environ.get("MASTER_ADDR", "127.0.0.1"),
            os.environ.get("MASTER_PORT", "29500"),
            str(rank),
        ]
    )
    with open(name, "wb") as f:
        f.write(b"\0" * 4096)
    with open(os.environ["SHM_LOG"], "a") as log:
        log.write(name + "\n")
