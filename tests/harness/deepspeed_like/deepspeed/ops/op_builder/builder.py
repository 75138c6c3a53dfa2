"""An op builder as DeepSpeed's: load() JIT-builds into torch's extension cache
(TORCH_EXTENSIONS_DIR) unless a build is there, under torch's lock file as torch's load takes
it (waited on with no bound), and imports what it built; each build is logged in BUILD_LOG. Its
compiler flags ask py-cpuinfo for the CPU's description twice a load, as DeepSpeed's do."""

import importlib.util
import os
import time

from torch.utils import cpp_extension


class OpBuilder:
    NAME = "op"

    def __init__(self):
        self.name = self.NAME

    def load(self, verbose=True):
        return self.jit_load(verbose)

    def cpu_arch(self):
        from cpuinfo import get_cpu_info

        return "-march=native" if get_cpu_info()["arch"] == "X86_64" else ""

    def simd_width(self):
        from cpuinfo import get_cpu_info

        return "-D__AVX256__" if "avx2" in get_cpu_info()["flags"] else "-D__SCALAR__"

    def jit_load(self, verbose=True):
        flags = [self.cpu_arch(), self.simd_width()]  # torch's load hashes them with the sources
        assert all(flags)
        folder = cpp_extension._get_build_directory(self.name, verbose=False)
        lock = os.path.join(folder, "lock")
        while os.path.exists(lock):  # torch's FileBaton.wait
            time.sleep(0.1)
        built = os.path.join(folder, f"{self.name}.py")  # a module stands in for the .so
        if not os.path.exists(built):
            with open(os.environ["BUILD_LOG"], "a") as log:
                log.write(f"{os.getpid()}\n")
            with open(built, "w") as f:
                f.write(f"NAME = {self.name!r}\n")
        spec = importlib.util.spec_from_file_location(self.name, built)
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        return module


class TinyAdamBuilder(OpBuilder):
    NAME = "tiny_adam"


class TinyLionBuilder(OpBuilder):
    NAME = "tiny_lion"
