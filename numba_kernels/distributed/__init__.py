"""Attention split across ranks by sequence (torch.distributed: NCCL on GPUs, gloo on CPUs):
sharding.py says which rows a rank holds, block_band.py how a block of the sharded problem
sees the whole problem's band through the kernel's own arguments, split.py the blocks a
rank computes and the merge of their parts, and two schemes, forward and backward: ring.py
ring attention (ring_attention: K and V passed around the ranks) and allgather.py the seed's
(allgather_attention: every query gathered to every rank, the parts to their rows' rank).
Imported on its own: the kernels do not import it, and only split.py and the schemes need
torch.
"""
