"""Pieces every model shares, written once (as timm's ``layers/``): masks, masked pooling and softmax, norms.

Shapes: ``B`` batch, ``K``/``L`` items (regions, cells, crops, words), ``d`` features."""
from __future__ import annotations

import numpy as np
import torch
from torch.nn.utils.rnn import PackedSequence

EPS = 1e-8


def lengths_mask(lengths: torch.Tensor, max_len: int, device: torch.device | None = None) -> torch.Tensor:
    """``[B, max_len]`` bool on ``device`` (default: the lengths'), True at positions ``< lengths[b]`` (``lengths``
    ``[B]`` long, e.g. on the host where the loop keeps them: moved ``non_blocking``, since a blocking upload
    waits for every kernel queued on the GPU)."""
    device = lengths.device if device is None else device
    lengths = lengths.to(device, non_blocking=True)
    return torch.arange(max_len, device=device).view(1, -1) < lengths.view(-1, 1)


def cat_parts(parts: list[torch.Tensor], dim: int = 0) -> torch.Tensor:
    """``torch.cat(parts, dim)`` of a chunked computation's parts, except that a single part is returned as it is:
    concatenating one tensor copies it, an operator forward and one backward for nothing."""
    return parts[0] if len(parts) == 1 else torch.cat(parts, dim)


