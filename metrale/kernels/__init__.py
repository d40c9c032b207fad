"""Triton kernels, one per file, each with a torch reference beside it (`*_ref`).

Imported only when the `triton` attention backend or fused layers are selected, so a machine
without Triton (or without a GPU) never loads them.
"""
