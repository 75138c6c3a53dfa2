"""Names DeepSpeed's engine registers for debugging, kept for the process's life
(deepspeed/utils/debug.py at commit edaa722)."""

module_names = {}
param_names = {}
