"""JGCAR — Joint Global and Co-Attentive Representation learning (ACM MM 2018; ``papers/jgcar.txt``).

Shapes: ``N`` regions (196 = 14×14 VGG-16 pool5 cells), ``T`` words (≤ ``max_words``), ``d`` the joint dimension
(256), ``l`` the co-attention hidden size (512), ``B`` the batch, ``I``/``C`` images/captions of a scoring block.
:meth:`JGCAR.encode_images`: features ``[B, N, 512]`` → ``V`` ``[B, N, d]`` and ``V̂`` ``[B, d]``;
:meth:`JGCAR.encode_captions`: tokens ``[B, L]`` → ``S^s`` ``[B, T, d]`` and ``Ŝ`` ``[B, d]``;
:meth:`JGCAR.global_score` Ω ``[I, C]`` (the shortlist) and :meth:`JGCAR.score` the co-attentive α ``[I, C]`` (the
re-rank) of two-step retrieval (:mod:`retr.trainers.evaluation.two_step`); :meth:`JGCAR.forward` the joint loss.
Equations, decisions and cost: docs/models-jgcar.md."""
from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Callable, Literal, Mapping

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

from retr.common.errors import UserError
from retr.trainers.config import (Settings, dropout_setting, embed_size_setting, margin_setting, setting, size_setting,
                                  violation_setting, word_dim_setting)
from retr.trainers.models.registry import InputFile, ModelSpec, register_model
from retr.trainers.models.optim import PerGroupOptimizer
from retr.trainers.models.base import Embeddings, MatchingModel, check_one_pair
from retr.trainers.models.layers import cat_parts, l2norm, lengths_mask, masked_mean, masked_softmax, run_rnn
from retr.trainers.models.side_inputs import load_jgcar_inputs

GLOBAL_SIMILARITIES = ("dot", "cosine")
INTRA_REDUCTIONS = ("mean_positive", "sum")
NEGATIVE_MINING = ("similar", "dissimilar")
OPTIMIZERS = ("paper", "adam")


class PhraseTextEncoder(nn.Module):
    """Word → phrase → sentence-level features ``S^s`` ``[B, T, d]`` (Eq. 1–4); zero at padding positions."""

    def __init__(self, vocab_size: int, word_dim: int = 512, phrase_dim: int = 512, embed_size: int = 256,
                 dropout: float = 0.5):
        super().__init__()
        self.embed_size = embed_size
        self.embed = nn.Embedding(vocab_size, word_dim)
        self.convs = nn.ModuleList(nn.Conv1d(word_dim, phrase_dim, c) for c in (1, 2, 3))
        self.lstm = nn.LSTM(phrase_dim, embed_size, batch_first=True, bidirectional=True)
        self.dropout = nn.Dropout(dropout)
        nn.init.uniform_(self.embed.weight, -0.1, 0.1)

    def forward(self, tokens: torch.Tensor, lengths: torch.Tensor) -> torch.Tensor:
        """``tokens`` [B, L] long, ``lengths`` [B] (≥ 1) → ``[B, max(lengths), d]``."""
        t = int(lengths.max())
        tokens = tokens[:, :t]
        mask = lengths_mask(lengths, t, tokens.device)
        words = self.dropout(self.embed(tokens)) * mask.unsqueeze(-1)            # S^w, 0 after each caption
        x = words.transpose(1, 2)                                                 # [B, word_dim, T]
        phrases = torch.stack([torch.tanh(conv(F.pad(x, (0, c - 1))))            # window t : t+c-1
                               for c, conv in zip((1, 2, 3), self.convs)]).amax(0)  # [B, phrase_dim, T]
        phrases = self.dropout(phrases.transpose(1, 2))
        out = run_rnn(self.lstm, phrases, lengths, t)
        return out[..., :self.embed_size] + out[..., self.embed_size:]           # sum of the two directions


class MapEncoder(nn.Module):
    """``[B, N, 512]`` pool5 cells → ``V`` ``[B, N, d]`` = tanh(W_I r + b_I) (Eq. 5)."""

    def __init__(self, img_dim: int = 512, embed_size: int = 256, dropout: float = 0.5):
        super().__init__()
        self.fc = nn.Linear(img_dim, embed_size)
        self.dropout = nn.Dropout(dropout)

    def forward(self, features: torch.Tensor) -> torch.Tensor:
        return torch.tanh(self.fc(self.dropout(features)))


#: entries of one chunk's ``[rows, M, C, l]`` tanh temporary in :class:`TanhContraction`: on a CPU (cache-sized
#: work) and on a GPU (a few large kernels; 2^28 float32 entries are 1 GiB)
CPU_CHUNK_ELEMENTS = 1 << 23
GPU_CHUNK_ELEMENTS = 1 << 28


