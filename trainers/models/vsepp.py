"""VSE++ (Faghri et al., BMVC 2018): global image ``[B, d]`` and caption ``[B, d]`` vectors, cosine score, hardest
negatives. As implemented, with presets: docs/trainer.md ("SCAN and VSE++ as implemented")."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import torch

from retr.store.features import TENCROP_ORDER
from retr.trainers.config import (Settings, embed_size_setting, margin_setting, setting, size_setting,
                                  violation_setting, word_dim_setting)
from retr.trainers.models.registry import ModelSpec, register_model
from retr.trainers.models.base import Embeddings, InnerProductModel
from retr.trainers.models.layers import masked_mean
from retr.trainers.models.scan import ENCODER_TYPES, RegionEncoder
from retr.trainers.models.text import GRUSentenceEncoder


class VSEPP(InnerProductModel):
    """VSE++ on any feature kind; settings: :class:`VSEPPConfig`; no attention maps (``explain`` raises). Scores
    the inner products of the l2-normalised ``vector`` s."""

    def __init__(self, vocab_size: int, img_dim: int = 2048, config: "VSEPPConfig | None" = None):
        cfg = self.config = config if config is not None else VSEPPConfig()
        super().__init__(cfg.margin, cfg.max_violation)
        embed_size, word_dim, bi_gru = cfg.embed_size, cfg.word_dim, cfg.bi_gru
        no_imgnorm, precomp_enc_type = cfg.no_imgnorm, cfg.precomp_enc_type
        self.crops = cfg.crops
        # VSE++'s l2norm is x / ‖x‖ (no epsilon, unlike SCAN's): eps 0, as tests/test_golden_vsepp.py checks
        self.img_enc = RegionEncoder(img_dim, embed_size, no_imgnorm, precomp_enc_type, eps=0.0)
        self.txt_enc = GRUSentenceEncoder(vocab_size, word_dim, embed_size, num_layers=cfg.num_layers,
                                          bidirectional=bi_gru, eps=0.0)

    def encode_images(self, features: torch.Tensor, mask: torch.Tensor) -> Embeddings:
        """``features`` [B, K, D_in], ``mask`` [B, K] → ``{"vector": [B, d]}`` (masked mean over K — or, with
        ``crops="centre"``, the centre crop of a ten-crop set —, fc, l2norm)."""
        if self.crops == "centre":
            if features.shape[1] != len(TENCROP_ORDER):
                raise ValueError(f"crops='centre' needs ten-crop features (K = 10), not K = {features.shape[1]}")
            return {"vector": self.img_enc(features[:, TENCROP_ORDER.index("centre")])}
        return {"vector": self.img_enc(masked_mean(features, mask))}

    def encode_captions(self, tokens: torch.Tensor, lengths: torch.Tensor) -> Embeddings:
        """``tokens`` [B, L], ``lengths`` [B] → ``{"vector": [B, d]}``."""
        return {"vector": self.txt_enc(tokens, lengths)}



@dataclass
class VSEPPConfig(Settings):
    """VSE++'s settings (defaults: the paper's)."""

    embed_size: int = embed_size_setting(1024)
    word_dim: int = word_dim_setting(300)
    bi_gru: bool = setting(False, "Caption GRU direction (VSE++: unidirectional).", flag="--bi-gru/--uni-gru")
    num_layers: int = size_setting(1, "GRU layers of the caption encoder.")
    no_imgnorm: bool = setting(False, "Do not l2-normalise the image vector.", flag="--no-imgnorm")
    precomp_enc_type: Literal[ENCODER_TYPES] = setting("basic", "Image encoder: Linear or weight-normed.")
    crops: Literal["mean", "centre"] = setting(
        "mean", "Ten-crop features: the mean of the crops, or the centre crop only (VSE++'s '1 crop' rows).")
    margin: float = margin_setting(0.2)
    max_violation: bool = violation_setting(True)


#: VSE++'s published schedule (the same for COCO and Flickr30K).
VSEPP_PRESET = {"epochs": 30, "lr": 2e-4, "lr_update": 15, "batch_size": 128, "grad_clip": 2.0}

register_model(ModelSpec(
    name="vsepp", model_class=VSEPP, config_class=VSEPPConfig,
    summary="Train the VSE++ baseline on any feature kind (vectors averaged over regions/grid cells/crops).",
    examples=("retr-train vsepp --features data/coco/features/tencrop-resnet152.h5 "
              "--manifest data/coco/manifest.jsonl --preset coco --out runs/vsepp-coco",),
    presets={"f30k": VSEPP_PRESET, "coco": VSEPP_PRESET}, default_preset="f30k"))
