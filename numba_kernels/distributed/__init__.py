"""Attention split across ranks by sequence (torch.distributed: NCCL on GPUs, gloo on CPUs):
sharding.py says which rows a rank holds, block_band.py how a block of the sharded problem
sees the whole problem's band through the kernel's own arguments, ring.py ring attention,
forward and backward (ring_attention, ring_attention_backward). Imported on its own: the
kernels do not import it, and only ring.py needs torch.
"""
