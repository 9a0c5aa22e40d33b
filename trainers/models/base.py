"""The interface between the training loop / evaluator and a matching model (methods, shapes, defaults:
docs/trainer.md#model-interface).
"""
from __future__ import annotations

import functools
from typing import Callable

import torch
from torch import nn

from retr.trainers.models.layers import cat_parts
from retr.trainers.models.losses import BatchRanking, hinge_triplet_loss, in_batch_ranking


Embeddings = dict[str, torch.Tensor]


def slice_embeddings(embeddings: Embeddings, index) -> Embeddings:
    """Rows ``index`` of every tensor of ``embeddings`` (a block's items)."""
    return {k: v[index] for k, v in embeddings.items()}


def cast_embeddings(embeddings: Embeddings, dtype: torch.dtype) -> Embeddings:
    """Every floating tensor of ``embeddings`` in ``dtype`` (masks and lengths stay as they are)."""
    return {k: v.to(dtype) if v.is_floating_point() else v for k, v in embeddings.items()}


def check_one_pair(images: Embeddings, captions: Embeddings) -> None:
    """Raise ``ValueError`` unless ``images`` and ``captions`` (encoder outputs) each hold exactly one row: what
    :meth:`MatchingModel.explain` takes."""
    for side, embeddings in (("images", images), ("captions", captions)):
        rows = {int(v.shape[0]) for v in embeddings.values()}
        if rows != {1}:
            raise ValueError(f"explain takes one image and one caption (batch 1); {side} has {sorted(rows)} rows")


