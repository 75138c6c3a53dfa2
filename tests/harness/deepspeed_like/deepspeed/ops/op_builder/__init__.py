from deepspeed.ops.op_builder.builder import OpBuilder, TinyAdamBuilder, TinyLionBuilder

__all__ = ["OpBuilder", "TinyAdamBuilder", "TinyLionBuilder"]
