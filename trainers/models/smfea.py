"""SMFEA — Structured Multi-modal Feature Embedding and Alignment (ACM MM 2021), on CVSE's instance and concept
branches.

Shapes: ``K`` regions (36), ``D_in`` their size (2048), ``d`` the joint size (1024), ``L`` words, ``C`` concepts,
``B`` the batch. :meth:`SMFEA.encode_images`: regions ``[B, K, D_in]`` and mask ``[B, K]`` → the fused vector
``V_F`` ``[B, d]`` with its branches ``V_D``, ``V_T``, ``V_C`` ``[B, d]``; :meth:`SMFEA.encode_captions`: tokens
``[B, L]`` → ``S_F`` and its branches likewise; :meth:`SMFEA.score`: the cosine of the fused vectors
``[n_img, n_cap]``; :meth:`SMFEA.forward`: the training loss (Eq. 20 with CVSE's ranking terms). Equations,
decisions, presets and parity: docs/models-smfea.md."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Literal

import torch
import torch.nn.functional as F
from torch import nn

from retr.store.word_vectors import GLOVE_SETS
from retr.trainers.config import (Settings, dropout_setting, embed_size_setting, freeze_word_vectors_setting,
                                  margin_setting, setting, size_setting, violation_setting, word_dim_setting,
                                  word_vectors_setting)
from retr.trainers.models.registry import InputFile, ModelSpec, register_model
from retr.trainers.models.base import Embeddings, InnerProductModel, check_one_pair
from retr.trainers.models.layers import l2norm, lengths_mask, masked_mean, masked_softmax
from retr.trainers.models.concepts import (ConceptAttention, ConceptGCN, consensus_vector, mix_text_labels)
from retr.trainers.models.scan import RegionEncoder
from retr.trainers.models.text import GRUWordEncoder, install_word_vectors
from retr.trainers.models.tree_lstm import ENTITY_SLOTS, FORGET_GATES, NUM_NODES, RELATION_SLOTS, StructuredTreeEncoder
from retr.trainers.models.side_inputs import load_smfea_inputs

TRAIN_TEXT_LABELS = ("image", "caption")


class MeanQueryAttention(nn.Module):
    """Attention pooling with the mean as query (CVSE's instance attention): ``[B, K, d]`` + mask → ``[B, d]``.

    ``h_k = tanh(N(fc1 x_k)) ⊙ tanh(N(fc2 x̄))``, ``α = softmax_k(fc3 h_k)`` over unmasked positions, output
    ``l2norm(Σ α_k x_k)``; ``N`` is BatchNorm1d (image side) or the identity (text side). The local path's batch
    norm is per region position over batch × features (``bn_axis="regions"``, CVSE's ``BatchNorm1d(36)``, unmasked:
    it needs exactly ``num_regions`` positions) or per feature over the unmasked positions (``"features"``).
    ``dropout`` follows each tanh."""

    def __init__(self, embed_size: int, batch_norm: bool, normalize_query: bool = False, bn_axis: str = "features",
                 num_regions: int = 36, dropout: float = 0.0):
        super().__init__()
        if bn_axis not in ("features", "regions"):
            raise ValueError(f"instance_bn must be features or regions, not {bn_axis!r}")
        #: CVSE batch-normalises the local path over the region positions (``BatchNorm1d(36)``), unmasked
        self.bn_axis, self.num_regions = bn_axis, int(num_regions)
        #: CVSE's dropout after each tanh of the attention (0.4 in its runs)
        self.dropout = nn.Dropout(dropout)
        #: l2-normalise the mean before it becomes the query (CVSE's text attention: ``l2norm(mean)``)
        self.normalize_query = normalize_query
        self.fc_local = nn.Linear(embed_size, embed_size)
        self.fc_query = nn.Linear(embed_size, embed_size)
        self.fc_score = nn.Linear(embed_size, 1)
        self.bn_local = (nn.BatchNorm1d(num_regions if bn_axis == "regions" else embed_size) if batch_norm
                         else None)
        self.bn_query = nn.BatchNorm1d(embed_size) if batch_norm else None

    def forward(self, x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        """``x`` [B, K, d], ``mask`` [B, K] → ``l2norm(Σ α_k x_k)`` [B, d] (:meth:`attend` without the weights)."""
        return self.attend(x, mask)[0]

    def attend(self, x: torch.Tensor, mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``x`` [B, K, d], ``mask`` [B, K] → (``l2norm(Σ α_k x_k)`` [B, d], ``α`` [B, K], 0 where masked)."""
        mean = masked_mean(x, mask)                                                # [B, d]
        if self.normalize_query:
            mean = l2norm(mean, dim=-1)
        local = self.fc_local(x)                                                   # [B, K, d]
        query = self.fc_query(mean)                                                # [B, d]
        if self.bn_local is not None and self.bn_axis == "regions":
            if local.shape[1] != self.num_regions:
                raise ValueError(f"num_regions is {self.num_regions} (instance_bn='regions' normalises each region "
                                 f"position), but the features have {local.shape[1]} regions")
            local = self.bn_local(local)                                           # [B, K, d]: per position
            query = self.bn_query(query)
        elif self.bn_local is not None:
            valid = local[mask]                                                    # [n_valid, d]
            local = local.masked_scatter(mask.unsqueeze(-1), self.bn_local(valid).to(local.dtype))
            query = self.bn_query(query)
        h = self.dropout(torch.tanh(local)) * self.dropout(torch.tanh(query)).unsqueeze(1)
        alpha = masked_softmax(self.fc_score(h).squeeze(-1), mask)               # [B, K]
        return l2norm((alpha.unsqueeze(-1) * x).sum(1), dim=-1), alpha


def node_cross_entropy(entity_logits: torch.Tensor, relation_logits: torch.Tensor,
                       nodes: torch.Tensor) -> torch.Tensor:
    """Per sample ``Σ_nodes CE`` [B]: logits [B, 4, E] (slots 0 2 4 6), [B, 3, R] (slots 1 3 5); nodes [B, 7]."""
    nodes = nodes.long()
    ce_e = F.cross_entropy(entity_logits.transpose(1, 2), nodes[:, list(ENTITY_SLOTS)], reduction="none")
    ce_r = F.cross_entropy(relation_logits.transpose(1, 2), nodes[:, list(RELATION_SLOTS)], reduction="none")
    return ce_e.sum(1) + ce_r.sum(1)


def node_ids(entity_logits: torch.Tensor, relation_logits: torch.Tensor) -> torch.Tensor:
    """Predicted node ids ``[B, 7]`` long in slot order from a tree's logits [B, 4, E] and [B, 3, R] (argmax)."""
    pred = torch.empty(entity_logits.shape[0], NUM_NODES, dtype=torch.long, device=entity_logits.device)
    pred[:, list(ENTITY_SLOTS)] = entity_logits.argmax(-1)
    pred[:, list(RELATION_SLOTS)] = relation_logits.argmax(-1)
    return pred


def node_kl(image: Embeddings, text: Embeddings) -> torch.Tensor:
    """Per pair ``Σ_nodes KL(P_V ‖ P_S)`` [B] between the image and text trees' node distributions."""
    total = 0.0
    for key in ("entity_logits", "relation_logits"):
        log_pv = F.log_softmax(image[key], dim=-1)
        log_ps = F.log_softmax(text[key], dim=-1)
        total = total + (log_pv.exp() * (log_pv - log_ps)).sum(-1).sum(-1)
    return total


class SMFEA(InnerProductModel):
    """SMFEA: instance + tree + consensus-concept embeddings fused by β, trained with Eq. 20; settings:
    :class:`SMFEAConfig`; ``num_entities``/``num_relations``/``num_concepts``: sizes of the run's side files.

    :meth:`explain`: ``"region_attention"`` ``[K]``, ``"word_attention"`` ``[L]`` (instance attention, C11), and with
    trees ``"image_tree_nodes"``/``"text_tree_nodes"`` ``[7]`` long (predicted ids, slots E1 R2 E3 R4 E5 R6 E7).
    """

    batch_extras = ("caption_index",)   # each row's training caption, to look up its tree and image labels
    vector_key = "fused"                # the score: the inner product (cosine) of the fused vectors

    def __init__(self, vocab_size: int, num_entities: int, num_relations: int, num_concepts: int,
                 img_dim: int = 2048, config: "SMFEAConfig | None" = None, word_vectors_file: str = "",
                 concept_vectors_file: str = ""):
        cfg = self.config = config if config is not None else SMFEAConfig()
        # the vectors the words and the concepts started from (name sha256:…), recorded in the run
        self.word_vectors_file, self.concept_vectors_file = word_vectors_file, concept_vectors_file
        super().__init__(cfg.margin, cfg.max_violation)
        embed_size, word_dim, tree_hidden, tree_input_dim = cfg.embed_size, cfg.word_dim, cfg.tree_hidden, cfg.tree_input_dim
        forget_gate, tree_residual, use_trees = cfg.forget_gate, cfg.tree_residual, cfg.use_trees
        beta_d, beta_t, beta_c, ce_weight, kl_weight = cfg.beta_d, cfg.beta_t, cfg.beta_c, cfg.ce_weight, cfg.kl_weight
        label_ratio, concept_smooth, concept_word_dim = cfg.label_ratio, cfg.concept_smooth, cfg.concept_word_dim
        concept_vectors, train_text_labels = cfg.concept_vectors, cfg.train_text_labels
        #: per training caption: referral-tree node ids [M, 7] (−100 = no tree) and image concept labels [M, C]
        self.train_nodes: torch.Tensor | None = None
        self.train_image_labels: torch.Tensor | None = None
        if train_text_labels not in TRAIN_TEXT_LABELS:
            raise ValueError(f"train_text_labels must be one of {', '.join(TRAIN_TEXT_LABELS)}")
        self.use_trees = bool(use_trees)
        self.betas = (float(beta_d), float(beta_t) if use_trees else 0.0, float(beta_c))
        self.ce_weight = float(ce_weight) if use_trees else 0.0
        self.kl_weight = float(kl_weight) if use_trees else 0.0
        self.label_ratio, self.concept_smooth = float(label_ratio), float(concept_smooth)
        self.train_text_labels = train_text_labels
        self.num_concepts = int(num_concepts)
        self.img_enc = RegionEncoder(img_dim, embed_size)
        self.img_attn = MeanQueryAttention(embed_size, batch_norm=True, bn_axis=cfg.instance_bn,
                                           num_regions=cfg.num_regions, dropout=cfg.attention_dropout)
        self.txt_enc = GRUWordEncoder(vocab_size, word_dim, embed_size, bidirectional=True, dropout=cfg.word_dropout)
        self.txt_attn = MeanQueryAttention(embed_size, batch_norm=False, normalize_query=cfg.text_query_l2norm,
                                           dropout=cfg.attention_dropout)
        self.rank_weights = {"fused": float(cfg.fused_rank_weight), "instance": float(cfg.instance_rank_weight),
                             "concept": float(cfg.concept_rank_weight)}
        self.concept_kl_weight = float(cfg.concept_kl_weight)
        self.concept_kl_reduction = cfg.concept_kl_reduction
        self.tree_loss_reduction = cfg.tree_loss_reduction
        if self.use_trees:
            tree_args = dict(embed_size=embed_size, num_entities=num_entities, num_relations=num_relations,
                             hidden_size=tree_hidden, input_dim=tree_input_dim, forget_gate=forget_gate,
                             residual=tree_residual)
            self.img_tree = StructuredTreeEncoder(**tree_args)
            self.txt_tree = StructuredTreeEncoder(**tree_args)
        self.gcn = ConceptGCN(num_concepts, concept_word_dim, 512, embed_size,
                              "learned" if concept_vectors == "learned" else "fixed")
        self.img_concept_attn = ConceptAttention(embed_size, concept_smooth)
        self.txt_concept_attn = ConceptAttention(embed_size, concept_smooth)
        #: vocabulary id → concept id (−1: the word is no concept); set from concepts.h5 by the command
        self.register_buffer("token_concepts", torch.full((vocab_size,), -1, dtype=torch.long))

    # ---------------------------------------------------------------------------------------------- inputs
    def prepare_training(self, inputs: dict[str, torch.Tensor]) -> None:
        """Install the run's side data (:func:`retr.trainers.models.side_inputs.load_smfea_inputs`): the concept graph
        ``adjacency`` [C, C] and fixed ``vectors`` [C, D] (if any), the token map ``token_concepts`` [V], and for
        the training captions the node targets ``nodes`` [M, 7] and image labels ``image_labels`` [M, C]; with
        ``--word-vectors`` the vocabulary's rows (:func:`~retr.trainers.models.text.install_word_vectors`)."""
        device = self.token_concepts.device
        install_word_vectors(self.txt_enc.embed, inputs, self.config.freeze_word_vectors)
        vectors = inputs.get("vectors")
        self.gcn.set_graph(inputs["adjacency"].to(device), None if vectors is None else vectors.to(device))
        self.set_token_concepts(inputs["token_concepts"].to(device))
        self.train_nodes = inputs.get("nodes")
        self.train_image_labels = inputs["image_labels"]

    @torch.no_grad()
    def set_token_concepts(self, token_concepts: torch.Tensor) -> None:
        """Install the vocabulary → concept map ``[V]`` long (−1 = none)."""
        if token_concepts.shape != self.token_concepts.shape:
            raise ValueError(f"token_concepts must be {tuple(self.token_concepts.shape)}")
        if int(token_concepts.max()) >= self.num_concepts:
            raise ValueError("token_concepts names a concept id beyond num_concepts")
        self.token_concepts.copy_(token_concepts)

    def caption_concept_labels(self, tokens: torch.Tensor, lengths: torch.Tensor) -> torch.Tensor:
        """Multi-hot ``[B, C]`` float of the concepts among each caption's own tokens."""
        concept = self.token_concepts[tokens]                                        # [B, L]
        valid = lengths_mask(lengths, tokens.shape[1], tokens.device) & (concept >= 0)
        labels = torch.zeros(tokens.shape[0], self.num_concepts + 1, device=tokens.device)
        labels.scatter_(1, torch.where(valid, concept, self.num_concepts), 1.0)
        return labels[:, :self.num_concepts]

    # ---------------------------------------------------------------------------------------------- encoders
    def _branches(self, instance: torch.Tensor, tree: StructuredTreeEncoder | None,
                  concept_attn: ConceptAttention, labels: torch.Tensor | None) -> Embeddings:
        out: Embeddings = {"instance": instance}
        beta_d, beta_t, beta_c = self.betas
        fused = beta_d * instance
        if tree is not None:
            nodes = tree(instance)
            fused = fused + beta_t * nodes["tree"]
            out["tree"] = nodes["tree"]
            out["tree_nodes"] = node_ids(nodes["entity_logits"], nodes["relation_logits"])
            if self.training:   # node distributions only feed the training losses; evaluation skips them
                out["entity_logits"], out["relation_logits"] = nodes["entity_logits"], nodes["relation_logits"]
        if beta_c != 0.0:
            concepts = self.gcn()                                                    # [C, d]
            weights = concept_attn(concepts, instance)
            if labels is not None:
                weights = mix_text_labels(weights, labels, self.label_ratio, self.concept_smooth)
            out["concept"] = consensus_vector(weights, concepts)
            if self.training:   # CVSE's concept KL compares the two sides' concept distributions
                out["concept_weights"] = weights
            fused = fused + beta_c * out["concept"]
        out["fused"] = l2norm(fused, dim=-1)
        return out

    def encode_images(self, features: torch.Tensor, mask: torch.Tensor) -> Embeddings:
        """``features`` [B, K, D_in], ``mask`` [B, K] → ``fused`` [B, d] (+ ``instance``/``tree``/``concept``
        [B, d]; ``attention`` [B, K] the instance attention and ``mask`` [B, K]; with trees ``tree_nodes`` [B, 7]
        long, the predicted node ids; in training also ``entity_logits`` [B, 4, E], ``relation_logits`` [B, 3, R])."""
        regions = self.img_enc(features)
        mask = mask.bool()
        instance, attention = self.img_attn.attend(regions, mask)
        out = self._branches(instance, self.img_tree if self.use_trees else None, self.img_concept_attn, None)
        return {**out, "attention": attention, "mask": mask}

    def encode_captions(self, tokens: torch.Tensor, lengths: torch.Tensor,
                        concept_labels: torch.Tensor | None = None) -> Embeddings:
        """``tokens`` [B, L], ``lengths`` [B] → as :meth:`encode_images` (``attention``/``mask`` [B, L'] over the
        words). ``concept_labels`` [B, C] replaces the caption's own labels (training with
        ``train_text_labels="image"`` only)."""
        words = self.txt_enc(tokens, lengths)
        mask = lengths_mask(lengths, words.shape[1], words.device)
        instance, attention = self.txt_attn.attend(words, mask)
        labels = concept_labels if concept_labels is not None else self.caption_concept_labels(tokens, lengths)
        out = self._branches(instance, self.txt_tree if self.use_trees else None, self.txt_concept_attn, labels)
        return {**out, "attention": attention, "mask": mask}


    @property
    def explains(self) -> tuple[str, ...]:
        """The attention maps, and with trees the predicted node ids (class docstring)."""
        maps = ("region_attention", "word_attention")
        return maps + ("image_tree_nodes", "text_tree_nodes") if self.use_trees else maps

    def explain(self, images: Embeddings, captions: Embeddings) -> dict[str, torch.Tensor]:
        """The attention behind the fused vectors of one pair, padding dropped (class docstring)."""
        check_one_pair(images, captions)
        out = {"region_attention": images["attention"][0][images["mask"][0].bool()],
               "word_attention": captions["attention"][0][captions["mask"][0].bool()]}
        if self.use_trees:
            out["image_tree_nodes"], out["text_tree_nodes"] = images["tree_nodes"][0], captions["tree_nodes"][0]
        return out

    # ---------------------------------------------------------------------------------------------- loss
    def loss(self, scores: torch.Tensor, images: Embeddings | None = None, captions: Embeddings | None = None,
             nodes: torch.Tensor | None = None) -> torch.Tensor:
        """Eq. 20 for a batch of matching pairs: ``scores`` [B, B]; ``nodes`` [B, 7] the captions' trees."""
        return sum(self.loss_terms(scores, images, captions, nodes).values())

    def loss_terms(self, scores: torch.Tensor, images: Embeddings | None, captions: Embeddings | None,
                   nodes: torch.Tensor | None) -> dict[str, torch.Tensor]:
        terms = {"rank": self.rank_weights["fused"] * self.ranking_loss(scores)}
        for branch in ("instance", "concept"):
            weight = self.rank_weights[branch]
            if weight and images is not None and captions is not None and branch in images:
                branch_scores = images[branch] @ captions[branch].t()
                terms[f"rank_{branch}"] = weight * self.ranking_loss(branch_scores, observe=False)
        if self.concept_kl_weight and images is not None and captions is not None and "concept_weights" in images:
            w_v, w_t = images["concept_weights"], captions["concept_weights"]
            kl = (w_t * (torch.log(w_t.clamp(min=1e-12)) - torch.log(w_v.clamp(min=1e-12)))).sum(-1)
            terms["concept_kl"] = self.concept_kl_weight * (kl.sum() if self.concept_kl_reduction == "sum"
                                                            else kl.mean())
        reduce = (lambda x: x.mean()) if self.tree_loss_reduction == "mean" else (lambda x: x.sum())
        if self.use_trees and (self.ce_weight or self.kl_weight):
            if images is None or captions is None or "entity_logits" not in images:
                raise ValueError("SMFEA's tree losses need the training-mode embeddings of both sides")
            if self.ce_weight:
                if nodes is None:
                    raise ValueError("SMFEA's node cross-entropy needs the captions' referral trees (nodes [B, 7])")
                ce = (node_cross_entropy(images["entity_logits"], images["relation_logits"], nodes)
                      + node_cross_entropy(captions["entity_logits"], captions["relation_logits"], nodes))
                terms["node_ce"] = self.ce_weight * reduce(ce)
            if self.kl_weight:
                terms["node_kl"] = self.kl_weight * reduce(node_kl(images, captions))
        return terms

    def forward(self, features: torch.Tensor, mask: torch.Tensor, tokens: torch.Tensor, lengths: torch.Tensor,
                gather: Callable[[Embeddings], Embeddings] | None = None, caption_index: torch.Tensor | None = None,
                nodes: torch.Tensor | None = None, image_concept_labels: torch.Tensor | None = None) -> torch.Tensor:
        """One training step's loss. ``nodes`` [B, 7] int: each caption's referral tree; ``image_concept_labels``
        [B, C]: the concept labels of each caption's image (used when ``train_text_labels="image"``). From the
        loop, ``caption_index`` [B] looks both up in the tables :meth:`prepare_training` installed."""
        if features.shape[0] < 2 and gather is None:
            # a one-pair batch (the loop keeps a last, smaller batch; CVSE drops it: docs C13) has no negatives,
            # and batch norm cannot take its statistics from one sample: it contributes nothing
            return features.new_zeros((), requires_grad=True)
        if caption_index is not None:
            index = caption_index.cpu()
            if nodes is None and self.train_nodes is not None:
                nodes = self.train_nodes[index].to(tokens.device, non_blocking=True)
            if image_concept_labels is None and self.train_image_labels is not None:
                image_concept_labels = self.train_image_labels[index].to(tokens.device, non_blocking=True)
        labels = image_concept_labels.float() if (self.train_text_labels == "image"
                                                  and image_concept_labels is not None) else None
        images = self.encode_images(features, mask)
        captions = self.encode_captions(tokens, lengths, labels)
        if nodes is not None:
            captions["nodes"] = nodes.long()
        if gather is not None:
            images, captions = gather(images), gather(captions)
        return self.loss(self.scoring()(images, captions), images, captions, captions.get("nodes"))

    # ---------------------------------------------------------------------------------------------- analysis
    @torch.no_grad()
    def predict_nodes(self, embeddings: Embeddings | None = None, *, features: torch.Tensor | None = None,
                      mask: torch.Tensor | None = None, tokens: torch.Tensor | None = None,
                      lengths: torch.Tensor | None = None) -> torch.Tensor:
        """Predicted node ids ``[B, 7]`` (slot order) of the image tree (``features``/``mask``) or the text
        tree (``tokens``/``lengths``); given ``embeddings`` (either encoder's output), the ids its tree
        predicted (``"tree_nodes"``)."""
        if not self.use_trees:
            raise ValueError("this SMFEA was trained without trees")
        if embeddings is not None:
            return embeddings["tree_nodes"]
        if features is not None:
            instance = self.img_attn(self.img_enc(features), mask)
            tree = self.img_tree
        else:
            words = self.txt_enc(tokens, lengths)
            instance = self.txt_attn(words, lengths_mask(lengths, words.shape[1], words.device))
            tree = self.txt_tree
        out = tree(instance)
        return node_ids(out["entity_logits"], out["relation_logits"])


# ------------------------------------------------------------------------------------------------ settings

@dataclass
class SMFEAConfig(Settings):
    """SMFEA's settings (defaults: §4.2 and CVSE's; ``docs/models-smfea.md`` gives every decision)."""

    embed_size: int = embed_size_setting(1024)
    word_dim: int = word_dim_setting(300)
    word_vectors: str = word_vectors_setting()
    freeze_word_vectors: bool = freeze_word_vectors_setting()
    tree_hidden: int = size_setting(128, "Tree node hidden size.")
    tree_input_dim: int | None = size_setting(None, "Tree node input size (default: the tree's hidden size, --tree-hidden).")
    forget_gate: Literal[FORGET_GATES] = setting(
        "as-printed", "Eq. 10 as printed or Tai et al.'s per-child forget gates.")
    tree_residual: bool = setting(True, "Add the instance feature S_D to the tree embedding S_T (§3.2.2: S_T "
                                        "includes the original instance-level feature).",
                                  flag="--tree-residual/--no-tree-residual")
    use_trees: bool = setting(True, "VCS/TCS-Tree encoders; --no-trees is the 'w/o trees' ablation (Table 5).",
                              flag="--use-trees/--no-trees")
    beta_d: float = setting(0.6, "Fusion weight of the instance features.")
    beta_t: float = setting(0.2, "Fusion weight of the tree embedding.")
    beta_c: float = setting(0.2, "Fusion weight of the concept vector.")
    ce_weight: float = setting(1.0, "Weight of the node cross-entropy L_CE (0: 'w/o L_CE').")
    kl_weight: float = setting(1.0, "Weight of D_KL (0: 'w/o D_KL').")
    label_ratio: float = setting(0.35, "Text label mixing r (0.35 Flickr30K / 0.4 COCO).")
    concept_smooth: float = setting(10.0, "Concept label smoothing scale (CVSE's 10).")
    concept_word_dim: int = size_setting(300, "Size of the learned concept vectors (fixed vectors: the file's).")
    concept_vectors: Literal["learned", "fixed"] = setting(
        "learned", "Concept vectors learned from U(±0.1), or fixed from --concept-vectors.", cli=False)
    train_text_labels: Literal[TRAIN_TEXT_LABELS] = setting(
        "image", "Labels the text branch mixes in training: its image's (CVSE) or its own. Evaluation always "
                 "uses the caption's own.")
    fused_rank_weight: float = setting(3.0, "Weight of Rank(V_F, S_F) (CVSE's 3; Eq. 20 as printed: 1).")
    instance_rank_weight: float = setting(5.0, "Weight of CVSE's Rank(instance) (5; Eq. 20 as printed: 0).")
    concept_rank_weight: float = setting(1.0, "Weight of CVSE's Rank(consensus concept) (1; Eq. 20 as printed: 0).")
    concept_kl_weight: float = setting(2.0, "Weight of CVSE's KL(w_t ‖ w_v) between the concept distributions "
                                            "(2; Eq. 20 as printed: 0).")
    tree_loss_reduction: Literal["mean", "sum"] = setting(
        "mean", "L_CE and D_KL over the batch: mean (the ranking term's scale) or the literal sum.")
    text_query_l2norm: bool = setting(True, "l2-normalise the mean word vector before it queries the text "
                                            "attention (CVSE's code).", flag="--text-query-l2norm/--raw-text-query")
    instance_bn: Literal["regions", "features"] = setting(
        "regions", "Image attention batch norm over the region positions (CVSE's BatchNorm1d(36), unmasked) or over "
                   "the features (masked statistics).")
    num_regions: int = size_setting(36, "Regions per image for instance_bn=regions (bottom-up features: 36).")
    attention_dropout: float = dropout_setting(0.4, "Dropout after each tanh of the instance attention (CVSE's 0.4).")
    word_dropout: float = dropout_setting(0.4, "Dropout on the word embeddings before the bi-GRU (CVSE's 0.4).")
    concept_kl_reduction: Literal["sum", "mean"] = setting(
        "sum", "KL(w_t ‖ w_v) over the batch: sum (CVSE's code, the scale its weight 2 was set for) or mean.")
    margin: float = margin_setting(0.2)
    max_violation: bool = violation_setting(True)


#: settings whose default changed after runs were written; a stored run without the field had the old value
SMFEA_OLD_DEFAULTS = {"tree_residual": False, "fused_rank_weight": 1.0, "instance_rank_weight": 0.0,
                      "concept_rank_weight": 0.0, "concept_kl_weight": 0.0, "tree_loss_reduction": "mean",
                      "text_query_l2norm": False, "instance_bn": "features", "attention_dropout": 0.0,
                      "word_dropout": 0.0, "concept_kl_reduction": "mean"}


#: SMFEA §4.2: Adam 2e-4 ×0.1 every 25 epochs, 50 epochs; CVSE's label ratio r: 0.4 COCO, 0.35 Flickr30K.
SMFEA_SCHEDULE = {"batch_size": 128, "grad_clip": 2.0, "epochs": 50, "lr": 2e-4, "lr_update": 25,
                  "drop_last": True}   # CVSE's training loader drops the last batch (docs/models-smfea.md C13)


def _smfea_inputs(data, files, config, vocab):
    return load_smfea_inputs(data, files, config, len(vocab))


def _smfea_features(config: SMFEAConfig, shape: tuple[int, int]) -> str | None:
    """Batch norm over the region positions has one channel per position: refused for another number of them."""
    k = shape[0]
    if config.instance_bn == "regions" and config.num_regions != k:
        return (f"the instance attention's batch norm over region positions is built for --num-regions "
                f"{config.num_regions}, the features have {k} positions per image; give --num-regions {k}, or "
                f"--instance-bn features (normalised over the features instead)")
    return None


def _smfea_upgrade(model_args: dict) -> tuple[dict, dict]:
    """Runs written before the spec registry kept the side files among the model's arguments."""
    inputs = {k: model_args.pop(k, None) for k in ("trees", "concepts")}
    inputs = {k: v for k, v in inputs.items() if v}
    for name, old in SMFEA_OLD_DEFAULTS.items():
        model_args.setdefault(name, old)
    vectors = model_args.get("concept_vectors")
    if vectors not in (None, "learned", "fixed"):
        inputs["concept_vectors"], model_args["concept_vectors"] = vectors, "fixed"
    return model_args, inputs


register_model(ModelSpec(
    name="smfea", model_class=SMFEA, config_class=SMFEAConfig,
    summary="Train SMFEA (tree encoders with the shared referral tree + consensus concepts) on region features. "
            "Needs the referral trees (retr-pipeline parse-trees) and the concept data (retr-pipeline "
            "build-concepts) of the same manifest. After training, the tree-node accuracy of the best checkpoint "
            "on the test split is written to OUT/tree_accuracy.json.",
    examples=("retr-train smfea --features data/f30k/features/butd-regions.h5 --manifest data/f30k/manifest.jsonl "
              "--trees data/f30k/trees.h5 --concepts data/f30k/concepts.h5 --preset f30k --out runs/smfea-f30k",
              "retr-train eval runs/smfea-f30k --protocol f30k-1k"),
    presets={"f30k": {**SMFEA_SCHEDULE, "label_ratio": 0.35}, "coco": {**SMFEA_SCHEDULE, "label_ratio": 0.4}},
    default_preset="f30k",
    inputs=(InputFile("trees", "trees.h5 from retr-pipeline parse-trees (required unless --no-trees).",
                      what="a trees.h5 file"),
            InputFile("concepts", "concepts.h5 from retr-pipeline build-concepts.", required=True,
                      what="a concepts.h5 file"),
            InputFile("concept_vectors", "Concept word vectors, kept fixed as CVSE: glove (GloVe 840B.300d, "
                                         "downloaded on first use), glove-6b, or a GloVe-format .txt/.zip file; "
                                         "default: vectors learned from U(±0.1).", resources=tuple(GLOVE_SETS),
                      what=f"a GloVe-format .txt or .zip file, or {' / '.join(GLOVE_SETS)}")),
    load_inputs=_smfea_inputs,
    shortcuts={"--no-kl": ("Ablation 'w/o D_KL' (Table 5): --kl-weight 0.", {"kl_weight": 0.0}),
               "--no-node-ce": ("Ablation 'w/o L_CE' (Table 5): --ce-weight 0.", {"ce_weight": 0.0})},
    upgrade_args=_smfea_upgrade, after_training=("tree_accuracy",), feature_kinds=("regions",),
    check_features=_smfea_features))
