"""Attention kernels behind kvferry's paged-KV interface.

Each kernel has a plain-torch reference (used on CPU and by the tests as the oracle) and,
where one exists, a Triton implementation used on CUDA devices.
"""
