"""The interface between the training loop / evaluator and a matching model.

A model is an ``nn.Module`` with four methods; the loop and the evaluator use nothing else:

* ``encode_images(features [B, K, D_in] float, mask [B, K] bool) -> dict[str, Tensor]`` — per-image tensors,
  each with the batch on dim 0 (e.g. ``{"regions": [B, K, d], "mask": [B, K]}``);
* ``encode_captions(tokens [B, L] long, lengths [B] long) -> dict[str, Tensor]`` — per-caption tensors, batch on
  dim 0 (padding on later dims is allowed: blocks are padded/sliced by the evaluator and DDP gather);
* ``score(images, captions) -> [n_img, n_cap]`` — similarity of every image of a block with every caption of a
  block (pair-specific models such as SCAN do their cross attention here, vectorised over the block);
* ``loss(scores [B, B]) -> scalar`` — the training objective for a batch whose diagonal pairs match.

``forward`` chains them for one training step so that DDP sees a single forward call; ``gather`` turns the
local embeddings into the global batch's (identity on one process).
"""
from __future__ import annotations

from typing import Callable

import torch
from torch import nn

from retr.trainers.losses import hinge_triplet_loss

Embeddings = dict[str, torch.Tensor]


def l2norm(x: torch.Tensor, dim: int = -1, eps: float = 1e-8) -> torch.Tensor:
    """``x / (‖x‖ + eps)`` along ``dim`` (the authors' ``l2norm``).

    ``vector_norm`` has a zero (not NaN) gradient at a zero vector, which padded word positions are.
    """
    return x / (torch.linalg.vector_norm(x, dim=dim, keepdim=True) + eps)


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

    def configure_optimizer(self, lr: float) -> torch.optim.Optimizer:
        """The optimiser the loop steps (default: Adam on every parameter at ``lr``)."""
        return torch.optim.Adam(self.parameters(), lr=lr)

    def encode_images(self, features: torch.Tensor, mask: torch.Tensor) -> Embeddings:
        raise NotImplementedError

    def encode_captions(self, tokens: torch.Tensor, lengths: torch.Tensor) -> Embeddings:
        raise NotImplementedError

    def score(self, images: Embeddings, captions: Embeddings) -> torch.Tensor:
        raise NotImplementedError

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