def masked_mean(x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Mean of ``x`` ``[B, K, d]`` over K where ``mask`` ``[B, K]`` is True → ``[B, d]`` (0 for an empty row)."""
    weights = mask.to(x.dtype).unsqueeze(-1)
    return (x * weights).sum(dim=1) / weights.sum(dim=1).clamp(min=1)


def masked_softmax(logits: torch.Tensor, mask: torch.Tensor, dim: int = -1) -> torch.Tensor:
    """Softmax of ``logits`` over ``dim`` where ``mask`` (broadcastable bool) is True; exactly 0 elsewhere."""
    logits = logits.masked_fill(~mask, torch.finfo(logits.dtype).min)
    return torch.softmax(logits, dim=dim) * mask


def row_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """``F.linear`` of ``x`` ``[P, d_in]`` → ``[P, d_out]``, each row by its own vector–matrix product (one batched
    kernel, ``weight`` shared without a copy): a row's result does not depend on how many rows are beside it, as
    one GEMM's does (BLAS picks its kernel by the row count), so pairs scored in any chunks score the same."""
    rows = x.shape[0]
    product = weight.t().unsqueeze(0).expand(rows, -1, -1)
    if bias is None:
        return torch.bmm(x.unsqueeze(1), product).squeeze(1)
    return torch.baddbmm(bias.view(1, 1, -1).expand(rows, 1, -1), x.unsqueeze(1), product).squeeze(1)


def l2norm(x: torch.Tensor, dim: int = -1, eps: float = EPS) -> torch.Tensor:
    """``x / (‖x‖ + eps)`` along ``dim`` (zero gradient at a zero vector)."""
    return x / (torch.linalg.vector_norm(x, dim=dim, keepdim=True) + eps)


def cosine(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """Cosine along the last axis (broadcasting), ``x·y / max(‖x‖‖y‖, 1e-8)`` (the authors' form)."""
    return (x * y).sum(-1) / (x.norm(dim=-1) * y.norm(dim=-1)).clamp(min=EPS)


def cosine_matrix(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """The cosine of every row of ``x`` ``[G, n, d]`` with every row of ``y`` ``[G, m, d]``, group by group →
    ``[G, n, m]``: :func:`cosine`'s formula with the dot products as one batched matrix product, not a
    ``[G, n, m, d]`` broadcast."""
    norms = torch.linalg.vector_norm(x, dim=-1).unsqueeze(2) * torch.linalg.vector_norm(y, dim=-1).unsqueeze(1)
    return torch.bmm(x, y.transpose(1, 2)) / norms.clamp(min=EPS)


def scale_grad(p: torch.Tensor, scale: float) -> torch.Tensor:
    """``p`` unchanged in value, its gradient multiplied by ``scale`` (1/world size for parameters used only after
    the gather)."""
    return p if scale == 1.0 else p * scale + p.detach() * (1 - scale)


def run_rnn(rnn: torch.nn.RNNBase, x: torch.Tensor, lengths: torch.Tensor, total_length: int | None = None
            ) -> torch.Tensor:
    """``rnn`` (``batch_first``) over the first ``lengths[b]`` steps of each row of ``x`` ``[B, T, d_in]`` →
    ``[B, total_length, d_out]`` (default: the longest length), zeros past each length.

    The values of ``pack_padded_sequence`` → ``rnn`` → ``pad_packed_sequence`` (the same rows in the same packed
    order, so the same numbers), but packing is one gather and unpacking one scatter, where torch's two functions
    slice and copy once per time step (forward and backward: ~7 operators a step on any device). ``lengths``
    (≥ 1) are read on the host: a CPU tensor costs no device sync."""
    host = lengths.cpu().numpy()
    batch, width = x.shape[:2]
    longest = int(host.max()) if host.size else 0
    total_length = longest if total_length is None else total_length
    if host.size and host.min() < 1:
        raise ValueError("run_rnn: every length must be at least 1")
    if longest > min(width, total_length):
        raise ValueError(f"run_rnn: a length of {longest} exceeds the input's {width} steps or the output's "
                         f"{total_length}")
    sorted_lengths, order = torch.sort(torch.from_numpy(host), descending=True)   # pack_padded_sequence's order
    sorted_lengths, order = sorted_lengths.numpy(), order.numpy()
    steps_count = int(sorted_lengths[0]) if batch else 0
    batch_sizes = (sorted_lengths[None, :] > np.arange(steps_count)[:, None]).sum(1)          # [T']
    step = np.repeat(np.arange(steps_count), batch_sizes)                                    # packed row → t
    rank = np.arange(len(step)) - np.repeat(np.cumsum(batch_sizes) - batch_sizes, batch_sizes)
    row = order[rank]                                                                        # packed row → b
    source = torch.from_numpy(row * width + step).to(x.device, non_blocking=True)
    target = torch.from_numpy(row * total_length + step).to(x.device, non_blocking=True)
    packed = PackedSequence(x.reshape(batch * width, -1)[source], torch.from_numpy(batch_sizes))
    data = rnn(packed)[0].data                                                               # [Σ lengths, d_out]
    out = data.new_zeros(batch * total_length, data.shape[-1]).index_put((target,), data)
    return out.view(batch, total_length, -1)


def masked_batch_norm(bn: torch.nn.modules.batchnorm._BatchNorm, x: torch.Tensor, mask: torch.Tensor
                      ) -> torch.Tensor:
    """``bn`` over the channels of ``x`` ``[B, T, C]`` at the positions where ``mask`` ``[B, T]`` is True, 0
    elsewhere: in training the batch statistics (and the running averages ``bn`` keeps) are those of the real
    positions alone, as ``bn(x[mask])`` takes them, but without indexing by the mask, which reads the number of
    real positions back from the device.

    Statistics as BatchNorm's: the biased variance normalises, the unbiased one (n / (n − 1), n ≥ 2; a single
    real position counts as 2) enters the running variance; ``momentum=None`` is a cumulative average. A batch
    without a real position gives zeros and leaves the running averages as they were (``bn(x[mask])`` raised).
    Padded positions are never read (a non-finite value there changes nothing). Half and bfloat16 inputs
    (autocast) are normalised in float32, as cuDNN's batch norm does, and returned in their dtype."""
    given = x.dtype
    real = mask.unsqueeze(-1)                                                      # [B, T, 1]
    x = torch.where(real, x.to(torch.promote_types(given, torch.float32)), 0.0)
    weights = real.to(x.dtype)
    if bn.training or bn.running_mean is None:
        count = weights.sum()
        divisor = count.clamp(min=1)
        mean = x.sum((0, 1)) / divisor                                             # [C]
        centered = (x - mean) * weights                                            # 0 at padded positions
        var = centered.pow(2).sum((0, 1)) / divisor
        if bn.training and bn.running_mean is not None:
            with torch.no_grad():
                any_real = count > 0                                               # on the device, not read back
                bn.num_batches_tracked.add_(any_real.to(bn.num_batches_tracked.dtype))
                dtype = bn.running_mean.dtype
                step = any_real.to(dtype)                                          # 0: nothing to average in
                factor = step * bn.momentum if bn.momentum is not None else \
                    step / bn.num_batches_tracked.clamp(min=1).to(dtype)
                bn.running_mean.lerp_(mean.to(dtype), factor)
                unbiased = var * count / (count - 1).clamp(min=1)
                bn.running_var.lerp_(unbiased.to(dtype), factor)
    else:
        centered, var = (x - bn.running_mean) * weights, bn.running_var
    scale = torch.rsqrt(var + bn.eps)                                              # [C]
    if not bn.affine:
        return (centered * scale).to(given)
    return torch.addcmul(centered * (scale * bn.weight), weights, bn.bias).to(given)   # + bias at real positions
