"""Multi-process training under ``torchrun`` (DDP): process-group setup and the embedding gather (hardest negatives
from the global batch; docs/trainer.md, "DDP")."""
from __future__ import annotations


import torch
import torch.distributed as dist
import torch.nn.functional as F

from retr.common.torchrun import TorchrunEnv


#: rank, world size and local rank of this process (one process by default)
DistInfo = TorchrunEnv


def init_from_env(device_type: str) -> DistInfo:
    """Join the process group when started by ``torchrun`` (``WORLD_SIZE`` > 1): NCCL on CUDA, gloo on CPU."""
    env = TorchrunEnv.from_environ()
    if not env.enabled:
        return DistInfo()
    if not dist.is_initialized():
        dist.init_process_group(backend="nccl" if device_type == "cuda" else "gloo")
    return DistInfo(dist.get_rank(), dist.get_world_size(), env.local_rank)


def _gather_tensor(tensor: torch.Tensor) -> torch.Tensor:
    if tensor.dtype == torch.bool:                     # masks travel as uint8 (gloo and F.pad want numbers)
        return _gather_tensor(tensor.to(torch.uint8)).bool()
    world, rank = dist.get_world_size(), dist.get_rank()
    shape = torch.tensor(tensor.shape, device=tensor.device, dtype=torch.long)
    shapes = [torch.zeros_like(shape) for _ in range(world)]
    dist.all_gather(shapes, shape)
    shapes = torch.stack(shapes)                       # [world, ndim]
    biggest = shapes.max(dim=0).values.tolist()
    pad = []
    for d in reversed(range(tensor.dim())):
        pad += [0, biggest[d] - tensor.shape[d]]
    padded = F.pad(tensor, pad) if any(pad) else tensor
    parts = [torch.zeros_like(padded) for _ in range(world)]
    dist.all_gather(parts, padded.detach().contiguous())
    parts[rank] = padded                               # the local part keeps its autograd history
    return torch.cat([p[:int(shapes[r, 0])] for r, p in enumerate(parts)])


class GatherEmbeddings:
    """What the loop hands a model's ``forward`` as ``gather`` under DDP: called on a dict of embeddings, every
    rank's, in rank order along dim 0 (other dims zero-padded to the largest); ``world_size`` the ranks joined
    (a model scales the gradients of what it uses only after the gather by ``1 / world_size``)."""

    def __init__(self, world_size: int):
        self.world_size = world_size

    def __call__(self, embeddings: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        return {key: _gather_tensor(value) for key, value in embeddings.items()}


def barrier(info: DistInfo) -> None:
    if info.enabled:
        dist.barrier()


def cleanup(info: DistInfo) -> None:
    if info.enabled and dist.is_initialized():
        dist.destroy_process_group()


def world_size() -> int:
    """Processes of the current DDP job (1 without torch.distributed)."""
    return dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1
