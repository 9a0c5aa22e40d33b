"""VSE++ (Faghri et al., BMVC 2018): global image and caption vectors, dot-product score, hardest negatives.

Image side: the mean of the feature set's vectors over its K axis — regions (only real ones, by the mask),
grid cells, or the ten crops (VSE++'s own 10-crop features are averaged the same way) — then ``fc``
(Linear(D_in → d), Xavier-uniform, bias 0) and l2norm, as ``EncoderImagePrecomp``. Caption side:
:class:`GRUSentenceEncoder` (unidirectional GRU, last state, l2norm). Score: dot product of the l2-normalised
vectors (cosine). Loss: hinge with hardest negatives (``--sum-violation`` gives VSE0).

Presets: the VSE++ paper trains 30 epochs at 2e-4 then ×0.1 (from epoch 15), margin 0.2, batch 128,
grad clip 2, d = 1024, word dim 300 — the same for COCO and Flickr30K.
"""
from __future__ import annotations

import torch

from retr.trainers.models import register_model
from retr.trainers.models.base import Embeddings, MatchingModel, l2norm
from retr.trainers.models.scan import RegionEncoder
from retr.trainers.models.text import GRUSentenceEncoder


@register_model("vsepp")
class VSEPP(MatchingModel):
    """VSE++ on any feature kind."""

    def __init__(self, vocab_size: int, img_dim: int = 2048, embed_size: int = 1024, word_dim: int = 300,
                 bi_gru: bool = False, no_imgnorm: bool = False, precomp_enc_type: str = "basic",
                 margin: float = 0.2, max_violation: bool = True):
        super().__init__(margin, max_violation)
        self.img_enc = RegionEncoder(img_dim, embed_size, no_imgnorm, precomp_enc_type)
        self.txt_enc = GRUSentenceEncoder(vocab_size, word_dim, embed_size, bidirectional=bi_gru)
        self.score_dtype: torch.dtype | None = None

    def encode_images(self, features: torch.Tensor, mask: torch.Tensor) -> Embeddings:
        """``features`` [B, K, D_in], ``mask`` [B, K] → ``{"vector": [B, d]}`` (masked mean over K, fc, l2norm)."""
        weights = mask.to(features.dtype).unsqueeze(-1)
        pooled = (features * weights).sum(dim=1) / weights.sum(dim=1).clamp(min=1)
        return {"vector": self.img_enc(pooled)}

    def encode_captions(self, tokens: torch.Tensor, lengths: torch.Tensor) -> Embeddings:
        """``tokens`` [B, L], ``lengths`` [B] → ``{"vector": [B, d]}``."""
        return {"vector": self.txt_enc(tokens, lengths)}

    def score(self, images: Embeddings, captions: Embeddings) -> torch.Tensor:
        """Dot products ``[n_img, n_cap]``."""
        dtype = self.score_dtype or images["vector"].dtype
        return images["vector"].to(dtype) @ captions["vector"].to(dtype).t()


VSEPP_SCHEDULE = {"epochs": 30, "lr": 2e-4, "lr_update": 15}
VSEPP_COMMON = {"batch_size": 128, "grad_clip": 2.0, "margin": 0.2, "max_violation": True, "bi_gru": False,
                "embed_size": 1024, "word_dim": 300}


def vsepp_preset(dataset: str | None, direction: str | None = None) -> dict:
    """VSE++'s published hyperparameters (identical for COCO and Flickr30K)."""
    return {**VSEPP_COMMON, **VSEPP_SCHEDULE}


from retr.trainers.models import register_preset  # noqa: E402

register_preset("vsepp", vsepp_preset)
