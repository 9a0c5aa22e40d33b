"""VSE∞ (Chen et al., CVPR 2021, "Learning the Best Pooling Strategy for Visual Semantic Embedding"), with either
of the authors' caption encoders: a BiGRU (their ``bigru`` branch) or BERT (their ``master`` branch).

Each side is a set of vectors pooled by a Generalized Pooling Operator (:class:`GPO`), then l2-normalised; the
score is their dot product and the loss VSE++'s hinge (``--warmup-epochs 1`` of summed violations, then hardest
negatives). Image side: ``fc`` (Linear, Xavier) plus, for regions, a residual two-layer MLP
(Linear → BatchNorm → ReLU → Linear) on every real region. Caption side, ``bigru``: embedding (the vocabulary plus
one ``<mask>`` row, as the authors append it) → BiGRU, directions averaged; ``bert``: WordPiece ids ``[CLS] … [SEP]``
→ a pretrained BERT → Linear(768 → d), every token's vector pooled. Training only: the authors' size augmentation
drops each region with probability ``drop_regions`` and each caption token (BiGRU) or word (BERT: all its pieces
alike, ``[CLS]``/``[SEP]`` never) with probability ``augment_words`` is masked (½), replaced by a random token
(1/10) or deleted (4/10). Optimiser: AdamW (BERT's parameters at ``bert_lr_factor`` × the learning rate).
Decisions, paper vs authors' code: docs/models-vse-infinity.md.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Literal

import torch
from torch import nn

from retr.trainers.config import (Settings, embed_size_setting, freeze_word_vectors_setting, margin_setting, setting,
                                  size_setting, violation_setting, word_dim_setting, word_vectors_setting)
from retr.trainers.models.base import Embeddings, InnerProductModel, check_one_pair
from retr.trainers.models.layers import l2norm, lengths_mask, masked_batch_norm, masked_softmax, run_rnn
from retr.store.word_vectors import RANDOM
from retr.trainers.models.pretrained_bert import DEFAULT_BERT
from retr.trainers.models.registry import ModelSpec, register_model
from retr.trainers.models.side_inputs import bert_vocabulary, load_bert_inputs
from retr.trainers.models.text import BertWordEncoder, GRUWordEncoder, install_word_vectors

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
    """VSE∞ with a BiGRU or a BERT caption encoder (``config.text_encoder``); settings: :class:`VSEInfinityConfig`.

    ``vocab_size``: the caption vocabulary's size (BiGRU: SCAN's vocabulary, the model adds ``<mask>``; BERT: the
    WordPiece vocabulary, ``bert_config["vocab_size"]``); ``bert_config``: BERT's stored configuration
    (:data:`~retr.trainers.models.pretrained_bert.CONFIG_KEYS`), required with BERT.

    ``explain`` gives GPO's pooling weights: ``image_pooling`` ``[k]`` over the k real regions' ranks (weight of
    each dimension's r-th largest value) and ``caption_pooling`` ``[n]`` over the n tokens' ranks; each sums to 1.
    """

    explains = rank_maps = ("image_pooling", "caption_pooling")

    def __init__(self, vocab_size: int, img_dim: int = 2048, config: "VSEInfinityConfig | None" = None,
                 word_vectors_file: str = "", bert_config: dict | None = None):
        cfg = self.config = config if config is not None else VSEInfinityConfig()
        super().__init__(cfg.margin, cfg.max_violation)
        self.word_vectors_file = word_vectors_file     # the vectors the words started from
        self.img_enc = GPOImageEncoder(img_dim, cfg.embed_size, cfg.image_mlp, cfg.pe_dim, cfg.gpo_hidden)
        self.uses_bert = cfg.text_encoder == "bert"
        if self.uses_bert:
            if bert_config is None:
                raise ValueError("text_encoder bert needs bert_config, BERT's configuration "
                                 "(retr.trainers.models.pretrained_bert.pretrained_bert(name).config)")
            if int(bert_config["vocab_size"]) != vocab_size:
                raise ValueError(f"bert_config has {bert_config['vocab_size']} embedding rows but the WordPiece "
                                 f"vocabulary {vocab_size} tokens")
            self.vocab_size = vocab_size
            self.mask_token: int | None = None             # [MASK]: given with the word pieces (prepare_training)
            self.txt_enc = BertWordEncoder(bert_config, cfg.embed_size)
            #: [V] bool, True where a WordPiece token continues a word (``##…``): training's word augmentation
            self.register_buffer("word_continues", None, persistent=False)
        else:
            self.mask_token = vocab_size                   # the authors' <mask>, appended after the vocabulary
            self.txt_enc = GRUWordEncoder(vocab_size + 1, cfg.word_dim, cfg.embed_size, cfg.num_layers,
                                          bidirectional=True, normalize=False)
        self.txt_pool = GPO(cfg.pe_dim, cfg.gpo_hidden)

    def prepare_training(self, inputs: dict) -> None:
        """BiGRU: ``--word-vectors``' rows (``<mask>`` keeps its init). BERT: the pretrained weights
        (``bert.<name>`` entries, when given), the vocabulary's ``word_continues`` ``[V]`` bool and ``mask_token``."""
        if not self.uses_bert:
            install_word_vectors(self.txt_enc.embed, inputs, self.config.freeze_word_vectors)
            return
        pretrained = {k[len("bert."):]: v for k, v in inputs.items() if k.startswith("bert.")}
        if pretrained:
            self.txt_enc.bert.load_state_dict(pretrained, strict=True)
        self.word_continues = inputs["word_continues"].to(self.img_enc.fc.weight.device, torch.bool)
        self.mask_token = int(inputs["mask_token"])

    def configure_optimizer(self, lr: float) -> torch.optim.Optimizer:
        """AdamW (the authors' optimiser for precomputed features); with BERT, BERT's parameters in a group of their
        own at ``bert_lr_factor`` × ``lr`` (their ``master`` branch). Weight decay: ``weight_decay``, else the
        authors' for the text encoder (:data:`WEIGHT_DECAY`)."""
        decay = self.config.weight_decay if self.config.weight_decay is not None \
            else WEIGHT_DECAY[self.config.text_encoder]
        if not self.uses_bert:
            return torch.optim.AdamW(self.parameters(), lr=lr, weight_decay=decay)
        bert = list(self.txt_enc.bert.parameters())
        inside = {id(p) for p in bert}
        text = [p for p in self.txt_enc.parameters() if id(p) not in inside] + list(self.txt_pool.parameters())
        return torch.optim.AdamW([{"params": text, "lr": lr},
                                  {"params": bert, "lr": lr * self.config.bert_lr_factor},
                                  {"params": list(self.img_enc.parameters()), "lr": lr}], lr=lr, weight_decay=decay)

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

    def augment_word_pieces(self, tokens: torch.Tensor, lengths: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The authors' ``process_caption`` on WordPiece ids: each word (its first piece and the ``##`` pieces after
        it; ``[CLS]`` and ``[SEP]`` never) with probability p = ``augment_words``: every piece ``[MASK]`` (p/2), every
        piece a random id in [0, V) (p/10), or all deleted (2p/5); survivors are moved to the front. Returns
        ``(tokens [B, L], lengths [B])``, both on the tokens' device: the words are found from the tokens' values,
        which are there, so nothing is drawn on the host and nothing read back."""
        if self.word_continues is None or self.mask_token is None:
            raise ValueError("the BERT word augmentation needs the vocabulary's word pieces: call prepare_training "
                             "with word_continues and mask_token (the spec's load_inputs gives them)")
        device, width = tokens.device, tokens.shape[1]
        lengths = lengths.to(device, non_blocking=True)
        position = torch.arange(width, device=device).view(1, -1)
        valid = position < lengths.view(-1, 1)
        inner = (position >= 1) & (position < lengths.view(-1, 1) - 1)               # between [CLS] and [SEP]
        starts = inner & ~self.word_continues[tokens]
        first = torch.where(starts, position, 0).cummax(dim=1).values                # each piece's word's first piece
        u = (torch.rand(tokens.shape, device=device) / self.config.augment_words).gather(1, first)
        hit = inner & (u < 1)                                                         # the word is hit
        random = torch.randint(0, self.vocab_size, tokens.shape, device=device)
        tokens = torch.where(hit & (u < 0.5), self.mask_token, tokens)
        tokens = torch.where(hit & (u >= 0.5) & (u < 0.6), random, tokens)
        keep = valid & ~(hit & (u >= 0.6))
        order = (~keep).to(torch.uint8).sort(dim=1, stable=True).indices
        lengths = keep.sum(1)
        return tokens.gather(1, order) * lengths_mask(lengths, width), lengths

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
            augment = self.augment_word_pieces if self.uses_bert else self.augment_words
            tokens, lengths = augment(tokens, lengths)
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


#: AdamW's weight decay for each caption encoder where ``--weight-decay`` is not given: the authors' ``bigru`` branch
#: leaves torch's default (0.01), their ``master`` branch (BERT) sets 1e-4
WEIGHT_DECAY = {"bigru": 0.01, "bert": 1e-4}


@dataclass
class VSEInfinityConfig(Settings):
    """VSE∞'s settings (defaults: the authors' BiGRU + BUTD region run; ``text_encoder="bert"``: their BERT run)."""

    text_encoder: Literal["bigru", "bert"] = setting(
        "bigru", "Caption encoder: bigru (the authors' bigru branch: word embeddings learned from scratch + a BiGRU) "
        "or bert (their master branch: the pretrained --bert-model + a linear map, WordPiece captions; needs the "
        "bert extra).")
    bert_model: str = setting(DEFAULT_BERT, "With --text-encoder bert: the pretrained BERT to start from and "
                              "tokenise with, a Hugging Face Hub name (read from the Hugging Face cache, downloaded "
                              "there on first use) or a folder of its config.json, vocab.txt and weights.")
    bert_lr_factor: float = setting(0.1, "With --text-encoder bert: BERT's learning rate as a multiple of --lr (the "
                                    "authors': 0.1).", at_least=0)
    embed_size: int = embed_size_setting(1024)
    word_dim: int = word_dim_setting(300)
    num_layers: int = size_setting(1, "GRU layers of the caption encoder (bigru).")
    word_vectors: str = word_vectors_setting()
    freeze_word_vectors: bool = freeze_word_vectors_setting()
    image_mlp: bool = setting(True, "Add the residual two-layer MLP to the image projection (the authors' region "
                              "encoder; their fine-tuned grid model has the linear layer only).",
                              flag="--image-mlp/--no-image-mlp")
    pe_dim: int = size_setting(32, "GPO: size of the positional encoding of the ranks.")
    gpo_hidden: int = size_setting(32, "GPO: hidden size of its BiGRU.")
    drop_regions: float = setting(0.2, "Size augmentation: drop each region with this probability in training.",
                                  at_least=0, below=1)
    augment_words: float = setting(0.2, "Size augmentation: mask/replace/delete each caption token (bigru) or word "
                                   "(bert: all its WordPiece pieces) with this probability in training.",
                                   at_least=0, below=1)
    weight_decay: float | None = setting(None, "AdamW weight decay (default: the authors' for the caption encoder: "
                                         "0.01, torch's default, with bigru; 1e-4 with bert).", at_least=0)
    margin: float = margin_setting(0.2)
    max_violation: bool = violation_setting(True)

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.text_encoder == "bert" and self.word_vectors != RANDOM:
            raise ValueError(f"word_vectors {self.word_vectors} starts the word embeddings of text_encoder bigru; "
                             "text_encoder bert starts from the pretrained bert_model")


#: the authors' region schedule (train_region.sh, supplement §1.1): 25 epochs, lr 5e-4 ×0.1 after 15, one warm-up
#: epoch on summed violations, batch 128, clip 2; their loader drops the last, smaller batch
VSE_INFINITY_PRESET = {"epochs": 25, "lr": 5e-4, "lr_update": 15, "batch_size": 128, "grad_clip": 2.0,
                       "warmup_epochs": 1, "drop_last": True}

register_model(ModelSpec(
    name="vse-infinity", model_class=VSEInfinity, config_class=VSEInfinityConfig,
    summary="Train VSE∞ (GPO pooling on both sides; BiGRU or BERT captions) on region or grid features.",
    examples=("retr-train vse-infinity --features data/coco/features/butd-regions.h5 "
              "--manifest data/coco/manifest.jsonl --preset coco --out runs/vse-infinity-coco",
              "retr-train vse-infinity --text-encoder bert --features data/f30k/features/butd-regions.h5 "
              "--manifest data/f30k/manifest.jsonl --preset f30k --out runs/vse-infinity-bert-f30k"),
    presets={"f30k": VSE_INFINITY_PRESET, "coco": VSE_INFINITY_PRESET}, default_preset="f30k",
    load_inputs=load_bert_inputs, caption_vocabulary=bert_vocabulary, feature_kinds=("regions", "grid")))
