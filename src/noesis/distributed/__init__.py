"""Tensor parallelism over torch.distributed: one model split across ranks (NCCL on CUDA, gloo on
CPU), rank 0 scheduling and sampling, the other ranks running the forwards it sends them."""