class MatchingModel(nn.Module):
    """Base class: subclasses implement ``encode_images``, ``encode_captions`` and ``score``; the rest has defaults."""

    #: the model's registry name, set by :func:`retr.trainers.models.register_model`
    name: str = ""
    #: batch entries (besides the four tensors) the loop passes to :meth:`forward` by name, e.g. ``image_index``
    batch_extras: tuple[str, ...] = ()
    #: two-step evaluation: candidates re-ranked per query (0: score every pair); see :mod:`retr.trainers.evaluation.two_step`
    shortlist: int = 0
    #: True when :meth:`pair_score` computes only the listed pairs (its cost grows with their number, not with the
    #: images × captions they span): the evaluator then rescores listed pairs in a few large calls on any device
    pair_score_is_aligned: bool = False
    #: how many copies of a listed pair's image and caption embeddings (in the scoring dtype) :meth:`pair_score`
    #: holds at once at most — its gathers and the intermediates of their size: the evaluator sizes its calls to
    #: its memory budget by it (retr.trainers.evaluation.similarity.Scorer.pair_step)
    pair_score_copies: float = 2.0
    #: False when :meth:`score` and :meth:`pair_score` compute from the embeddings alone (no parameter): the
    #: evaluator then scores in float64 with the model itself, not a float64 copy of it (SCAN's at d = 1024 is
    #: 130 MB), for the same numbers
    score_uses_parameters: bool = True
    #: True when :meth:`global_score` is a pair-independent first stage that :meth:`pair_score` re-ranks
    has_global_stage: bool = False

    def __init__(self, margin: float = 0.2, max_violation: bool = True):
        super().__init__()
        self.margin = float(margin)
        self.max_violation = bool(max_violation)
        #: set by the loop during ``--warmup-epochs``: the hinge sums every violation (VSE∞'s warm-up)
        self.warming_up = False
        #: the last training batch's :class:`~retr.trainers.models.losses.BatchRanking` (None before the first step)
        self.batch_ranking: BatchRanking | None = None

    @property
    def hardest_negatives(self) -> bool:
        """Whether the hinge keeps only each row's and column's hardest negative now: the configured
        ``max_violation``, except during the loop's warm-up."""
        return self.max_violation and not self.warming_up

    def ranking_loss(self, scores: torch.Tensor, positives: torch.Tensor | None = None,
                     observe: bool = True) -> torch.Tensor:
        """Hinge triplet loss of ``scores`` [B, B] (diagonal matches; ``positives`` [B, B] bool never negatives).

        With ``observe`` the batch's ranking is kept in :attr:`batch_ranking`."""
        hardest = self.hardest_negatives
        loss = hinge_triplet_loss(scores, self.margin, hardest, positives)
        if observe and self.training:
            self.batch_ranking = in_batch_ranking(scores, self.margin, hardest, loss, positives)
        return loss

    #: the methods :meth:`compile_scoring` compiles: what :meth:`forward` scores the training batch with
    compiled_functions: tuple[str, ...] = ("score",)

    def compile_scoring(self, **options) -> None:
        """``torch.compile`` the class functions named in :attr:`compiled_functions`; :meth:`forward` calls them."""
        self._compiled = {name: torch.compile(getattr(type(self), name), **options)
                          for name in self.compiled_functions}

    def scoring(self, name: str = "score") -> Callable:
        """The method ``name`` as training calls it: compiled after :meth:`compile_scoring`, else the method."""
        compiled = self.__dict__.get("_compiled", {}).get(name)
        return functools.partial(compiled, self) if compiled is not None else getattr(self, name)

    def prepare_training(self, inputs: dict[str, torch.Tensor]) -> None:
        """Install per-run training data read by the spec's ``load_inputs`` (tensors only, e.g. SMFEA's tree
        node targets ``{"nodes": [M, 7]}``). Called once by the loop before training; default: nothing."""

    def configure_optimizer(self, lr: float) -> torch.optim.Optimizer:
        """The optimiser the loop steps (default: Adam on every parameter at ``lr``)."""
        return torch.optim.Adam(self.parameters(), lr=lr)

    def encode_images(self, features: torch.Tensor, mask: torch.Tensor) -> Embeddings:
        """``features`` ``[B, K, D_in]``, ``mask`` ``[B, K]`` bool → per-image tensors, batch on dim 0."""
        raise NotImplementedError(f"model {self.name or type(self).__name__} defines no encode_images")

    def encode_captions(self, tokens: torch.Tensor, lengths: torch.Tensor) -> Embeddings:
        """``tokens`` ``[B, L]`` long, ``lengths`` ``[B]`` → per-caption tensors, batch on dim 0."""
        raise NotImplementedError(f"model {self.name or type(self).__name__} defines no encode_captions")

    def score(self, images: Embeddings, captions: Embeddings, dtype: torch.dtype | None = None) -> torch.Tensor:
        """Every image of a block × every caption of a block → ``[n_img, n_cap]``; ``dtype`` is the arithmetic's
        dtype when given (the evaluator's float32 and float64 passes), else the embeddings' (training)."""
        raise NotImplementedError(f"model {self.name or type(self).__name__} defines no score")

    def global_score(self, images: Embeddings, captions: Embeddings, dtype: torch.dtype | None = None) -> torch.Tensor:
        """The cheap pair-independent score ``[n_img, n_cap]`` two-step evaluation shortlists by (models with
        ``has_global_stage`` only)."""
        raise NotImplementedError(f"model {self.name or type(self).__name__} has no global stage")

    def pair_score(self, images: Embeddings, captions: Embeddings, img_idx: torch.Tensor, cap_idx: torch.Tensor,
                   dtype: torch.dtype | None = None, image_block: int = 64,
                   pair_budget: int = 1 << 16) -> torch.Tensor:
        """``score`` of the listed pairs: ``[P]`` for ``img_idx``, ``cap_idx`` ``[P]`` long (repeats allowed).

        Default: distinct images ``image_block`` at a time against their captions, ≤ ``pair_budget`` pairs a call.
        """
        rows, row_of = torch.unique(img_idx, return_inverse=True)             # distinct images, pair → row
        out: torch.Tensor | None = None
        for r in range(0, rows.numel(), image_block):
            sel = torch.nonzero((row_of >= r) & (row_of < r + image_block)).view(-1)   # pairs of this block
            block_rows = rows[r:r + image_block]
            block = {k: v[block_rows] for k, v in images.items()}
            caps, col_of = torch.unique(cap_idx[sel], return_inverse=True)
            step = max(1, pair_budget // block_rows.numel())
            for c in range(0, caps.numel(), step):
                in_part = (col_of >= c) & (col_of < c + step)
                part = sel[in_part]
                scores = self.score(block, {k: v[caps[c:c + step]] for k, v in captions.items()}, dtype=dtype)
                if out is None:
                    out = scores.new_empty(img_idx.numel())
                out[part] = scores[row_of[part] - r, col_of[in_part] - c]
        if out is None:                                                        # no pairs listed
            out = torch.empty(0, dtype=dtype or torch.get_default_dtype(), device=img_idx.device)
        return out

    def index_vectors(self, embeddings: Embeddings, side: str) -> torch.Tensor | None:
        """``[n, d]`` vectors whose inner products are the pair-independent score, for ``side`` image/caption.

        None: the score is no inner product (cross attention, order violation)."""
        return None

    #: the names of the maps :meth:`explain` returns (empty: the model has no attention to show, e.g. VSE++)
    explains: tuple[str, ...] = ()
    #: those of :attr:`explains` over ranks (VSE∞'s k-th largest values), not positions: the report draws no image
    rank_maps: tuple[str, ...] = ()

    def explain(self, images: Embeddings, captions: Embeddings) -> dict[str, torch.Tensor]:
        """The attention behind :meth:`score` for one encoded image and caption (batch 1): ``{name: tensor}``.

        Names and shapes per model: docs/trainer.md#attention-maps-explain. Default: raises."""
        raise NotImplementedError(f"model {self.name or type(self).__name__} has no attention maps to explain")

    def predict_nodes(self, *args, **kwargs) -> torch.Tensor:
        """Referral-tree node ids ``[B, 7]`` (SMFEA only)."""
        raise NotImplementedError(f"model {self.name or type(self).__name__} predicts no tree nodes")

    def loss(self, scores: torch.Tensor) -> torch.Tensor:
        return self.ranking_loss(scores)

    def forward(self, features: torch.Tensor, mask: torch.Tensor, tokens: torch.Tensor, lengths: torch.Tensor,
                gather: Callable[[Embeddings], Embeddings] | None = None) -> torch.Tensor:
        """One training step's loss: encode both sides, gather the global batch, score it, hinge loss.

        ``gather`` (under DDP, from the loop): called on a dict of embeddings it returns every rank's, in rank
        order; its ``world_size`` is the number of ranks joined."""
        images = self.encode_images(features, mask)
        captions = self.encode_captions(tokens, lengths)
        if gather is not None:
            images, captions = gather(images), gather(captions)
        return self.loss(self.scoring()(images, captions))


class InnerProductModel(MatchingModel):
    """A model whose score is the inner product of one vector per image and one per caption, ``embeddings[
    vector_key]`` ``[n, d]`` (VSE++, VSE∞, SMFEA): :meth:`score` is one matrix product, :meth:`pair_score` the
    listed pairs' own dot products (aligned: its cost grows with the pairs), :meth:`index_vectors` the vectors."""

    #: the embeddings entry holding each side's vector
    vector_key = "vector"
    pair_score_is_aligned = True
    score_uses_parameters = False
    #: pairs one step of :meth:`pair_score` gathers (two ``[pairs, d]`` tensors)
    pair_chunk = 1 << 15
    #: nothing for ``--compile``: the training score is one matrix product, which a compiled graph can only
    #: call as eager does, behind its guards (VSE++ trained slower compiled than eager on an H200)
    compiled_functions = ()

    def index_vectors(self, embeddings: Embeddings, side: str) -> torch.Tensor:
        """The vector ``[n, d]`` (:meth:`score` is their inner product)."""
        return embeddings[self.vector_key]

    def score(self, images: Embeddings, captions: Embeddings, dtype: torch.dtype | None = None) -> torch.Tensor:
        """Inner products ``[n_img, n_cap]``."""
        dtype = dtype or images[self.vector_key].dtype
        return images[self.vector_key].to(dtype) @ captions[self.vector_key].to(dtype).t()

    def pair_score(self, images: Embeddings, captions: Embeddings, img_idx: torch.Tensor, cap_idx: torch.Tensor,
                   dtype: torch.dtype | None = None) -> torch.Tensor:
        """The inner products of the listed pairs ``[P]`` (``img_idx``, ``cap_idx`` ``[P]`` long)."""
        image, caption = images[self.vector_key], captions[self.vector_key]
        dtype = dtype or image.dtype
        parts = [(image[img_idx[s:s + self.pair_chunk]].to(dtype) * caption[cap_idx[s:s + self.pair_chunk]].to(dtype))
                 .sum(-1) for s in range(0, img_idx.numel(), self.pair_chunk)]
        return cat_parts(parts) if parts else image.new_zeros(0, dtype=dtype)
