"""SCAN — Stacked Cross Attention for image–text matching (Lee et al., ECCV 2018).

Image side: ``v_i = l2norm(fc(x_i))`` for each region (``fc`` Linear(D_in → d), Xavier-uniform, bias 0;
``no_imgnorm`` skips the l2norm; ``precomp_enc_type="weight_norm"`` wraps ``fc`` in weight normalisation with
the authors' parameter names ``fc.weight_g``/``fc.weight_v``). Caption side: :class:`GRUWordEncoder`
(bi-GRU averaged by default). Score: :func:`retr.trainers.models.xattn.xattn_scores` (t-i or i-t, every
normalisation and aggregation). Loss: hinge with hardest negatives (margin 0.2).

Presets (``reference/scan.md``, the README runs of the authors, all ``--max_violation --bi_gru``):
COCO 20 epochs, lr 5e-4 decayed ×0.1 at epoch 10; Flickr30K 30 epochs, lr 2e-4 decayed at 15; λ_softmax 9
(t-i) / 4 (i-t); λ_lse 6 (t-i), 5 (i-t Flickr30K), 20 (i-t COCO); batch 128, grad-norm clip 2.0.
"""
from __future__ import annotations

import warnings

import torch
from torch import nn

from retr.trainers.models import register_model
from retr.trainers.models.base import Embeddings, MatchingModel, l2norm
from retr.trainers.models.text import GRUWordEncoder
from retr.trainers.models.xattn import AGGREGATIONS, DIRECTIONS, NORMS, xattn_scores

ENCODER_TYPES = ("basic", "weight_norm")


class RegionEncoder(nn.Module):
    """``[B, K, D_in]`` region features → ``[B, K, d]`` (SCAN's ``EncoderImagePrecomp``)."""

    def __init__(self, img_dim: int, embed_size: int, no_imgnorm: bool = False, precomp_enc_type: str = "basic"):
        super().__init__()
        if precomp_enc_type not in ENCODER_TYPES:
            raise ValueError(f"precomp_enc_type must be one of {', '.join(ENCODER_TYPES)}")
        self.no_imgnorm = no_imgnorm
        fc = nn.Linear(img_dim, embed_size)
        bound = (6.0 ** 0.5) / (img_dim + embed_size) ** 0.5
        nn.init.uniform_(fc.weight, -bound, bound)
        nn.init.zeros_(fc.bias)
        if precomp_enc_type == "weight_norm":
            with warnings.catch_warnings():  # the legacy hook keeps the authors' key names (weight_g, weight_v)
                warnings.simplefilter("ignore", FutureWarning)
                fc = nn.utils.weight_norm(fc, dim=None)
        self.fc = fc

    def forward(self, features: torch.Tensor) -> torch.Tensor:
        x = self.fc(features)
        return x if self.no_imgnorm else l2norm(x, dim=-1)


def _lengths_mask(lengths: torch.Tensor, max_len: int) -> torch.Tensor:
    return torch.arange(max_len, device=lengths.device).view(1, -1) < lengths.view(-1, 1)


@register_model("scan")
class SCAN(MatchingModel):
    """SCAN with either formulation (``t2i``: text–image, ``i2t``: image–text)."""

    def __init__(self, vocab_size: int, img_dim: int = 2048, embed_size: int = 1024, word_dim: int = 300,
                 direction: str = "t2i", agg: str = "lse", norm: str = "clipped_l2norm",
                 lambda_softmax: float = 9.0, lambda_lse: float = 6.0, bi_gru: bool = True,
                 no_imgnorm: bool = False, no_txtnorm: bool = False, precomp_enc_type: str = "basic",
                 margin: float = 0.2, max_violation: bool = True):
        super().__init__(margin, max_violation)
        for value, allowed, what in ((direction, DIRECTIONS, "direction"), (agg, AGGREGATIONS, "agg"),
                                     (norm, NORMS, "norm")):
            if value not in allowed:
                raise ValueError(f"{what} must be one of {', '.join(allowed)}, not {value!r}")
        self.direction, self.agg, self.norm = direction, agg, norm
        self.lambda_softmax, self.lambda_lse = float(lambda_softmax), float(lambda_lse)
        self.img_enc = RegionEncoder(img_dim, embed_size, no_imgnorm, precomp_enc_type)
        self.txt_enc = GRUWordEncoder(vocab_size, word_dim, embed_size, bidirectional=bi_gru,
                                      normalize=not no_txtnorm)
        #: dtype of ``score``'s arithmetic, set by the evaluator (None: the embeddings'); aggregation is then float64
        self.score_dtype: torch.dtype | None = None

    def encode_images(self, features: torch.Tensor, mask: torch.Tensor) -> Embeddings:
        """``features`` [B, K, D_in], ``mask`` [B, K] → ``{"regions": [B, K, d], "mask": [B, K]}``."""
        return {"regions": self.img_enc(features), "mask": mask}

    def encode_captions(self, tokens: torch.Tensor, lengths: torch.Tensor) -> Embeddings:
        """``tokens`` [B, L], ``lengths`` [B] → ``{"words": [B, L', d], "mask": [B, L']}``."""
        words = self.txt_enc(tokens, lengths)
        return {"words": words, "mask": _lengths_mask(lengths.to(words.device), words.shape[1])}

    def score(self, images: Embeddings, captions: Embeddings) -> torch.Tensor:
        """Cross-attention similarities ``[n_img, n_cap]``."""
        return xattn_scores(images["regions"], images["mask"].bool(), captions["words"], captions["mask"].bool(),
                            self.direction, self.norm, self.agg, self.lambda_softmax, self.lambda_lse,
                            dtype=self.score_dtype, agg_dtype=torch.float64 if self.score_dtype else None)


#: Published settings: dataset → schedule, and (direction, agg) → λs.
SCAN_SCHEDULES = {"coco": {"epochs": 20, "lr": 5e-4, "lr_update": 10},
                  "f30k": {"epochs": 30, "lr": 2e-4, "lr_update": 15}}
SCAN_LAMBDAS = {
    ("coco", "t2i"): {"lambda_softmax": 9.0, "lambda_lse": 6.0},
    ("coco", "i2t"): {"lambda_softmax": 4.0, "lambda_lse": 20.0},
    ("f30k", "t2i"): {"lambda_softmax": 9.0, "lambda_lse": 6.0},
    ("f30k", "i2t"): {"lambda_softmax": 4.0, "lambda_lse": 5.0},
}
SCAN_COMMON = {"batch_size": 128, "grad_clip": 2.0, "margin": 0.2, "max_violation": True, "bi_gru": True,
               "embed_size": 1024, "word_dim": 300, "agg": "lse", "norm": "clipped_l2norm", "direction": "t2i"}


def scan_preset(dataset: str | None, direction: str | None) -> dict:
    """The published hyperparameters for ``dataset`` (``coco``/``f30k``; None → Flickr30K's) and direction."""
    dataset = dataset or "f30k"
    direction = direction or "t2i"
    return {**SCAN_COMMON, **SCAN_SCHEDULES[dataset], **SCAN_LAMBDAS[(dataset, direction)], "direction": direction}


from retr.trainers.models import register_preset  # noqa: E402

register_preset("scan", scan_preset)
