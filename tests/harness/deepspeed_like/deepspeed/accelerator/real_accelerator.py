import os

ds_accelerator = None


class CPU_Accelerator:
    def is_available(self):
        return True

    def device_count(self):  # DeepSpeed's CPU rule, reduced: LOCAL_SIZE, else 1
        return int(os.environ.get("LOCAL_SIZE", "1"))

    def device_name(self):
        return "cpu"

    def communication_backend_name(self):
        return "gloo"

    def set_device(self, index):
        pass


def get_accelerator():
    global ds_accelerator
    if ds_accelerator is None:
        ds_accelerator = CPU_Accelerator()
    return ds_accelerator
