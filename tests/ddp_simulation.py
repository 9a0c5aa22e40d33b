"""Two simulated DDP ranks in one process, for models whose score needs the gathered batch (SEAM, SMAN)."""
from __future__ import annotations

import torch


class Gather:
    """A gather as the loop hands it over (``GatherEmbeddings``): a callable with the ranks' ``world_size``."""

    def __init__(self, join, world_size: int = 2):
        self.join, self.world_size = join, world_size

    def __call__(self, embeddings):
        return self.join(embeddings)


def simulated_ddp_grads(model, features, mask, tokens, lengths):
    """(single-process gradients, Σ over two simulated DDP ranks of their gradients) of ``model.forward``.

    Rank r encodes its half of the batch; the fake gather puts the other half's embeddings (no gradient)
    around it, as ``retr.trainers.training.distributed.GatherEmbeddings`` does. The loop scales each rank's loss by
    the world size and DDP averages gradients, so the update follows the sum of the ranks' gradients.
    """
    def grads():
        return {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}

    model.zero_grad()
    model(features, mask, tokens, lengths).backward()
    single = grads()
    half = features.shape[0] // 2
    parts = [slice(0, half), slice(half, None)]
    total: dict = {}
    for rank, part in enumerate(parts):
        other = parts[1 - rank]
        with torch.no_grad():
            other_im = model.encode_images(features[other], mask[other])
            other_cap = model.encode_captions(tokens[other], lengths[other])

        def join(local, rank=rank, other_im=other_im, other_cap=other_cap):
            remote = other_im if "v0" in local or ("vector" in local and "penalty" not in local) else other_cap
            return {k: torch.cat([local[k], remote[k]] if rank == 0 else [remote[k], local[k]]) for k in local}

        gather = Gather(join)

        model.zero_grad()
        model(features[part], mask[part], tokens[part], lengths[part], gather=gather).backward()
        for n, g in grads().items():
            total[n] = total.get(n, 0) + g
    return single, total
