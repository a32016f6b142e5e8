"""Kernels: fused operations with a PyTorch reference and a Triton version for CUDA tensors.

Models call these functions and never branch on hardware themselves; the dispatch happens here,
on the tensors' device.
"""
