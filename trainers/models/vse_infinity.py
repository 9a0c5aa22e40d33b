"""VSE∞ (Chen et al., CVPR 2021, "Learning the Best Pooling Strategy for Visual Semantic Embedding"), BiGRU text.

Each side is a set of vectors pooled by a Generalized Pooling Operator (:class:`GPO`), then l2-normalised; the
score is their dot product and the loss VSE++'s hinge (``--warmup-epochs 1`` of summed violations, then hardest
negatives). Image side: ``fc`` (Linear, Xavier) plus, for regions, a residual two-layer MLP
(Linear → BatchNorm → ReLU → Linear) on every real region. Caption side: embedding (the vocabulary plus one
``<mask>`` row, as the authors append it) → BiGRU, directions averaged. Training only: the authors' size
augmentation drops each region with probability ``drop_regions`` and each caption token with probability
``augment_words`` is masked (½), replaced by a random token (1/10) or deleted (4/10). Optimiser: AdamW.
Decisions, paper vs authors' code: docs/models-vse-infinity.md.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import nn

from retr.trainers.config import (Settings, embed_size_setting, freeze_word_vectors_setting, margin_setting, setting,
                                  size_setting, violation_setting, word_dim_setting, word_vectors_setting)
from retr.trainers.models.base import Embeddings, InnerProductModel, check_one_pair
from retr.trainers.models.layers import l2norm, lengths_mask, masked_batch_norm, masked_softmax, run_rnn
from retr.trainers.models.registry import ModelSpec, register_model
from retr.trainers.models.text import GRUWordEncoder, install_word_vectors

#: the authors' softmax temperature of the pooling weights (hard-coded in their GPO)
TEMPERATURE = 0.1


def positional_encoding(length: int, dim: int) -> torch.Tensor:
    """``[length, dim]`` sin (even columns) / cos (odd columns) of position·10000^(−2j/dim), float32 as the
    authors compute it whatever the model's dtype."""
    if dim % 2:
        raise ValueError(f"the positional encoding needs an even size, not {dim}")
    position = torch.arange(length, dtype=torch.float32).unsqueeze(1)
    freq = torch.exp(torch.arange(0, dim, 2, dtype=torch.float32) * -(math.log(10000.0) / dim))
    pe = torch.zeros(length, dim)
    pe[:, 0::2], pe[:, 1::2] = torch.sin(position * freq), torch.cos(position * freq)
    return pe


