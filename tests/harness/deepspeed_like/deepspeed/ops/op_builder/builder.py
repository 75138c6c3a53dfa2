"""An op builder as DeepSpeed's: load() JIT-builds into torch's extension cache
(TORCH_EXTENSIONS_DIR) unless a build is there, under torch's lock file as torch's load takes
it (waited on with no bound), and imports what it built; each build is logged in BUILD_LOG."""

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

    def jit_load(self, verbose=True):
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
