"""Triton kernels of the HSTU layer."""
