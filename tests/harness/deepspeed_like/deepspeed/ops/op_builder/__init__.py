from deepspeed.ops.op_builder.builder import OpBuilder, TinyAdamBuilder

__all__ = ["OpBuilder", "TinyAdamBuilder"]
