"""pytest conformance: Hypothesis property tests of the attention contract.

    pytest conformance                              # the bundled Numba kernel
    pytest conformance --impl torch-efficient       # a built-in adapter of verify
    pytest conformance --impl mypkg.attn:my_kernel  # your kernel (or FLASH_CONFORMANCE_IMPL)
    pytest conformance --profile thorough           # ci, gpu or thorough; default by device

Every property draws verify Cases and judges them with verify's runner and criterion: the
same rule as `python -m verify`, never a second copy.
"""
