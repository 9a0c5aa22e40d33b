"""SMAN — Stacked Multi-modal Attention Network (Ji, Wang, Han, Pang; ``papers/sman.txt``).

Shapes: ``M`` grid cells (49 = 7×7 ResNet-152 res5c), ``D_in`` their size (2048), ``d`` the common size (512), ``L``
words of a caption, ``B`` the batch. :meth:`SMAN.encode_images`: ``[B, M, D_in]`` → the pair-independent levels
``v0``, ``v1`` ``[B, d]``; :meth:`SMAN.encode_captions`: ``[B, L]`` → ``t0``, ``t1`` ``[B, d]`` and the words
``[B, L', d]``; :meth:`SMAN.score`: ``Σ_k cos(v_k, t_k)`` ``[n_img, n_cap]``, its level 2 (the multi-modal step)
computed for every pair of the block; :meth:`SMAN.forward`: the training loss (Eq. 23). Equations and decisions:
docs/models-seam-sman.md ("SMAN")."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import torch
import torch.nn.functional as F
from torch import nn

from retr.trainers.config import (Settings, dropout_setting, embed_size_setting, freeze_word_vectors_setting,
                                  margin_setting, setting, violation_setting, word_dim_setting, word_vectors_setting)
from retr.trainers.models.registry import ModelSpec, register_model
from retr.trainers.models.base import Embeddings, MatchingModel, check_one_pair
from retr.trainers.models.layers import (EPS, cat_parts, cosine, cosine_matrix, lengths_mask, masked_mean, row_linear,
                                        masked_softmax, run_rnn, scale_grad)
from retr.trainers.models.text import install_word_vectors

INTRA_PAIR_LEVELS = ("each", "sum")
EVAL_SCORES = ("sum", "concat")
TEXT_RNNS = ("lstm", "gru")
OPTIMIZERS = ("adadelta", "adam")


class GuidedAttention(nn.Module):
    """One attention step of SMAN: ``a = softmax(w_h · (tanh(W x_m) ⊙ tanh(W_q q)))`` over the items ``m``.

    Split in two so that the pair-specific step never forms ``[n_img, n_cap, T, d]``: :meth:`keys` is per item
    (``w_h ⊙ tanh(W x)``, [B, T, d]), :meth:`gate` per query (``tanh(W_q q)``, [..., d]); the logits are their dot
    product. ``w_h``'s bias is dropped because softmax ignores a constant."""

    def __init__(self, in_dim: int, query_dim: int, hidden: int):
        super().__init__()
        self.item = nn.Linear(in_dim, hidden)     # W_v / W_t
        self.query = nn.Linear(query_dim, hidden)  # W_{v,q} / W_{t,q}
        self.logit = nn.Linear(hidden, 1)          # W_{v,h} / W_{t,h}

    def keys(self, items: torch.Tensor) -> torch.Tensor:
        """``items`` [B, T, in_dim] → ``w_h ⊙ tanh(W x)`` [B, T, hidden]."""
        return torch.tanh(self.item(items)) * self.logit.weight.view(-1)

    def gate(self, query: torch.Tensor, grad_scale: float = 1.0, by_row: bool = False) -> torch.Tensor:
        """``query`` [..., query_dim] → ``tanh(W_q q)`` [..., hidden] (``grad_scale``: see ``SMAN.forward``;
        ``by_row``: ``query`` [P, query_dim] of listed pairs, each row's product its own, :func:`row_linear`)."""
        linear = row_linear if by_row else F.linear
        return torch.tanh(linear(query, scale_grad(self.query.weight, grad_scale),
                                 scale_grad(self.query.bias, grad_scale)))

    def forward(self, items: torch.Tensor, mask: torch.Tensor, query: torch.Tensor) -> torch.Tensor:
        """Weights [B, T] of ``items`` [B, T, in_dim] (``mask`` [B, T]) for one query per row, [B, query_dim]."""
        logits = (self.keys(items) * self.gate(query).unsqueeze(1)).sum(-1)
        return masked_softmax(logits, mask)


