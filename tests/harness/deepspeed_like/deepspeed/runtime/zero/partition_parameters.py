"""What DeepSpeed's zero.Init leaves in a process outside DeepSpeed's own module globals
(deepspeed/runtime/zero/partition_parameters.py at commit edaa722): given a module, it
replaces torch.nn.functional.linear for good (memory_efficient_linear), keeping the original
as a class attribute; entered, it replaces torch's creation functions, Tensor.__new__ and
Module's __init_subclass__ and apply until it exits, and with quantized initialization wraps
nn.Linear's and nn.Embedding's _load_from_state_dict for good."""

import torch

_orig_torch_empty = torch.empty
zero_init_context = 0  # how many Inits are entered


def zero3_linear_wrap(input, weight, bias=None):
    return InsertPostInitMethodToModuleSubClasses.linear_bk(input, weight, bias)


def _wrapped(function):
    def wrapper(*args, **kwargs):
        return function(*args, **kwargs)

    wrapper.__wrapped__ = function
    return wrapper


class InsertPostInitMethodToModuleSubClasses:
    num_module_parameters = 0

    def __init__(self, module=None, quantized=False):
        self.quantized = quantized
        if not hasattr(InsertPostInitMethodToModuleSubClasses, "linear_bk"):
            InsertPostInitMethodToModuleSubClasses.linear_bk = torch.nn.functional.linear
        if torch.nn.functional.linear is InsertPostInitMethodToModuleSubClasses.linear_bk:
            torch.nn.functional.linear = zero3_linear_wrap
        if module is not None:
            count = sum(p.numel() for p in module.parameters())
            InsertPostInitMethodToModuleSubClasses.num_module_parameters += count

    def __enter__(self):
        global zero_init_context
        zero_init_context += 1
        module = torch.nn.modules.module.Module
        module._old_init_subclass = module.__init_subclass__
        module._old_apply = module.apply
        torch.Tensor.__old_new__ = torch.Tensor.__new__
        module.__init_subclass__ = classmethod(lambda cls, **kwargs: None)
        module.apply = _wrapped(module._old_apply)
        torch.Tensor.__new__ = _wrapped(torch.Tensor.__old_new__)
        torch.empty = _wrapped(_orig_torch_empty)
        if self.quantized:
            for layer in (torch.nn.Linear, torch.nn.Embedding):
                layer._load_from_state_dict = _wrapped(layer._load_from_state_dict)
        return self

    def __exit__(self, *exc_info):
        global zero_init_context
        zero_init_context -= 1
        module = torch.nn.modules.module.Module
        module.__init_subclass__ = module._old_init_subclass
        module.apply = module._old_apply
        torch.Tensor.__new__ = torch.Tensor.__old_new__
        torch.empty = _orig_torch_empty


class Init(InsertPostInitMethodToModuleSubClasses):
    pass
