"""SEAM — Self-attentive Embeddings for Aligning Modalities (Wehrmann et al.; ``papers/seam.txt``).

Three caption encoders (SEAM-E, SEAM-C, SEAM-G) share one self-attention module (Lin et al. 2017); images are
10-crop global vectors; both sides live in the non-negative orthant and are compared by order violation. Shapes:
``B`` batch, ``T`` words (``<start>`` … ``<end>``), ``hops`` attention views, ``d`` = 1024 joint space, ``D_in``
image features (4096 VGG-19 fc7, 2048 ResNet-152 pool). :meth:`SEAM.encode_images`: ``[B, 10, D_in]`` → ``[B, d]``;
:meth:`SEAM.encode_captions`: ``[B, T]`` → ``[B, d]``, the attention penalty ``[B]`` and the attention
``[B, modules·hops, T]``; :meth:`SEAM.score`: ``[n_img, n_cap]``; :meth:`SEAM.forward`: the loss. Equations,
decisions and parity: docs/models-seam-sman.md ("SEAM")."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import torch
import torch.nn.functional as F
from torch import nn

from retr.trainers.config import (Settings, embed_size_setting, margin_setting, setting, size_setting,
                                  violation_setting, word_dim_setting)
from retr.trainers.models.registry import ModelSpec, register_model
from retr.trainers.models.base import Embeddings, MatchingModel, check_one_pair
from retr.trainers.models.layers import cat_parts, lengths_mask, masked_batch_norm, masked_mean, run_rnn
from retr.store.vocab import PAD_ID

TEXT_ENCODERS = ("e", "c", "g")
DEFAULT_HOPS = {"e": 30, "c": 10, "g": 30}
#: per text encoder, the name of each attention module's map (:meth:`SEAM.explain`), in the modules' order
ATTENTION_MAPS = {"e": ("hops",), "c": ("bigram_hops", "trigram_hops", "word_hops"), "g": ("hops",)}
CROP_MODES = ("mean", "random")
PENALTY_NORMS = ("squared", "plain")
PADDINGS = ("masked", "authors")
INITS = ("authors", "zero_bias")
PAD_LOGIT = -10000.0


def _xavier(module: nn.Module, zero_bias: bool = True) -> nn.Module:
    """Xavier-uniform weight; the bias zeroed, or (``zero_bias=False``) left at PyTorch's default init."""
    nn.init.xavier_uniform_(module.weight)
    if zero_bias and getattr(module, "bias", None) is not None:
        nn.init.zeros_(module.bias)
    return module


