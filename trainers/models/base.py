"""The interface between the training loop / evaluator and a matching model.

A model is an ``nn.Module``; the loop and the evaluator call only the methods and attributes declared on
:class:`MatchingModel` (each has its documented default here, nothing is probed with ``hasattr``):

* ``encode_images(features [B, K, D_in] float, mask [B, K] bool) -> dict[str, Tensor]`` — per-image tensors,
  each with the batch on dim 0 (e.g. ``{"regions": [B, K, d], "mask": [B, K]}``);
* ``encode_captions(tokens [B, L] long, lengths [B] long) -> dict[str, Tensor]`` — per-caption tensors, batch on
  dim 0 (padding on later dims is allowed: blocks are padded/sliced by the evaluator and DDP gather);
* ``score(images, captions, dtype=None) -> [n_img, n_cap]`` — similarity of every image of a block with every
  caption of a block (pair-specific models such as SCAN do their cross attention here, vectorised over the
  block); ``dtype`` is the arithmetic's dtype (the evaluator's float64), an argument, never state;
* ``loss(scores [B, B]) -> scalar`` — the training objective for a batch whose diagonal pairs match;
* ``forward(features, mask, tokens, lengths, gather, **extras)`` — one training step's loss (encode, gather the
  global batch, score, loss), a single forward call for DDP; ``batch_extras`` names the batch entries it takes;
* ``prepare_training(inputs)`` — per-run tensors from the spec's ``load_inputs`` (default: none);
* ``configure_optimizer(lr)`` — the optimiser (default: Adam);
* ``shortlist`` / ``has_global_stage`` / ``global_score`` / ``pair_score`` — two-step evaluation
  (:mod:`retr.trainers.two_step`) and scoring of listed pairs;
* ``predict_nodes(...)`` — referral-tree node predictions (SMFEA; others raise).
"""
from __future__ import annotations

from typing import Callable

import torch
from torch import nn

from retr.trainers.losses import hinge_triplet_loss


Embeddings = dict[str, torch.Tensor]


class MatchingModel(nn.Module):
    """Base class: subclasses implement the encoders and ``score``; the hinge loss is shared."""

    #: the model's registry name, set by :func:`retr.trainers.models.register_model`
    name: str = ""
    #: batch entries (besides the four tensors) the loop passes to :meth:`forward` by name, e.g. ``image_index``
    batch_extras: tuple[str, ...] = ()
    #: two-step evaluation: candidates re-ranked per query (0: score every pair); see :mod:`retr.trainers.two_step`
    shortlist: int = 0

    def __init__(self, margin: float = 0.2, max_violation: bool = True):
        super().__init__()
        self.margin = float(margin)
        self.max_violation = bool(max_violation)

    @staticmethod
    def settings(config_class: type, config=None, overrides: dict | None = None):
        """The model's config: ``config`` (default: ``config_class()``) with ``overrides`` applied.

        Every model's constructor is ``(data sizes…, config=None, **settings)``: ``settings`` are the config's
        field names (an unknown name raises ``ValueError`` naming it), so the config dataclass holds the only
        defaults.
        """
        from dataclasses import asdict

        from retr.trainers.config import make_config

        base = asdict(config) if config is not None else {}
        return make_config(config_class, {**base, **(overrides or {})})

    def prepare_training(self, inputs: dict[str, torch.Tensor]) -> None:
        """Install per-run training data read by the spec's ``load_inputs`` (tensors only, e.g. SMFEA's tree
        node targets ``{"nodes": [M, 7]}``). Called once by the loop before training; default: nothing."""

    #: True when :meth:`global_score` is a pair-independent first stage that :meth:`pair_score` re-ranks
    has_global_stage: bool = False

    def configure_optimizer(self, lr: float) -> torch.optim.Optimizer:
        """The optimiser the loop steps (default: Adam on every parameter at ``lr``)."""
        return torch.optim.Adam(self.parameters(), lr=lr)

    def encode_images(self, features: torch.Tensor, mask: torch.Tensor) -> Embeddings:
        raise NotImplementedError

    def encode_captions(self, tokens: torch.Tensor, lengths: torch.Tensor) -> Embeddings:
        raise NotImplementedError

    def score(self, images: Embeddings, captions: Embeddings, dtype: torch.dtype | None = None) -> torch.Tensor:
        raise NotImplementedError

    def global_score(self, images: Embeddings, captions: Embeddings, dtype: torch.dtype | None = None) -> torch.Tensor:
        """The cheap pair-independent score ``[n_img, n_cap]`` two-step evaluation shortlists by (models with
        ``has_global_stage`` only)."""
        raise NotImplementedError(f"model {self.name or type(self).__name__} has no global stage")

    def pair_score(self, images: Embeddings, captions: Embeddings, img_idx: torch.Tensor, cap_idx: torch.Tensor,
                   dtype: torch.dtype | None = None, image_block: int = 64) -> torch.Tensor:
        """``score`` of the listed pairs only: ``[P]`` for ``img_idx``, ``cap_idx`` ``[P]`` long.

        Default: each block of ``image_block`` images is scored against the distinct captions its pairs name,
        so memory is bounded by the block; models with a cheaper pair path override it.
        """
        out: torch.Tensor | None = None
        for start in range(0, int(img_idx.max()) + 1 if img_idx.numel() else 0, image_block):
            sel = torch.nonzero((img_idx >= start) & (img_idx < start + image_block)).view(-1)
            if sel.numel() == 0:
                continue
            caps, column = torch.unique(cap_idx[sel], return_inverse=True)
            block = {k: v[start:start + image_block] for k, v in images.items()}
            scores = self.score(block, {k: v[caps] for k, v in captions.items()}, dtype=dtype)
            if out is None:
                out = scores.new_empty(img_idx.numel())
            out[sel] = scores[img_idx[sel] - start, column]
        return out if out is not None else torch.empty(0, dtype=dtype or torch.float32)

    def predict_nodes(self, *args, **kwargs) -> torch.Tensor:
        """Referral-tree node ids ``[B, 7]`` (SMFEA only)."""
        raise NotImplementedError(f"model {self.name or type(self).__name__} predicts no tree nodes")

    def loss(self, scores: torch.Tensor) -> torch.Tensor:
        return hinge_triplet_loss(scores, self.margin, self.max_violation)

    def forward(self, features: torch.Tensor, mask: torch.Tensor, tokens: torch.Tensor, lengths: torch.Tensor,
                gather: Callable[[Embeddings], Embeddings] | None = None) -> torch.Tensor:
        """One training step's loss: encode both sides, gather the global batch, score it, hinge loss."""
        images = self.encode_images(features, mask)
        captions = self.encode_captions(tokens, lengths)
        if gather is not None:
            images, captions = gather(images), gather(captions)
        return self.loss(self.score(images, captions))