class WordEncoder(nn.Module):
    """Per-word features S ``[B, L', d]`` (L' = max length) of captions ``[B, L]``: embedding → bi-RNN, averaged.

    ``rnn="lstm"`` is the paper's bi-LSTM; ``"gru"`` is offered for comparison with the GRU-based models. Dropout
    applies to the word embeddings. Positions past a caption's length are 0."""

    def __init__(self, vocab_size: int, word_dim: int, hidden: int, rnn: str = "lstm", dropout: float = 0.0):
        super().__init__()
        if rnn not in TEXT_RNNS:
            raise ValueError(f"text_rnn must be one of {', '.join(TEXT_RNNS)}, not {rnn!r}")
        self.hidden = hidden
        self.embed = nn.Embedding(vocab_size, word_dim)
        nn.init.xavier_uniform_(self.embed.weight)
        self.dropout = nn.Dropout(dropout)
        cls = nn.LSTM if rnn == "lstm" else nn.GRU
        self.rnn = cls(word_dim, hidden, batch_first=True, bidirectional=True)

    def forward(self, tokens: torch.Tensor, lengths: torch.Tensor) -> torch.Tensor:
        x = self.dropout(self.embed(tokens))
        out = run_rnn(self.rnn, x, lengths)
        return (out[..., :self.hidden] + out[..., self.hidden:]) / 2


