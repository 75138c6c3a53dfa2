"""The little of DeepSpeed's package the DeepSpeed-like test base calls."""

import os

from deepspeed import comm
from deepspeed.comm.comm import init_distributed

IMPORTED_IN = os.getpid()  # a rank that did not import it got it from the fork server

__all__ = ["comm", "init_distributed"]
