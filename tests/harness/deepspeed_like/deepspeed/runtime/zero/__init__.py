from deepspeed.runtime.zero.partition_parameters import Init

__all__ = ["Init"]