class SMAN(MatchingModel):
    """SMAN on grid features ``[B, M, D_in]`` (docs/models-seam-sman.md, "SMAN"); settings: :class:`SMANConfig`.

    :meth:`explain`: ``"visual_attention"`` ``[S, K]`` and ``"textual_attention"`` ``[S, L]``, row 0 intra-modal
    (Eq. 6, 10), row 1 multi-modal for the pair (Eq. 14, 17); S = 2, or 1 without the multi-modal step."""

    #: the attention maps :meth:`explain` returns (class docstring)
    explains = ("visual_attention", "textual_attention")

    has_global_stage = True
    pair_score_is_aligned = True               # pair_score scores each listed pair on its own
    compiled_functions = ("level_scores",)     # what forward scores the batch with (--compile)

    def __init__(self, vocab_size: int, img_dim: int = 2048, config: "SMANConfig | None" = None,
                 word_vectors_file: str = ""):
        cfg = self.config = config if config is not None else SMANConfig()
        self.word_vectors_file = word_vectors_file     # the vectors the words started from
        super().__init__(cfg.margin, cfg.max_violation)
        embed_size, word_dim, alpha, use_location = cfg.embed_size, cfg.word_dim, cfg.alpha, cfg.use_location
        multimodal_step, intra_pair_weight = cfg.multimodal_step, cfg.intra_pair_weight
        intra_pair_margin, intra_pair_level, eval_score = cfg.intra_pair_margin, cfg.intra_pair_level, cfg.eval_score
        divide_by_cells, text_rnn, dropout = cfg.divide_by_cells, cfg.text_rnn, cfg.dropout
        optimizer, rho, weight_decay, shortlist = cfg.optimizer, cfg.rho, cfg.weight_decay, cfg.shortlist
        if optimizer not in OPTIMIZERS:
            raise ValueError(f"optimizer must be one of {', '.join(OPTIMIZERS)}, not {optimizer!r}")
        self.optimizer_name, self.rho, self.weight_decay = optimizer, float(rho), float(weight_decay)
        self.adadelta_eps = float(cfg.adadelta_eps)
        #: > 0: evaluate in two steps (``retr.trainers.evaluation.two_step``) — shortlist by the pair-independent levels
        #: 0 and 1, re-score the top ``shortlist`` with all three levels; 0 scores every pair (the paper)
        self.shortlist = int(shortlist)
        if not 0.0 <= alpha <= 1.0:
            raise ValueError(f"alpha must be in [0, 1], got {alpha}")
        if intra_pair_level not in INTRA_PAIR_LEVELS:
            raise ValueError(f"intra_pair_level must be one of {', '.join(INTRA_PAIR_LEVELS)}")
        if eval_score not in EVAL_SCORES:
            raise ValueError(f"eval_score must be one of {', '.join(EVAL_SCORES)}")
        d = embed_size
        self.alpha, self.use_location, self.multimodal_step = float(alpha), bool(use_location), bool(multimodal_step)
        self.intra_pair_weight, self.intra_pair_margin = float(intra_pair_weight), float(intra_pair_margin)
        self.intra_pair_level, self.eval_score, self.divide_by_cells = intra_pair_level, eval_score, divide_by_cells
        self.feature_dropout = nn.Dropout(dropout)
        # image side
        self.img_global = nn.Linear(img_dim, d)                                   # P0
        self.img_location = nn.GRU(img_dim, d, batch_first=True) if use_location else None
        self.img_attn1 = GuidedAttention(img_dim, d, d)
        self.img_proj1 = nn.Linear(img_dim, d)                                    # P1
        # text side
        self.txt_enc = WordEncoder(vocab_size, word_dim, d, text_rnn, dropout)
        self.txt_attn1 = GuidedAttention(d, d, d)
        if self.multimodal_step:
            self.img_memory = nn.Linear(d, d)                                     # U_v
            self.txt_memory = nn.Linear(d, d)                                     # U_t
            self.img_attn2 = GuidedAttention(img_dim, d, d)
            self.img_proj2 = nn.Linear(img_dim, d)                                # P2
            self.txt_attn2 = GuidedAttention(d, d, d)
        #: upper bound on n_img·n_cap·d elements per pair-specific chunk inside ``score``
        self.max_chunk_elements = 1 << 23
        #: gradient scale of the parameters used only inside ``score`` (1/world size while a DDP step scores
        #: the gathered global batch on every process; see ``forward``)
        self.score_grad_scale = 1.0

    def prepare_training(self, inputs: dict) -> None:
        """``--word-vectors``: the vocabulary's rows (:func:`~retr.trainers.models.text.install_word_vectors`)."""
        install_word_vectors(self.txt_enc.embed, inputs, self.config.freeze_word_vectors)

    # -- encoders (pair-independent) -------------------------------------------------------------------------
    def encode_images(self, features: torch.Tensor, mask: torch.Tensor) -> Embeddings:
        """``features`` [B, M, D_in], ``mask`` [B, M] → ``v0``, ``v1`` [B, d]; ``keys``, ``values`` [B, M, d]; mask;
        ``attention`` [B, M] (the intra-modal weights ``v1`` pools with, 0 at padded cells).

        ``keys``/``values`` (only with the multi-modal step) are ``w_h ⊙ tanh(W2_v I_m)`` and ``P2 I_m`` without
        P2's bias: all the multi-modal step needs of the cells."""
        x = self.feature_dropout(features.to(self.img_global.weight.dtype))   # float16 storage → the model's dtype
        mask = mask.bool()
        v0 = torch.tanh(self.img_global(masked_mean(x, mask)))
        if self.img_location is not None:
            hidden, _ = self.img_location(x)     # raster order: cells as stored, row by row
            v0 = v0 + masked_mean(hidden, mask)
        a1 = self.img_attn1(x, mask, v0)
        v1 = torch.tanh(self.img_proj1(self._pool(a1, x, mask)))
        out = {"v0": v0, "v1": v1, "mask": mask, "attention": a1}
        if self.multimodal_step:
            out["keys"] = self.img_attn2.keys(x)
            out["values"] = x @ self.img_proj2.weight.t()
        return out

    def _pool(self, weights: torch.Tensor, x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        pooled = (weights.unsqueeze(-1) * x).sum(1)
        if self.divide_by_cells:
            pooled = pooled / mask.sum(1, keepdim=True).clamp(min=1)
        return pooled

    def encode_captions(self, tokens: torch.Tensor, lengths: torch.Tensor) -> Embeddings:
        """``tokens`` [B, L], ``lengths`` [B] → ``t0``, ``t1`` [B, d]; ``words`` S, ``keys`` [B, L', d]; ``mask``;
        ``attention`` [B, L'] (the intra-modal weights ``t1`` pools with, 0 past each caption)."""
        words = self.txt_enc(tokens, lengths)
        mask = lengths_mask(lengths, words.shape[1], words.device)
        t0 = masked_mean(words, mask)
        a1 = self.txt_attn1(words, mask, t0)
        t1 = (a1.unsqueeze(-1) * words).sum(1)
        out = {"t0": t0, "t1": t1, "words": words, "mask": mask, "attention": a1}
        if self.multimodal_step:
            out["keys"] = self.txt_attn2.keys(words)
        return out

    # -- pair-specific scoring --------------------------------------------------------------------------------
    def level_scores(self, images: Embeddings, captions: Embeddings, dtype: torch.dtype | None = None) -> torch.Tensor:
        """Per-level cosines ``[n_img, n_cap, levels]`` (levels: v0·t0, v1·t1 and, with the multi-modal step, v2·t2)."""
        return self._levels(images, captions, dots=False, dtype=dtype)

    def score(self, images: Embeddings, captions: Embeddings, dtype: torch.dtype | None = None) -> torch.Tensor:
        """``[n_img, n_cap]``: Σ_k cos(v_k, t_k) (or, evaluating with ``eval_score="concat"``, the cosine of the
        concatenated levels); the cosines in ``dtype`` when given."""
        if self.eval_score == "concat" and not self.training:
            parts = self._levels(images, captions, dots=True, dtype=dtype)   # [n_i, n_c, levels, 3]: v·t, ‖v‖², ‖t‖²
            dot, vv, tt = parts.sum(2).unbind(-1)
            return dot / (vv.sqrt() * tt.sqrt()).clamp(min=EPS)
        return self.level_scores(images, captions, dtype).sum(-1)

    def _levels(self, images: Embeddings, captions: Embeddings, dots: bool, pair_specific: bool = True,
                dtype: torch.dtype | None = None) -> torch.Tensor:
        dtype = dtype or images["v0"].dtype
        n_img, n_cap = images["v0"].shape[0], captions["t0"].shape[0]
        # the pair-independent levels 0 and 1 together: [2, n_img, d] against [2, n_cap, d], one batched product
        v = torch.stack([images["v0"], images["v1"]]).to(dtype)
        t = torch.stack([captions["t0"], captions["t1"]]).to(dtype)
        if dots:
            parts = torch.broadcast_tensors(torch.bmm(v, t.transpose(1, 2)), v.pow(2).sum(-1).unsqueeze(2),
                                            t.pow(2).sum(-1).unsqueeze(1))
            levels = torch.stack(parts, -1).permute(1, 2, 0, 3)                # [n_img, n_cap, 2, 3]
        else:
            levels = cosine_matrix(v, t).permute(1, 2, 0)                       # [n_img, n_cap, 2]
        if not (self.multimodal_step and pair_specific):
            return levels
        d = images["v0"].shape[-1]
        step = max(1, self.max_chunk_elements // max(1, n_cap * d))
        chunks = [self._multimodal(images, captions, slice(i, i + step), dtype, dots) for i in range(0, n_img, step)]
        return torch.cat([levels, cat_parts(chunks).unsqueeze(2)], 2)

    def _multimodal(self, images: Embeddings, captions: Embeddings, rows: slice, dtype: torch.dtype,
                    dots: bool) -> torch.Tensor:
        """Level-2 cosines (or [v·t, ‖v‖², ‖t‖²]) of images ``rows`` × every caption: ``[n_i, n_cap(, 3)]``
        (:meth:`_multimodal_attention` without the attention)."""
        return self._multimodal_attention(images, captions, rows, dtype, dots)[0]

    def _multimodal_attention(self, images: Embeddings, captions: Embeddings, rows: slice, dtype: torch.dtype,
                              dots: bool) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Level-2 cosines (or [v·t, ‖v‖², ‖t‖²]) of images ``rows`` × every caption: ``[n_i, n_cap(, 3)]``, and the
        multi-modal attention they were computed with: visual ``[n_i, n_cap, M]`` over the cells and textual
        ``[n_i, n_cap, L]`` over the words (``score`` keeps the first, ``explain`` the other two).

        The attention runs in the parameters' dtype (float64 evaluation scores with a float64 copy of the model,
        :class:`retr.trainers.evaluation.similarity.Scorer`); the final cosine uses ``dtype``."""
        w = self.img_memory.weight.dtype
        images = {k: (v[rows].to(w) if v.is_floating_point() else v[rows]) for k, v in images.items()}
        captions = {k: (v.to(w) if v.is_floating_point() else v) for k, v in captions.items()}
        v_mem = self._memory(self.img_memory, images["v0"] + images["v1"])        # v̂ [n_i, d]
        t_mem = self._memory(self.txt_memory, captions["t0"] + captions["t1"])     # t̂ [n_c, d]
        a = self.alpha
        o_v = torch.sigmoid(a * v_mem.unsqueeze(1) + (1 - a) * t_mem.unsqueeze(0))  # [n_i, n_c, d]
        o_t = torch.sigmoid(a * t_mem.unsqueeze(0) + (1 - a) * v_mem.unsqueeze(1))  # [n_i, n_c, d]
        # visual multi-modal attention: logits[i, c, m] = keys[i, m] · gate[i, c]
        img_mask = images["mask"]
        logits = torch.bmm(self.img_attn2.gate(o_v, self.score_grad_scale), images["keys"].transpose(1, 2))
        weights = masked_softmax(logits, img_mask.unsqueeze(1))                     # [n_i, n_c, M]
        pooled = torch.bmm(weights, images["values"])                        # [n_i, n_c, d]
        if self.divide_by_cells:
            pooled = pooled / img_mask.sum(1).clamp(min=1).view(-1, 1, 1)
        v2 = torch.tanh(pooled + scale_grad(self.img_proj2.bias, self.score_grad_scale))
        # textual multi-modal attention: logits[i, c, l] = keys[c, l] · gate[i, c]
        gate_t = self.txt_attn2.gate(o_t, self.score_grad_scale).transpose(0, 1)                          # [n_c, n_i, d]
        logits_t = torch.bmm(gate_t, captions["keys"].transpose(1, 2))             # [n_c, n_i, L]
        weights_t = masked_softmax(logits_t, captions["mask"].unsqueeze(1))
        t2 = torch.bmm(weights_t, captions["words"]).transpose(0, 1)               # [n_i, n_c, d]
        v2, t2 = v2.to(dtype), t2.to(dtype)
        if dots:
            level = torch.stack(((v2 * t2).sum(-1), v2.pow(2).sum(-1), t2.pow(2).sum(-1)), -1)
        else:
            level = cosine(v2, t2)
        return level, weights, weights_t.transpose(0, 1)

    def explain(self, images: Embeddings, captions: Embeddings) -> dict[str, torch.Tensor]:
        """The attention behind ``score`` for one pair, padding dropped (class docstring: names and shapes)."""
        check_one_pair(images, captions)
        visual, textual = [images["attention"][0]], [captions["attention"][0]]
        if self.multimodal_step:
            _, weights, weights_t = self._multimodal_attention(images, captions, slice(0, 1), images["v0"].dtype,
                                                               dots=False)
            visual.append(weights[0, 0].to(visual[0].dtype))
            textual.append(weights_t[0, 0].to(textual[0].dtype))
        cells, words = images["mask"][0].bool(), captions["mask"][0].bool()
        return {"visual_attention": torch.stack(visual)[:, cells], "textual_attention": torch.stack(textual)[:, words]}

    def configure_optimizer(self, lr: float) -> torch.optim.Optimizer:
        """The paper's Adadelta (lr 0.05, "momentum 0.9" read as Adadelta's decay ρ — Adadelta has no
        momentum — ε ``adadelta_eps`` (TensorFlow's 1e-8), weight decay 5e-4), or Adam (``optimizer="adam"``,
        no weight decay) for comparison."""
        if self.optimizer_name == "adam":
            return torch.optim.Adam(self.parameters(), lr=lr)
        return torch.optim.Adadelta(self.parameters(), lr=lr, rho=self.rho, eps=self.adadelta_eps,
                                    weight_decay=self.weight_decay)

    def _memory(self, linear: nn.Linear, x: torch.Tensor, by_row: bool = False) -> torch.Tensor:
        """U_v / U_t of Eq. 12 (with the score-side gradient scale); ``by_row`` as :meth:`GuidedAttention.gate`."""
        return (row_linear if by_row else F.linear)(x, scale_grad(linear.weight, self.score_grad_scale),
                                                    scale_grad(linear.bias, self.score_grad_scale))

    # -- two-step evaluation (optional) ---------------------------------------------------------------------------
    def global_score(self, images: Embeddings, captions: Embeddings, dtype: torch.dtype | None = None) -> torch.Tensor:
        """The pair-independent part, ``cos(v0, t0) + cos(v1, t1)`` ``[n_img, n_cap]`` (two-step shortlist)."""
        return self._levels(images, captions, dots=False, pair_specific=False, dtype=dtype).sum(-1)

    def pair_score(self, images: Embeddings, captions: Embeddings, img_idx: torch.Tensor,
                   cap_idx: torch.Tensor, dtype: torch.dtype | None = None) -> torch.Tensor:
        """``score`` of the listed pairs only: ``[P]`` for ``img_idx``, ``cap_idx`` [P] (chunked, bounded memory)."""
        dtype = dtype or images["v0"].dtype
        w = self.img_memory.weight.dtype if self.multimodal_step else dtype
        per_pair = (images["mask"].shape[1] + captions["mask"].shape[1]) * images["v0"].shape[-1]
        step = max(1, self.max_chunk_elements // per_pair)
        out = []
        for start in range(0, img_idx.numel(), step):
            ii, cc = img_idx[start:start + step], cap_idx[start:start + step]
            im = {k: (v[ii].to(w) if v.is_floating_point() else v[ii]) for k, v in images.items()}
            cap = {k: (v[cc].to(w) if v.is_floating_point() else v[cc]) for k, v in captions.items()}
            pairs = [(im["v0"], cap["t0"]), (im["v1"], cap["t1"])]
            if self.multimodal_step:
                pairs.append(self._multimodal_pairs(im, cap))
            pairs = [(v.to(dtype), t.to(dtype)) for v, t in pairs]
            if self.eval_score == "concat" and not self.training:
                dot = sum((v * t).sum(-1) for v, t in pairs)
                vv, tt = sum(v.pow(2).sum(-1) for v, _ in pairs), sum(t.pow(2).sum(-1) for _, t in pairs)
                out.append(dot / (vv.sqrt() * tt.sqrt()).clamp(min=EPS))
            else:
                out.append(sum(cosine(v, t) for v, t in pairs))
        return cat_parts(out) if out else images["v0"].new_zeros(0, dtype=dtype)

    def _multimodal_pairs(self, im: Embeddings, cap: Embeddings) -> tuple[torch.Tensor, torch.Tensor]:
        """(v2, t2) ``[P, d]`` of P aligned pairs (image p with caption p): Eq. 12–18 without the block axes, every
        product a pair's own (a pair's score does not depend on the chunk it is scored in)."""
        v_mem = self._memory(self.img_memory, im["v0"] + im["v1"], by_row=True)
        t_mem = self._memory(self.txt_memory, cap["t0"] + cap["t1"], by_row=True)
        o_v = torch.sigmoid(self.alpha * v_mem + (1 - self.alpha) * t_mem)
        o_t = torch.sigmoid(self.alpha * t_mem + (1 - self.alpha) * v_mem)
        gate_v = self.img_attn2.gate(o_v, self.score_grad_scale, by_row=True)
        logits = torch.bmm(im["keys"], gate_v.unsqueeze(-1)).squeeze(-1)                                   # [P, M]
        pooled = torch.bmm(masked_softmax(logits, im["mask"]).unsqueeze(1), im["values"]).squeeze(1)
        if self.divide_by_cells:
            pooled = pooled / im["mask"].sum(1, keepdim=True).clamp(min=1)
        v2 = torch.tanh(pooled + scale_grad(self.img_proj2.bias, self.score_grad_scale))
        gate_t = self.txt_attn2.gate(o_t, self.score_grad_scale, by_row=True)
        logits_t = torch.bmm(cap["keys"], gate_t.unsqueeze(-1)).squeeze(-1)                                # [P, L]
        t2 = torch.bmm(masked_softmax(logits_t, cap["mask"]).unsqueeze(1), cap["words"]).squeeze(1)
        return v2, t2

    # -- objective ----------------------------------------------------------------------------------------------
    def intra_pair_loss(self, matched_levels: torch.Tensor) -> torch.Tensor:
        """Eq. 22 on cosines for the matched pairs' per-level cosines ``[B, levels]``: a scalar (sum over pairs)."""
        distance = 1 - matched_levels
        if self.intra_pair_level == "sum":
            distance = distance.sum(-1, keepdim=True)
        per_direction = (distance - self.intra_pair_margin).clamp(min=0).sum()
        return 2 * per_direction   # Eq. 22's two terms: d(v, t+) and d(t, v+) are the same matched pair

    def loss(self, scores: torch.Tensor, matched_levels: torch.Tensor | None = None) -> torch.Tensor:
        """Eq. 23: hinge (hardest negatives, m1) on ``scores`` [B, B] + λ · intra-pair on ``matched_levels``
        [B, levels] (the per-level cosines of the diagonal pairs, required when λ > 0)."""
        total = self.ranking_loss(scores)
        if self.intra_pair_weight > 0:
            if matched_levels is None:
                raise ValueError("SMAN's loss needs the matched pairs' per-level cosines (use model.forward)")
            total = total + self.intra_pair_weight * self.intra_pair_loss(matched_levels)
        return total

    def forward(self, features: torch.Tensor, mask: torch.Tensor, tokens: torch.Tensor, lengths: torch.Tensor,
                gather=None) -> torch.Tensor:
        """One training step's loss (Eq. 23) for a batch whose i-th image and i-th caption match.

        Under DDP the gradients of parameters used only inside ``score`` are scaled by 1/world size, so their sum
        over processes is the single-process gradient."""
        images = self.encode_images(features, mask)
        captions = self.encode_captions(tokens, lengths)
        world = 1
        if gather is not None:
            images, captions = gather(images), gather(captions)
            world = gather.world_size
        self.score_grad_scale = 1.0 / world
        try:
            levels = self.scoring("level_scores")(images, captions)                 # [B, B, levels]
        finally:
            self.score_grad_scale = 1.0
        return self.loss(levels.sum(-1), levels.diagonal(dim1=0, dim2=1).t())


