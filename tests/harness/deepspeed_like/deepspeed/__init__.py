"""The little of DeepSpeed's package the DeepSpeed-like test base calls."""

import os

# As DeepSpeed's sets torch's NVML check before importing torch, a variable set at import.
os.environ.setdefault("DEEPSPEED_LIKE_IMPORTED", "1")

from deepspeed import comm
from deepspeed.comm.comm import init_distributed

IMPORTED_IN = os.getpid()  # a rank that did not import it got it from the fork server

__all__ = ["comm", "init_distributed"]
