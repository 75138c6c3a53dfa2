"""The little of DeepSpeed's package the DeepSpeed-like test base calls."""

from deepspeed import comm
from deepspeed.comm.comm import init_distributed

__all__ = ["comm", "init_distributed"]