class TanhContraction(torch.autograd.Function):
    """``out[p, m, c] = Σ_l tanh(a[p, m] · b[c, :, l]) · w[p, m, l]`` — the co-attention logits of Eq. 11–12 for
    every pair of a block: ``a`` ``[P, M, d]``, ``b`` ``[C, d, l]``, ``w`` ``[P, M, l]`` → ``[P, M, C]``.

    The ``[P, M, C, l]`` tanh is formed chunk by chunk (rows of ``a``, :data:`CPU_CHUNK_ELEMENTS` or
    :data:`GPU_CHUNK_ELEMENTS` entries a chunk) and never kept: backward recomputes it from the three inputs,
    so a training step's co-attention costs a handful of kernels per chunk (one GEMM, the tanh, one batched GEMV
    forward; a GEMM, the tanh, three batched products and two GEMMs backward) whatever the batch. Backward runs
    under the autocast state forward ran under (``--amp``), as ``torch.amp.custom_bwd`` does for one device."""

    @staticmethod
    def _autocast(ctx):
        device, enabled, dtype = ctx.autocast_state
        return torch.autocast(device, dtype=dtype) if enabled else contextlib.nullcontext()

    @staticmethod
    def _steps(a: torch.Tensor, b: torch.Tensor) -> list[slice]:
        per_row = a.shape[1] * b.shape[0] * b.shape[2]
        budget = GPU_CHUNK_ELEMENTS if a.is_cuda else CPU_CHUNK_ELEMENTS
        step = max(1, budget // max(1, per_row))
        return [slice(s, s + step) for s in range(0, a.shape[0], step)] or [slice(0, 0)]

    @staticmethod
    def forward(ctx, a: torch.Tensor, b: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        n_rows, m, d = a.shape
        n_cols, _, l = b.shape
        b_flat = b.permute(1, 0, 2).reshape(d, n_cols * l)                        # [d, C·l]
        parts = []
        for rows in TanhContraction._steps(a, b):
            t = torch.tanh(a[rows].reshape(-1, d) @ b_flat).view(-1, n_cols, l)   # [p·M, C, l]
            parts.append(torch.bmm(t, w[rows].reshape(-1, l, 1)).view(len(range(n_rows)[rows]), m, n_cols))
        ctx.save_for_backward(a, b, w)
        device = a.device.type
        enabled = torch.amp.is_autocast_available(device) and torch.is_autocast_enabled(device)
        ctx.autocast_state = (device, enabled, torch.get_autocast_dtype(device) if enabled else None)
        return cat_parts(parts)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        with TanhContraction._autocast(ctx):
            return TanhContraction._backward(ctx, grad)

    @staticmethod
    def _backward(ctx, grad: torch.Tensor):
        a, b, w = ctx.saved_tensors
        n_rows, m, d = a.shape
        n_cols, _, l = b.shape
        b_flat = b.permute(1, 0, 2).reshape(d, n_cols * l)
        need_a, need_b, need_w = ctx.needs_input_grad
        grad_a, grad_w = [], []
        grad_b = torch.zeros(d, n_cols * l, dtype=b.dtype, device=b.device) if need_b else None
        for rows in TanhContraction._steps(a, b):
            a_rows = a[rows].reshape(-1, d)                                       # [p·M, d]
            p = len(range(n_rows)[rows])
            g = grad[rows].reshape(-1, 1, n_cols)                                 # [p·M, 1, C]
            t = torch.tanh(a_rows @ b_flat).view(-1, n_cols, l)                   # [p·M, C, l]
            if need_w:
                grad_w.append(torch.bmm(g, t).view(p, m, l))
            if need_a or need_b:
                pre = torch.bmm(g.transpose(1, 2), w[rows].reshape(-1, 1, l))     # g ⊗ w  [p·M, C, l]
                pre = pre.addcmul_(pre, t.square_(), value=-1).view(-1, n_cols * l)   # · (1 − tanh²)
                if need_a:
                    grad_a.append((pre @ b_flat.t()).view(p, m, d))
                if need_b:
                    grad_b.add_(a_rows.t() @ pre)
        return (torch.cat(grad_a) if need_a else None,
                grad_b.view(d, n_cols, l).permute(1, 0, 2) if need_b else None,
                torch.cat(grad_w) if need_w else None)


class CoAttention(nn.Module):
    """Parallel co-attention of Eq. 11–15; scores aligned pairs (``pair_scores``) or whole blocks (``block_scores``)."""

    def __init__(self, embed_size: int = 256, hidden: int = 512, num_regions: int = 196, max_words: int = 20,
                 position_bias: bool = True):
        super().__init__()
        self.W_b = nn.Linear(embed_size, embed_size, bias=False)
        self.W_v = nn.Linear(embed_size, hidden, bias=False)
        self.W_s = nn.Linear(embed_size, hidden, bias=False)
        self.b_v = nn.Parameter(torch.zeros(num_regions if position_bias else 1, hidden))
        self.b_s = nn.Parameter(torch.zeros(max_words if position_bias else 1, hidden))
        self.w_hv = nn.Linear(hidden, 1, bias=False)
        self.w_hs = nn.Linear(hidden, 1, bias=False)
        self.position_bias = position_bias
        #: In a DDP training step every process runs the co-attention on the gathered global batch (no
        #: co-attention parameter is used before the gather), so each process would receive the full-batch
        #: gradient; JGCAR.forward sets this to 1/world size and a hook scales every co-attention gradient,
        #: making the sum over processes (what the loop's loss scaling and DDP's average give) exact.
        self.score_grad_scale = 1.0
        for parameter in self.parameters():
            parameter.register_hook(self._scale_parameter_grad)

    # pair-independent parts ------------------------------------------------------------------------------
    def image_side(self, regions: torch.Tensor, mask: torch.Tensor) -> dict[str, torch.Tensor]:
        """``regions`` [I, N, d] → ``X = tanh(V W_vᵀ + b_v)`` [I, N, l] and ``R = W_b Vᵀ V W_vᵀ`` [I, d, l]."""
        n = regions.shape[1]
        if self.position_bias and n != self.b_v.shape[0]:
            raise UserError(f"JGCAR's per-region bias b_v was built for {self.b_v.shape[0]} regions, the features "
                            f"have {n} (set num_regions, or position_bias=False)")
        v = regions * mask.unsqueeze(-1).to(regions.dtype)
        proj = v @ self.W_v.weight.to(v.dtype).t()                                # [I, N, l]
        x = torch.tanh(proj + self.b_v.to(v.dtype))
        r = v.transpose(1, 2) @ proj                                              # Vᵀ V W_vᵀ  [I, d, l]
        r = torch.einsum("ed,idl->iel", self.W_b.weight.to(v.dtype), r)           # W_b · …     [I, d, l]
        return {"X": x, "R": r}

    def caption_side(self, words: torch.Tensor, mask: torch.Tensor) -> dict[str, torch.Tensor]:
        """``words`` [C, T, d] → ``Z = tanh(S W_sᵀ + b_s)`` [C, T, l] and ``Q = W_bᵀ Sᵀ S W_sᵀ`` [C, d, l]."""
        t = words.shape[1]
        s = words * mask.unsqueeze(-1).to(words.dtype)
        proj = s @ self.W_s.weight.to(s.dtype).t()                                # [C, T, l]
        bias = self.b_s[:t] if self.position_bias else self.b_s
        if self.position_bias and t > self.b_s.shape[0]:
            raise ValueError(f"captions of {t} tokens exceed max_words={self.b_s.shape[0]}")
        z = torch.tanh(proj + bias.to(s.dtype))
        q = s.transpose(1, 2) @ proj                                              # Sᵀ S W_sᵀ   [C, d, l]
        q = torch.einsum("de,cdl->cel", self.W_b.weight.to(s.dtype), q)           # W_bᵀ · …    [C, d, l]
        return {"Z": z, "Q": q}

    # the pair-specific step ------------------------------------------------------------------------------
    def _attention_weights(self, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """``w_hv``, ``w_hs`` as ``[l]`` vectors of ``dtype``."""
        return self.w_hv.weight.view(-1).to(dtype), self.w_hs.weight.view(-1).to(dtype)

    def _scale_parameter_grad(self, grad: torch.Tensor) -> torch.Tensor:
        return grad if self.score_grad_scale == 1.0 else grad * self.score_grad_scale

    def _aligned(self, v, vmask, x, r, s, smask, z, q) -> torch.Tensor:
        """Scores ``[P]`` of P aligned pairs (all arguments have the pair on dim 0)."""
        hv = x * torch.tanh(v @ q)                                                # [P, N, l]
        hs = z * torch.tanh(s @ r)                                                # [P, T, l]
        w_hv, w_hs = self._attention_weights(hv.dtype)
        av = masked_softmax(hv @ w_hv, vmask, dim=1)                              # [P, N]
        as_ = masked_softmax(hs @ w_hs, smask, dim=1)                             # [P, T]
        v_bar = (av.unsqueeze(-1) * v).sum(1)                                     # [P, d]
        s_bar = (as_.unsqueeze(-1) * s).sum(1)
        return F.cosine_similarity(v_bar, s_bar, dim=-1, eps=1e-8)

    def pair_scores(self, images: Embeddings, captions: Embeddings, img_idx: torch.Tensor, cap_idx: torch.Tensor,
                    chunk: int = 256, recompute: bool = False) -> torch.Tensor:
        """α of pairs ``(img_idx[p], cap_idx[p])`` → ``[P]``, ``chunk`` pairs at a time (checkpointed with
        ``recompute``, so memory holds no ``[P, N, l]`` intermediates)."""
        out = []
        for start in range(0, img_idx.numel(), chunk):
            ii, cc = img_idx[start:start + chunk], cap_idx[start:start + chunk]

            def run(ii=ii, cc=cc, iv=images["regions"], ix=images["X"], ir=images["R"],
                    cs=captions["words"], cz=captions["Z"], cq=captions["Q"]):
                return self._aligned(iv[ii], images["mask"][ii], ix[ii], ir[ii],
                                     cs[cc], captions["mask"][cc], cz[cc], cq[cc])
            out.append(checkpoint(run, use_reentrant=False) if recompute else run())
        return cat_parts(out) if out else images["regions"].new_zeros(0)

    def _block(self, v, vmask, x, r, s, smask, z, q) -> torch.Tensor:
        """Scores ``[I, C]`` of every pair of ``I`` images × ``C`` captions (:meth:`_block_attention`'s scores)."""
        return self._block_attention(v, vmask, x, r, s, smask, z, q)[0]

    def _block_attention(self, v, vmask, x, r, s, smask, z, q) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Scores ``[I, C]`` of every pair of a block and the co-attention: ``a^v`` ``[I, N, C]`` (softmax over regions)
        and ``a^s`` ``[C, T, I]`` (over words), padding 0; the logits by :class:`TanhContraction` (``V_i Q_j`` and
        ``S_j R_i`` one GEMM a chunk each, no ``[I, N, C, l]`` tensor kept for backward)."""
        w_hv, w_hs = self._attention_weights(v.dtype)
        logit_v = TanhContraction.apply(v, q, x * w_hv)                           # Σ_l w_hv x tanh(V Q)  [I, N, C]
        logit_s = TanhContraction.apply(s, r, z * w_hs)                           # Σ_l w_hs z tanh(S R)  [C, T, I]
        av = masked_softmax(logit_v, vmask.unsqueeze(2), dim=1)                                       # [I, N, C]
        as_ = masked_softmax(logit_s, smask.unsqueeze(2), dim=1)                                      # [C, T, I]
        v_bar = torch.einsum("inc,ind->icd", av, v)                                                   # [I, C, d]
        s_bar = torch.einsum("cti,ctd->icd", as_, s)                                                  # [I, C, d]
        return F.cosine_similarity(v_bar, s_bar, dim=-1, eps=1e-8), av, as_

    def block_scores(self, images: Embeddings, captions: Embeddings) -> torch.Tensor:
        """α of every pair of a block → ``[I, C]`` (memory: :class:`TanhContraction`'s chunks)."""
        return self._block(images["regions"], images["mask"], images["X"], images["R"],
                           captions["words"], captions["mask"], captions["Z"], captions["Q"])


# ------------------------------------------------------------------------------------------------ losses

def intra_modal_triplet(sims: torch.Tensor, positives: torch.Tensor, negatives: torch.Tensor, margin: float,
                        reduction: str = "mean_positive") -> torch.Tensor:
    """J2/J3 (Eq. 7–8) of a within-modality similarity matrix ``sims`` [B, B].

    ``positives``/``negatives`` [B, B] bool (the diagonal is ignored). Triplet (k, p, n) costs
    ``[margin − sims[k, p] + sims[k, n]]₊``. ``mean_positive``: Σ_k Σ_n mean_p; ``sum``: Σ_k Σ_p Σ_n."""
    if reduction not in INTRA_REDUCTIONS:
        raise ValueError(f"intra_reduction must be one of {', '.join(INTRA_REDUCTIONS)}")
    eye = torch.eye(sims.shape[0], dtype=torch.bool, device=sims.device)
    pos, neg = positives & ~eye, negatives & ~eye & ~positives
    cost = (margin - sims.unsqueeze(2) + sims.unsqueeze(1)).clamp(min=0)       # [k, p, n]
    valid = pos.unsqueeze(2) & neg.unsqueeze(1)
    cost = cost * valid.to(cost.dtype)
    if reduction == "sum":
        return cost.sum()
    per_anchor_negative = cost.sum(1) / pos.sum(1, keepdim=True).clamp(min=1).to(cost.dtype)  # [k, n]
    return per_anchor_negative.sum()


def decorrelation_loss(x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """½(‖C‖²_F − ‖diag C‖²) of the per-location batch covariance of ``x`` [B, K, d] (Eq. 9; ``mask`` [B, K])."""
    w = mask.to(x.dtype).unsqueeze(-1)                                            # [B, K, 1]
    mean = (x * w).sum(0, keepdim=True) / w.sum(0, keepdim=True).clamp(min=1)     # μ per location [1, K, d]
    centred = (x - mean) * w
    cov = torch.einsum("bkd,bke->de", centred, centred) / x.shape[0]
    return 0.5 * (cov.pow(2).sum() - cov.diagonal().pow(2).sum())


def bi_rank_loss(alpha_i2t: torch.Tensor, alpha_i2t_intra: torch.Tensor, alpha_t2i: torch.Tensor,
                 alpha_t2i_intra: torch.Tensor, gamma: float) -> torch.Tensor:
    """J_C (Eq. 16, both directions) from co-attentive scores of the comparison sets, summed over anchors.

    Each argument is ``[B, 1 + M']``: column 0 the positive pair's α, the rest the negatives' (``-inf`` where an
    anchor has fewer than M′ valid negatives). Image anchor: ``alpha_i2t`` = α(i, s) over {j} ∪ S⁻_i,
    ``alpha_i2t_intra`` = α(v, j) over {i} ∪ V⁻_i; caption anchor: ``alpha_t2i`` = α(v, j) over {i} ∪ V⁻_j,
    ``alpha_t2i_intra`` = α(i, s) over {j} ∪ S⁻_j. ``P = 2 − p_cross − p_intra`` per anchor."""
    def p0(a: torch.Tensor) -> torch.Tensor:
        return torch.softmax(gamma * a, dim=1)[:, 0]
    p_images = 2 - p0(alpha_i2t) - p0(alpha_i2t_intra)
    p_captions = 2 - p0(alpha_t2i) - p0(alpha_t2i_intra)
    return p_images.sum() + p_captions.sum()


def mine_negatives(sims: torch.Tensor, valid: torch.Tensor, count: int, mode: str) -> tuple[torch.Tensor, torch.Tensor]:
    """Per row of ``sims`` [B, M], ``count`` columns among ``valid`` ones: the least (``dissimilar``) or most
    (``similar``) similar. Returns (indices [B, count'], found [B, count'] bool), count' = min(count, M)."""
    if mode not in NEGATIVE_MINING:
        raise ValueError(f"negative_mining must be one of {', '.join(NEGATIVE_MINING)}")
    count = min(count, sims.shape[1])
    fill = float("inf") if mode == "dissimilar" else float("-inf")
    keyed = sims.detach().masked_fill(~valid, fill)
    values, idx = keyed.topk(count, dim=1, largest=(mode == "similar"))
    return idx, torch.isfinite(values)


# --------------------------------------------------------------------------------------------------- model

class JGCAR(MatchingModel):
    """JGCAR on VGG-16 14×14 maps (docs/models-jgcar.md); settings: :class:`JGCARConfig`.

    :meth:`explain`: the pair's co-attention (Eq. 13): ``"visual_attention"`` ``[1, N]`` over the real cells and
    ``"textual_attention"`` ``[1, T]`` over the real tokens (≤ ``max_words``), both softmaxes."""

    has_global_stage = True
    compiled_functions = ("bi_rank",)     # the co-attentive part of the training loss (--compile)
    #: the attention maps :meth:`explain` returns (class docstring)
    explains = ("visual_attention", "textual_attention")

    def __init__(self, vocab_size: int, img_dim: int = 512, config: "JGCARConfig | None" = None):
        cfg = self.config = config if config is not None else JGCARConfig()
        super().__init__(cfg.margin, cfg.max_violation)
        embed_size, word_dim, hidden_size, num_regions = cfg.embed_size, cfg.word_dim, cfg.hidden_size, cfg.num_regions
        max_words, dropout, position_bias = cfg.max_words, cfg.dropout, cfg.position_bias
        global_similarity, lambda2, lambda3, lambda4 = cfg.global_similarity, cfg.lambda2, cfg.lambda3, cfg.lambda4
        intra_reduction, gamma, num_negatives = cfg.intra_reduction, cfg.gamma, cfg.num_negatives
        negative_mining, beta, pair_chunk = cfg.negative_mining, cfg.beta, cfg.pair_chunk
        shortlist, optimizer, momentum, weight_decay = cfg.shortlist, cfg.optimizer, cfg.momentum, cfg.weight_decay
        for value, allowed, what in ((global_similarity, GLOBAL_SIMILARITIES, "global_similarity"),
                                     (intra_reduction, INTRA_REDUCTIONS, "intra_reduction"),
                                     (negative_mining, NEGATIVE_MINING, "negative_mining")):
            if value not in allowed:
                raise ValueError(f"{what} must be one of {', '.join(allowed)}, not {value!r}")
        if not 0.0 <= beta <= 1.0:
            raise ValueError("beta must be in [0, 1]")
        if optimizer not in OPTIMIZERS:
            raise ValueError(f"optimizer must be one of {', '.join(OPTIMIZERS)}, not {optimizer!r}")
        #: two-step evaluation: shortlist size per query (the evaluator and the loop's validation read it)
        self.shortlist = int(shortlist)
        self.optimizer_name, self.momentum, self.weight_decay = optimizer, float(momentum), float(weight_decay)
        #: [N_train_images, L] bool labels of the training images (set by ``prepare_training``; not saved)
        self.image_label_table: torch.Tensor | None = None
        self.labels_are_captions = False
        self.max_words, self.global_similarity = int(max_words), global_similarity
        self.lambda2, self.lambda3, self.lambda4 = float(lambda2), float(lambda3), float(lambda4)
        self.intra_reduction, self.gamma = intra_reduction, float(gamma)
        self.num_negatives, self.negative_mining = int(num_negatives), negative_mining
        self.beta, self.pair_chunk = float(beta), int(pair_chunk)
        self.img_enc = MapEncoder(img_dim, embed_size, dropout)
        self.txt_enc = PhraseTextEncoder(vocab_size, word_dim, hidden_size, embed_size, dropout)
        self.coattn = CoAttention(embed_size, hidden_size, num_regions, max_words, position_bias)

    # -- the shared interface ---------------------------------------------------------------------------
    def encode_images(self, features: torch.Tensor, mask: torch.Tensor) -> Embeddings:
        """``features`` [B, N, 512], ``mask`` [B, N] → ``regions`` V [B, N, d], ``mask``, ``global`` V̂ [B, d]."""
        v = self.img_enc(features) * mask.unsqueeze(-1).to(features.dtype)
        g = masked_mean(v, mask)
        return {"regions": v, "mask": mask, "global": l2norm(g) if self.global_similarity == "cosine" else g}

    def encode_captions(self, tokens: torch.Tensor, lengths: torch.Tensor) -> Embeddings:
        """``tokens`` [B, L], ``lengths`` [B] → ``words`` S^s [B, T, d] (T ≤ max_words), ``mask`` [B, T], ``global``."""
        lengths = lengths.clamp(max=self.max_words)
        words = self.txt_enc(tokens, lengths)
        mask = lengths_mask(lengths, words.shape[1], words.device)
        g = masked_mean(words, mask)
        return {"words": words, "mask": mask, "global": l2norm(g) if self.global_similarity == "cosine" else g}

    def index_vectors(self, embeddings: Embeddings, side: str) -> torch.Tensor:
        """The global vector ``[n, d]`` (``global_score``, the stage that shortlists, is their inner product)."""
        return embeddings["global"]

    def global_score(self, images: Embeddings, captions: Embeddings, dtype: torch.dtype | None = None) -> torch.Tensor:
        """Ω = V̂ Ŝᵀ ``[n_img, n_cap]``: the first step of retrieval and J1's scores."""
        dtype = dtype or images["regions"].dtype
        return images["global"].to(dtype) @ captions["global"].to(dtype).t()

    def _sides(self, images: Embeddings, captions: Embeddings, dtype: torch.dtype) -> tuple[Embeddings, Embeddings]:
        regions, words = images["regions"].to(dtype), captions["words"].to(dtype)
        img = {"regions": regions, "mask": images["mask"].bool(),
               **self.coattn.image_side(regions, images["mask"].bool())}
        cap = {"words": words, "mask": captions["mask"].bool(),
               **self.coattn.caption_side(words, captions["mask"].bool())}
        return img, cap

    def score(self, images: Embeddings, captions: Embeddings, dtype: torch.dtype | None = None) -> torch.Tensor:
        """Co-attentive α of every pair of the block ``[n_img, n_cap]`` (Eq. 11–15): the re-rank score."""
        img, cap = self._sides(images, captions, dtype or images["regions"].dtype)
        return self.coattn.block_scores(img, cap)

    def explain(self, images: Embeddings, captions: Embeddings) -> dict[str, torch.Tensor]:
        """The co-attention behind ``score`` for one pair, padding dropped (class docstring: names and shapes)."""
        check_one_pair(images, captions)
        img, cap = self._sides(images, captions, images["regions"].dtype)
        _, av, as_ = self.coattn._block_attention(img["regions"], img["mask"], img["X"], img["R"],
                                                   cap["words"], cap["mask"], cap["Z"], cap["Q"])
        return {"visual_attention": av[0, :, 0][img["mask"][0]].unsqueeze(0),
                "textual_attention": as_[0, :, 0][cap["mask"][0]].unsqueeze(0)}

    def pair_score(self, images: Embeddings, captions: Embeddings, img_idx: torch.Tensor,
                   cap_idx: torch.Tensor, dtype: torch.dtype | None = None, image_block: int = 128) -> torch.Tensor:
        """Co-attentive α of the listed pairs only → ``[P]``, ``image_block`` images and ``pair_chunk`` pairs at a
        time (memory bounded for any split). The pairs are grouped on the host (the indices read back once, not a
        ``nonzero`` and a ``unique`` per block and chunk, each a wait on a GPU); each image block's side ``X``,
        ``R`` is computed once for all its pairs."""
        dtype = dtype or images["regions"].dtype
        device = images["regions"].device
        out = images["regions"].new_empty(img_idx.numel(), dtype=dtype)
        images_of, captions_of = img_idx.cpu().numpy(), cap_idx.cpu().numpy()
        for block_index in np.unique(images_of // image_block):
            start = int(block_index) * image_block
            sel = np.flatnonzero((images_of >= start) & (images_of < start + image_block))   # ascending
            rows = slice(start, start + image_block)
            img = {"regions": images["regions"][rows].to(dtype), "mask": images["mask"][rows].bool()}
            img.update(self.coattn.image_side(img["regions"], img["mask"]))
            for c in range(0, len(sel), self.pair_chunk):
                part = sel[c:c + self.pair_chunk]
                caps, inverse = np.unique(captions_of[part], return_inverse=True)
                caps = torch.from_numpy(caps).to(device, non_blocking=True)
                words = captions["words"][caps].to(dtype)
                mask = captions["mask"][caps].bool()
                cap = {"words": words, "mask": mask, **self.coattn.caption_side(words, mask)}
                local = torch.from_numpy(images_of[part] - start).to(device, non_blocking=True)
                scores = self.coattn.pair_scores(img, cap, local, torch.from_numpy(inverse.reshape(-1)).to(
                    device, non_blocking=True), chunk=len(part))
                out[torch.from_numpy(part).to(device, non_blocking=True)] = scores
        return out

    # -- the objective ----------------------------------------------------------------------------------
    def joint_loss(self, images: Embeddings, captions: Embeddings, image_index: torch.Tensor,
                   image_labels: torch.Tensor | None = None, caption_labels: torch.Tensor | None = None,
                   terms: dict[str, float] | None = None) -> torch.Tensor:
        """J = β J_G + (1 − β) J_C of a batch whose row k pairs image k with caption k.

        ``image_index`` [B]; ``image_labels``/``caption_labels`` [B, L] bool (None: same-image positives only);
        ``terms`` receives each term's value."""
        same = image_index.view(-1, 1) == image_index.view(1, -1)                  # [B, B]
        omega = self.global_score(images, captions)                                # [B, B]
        j1 = self.ranking_loss(omega, positives=same)

        def related(labels: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
            if labels is None:
                return same, ~same
            shared = (labels.float() @ labels.float().t()) > 0
            return same | shared, ~same & ~shared
        gi, gc = images["global"], captions["global"]
        img_pos, img_neg = related(image_labels)
        cap_pos, cap_neg = related(caption_labels)
        j2 = intra_modal_triplet(gi @ gi.t(), img_pos, img_neg, self.margin, self.intra_reduction)
        j3 = intra_modal_triplet(gc @ gc.t(), cap_pos, cap_neg, self.margin, self.intra_reduction)
        j4 = decorrelation_loss(images["regions"], images["mask"].bool()) + \
            decorrelation_loss(captions["words"], captions["mask"].bool())
        j_g = j1 + self.lambda2 * j2 + self.lambda3 * j3 + self.lambda4 * j4
        j_c = (self.scoring("bi_rank")(images, captions, omega, gi @ gi.t(), gc @ gc.t(), same) if self.beta < 1
               else omega.new_zeros(()))
        if terms is not None:
            terms.update({k: float(v.detach()) for k, v in dict(j1=j1, j2=j2, j3=j3, j4=j4, j_g=j_g, j_c=j_c).items()})
        return self.beta * j_g + (1 - self.beta) * j_c

    def bi_rank(self, images: Embeddings, captions: Embeddings, omega: torch.Tensor, image_sims: torch.Tensor,
                caption_sims: torch.Tensor, same: torch.Tensor) -> torch.Tensor:
        """J_C: mine the comparison sets from the global similarities, score them co-attentively, Eq. 16."""
        b = omega.shape[0]
        rows = torch.arange(b, device=omega.device)
        other = ~same
        s_neg, s_ok = mine_negatives(omega, other, self.num_negatives, self.negative_mining)          # S⁻_i
        v_neg_i, v_ok_i = mine_negatives(image_sims, other, self.num_negatives, self.negative_mining)  # V⁻_i
        v_neg, v_ok = mine_negatives(omega.t(), other, self.num_negatives, self.negative_mining)      # V⁻_j
        s_neg_j, s_ok_j = mine_negatives(caption_sims, other, self.num_negatives, self.negative_mining)  # S⁻_j
        m = s_neg.shape[1]
        anchor = rows.view(-1, 1).expand(b, m)
        # pairs (image, caption): positives, then the four negative sets
        img_idx = torch.cat([rows, anchor.reshape(-1), v_neg_i.reshape(-1), v_neg.reshape(-1), anchor.reshape(-1)])
        cap_idx = torch.cat([rows, s_neg.reshape(-1), anchor.reshape(-1), anchor.reshape(-1), s_neg_j.reshape(-1)])
        img, cap = self._sides(images, captions, images["regions"].dtype)
        # every pair of the batch as one block (no per-pair gathers), then the comparison sets' entries
        alpha = self.coattn.block_scores(img, cap)[img_idx, cap_idx]
        pos, rest = alpha[:b].view(b, 1), alpha[b:].view(4, b, m)

        def comparison(neg: torch.Tensor, ok: torch.Tensor) -> torch.Tensor:
            return torch.cat([pos, neg.masked_fill(~ok, float("-inf"))], dim=1)
        return bi_rank_loss(comparison(rest[0], s_ok), comparison(rest[1], v_ok_i), comparison(rest[2], v_ok),
                            comparison(rest[3], s_ok_j), self.gamma)

    batch_extras = ("image_index",)     # each row's training image, to look up its labels

    def prepare_training(self, inputs: dict[str, torch.Tensor]) -> None:
        """Install the intra-modal label table of the training images (built by
        :func:`retr.trainers.models.side_inputs.load_jgcar_inputs`): ``image_labels`` [N_train_images, L] bool, and
        ``labels_are_captions`` (a 0-d bool tensor: True when the labels come from a label file, so a caption has
        its image's labels; False for the caption-concept fallback, where captions are positives iff same image)."""
        self.image_label_table = inputs["image_labels"].bool()
        self.labels_are_captions = bool(inputs["labels_are_captions"])

    def configure_optimizer(self, lr: float) -> torch.optim.Optimizer:
        """``paper``: SGD (momentum, weight decay) on the encoders + RMSprop on the co-attention, both at ``lr``
        (§3.1: "SGD for training GRL and Rmsprop for training co-attention", lr 4e-4, momentum 0.99, weight
        decay 1e-8; RMSprop's 0.99 is read as its smoothing constant α, with no momentum). ``adam``: Adam on all."""
        if self.optimizer_name == "adam":
            return torch.optim.Adam(self.parameters(), lr=lr)
        groups = split_parameters(self)
        return PerGroupOptimizer([
            torch.optim.SGD(groups["global"], lr=lr, momentum=self.momentum, weight_decay=self.weight_decay),
            torch.optim.RMSprop(groups["coattention"], lr=lr, alpha=self.momentum, weight_decay=self.weight_decay)])

    def forward(self, features: torch.Tensor, mask: torch.Tensor, tokens: torch.Tensor, lengths: torch.Tensor,
                gather: Callable[[Embeddings], Embeddings] | None = None, image_index: torch.Tensor | None = None,
                image_labels: torch.Tensor | None = None, caption_labels: torch.Tensor | None = None) -> torch.Tensor:
        """One training step's joint loss (``image_index`` [B] defaults to every row being its own image).

        Labels not given are looked up in the table ``prepare_training`` built, by ``image_index``."""
        if image_labels is None and image_index is not None and self.image_label_table is not None:
            image_labels = self.image_label_table[image_index.cpu()].to(features.device, non_blocking=True)
            if self.labels_are_captions and caption_labels is None:
                caption_labels = image_labels
        images = self.encode_images(features, mask)
        captions = self.encode_captions(tokens, lengths)
        extras = {"image_index": image_index.to(features.device, non_blocking=True)      # a host index
                  if image_index is not None else torch.arange(features.shape[0], device=features.device)}
        if image_labels is not None:
            extras["image_labels"] = image_labels
        if caption_labels is not None:
            extras["caption_labels"] = caption_labels
        # every process scores the gathered global batch: the co-attention weights used after the gather get
        # their gradient scaled by 1/world size so the sum over processes is the single-process gradient
        self.coattn.score_grad_scale = 1.0
        if gather is not None:
            images, captions, extras = gather(images), gather(captions), gather(extras)
            self.coattn.score_grad_scale = 1.0 / gather.world_size
        return self.joint_loss(images, captions, extras["image_index"], extras.get("image_labels"),
                               extras.get("caption_labels"))

    def loss(self, scores: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError("JGCAR's objective needs the embeddings: call forward() or joint_loss()")


def split_parameters(model: "JGCAR") -> Mapping[str, list[nn.Parameter]]:
    """``{"global": encoder parameters (SGD), "coattention": co-attention parameters (RMSprop)}``."""
    groups: dict[str, list[nn.Parameter]] = {"global": [], "coattention": []}
    for name, p in model.named_parameters():
        groups["coattention" if name.startswith("coattn.") else "global"].append(p)
    return groups


# ------------------------------------------------------------------------------------------------ settings

@dataclass
class JGCARConfig(Settings):
    """JGCAR's settings (defaults: the paper's §3.1; ``docs/models-jgcar.md`` gives every decision)."""

    embed_size: int = embed_size_setting(256)
    word_dim: int = word_dim_setting(512)
    hidden_size: int = size_setting(512, "Co-attention / phrase hidden size l.")
    num_regions: int = size_setting(196, "Map cells N per image (196 = 14×14 from a 448 input; 49 for 224-px maps).")
    max_words: int = size_setting(20, "Tokens kept per caption (the presets: 20 COCO, 15 Flickr30K).")
    dropout: float = dropout_setting(0.5, "Dropout on features, words and phrases.")
    position_bias: bool = setting(True, "Per-region/per-word biases b_v, b_s as printed, or one bias vector each.",
                                  flag="--position-bias/--shared-bias")
    global_similarity: Literal[GLOBAL_SIMILARITIES] = setting(
        "dot", "Ω = V̂ᵀŜ as printed (dot) or on l2-normalised vectors (cosine).")
    lambda2: float = setting(1.0, "Weight of the image intra-modal loss J2.")
    lambda3: float = setting(1.0, "Weight of the text intra-modal loss J3.")
    lambda4: float = setting(1.0, "Weight of the de-correlation loss J4.")
    intra_reduction: Literal[INTRA_REDUCTIONS] = setting(
        "mean_positive", "J2/J3: mean over positives (J1's scale) or the literal sum over all triplets.")
    gamma: float = setting(10.0, "Bi-rank softmax scale γ (the paper says 10 in §3.1 and 20 in §3.4).")
    num_negatives: int = size_setting(30, "M′, negatives per comparison set.")
    negative_mining: Literal[NEGATIVE_MINING] = setting(
        "similar", "Bi-rank negatives by the global score: the M′ most similar (hardest; the paper's "
                   "\"representative non-matching pairs\") or the M′ least similar (\"most dissimilar\" literally).")
    beta: float = setting(0.5, "J = β·J_G + (1 − β)·J_C.")
    pair_chunk: int = size_setting(256, "Pairs co-attended at once (memory bound; does not change results).")
    concept_min_captions: int = size_setting(
        2, "Without --labels: a word is an image label when at least this many of its captions use it.")
    shortlist: int = size_setting(100, "Two-step retrieval: candidates re-ranked per query.")
    optimizer: Literal[OPTIMIZERS] = setting(
        "paper", "paper: SGD on the encoders + RMSprop on the co-attention; adam: Adam on everything.")
    momentum: float = setting(0.99, "SGD momentum and RMSprop's smoothing constant α.")
    weight_decay: float = setting(1e-8, "Weight decay of SGD and RMSprop.")
    margin: float = margin_setting(0.2)
    max_violation: bool = violation_setting(False)


#: The paper's §3.1 schedule: lr 4e-4, batch 200, early stop after 5 epochs without a better validation rSum.
JGCAR_SCHEDULE = {"batch_size": 200, "epochs": 128, "early_stop": 5, "lr": 4e-4, "lr_update": 128, "grad_clip": 2.0}


def _jgcar_inputs(data, files, config, vocab):
    return load_jgcar_inputs(data, files.get("labels"), config.concept_min_captions)


def _jgcar_features(config: "JGCARConfig", shape: tuple[int, int]) -> str | None:
    """The per-region bias b_v has one row per map cell: refused for features with another number of positions."""
    k = shape[0]
    if config.position_bias and config.num_regions != k:
        return (f"JGCAR's per-region bias b_v is built for --num-regions {config.num_regions}, the features have {k} "
                f"positions per image; give --num-regions {k}, or --shared-bias (one bias for every position)")
    return None


def _jgcar_upgrade(model_args: dict) -> tuple[dict, dict]:
    """Runs written before the spec registry kept the label file among the model's arguments; runs whose
    ``model_args`` lack ``negative_mining`` were trained before its default became ``similar``."""
    labels = model_args.pop("labels", None)
    model_args.setdefault("negative_mining", "dissimilar")
    return model_args, ({"labels": labels} if labels else {})


register_model(ModelSpec(
    name="jgcar", model_class=JGCAR, config_class=JGCARConfig,
    summary="Train JGCAR (joint global and co-attentive representations) on VGG-16 14×14 maps. Validation and "
            "`retr-train eval` use two-step retrieval: a global shortlist of --shortlist candidates per query, "
            "re-ranked by the co-attentive score; both steps' numbers and times are reported.",
    examples=("retr-train jgcar --features data/coco/features/vgg16-maps.h5 --manifest data/coco/manifest.jsonl "
              "--preset coco --labels data/coco/instance_labels.json --out runs/jgcar-coco",
              "retr-train eval runs/jgcar-coco --protocol coco-1k"),
    presets={"coco": {**JGCAR_SCHEDULE, "max_words": 20}, "f30k": {**JGCAR_SCHEDULE, "max_words": 15}},
    default_preset="f30k",
    inputs=(InputFile("labels", "Image labels for the intra-modal losses (JSON {id: [labels]} or .jsonl "
                                "{id, labels}), e.g. COCO instance categories; default: shared caption concepts "
                                "(see docs/models-jgcar.md).", what="a label file (.json or .jsonl)"),),
    load_inputs=_jgcar_inputs, upgrade_args=_jgcar_upgrade, feature_kinds=("maps",),
    check_features=_jgcar_features))
