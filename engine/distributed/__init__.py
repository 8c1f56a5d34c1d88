"""Tensor parallelism's process group and collectives (torch.distributed: gloo on CPU, NCCL on CUDA)."""
