"""PyTorch's float32 matmul precision (torch.get_float32_matmul_precision()), read as a
constant under torch.compile: its value when the graph is traced. Imported where a call
takes torch tensors (torch is optional)."""
import torch


@torch._dynamo.assume_constant_result
def float32_matmul_precision():
    """torch.get_float32_matmul_precision()."""
    return torch.get_float32_matmul_precision()