@dataclass
class SMANConfig(Settings):
    """SMAN's settings (defaults: the paper's, §IV-A3; each decision: ``docs/models-seam-sman.md``)."""

    embed_size: int = embed_size_setting(512)
    word_dim: int = word_dim_setting(512)
    word_vectors: str = word_vectors_setting()
    freeze_word_vectors: bool = freeze_word_vectors_setting()
    alpha: float = setting(0.9, "Fusion gate α of Eq. 12; 1 = stacked intra-modal attention (SMAN-SIM).")
    use_location: bool = setting(True, "GRU location vector in the visual query (off = SMAN-IM).",
                                 flag="--location/--no-location")
    multimodal_step: bool = setting(True, "Second, multi-modal attention step (off = SMAN-IM[-LOC]).",
                                    flag="--multimodal-step/--intra-only")
    intra_pair_weight: float = setting(1.0, "λ of Eq. 23; 0 = SMAN-inter.")
    intra_pair_margin: float = setting(0.25, "m2 of Eq. 22.")
    intra_pair_level: Literal[INTRA_PAIR_LEVELS] = setting(
        "each", "Eq. 22 per level and summed (each) or once on the summed distance.")
    eval_score: Literal[EVAL_SCORES] = setting(
        "sum", "Evaluation score: sum of per-level cosines or cosine of the raw concatenation.")
    divide_by_cells: bool = setting(False, "Keep the 1/M printed in Eq. 7/15 (default: dropped).",
                                    flag="--divide-by-cells")
    text_rnn: Literal[TEXT_RNNS] = setting("lstm", "Bi-LSTM (paper) or bi-GRU.")
    dropout: float = dropout_setting(0.3, "Dropout on grid features and word embeddings.")
    optimizer: Literal[OPTIMIZERS] = setting("adadelta", "Adadelta (paper) or Adam.")
    rho: float = setting(0.9, "Adadelta's decay ρ (the paper's \"momentum 0.9\"; 0.95: TensorFlow's default).")
    adadelta_eps: float = setting(1e-8, "Adadelta's ε (1e-8: TensorFlow's, the paper's toolkit; 1e-6: PyTorch's).")
    weight_decay: float = setting(5e-4, "Adadelta weight decay.")
    shortlist: int = setting(0, "Evaluate in two steps: shortlist K by the pair-independent levels, re-score them "
                                "with all three (0: score every pair, as the paper).", at_least=0)
    margin: float = margin_setting(0.2)
    max_violation: bool = violation_setting(True)