class GPO(nn.Module):
    """Generalized Pooling Operator: each dimension's values sorted in decreasing order, weighted by θ_k.

    θ (one weight per rank k, shared by all dimensions) comes from the set's size alone: positional encodings of
    ranks 1…n → BiGRU (directions averaged) → Linear(→1, no bias) → softmax(·/0.1) over the n ranks."""

    def __init__(self, pe_dim: int = 32, hidden: int = 32):
        super().__init__()
        self.pe_dim, self.hidden = pe_dim, hidden
        self.gru = nn.GRU(pe_dim, hidden, 1, batch_first=True, bidirectional=True)
        self.linear = nn.Linear(hidden, 1, bias=False)

    def weights(self, lengths: torch.Tensor, width: int) -> torch.Tensor:
        """``lengths`` [B] (1 … width) → θ ``[B, width]`` (0 past each length).

        θ depends on the set's size alone, so it is computed once for every size 1 … width (one GRU call over
        ``width`` sequences, whose lengths are known on the host) and looked up by ``lengths`` on their device:
        nothing is read back from it. Each row's values are those of running the GRU on that size alone, to the
        rounding of a batch of other rows (float32: ~1e-8; the authors' code packs the batch's own sizes). The
        GRU runs over ``width`` sequences whatever the batch: 36 for regions, 577 for CLIP-L/336's tokens."""
        sizes = torch.arange(1, width + 1)                                           # host
        mask = lengths_mask(sizes, width, self.linear.weight.device)
        pe = positional_encoding(width, self.pe_dim).to(self.linear.weight, non_blocking=True)
        out = run_rnn(self.gru, pe.expand(width, -1, -1), sizes, width)           # [width, width, 2h]
        out = (out[..., :self.hidden] + out[..., self.hidden:]) / 2
        table = masked_softmax(self.linear(out).squeeze(-1) / TEMPERATURE, mask)   # [size − 1, rank]
        # an empty set pools to 0 whatever θ
        return table[lengths.to(table.device, non_blocking=True).clamp(min=1) - 1]

    def forward(self, x: torch.Tensor, mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """``x`` [B, K, d], ``mask`` [B, K] (any positions) → pooled ``[B, d]``, θ ``[B, K]``, lengths ``[B]``."""
        lengths = mask.sum(1)
        top = x.masked_fill(~mask.unsqueeze(-1), float("-inf")).sort(dim=1, descending=True).values
        top = top.masked_fill(~lengths_mask(lengths, x.shape[1]).unsqueeze(-1), 0.0)
        theta = self.weights(lengths, x.shape[1]).to(x.dtype)
        return (top * theta.unsqueeze(-1)).sum(1), theta, lengths


class GPOImageEncoder(nn.Module):
    """Regions (or grid cells) ``[B, K, D_in]`` → their set in the joint space ``[B, K, d]`` → GPO → l2norm."""

    def __init__(self, img_dim: int, embed_size: int, mlp: bool, pe_dim: int, hidden: int):
        super().__init__()
        self.fc = nn.Linear(img_dim, embed_size)
        nn.init.xavier_uniform_(self.fc.weight)
        nn.init.zeros_(self.fc.bias)
        self.mlp = nn.Sequential(nn.Linear(img_dim, embed_size // 2), nn.BatchNorm1d(embed_size // 2), nn.ReLU(),
                                 nn.Linear(embed_size // 2, embed_size)) if mlp else None
        self.gpool = GPO(pe_dim, hidden)

    def project(self, features: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        """``fc(x) + MLP(x)``; the MLP (and its batch statistics) sees the real positions only."""
        x = self.fc(features)
        if self.mlp is not None:
            first, norm, relu, last = self.mlp
            hidden = relu(masked_batch_norm(norm, first(features), mask))      # statistics of the real positions
            x = x + last(hidden).to(x.dtype) * mask.unsqueeze(-1)
        return x


class VSEInfinity(InnerProductModel):
    """VSE∞ with a BiGRU caption encoder; settings: :class:`VSEInfinityConfig`.

    ``explain`` gives GPO's pooling weights: ``image_pooling`` ``[k]`` over the k real regions' ranks (weight of
    each dimension's r-th largest value) and ``caption_pooling`` ``[n]`` over the n tokens' ranks; each sums to 1.
    """

    explains = rank_maps = ("image_pooling", "caption_pooling")

    def __init__(self, vocab_size: int, img_dim: int = 2048, config: "VSEInfinityConfig | None" = None,
                 word_vectors_file: str = ""):
        cfg = self.config = config if config is not None else VSEInfinityConfig()
        super().__init__(cfg.margin, cfg.max_violation)
        self.word_vectors_file = word_vectors_file     # the vectors the words started from
        self.mask_token = vocab_size                       # the authors' <mask>, appended after the vocabulary
        self.img_enc = GPOImageEncoder(img_dim, cfg.embed_size, cfg.image_mlp, cfg.pe_dim, cfg.gpo_hidden)
        self.txt_enc = GRUWordEncoder(vocab_size + 1, cfg.word_dim, cfg.embed_size, cfg.num_layers,
                                      bidirectional=True, normalize=False)
        self.txt_pool = GPO(cfg.pe_dim, cfg.gpo_hidden)

    def prepare_training(self, inputs: dict) -> None:
        """``--word-vectors``: the vocabulary's rows (``<mask>`` keeps its init)."""
        install_word_vectors(self.txt_enc.embed, inputs, self.config.freeze_word_vectors)

    def configure_optimizer(self, lr: float) -> torch.optim.Optimizer:
        """AdamW on every parameter (the authors' optimiser for precomputed features)."""
        return torch.optim.AdamW(self.parameters(), lr=lr, weight_decay=self.config.weight_decay)

    def drop_regions(self, mask: torch.Tensor) -> torch.Tensor:
        """Size augmentation: each real region kept with probability 1 − ``drop_regions`` (a set never empties)."""
        kept = mask & (torch.rand(mask.shape, device=mask.device) >= self.config.drop_regions)
        return torch.where(kept.any(1, keepdim=True), kept, mask)

    def augment_words(self, tokens: torch.Tensor, lengths: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Each token with probability p = ``augment_words``: ``<mask>`` (p/2), a random id (p/10), deleted
        (2p/5); survivors are moved to the front. Returns ``(tokens [B, L], lengths [B])``, each on its own device.

        The draws and the new lengths are made where ``lengths`` lies (the host, in training), so the RNN packs by
        lengths read there; the tokens are rewritten on their device from one upload of the replacements and the
        new order: nothing is read back from a GPU."""
        host, width = lengths.device, tokens.shape[1]
        valid = lengths_mask(lengths, width, host)
        u = torch.rand(tokens.shape, device=host) / self.config.augment_words          # < 1: the token is hit
        hit = valid & (u < 1)
        replacement = torch.where(hit & (u < 0.5), self.mask_token, -1)                  # −1: the token stays
        random = torch.randint(0, self.mask_token + 1, tokens.shape, device=host)
        replacement = torch.where(hit & (u >= 0.5) & (u < 0.6), random, replacement)
        keep = valid & ~(hit & (u >= 0.6))
        keep = torch.where(keep.any(1, keepdim=True), keep, valid)                       # never an empty caption
        order = (~keep).to(torch.uint8).sort(dim=1, stable=True).indices
        lengths = keep.sum(1)
        moved = torch.stack([replacement, order, lengths_mask(lengths, width, host).long()])
        replacement, order, kept = moved.to(tokens.device, non_blocking=True).unbind(0)
        tokens = torch.where(replacement >= 0, replacement, tokens)
        return tokens.gather(1, order) * kept, lengths

    def encode_images(self, features: torch.Tensor, mask: torch.Tensor) -> Embeddings:
        """``features`` [B, K, D_in], ``mask`` [B, K] → ``{"vector": [B, d]}`` (+ outside training
        ``"pooling"`` θ ``[B, K]`` and ``"size"`` ``[B]``, for :meth:`explain`)."""
        if self.training and self.config.drop_regions > 0:
            mask = self.drop_regions(mask)
        pooled, theta, size = self.img_enc.gpool(self.img_enc.project(features, mask), mask)
        return self._embeddings(pooled, theta, size)

    def encode_captions(self, tokens: torch.Tensor, lengths: torch.Tensor) -> Embeddings:
        """``tokens`` [B, L], ``lengths`` [B] → ``{"vector": [B, d]}`` (+ ``"pooling"``, ``"size"`` as images)."""
        if self.training and self.config.augment_words > 0:
            tokens, lengths = self.augment_words(tokens, lengths)
        words = self.txt_enc(tokens, lengths)
        mask = lengths_mask(lengths, words.shape[1], words.device)
        pooled, theta, size = self.txt_pool(words, mask)
        return self._embeddings(pooled, theta, size)

    def _embeddings(self, pooled: torch.Tensor, theta: torch.Tensor, size: torch.Tensor) -> Embeddings:
        if self.training:
            return {"vector": l2norm(pooled)}
        return {"vector": l2norm(pooled), "pooling": theta, "size": size}


    def explain(self, images: Embeddings, captions: Embeddings) -> dict[str, torch.Tensor]:
        check_one_pair(images, captions)
        return {f"{side}_pooling": e["pooling"][0, :int(e["size"][0])]
                for side, e in (("image", images), ("caption", captions))}


@dataclass
class VSEInfinityConfig(Settings):
    """VSE∞'s settings (defaults: the authors' BiGRU + BUTD region run)."""

    embed_size: int = embed_size_setting(1024)
    word_dim: int = word_dim_setting(300)
    num_layers: int = size_setting(1, "GRU layers of the caption encoder.")
    word_vectors: str = word_vectors_setting()
    freeze_word_vectors: bool = freeze_word_vectors_setting()
    image_mlp: bool = setting(True, "Add the residual two-layer MLP to the image projection (the authors' region "
                              "encoder; their fine-tuned grid model has the linear layer only).",
                              flag="--image-mlp/--no-image-mlp")
    pe_dim: int = size_setting(32, "GPO: size of the positional encoding of the ranks.")
    gpo_hidden: int = size_setting(32, "GPO: hidden size of its BiGRU.")
    drop_regions: float = setting(0.2, "Size augmentation: drop each region with this probability in training.",
                                  at_least=0, below=1)
    augment_words: float = setting(0.2, "Size augmentation: mask/replace/delete each caption token with this "
                                   "probability in training.", at_least=0, below=1)
    weight_decay: float = setting(0.01, "AdamW weight decay (the authors' code: torch's default 0.01).")
    margin: float = margin_setting(0.2)
    max_violation: bool = violation_setting(True)


#: the authors' region schedule (train_region.sh, supplement §1.1): 25 epochs, lr 5e-4 ×0.1 after 15, one warm-up
#: epoch on summed violations, batch 128, clip 2; their loader drops the last, smaller batch
VSE_INFINITY_PRESET = {"epochs": 25, "lr": 5e-4, "lr_update": 15, "batch_size": 128, "grad_clip": 2.0,
                       "warmup_epochs": 1, "drop_last": True}

register_model(ModelSpec(
    name="vse-infinity", model_class=VSEInfinity, config_class=VSEInfinityConfig,
    summary="Train VSE∞ (GPO pooling on both sides, BiGRU captions) on region or grid features.",
    examples=("retr-train vse-infinity --features data/coco/features/butd-regions.h5 "
              "--manifest data/coco/manifest.jsonl --preset coco --out runs/vse-infinity-coco",),
    presets={"f30k": VSE_INFINITY_PRESET, "coco": VSE_INFINITY_PRESET}, default_preset="f30k",
    feature_kinds=("regions", "grid")))