class SelfAttention(nn.Module):
    """Lin et al.'s structured self-attention over ``H`` [B, T, z] → ``M`` [B, hops·z] and ``A`` [B, hops, T]."""

    def __init__(self, in_dim: int, hops: int, hidden: int = 300):
        super().__init__()
        self.hops = hops
        self.ws1 = _xavier(nn.Linear(in_dim, hidden, bias=False))
        self.ws2 = _xavier(nn.Linear(hidden, hops, bias=False))

    def forward(self, h: torch.Tensor, mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        logits = self.ws2(torch.tanh(self.ws1(h))).transpose(1, 2)               # [B, hops, T]
        logits = logits.masked_fill(~mask.unsqueeze(1), PAD_LOGIT)
        attention = torch.softmax(logits, dim=-1)
        return torch.bmm(attention, h).flatten(1), attention


def attention_penalty(attention: torch.Tensor, squared: bool = True) -> torch.Tensor:
    """``‖A Aᵀ − I‖_F`` (squared by default) per caption for ``attention`` [B, hops, T] → [B]."""
    gram = torch.bmm(attention, attention.transpose(1, 2))
    eye = torch.eye(gram.shape[-1], dtype=gram.dtype, device=gram.device)
    squares = (gram - eye).pow(2).sum(dim=(1, 2))
    return squares if squared else squares.clamp(min=1e-12).sqrt()


class MaskedBatchNorm1d(nn.BatchNorm1d):
    """BatchNorm over the channels of ``x`` [B, C, T] using only positions where ``mask`` [B, T] is True
    (``mask=None``: every position, as ``nn.BatchNorm1d``; padded positions are then normalised too)."""

    def forward(self, x: torch.Tensor, mask: torch.Tensor | None = None) -> torch.Tensor:  # type: ignore[override]
        if mask is None:
            return super().forward(x)
        return masked_batch_norm(self, x.transpose(1, 2), mask).transpose(1, 2)


def _unit(x: torch.Tensor) -> torch.Tensor:
    """``x / ‖x‖`` over the last dim, the bare norm as the public code's ``l2norm`` divides (a zero vector stays
    zero: the norm is clamped at 1e-12, far below any norm SEAM's vectors have)."""
    return x / torch.linalg.vector_norm(x, dim=-1, keepdim=True).clamp(min=1e-12)


class SEAMTextEncoder(nn.Module):
    """Caption ``[B, T]`` → ``(vector [B, d] before normalisation, [attention [B, hops, T] per module],
    mask [B, T])``: the mask of the positions the modules attend over (T = the batch's longest caption)."""

    def __init__(self, vocab_size: int, kind: str, embed_size: int = 1024, word_dim: int = 300,
                 hops: int | None = None, attention_hidden: int = 300, conv_filters: int = 100,
                 gru_size: int = 1024, padding: str = "masked", init: str = "authors"):
        super().__init__()
        if kind not in TEXT_ENCODERS:
            raise ValueError(f"text_encoder must be one of {', '.join(TEXT_ENCODERS)}, not {kind!r}")
        if padding not in PADDINGS:
            raise ValueError(f"padding must be one of {', '.join(PADDINGS)}, not {padding!r}")
        if init not in INITS:
            raise ValueError(f"init must be one of {', '.join(INITS)}, not {init!r}")
        self.kind, self.padding = kind, padding
        zero_bias = init == "zero_bias"
        hops = hops or DEFAULT_HOPS[kind]
        self.embed = nn.Embedding(vocab_size, word_dim)
        nn.init.uniform_(self.embed.weight, -0.1, 0.1)
        if kind == "e":
            widths = [word_dim]
        elif kind == "c":
            self.conv2 = _xavier(nn.Conv1d(word_dim, conv_filters, kernel_size=2, padding=1), zero_bias)
            self.conv3 = _xavier(nn.Conv1d(word_dim, conv_filters, kernel_size=3, padding=1), zero_bias)
            self.bn2, self.bn3 = MaskedBatchNorm1d(conv_filters), MaskedBatchNorm1d(conv_filters)
            widths = [conv_filters, conv_filters, word_dim]
        else:
            self.rnn = nn.GRU(word_dim, gru_size, batch_first=True)
            widths = [gru_size]
        self.attention = nn.ModuleList(SelfAttention(w, hops, attention_hidden) for w in widths)
        self.fc = _xavier(nn.Linear(sum(widths) * hops, embed_size), zero_bias)

    def forward(self, tokens: torch.Tensor, lengths: torch.Tensor) -> tuple[torch.Tensor, list[torch.Tensor],
                                                                            torch.Tensor]:
        views, mask = self.views(tokens, lengths)
        pooled, attentions = zip(*(attend(v, mask) for attend, v in zip(self.attention, views)))
        return self.fc(torch.cat(pooled, dim=1)), list(attentions), mask

    def views(self, tokens: torch.Tensor, lengths: torch.Tensor) -> tuple[list[torch.Tensor], torch.Tensor]:
        """What the attention modules attend over: one ``[B, T, z]`` per module (E: the word embeddings; C: the
        bigram and trigram features and the embeddings; G: the GRU outputs), and their mask ``[B, T]``."""
        length = int(lengths.max())
        tokens = tokens[:, :length]
        mask = lengths_mask(lengths, length, tokens.device)
        words = self.embed(tokens) * mask.unsqueeze(-1)                           # [B, T, 300], padding = 0
        if self.kind == "e":
            views = [words]
        elif self.kind == "c" and self.padding == "authors":
            views, mask = self._authors_conv_views(tokens, mask)
        elif self.kind == "c":
            x = words.transpose(1, 2)                                             # [B, 300, T]
            bigram = self.bn2(F.relu(self.conv2(x)[..., :length]), mask)         # crop the k=2 output to T
            trigram = self.bn3(F.relu(self.conv3(x)), mask)
            views = [bigram.transpose(1, 2), trigram.transpose(1, 2), words]
        else:
            views = [run_rnn(self.rnn, words, lengths, length)]
        return views, mask

    def _authors_conv_views(self, tokens: torch.Tensor, mask: torch.Tensor) -> tuple[list[torch.Tensor], torch.Tensor]:
        """SEAM-C's three views with the public code's padding (``padding="authors"``, ``docs/models-seam-sman.md``), in
        training and evaluation alike: the public ``ConvAttentiveTextEncoder`` on this very batch.

        ``tokens`` [B, T] cut to the longest caption, ``mask`` [B, T]. Padded positions hold the ``<pad>`` row's
        embedding; the convolutions' own zero padding lies beyond T, where only the batch's longest captions'
        last trigram reaches; BatchNorm sees every position (the bigram's T+1 outputs, cropped afterwards).
        Returns the views ``[B, T, 100 | 100 | 300]`` and their mask ``[B, T]``.
        """
        words = self.embed(tokens.masked_fill(~mask, PAD_ID))                    # <pad> row where padded
        x = words.transpose(1, 2)                                                 # [B, 300, T]
        bigram = self.bn2(F.relu(self.conv2(x)))[..., :x.shape[-1]]              # BN over T+1, then crop
        trigram = self.bn3(F.relu(self.conv3(x)))
        return [bigram.transpose(1, 2), trigram.transpose(1, 2), words], mask


class SEAM(MatchingModel):
    """SEAM-E/C/G on 10-crop features ``[B, 10, D_in]`` (docs/models-seam-sman.md); settings: :class:`SEAMConfig`.

    :meth:`explain`: the self-attention ``A`` over the caption's real tokens, ``[hops, L]`` per module: ``"hops"``
    (E, G) or ``"bigram_hops"``, ``"trigram_hops"``, ``"word_hops"`` (C); rows sum to 1."""

    def __init__(self, vocab_size: int, img_dim: int = 4096, config: "SEAMConfig | None" = None):
        cfg = self.config = config if config is not None else SEAMConfig()
        super().__init__(cfg.margin, cfg.max_violation)
        crops, penalty_norm, text_encoder = cfg.crops, cfg.penalty_norm, cfg.text_encoder
        input_l2norm, penalty_weight, order_squared = cfg.input_l2norm, cfg.penalty_weight, cfg.order_squared
        embed_size, word_dim, hops = cfg.embed_size, cfg.word_dim, cfg.hops
        attention_hidden, conv_filters, gru_size = cfg.attention_hidden, cfg.conv_filters, cfg.gru_size
        if crops not in CROP_MODES:
            raise ValueError(f"crops must be one of {', '.join(CROP_MODES)}, not {crops!r}")
        if penalty_norm not in PENALTY_NORMS:
            raise ValueError(f"penalty_norm must be one of {', '.join(PENALTY_NORMS)}, not {penalty_norm!r}")
        self.text_encoder, self.crops, self.input_l2norm = text_encoder, crops, input_l2norm
        self.penalty_weight, self.penalty_squared = float(penalty_weight), penalty_norm == "squared"
        self.order_squared = bool(order_squared)
        self.img_fc = _xavier(nn.Linear(img_dim, embed_size))     # bias zero in both inits (the public code's)
        self.txt_enc = SEAMTextEncoder(vocab_size, text_encoder, embed_size, word_dim, hops, attention_hidden,
                                       conv_filters, gru_size, cfg.padding, cfg.init)
        #: upper bound on n_img·n_cap·d elements per chunk inside ``score``
        self.max_chunk_elements = 1 << 24

    def encode_images(self, features: torch.Tensor, mask: torch.Tensor) -> Embeddings:
        """``features`` [B, K crops, D_in], ``mask`` [B, K] → ``{"vector": [B, d]}`` (non-negative, unit norm)."""
        features, mask = features.to(self.img_fc.weight.dtype), mask.bool()     # float16/32 → the model's dtype
        if self.crops == "random" and self.training:
            # one valid crop per image, uniformly
            choice = torch.multinomial(mask.float(), 1).squeeze(1)
            pooled = features[torch.arange(features.shape[0], device=features.device), choice]
        else:
            pooled = masked_mean(features, mask)
        if self.input_l2norm:
            pooled = _unit(pooled)
        return {"vector": _unit(self.img_fc(pooled)).abs()}

    def encode_captions(self, tokens: torch.Tensor, lengths: torch.Tensor) -> Embeddings:
        """``tokens`` [B, T], ``lengths`` [B] → ``{"vector": [B, d], "penalty": [B]}`` (penalty summed over modules),
        ``"attention"`` [B, modules·hops, T] (each module's ``A``, stacked in module order) and ``"mask"``
        [B, T] (the positions attended over)."""
        vector, attentions, mask = self.txt_enc(tokens, lengths)
        stacked = torch.cat(attentions, dim=1)                                    # [B, modules·hops, T]
        batch, hops = stacked.shape[0], attentions[0].shape[1]
        # every module has the same hops: one batched penalty over [B·modules, hops, T], summed per caption
        penalty = attention_penalty(stacked.view(batch * len(attentions), hops, -1), self.penalty_squared)
        return {"vector": _unit(vector).abs(), "penalty": penalty.view(batch, -1).sum(1), "attention": stacked,
                "mask": mask}

    @property
    def captions_in_split_order(self) -> bool:
        """Whether a caption's embedding depends on its batch (SEAM-C with ``padding="authors"``); the evaluator
        then encodes in the authors' batches (:func:`retr.trainers.evaluation.similarity.encode_split`)."""
        return self.text_encoder == "c" and self.txt_enc.padding == "authors"

    @property
    def explains(self) -> tuple[str, ...]:
        """One map per attention module (class docstring)."""
        return ATTENTION_MAPS[self.text_encoder]

    def explain(self, images: Embeddings, captions: Embeddings) -> dict[str, torch.Tensor]:
        """The self-attention behind the caption's vector, padding dropped (class docstring: names and shapes)."""
        check_one_pair(images, captions)
        words = captions["mask"][0].bool()
        hops = [a.hops for a in self.txt_enc.attention]
        rows = captions["attention"][0, :sum(hops)].split(hops, dim=0)
        return {name: a[:, words] for name, a in zip(self.explains, rows)}

    def score(self, images: Embeddings, captions: Embeddings, dtype: torch.dtype | None = None) -> torch.Tensor:
        """Order-violation similarity ``[n_img, n_cap]``: ``−‖max(0, c − i)‖₂`` (squared with ``order_squared``)."""
        dtype = dtype or images["vector"].dtype
        im, cap = images["vector"].to(dtype), captions["vector"].to(dtype)
        step = max(1, self.max_chunk_elements // max(1, cap.shape[0] * cap.shape[1]))
        rows = []
        for start in range(0, im.shape[0], step):
            violation = (cap.unsqueeze(0) - im[start:start + step].unsqueeze(1)).clamp(min=0).pow(2).sum(-1)
            rows.append(-violation if self.order_squared else -violation.clamp(min=1e-12).sqrt())
        return cat_parts(rows)

    pair_score_is_aligned = True
    #: the order violation of the encoders' vectors: no parameter takes part in a score
    score_uses_parameters = False

    def pair_score(self, images: Embeddings, captions: Embeddings, img_idx: torch.Tensor, cap_idx: torch.Tensor,
                   dtype: torch.dtype | None = None) -> torch.Tensor:
        """:meth:`score` of the listed pairs only, ``[P]`` (``img_idx``, ``cap_idx`` ``[P]`` long), in chunks of
        ``max_chunk_elements``."""
        dtype = dtype or images["vector"].dtype
        im, cap = images["vector"], captions["vector"]
        step = max(1, self.max_chunk_elements // max(1, cap.shape[1]))
        out = []
        for start in range(0, img_idx.numel(), step):
            i, c = img_idx[start:start + step], cap_idx[start:start + step]
            violation = (cap[c].to(dtype) - im[i].to(dtype)).clamp(min=0).pow(2).sum(-1)
            out.append(-violation if self.order_squared else -violation.clamp(min=1e-12).sqrt())
        return cat_parts(out) if out else im.new_zeros(0, dtype=dtype)

    def loss(self, scores: torch.Tensor, penalty: torch.Tensor | None = None) -> torch.Tensor:
        """Hinge over ``scores`` [B, B] (all negatives, margin 0.05) + λ · mean of ``penalty`` [B]."""
        total = self.ranking_loss(scores)
        if self.penalty_weight > 0:
            if penalty is None:
                raise ValueError("SEAM's loss needs the captions' attention penalty (use model.forward)")
            total = total + self.penalty_weight * penalty.mean()
        return total

    def forward(self, features: torch.Tensor, mask: torch.Tensor, tokens: torch.Tensor, lengths: torch.Tensor,
                gather=None) -> torch.Tensor:
        """One training step's loss: the hinge on the (gathered) batch plus λ · the penalty's batch mean (under DDP
        each process adds its captions' penalties over the global batch size)."""
        images = self.encode_images(features, mask)
        captions = self.encode_captions(tokens, lengths)
        local_penalty = captions["penalty"]
        if gather is not None:
            images, captions = gather(images), gather(captions)
        global_batch = captions["vector"].shape[0]
        penalty = local_penalty * (local_penalty.shape[0] / global_batch)    # mean → Σ_local / global batch
        return self.loss(self.scoring()(images, captions), penalty)


@dataclass
class SEAMConfig(Settings):
    """SEAM's settings (defaults: the paper's SEAM-C on COCO)."""

    embed_size: int = embed_size_setting(1024)
    word_dim: int = word_dim_setting(300)
    text_encoder: Literal[TEXT_ENCODERS] = setting(
        "c", "SEAM-E (attention over embeddings), SEAM-C (convolutions) or SEAM-G (GRU).")
    hops: int | None = size_setting(None, "Attention hops (default: E/G 30, C 10 per module).")
    attention_hidden: int = size_setting(300, "Hidden size of the self-attention (W1: z → N).")
    conv_filters: int = size_setting(100, "SEAM-C's filters per convolution.")
    gru_size: int = size_setting(512, "SEAM-G's GRU size (512, the paper's reported model; the authors' code: 1024).")
    penalty_weight: float = setting(0.5, "λ of the attention penalty (0 = off).")
    penalty_norm: Literal[PENALTY_NORMS] = setting(
        "squared", "‖AAᵀ − I‖_F squared (paper) or plain (the authors' code).")
    order_squared: bool = setting(False, "Square the order violation (original order embeddings); default: its norm.",
                                  flag="--order-squared")
    padding: Literal[PADDINGS] = setting(
        "masked", "SEAM-C's padded positions: masked (zeroed before the convolutions, BatchNorm over real words; "
                  "scores independent of batching) or authors (the <pad> embedding is convolved and BatchNorm "
                  "sees padded positions: the public code's arithmetic, batch for batch, evaluated in its batches).")
    init: Literal[INITS] = setting(
        "authors", "Initial biases: authors (text Linear/Conv biases at PyTorch's default, image Linear bias 0, "
                   "as the public code) or zero_bias (every bias 0).")
    crops: Literal[CROP_MODES] = setting("mean", "Average the 10 crops or train on one random crop per image.")
    input_l2norm: bool = setting(True, "l2-normalise the averaged image vector before the linear map.",
                                 flag="--input-l2norm/--no-input-l2norm")
    margin: float = margin_setting(0.05)
    max_violation: bool = violation_setting(False)


#: The paper's schedule (§3.2, COCO; the paper trains no Flickr30K model, so its preset is the same).
SEAM_PRESET = {"epochs": 30, "lr": 1e-3, "lr_update": 15, "batch_size": 128, "grad_clip": 1.0}

register_model(ModelSpec(
    name="seam", model_class=SEAM, config_class=SEAMConfig,
    summary="Train SEAM-E/C/G (self-attentive caption embeddings, order violation) on 10-crop features.",
    examples=("retr-train seam --features data/coco/features/tencrop-vgg19.h5 --manifest data/coco/manifest.jsonl "
              "--preset coco --text-encoder c --out runs/seam-c-coco",
              "retr-train eval runs/seam-c-coco --protocol coco-1k"),
    presets={"coco": SEAM_PRESET, "f30k": SEAM_PRESET}, default_preset="coco", feature_kinds=("tencrop",)))
