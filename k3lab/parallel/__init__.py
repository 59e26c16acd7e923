"""torch.distributed for k3lab: the launcher, decode context parallelism for MLA, the MoE tail.

`launch` starts ranks (gloo on CPU, NCCL / RCCL on GPUs, or torchrun). `dcp` and `moe_tail` are
imported on use (`from k3lab.parallel import dcp`), so that importing the launcher does not load
the attention kernels.
"""

from .launch import RankError, default_backend, init_from_env, rank_device, spawn

__all__ = ["RankError", "default_backend", "init_from_env", "rank_device", "spawn"]
