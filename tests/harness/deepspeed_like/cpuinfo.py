"""py-cpuinfo as DeepSpeed's op builders call it: get_cpu_info() describes the CPU (the real
one runs a Python subprocess that times the CPU: about a second a call). Each call is logged
in CPUINFO_LOG, where set."""

import os


def get_cpu_info():
    log = os.environ.get("CPUINFO_LOG")
    if log:
        with open(log, "a") as f:
            f.write(f"{os.getpid()}\n")
    return {"arch": "X86_64", "flags": ["avx2"]}