#: The paper's schedule (§IV-A3), the same for Flickr30K and COCO: Adadelta 0.05 → 0.005 after epoch 50.
SMAN_PRESET = {"epochs": 60, "lr": 0.05, "lr_update": 50, "batch_size": 128, "grad_clip": 0.1}

def _sman_upgrade(model_args: dict) -> tuple[dict, dict]:
    """Runs written before ``adadelta_eps`` existed trained with PyTorch's Adadelta ε, 1e-6."""
    model_args.setdefault("adadelta_eps", 1e-6)
    return model_args, {}


register_model(ModelSpec(
    name="sman", model_class=SMAN, config_class=SMANConfig,
    summary="Train SMAN (stacked multi-modal attention) on ResNet-152 7×7 grid features. Pair-specific: "
            "validation and `retr-train eval` score every image–caption pair, in blocks.",
    examples=("retr-train sman --features data/f30k/features/resnet152-grid.h5 --manifest data/f30k/manifest.jsonl "
              "--preset f30k --out runs/sman-f30k",
              "retr-train sman --features data/f30k/features/resnet152-grid.h5 --manifest data/f30k/manifest.jsonl "
              "--preset f30k --alpha 1 --intra-pair-weight 0 --out runs/sman-f30k-sim-inter"),
    presets={"f30k": SMAN_PRESET, "coco": SMAN_PRESET}, default_preset="f30k", upgrade_args=_sman_upgrade,
    feature_kinds=("grid",)))
