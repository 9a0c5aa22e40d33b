"""Images × captions similarity matrices: blockwise scoring, ensembles, float64 where it decides ranks.

Decisions (blocks, shared identical captions, ``--precision``, CUDA paths): docs/trainer.md#evaluation."""
from __future__ import annotations

import copy
from dataclasses import dataclass
from typing import Callable, Iterator, Sequence

import numpy as np
import torch

from retr.common.errors import UserError
from retr.common.memory import available_bytes, release_free_memory
from retr.common.progress import progress
from retr.trainers.data.splits import ImageFeatures, SplitData, pad_tokens
from retr.trainers.models.base import Embeddings, MatchingModel, cast_embeddings, slice_embeddings

PRECISIONS = ("refined", "float64", "float32")
DEFAULT_PRECISION = "refined"
SAFETY = 16                 # ε = SAFETY × the largest float32 error seen
PROBE = 32                  # probe block: the first PROBE images × the first PROBE captions
MAX_ROUNDS = 5              # ε grows at most this many times
CPU_PAIR_BUDGET = 1 << 16   # pairs per score call on the CPU: the block's attention stays in the caches
GPU_MEMORY_SHARE = 0.5      # on CUDA, one score call may use this share of the free memory …
GPU_PAIR_BUDGET_MAX = 1 << 24   # … and hold at most this many pairs
PAIR_STRATEGIES = ("auto", "image", "block", "aligned")
#: listed pairs (rescoring, re-ranking) are scored in chunks whose working memory takes at most this share of
#: the memory available where they are scored (host RAM on a CPU, the GPU's free memory on CUDA) …
PAIR_MEMORY_SHARE = 0.25
#: … and on a CPU at most this many bytes: a larger chunk is no faster there, only a larger peak
CPU_PAIR_MEMORY_MAX = 256 << 20
#: … and at least this many: calls of a pair or two would cost more in overhead than they save
PAIR_MEMORY_MIN = 16 << 20



def _concat(blocks: Sequence[Embeddings], shapes: dict[str, tuple[int, ...]] | None = None) -> Embeddings:
    """Join per-block embeddings along dim 0, zero-padding other dims to the largest block's (or to ``shapes``,
    per key the row shape to pad to, when given)."""
    out = {}
    for key in blocks[0]:
        parts = [b[key] for b in blocks]
        shape = (list(shapes[key]) if shapes is not None
                 else [max(p.shape[d] for p in parts) for d in range(1, parts[0].dim())])
        padded = []
        for p in parts:
            pad = []
            for d in reversed(range(1, p.dim())):
                pad += [0, shape[d - 1] - p.shape[d]]
            padded.append(torch.nn.functional.pad(p, pad) if any(pad) else p)
        out[key] = torch.cat(padded)
    return out


def caption_sources(tokens: Sequence[Sequence[int]]) -> np.ndarray:
    """``[M]``: for each caption, the first caption with the same token ids (itself when it is the first)."""
    first: dict[tuple, int] = {}
    return np.array([first.setdefault(tuple(t), m) for m, t in enumerate(tokens)], dtype=np.int64)


def pair_memory_budget(device: torch.device) -> int:
    """Bytes one call scoring listed pairs may take on ``device``: :data:`PAIR_MEMORY_SHARE` of the memory
    available now (:func:`~retr.common.memory.available_bytes`), at most :data:`CPU_PAIR_MEMORY_MAX` on a CPU, at
    least :data:`PAIR_MEMORY_MIN` (where the system does not say what is free, or almost nothing is)."""
    budget = int(PAIR_MEMORY_SHARE * available_bytes(device))
    return max(PAIR_MEMORY_MIN, budget if device.type == "cuda" else min(budget, CPU_PAIR_MEMORY_MAX))


def row_bytes(shapes: dict[str, tuple[int, ...]], dtypes: dict[str, torch.dtype], dtype: torch.dtype) -> int:
    """Bytes one row of embeddings with these row ``shapes`` takes, its floating tensors in ``dtype``."""
    total = 0
    for key, shape in shapes.items():
        size = dtype.itemsize if dtypes[key].is_floating_point else dtypes[key].itemsize
        total += int(np.prod(shape, dtype=np.int64)) * size
    return total


def chunk_bounds(groups: np.ndarray | None, step: int, count: int | None = None) -> list[tuple[int, int]]:
    """``(start, stop)`` of consecutive chunks of at most ``step`` items: of ``count`` items anywhere (``groups``
    None), else of the items of ``groups`` (sorted group ids) without splitting a group, unless a group alone is
    larger than ``step`` (it is then cut in chunks of ``step``)."""
    if groups is None:
        return [(s, min(s + step, count)) for s in range(0, count, step)]
    starts = np.flatnonzero(np.r_[True, groups[1:] != groups[:-1]]) if len(groups) else np.zeros(0, dtype=np.int64)
    bounds, start = [], 0
    for first, stop in zip(starts, np.r_[starts[1:], len(groups)]):
        first, stop = int(first), int(stop)
        if stop - start <= step:
            continue                             # the group fits in the chunk being filled
        if first > start:
            bounds.append((start, first))        # close the chunk before this group
            start = first
        while stop - start > step:               # a group larger than a chunk on its own
            bounds.append((start, start + step))
            start += step
    if start < len(groups):
        bounds.append((start, len(groups)))
    return bounds


def pairs_per_chunk(budget: int, bytes_per_pair: float) -> int:
    """Listed pairs one call takes: as many as ``budget`` bytes hold at ``bytes_per_pair`` (at least one)."""
    return max(1, int(budget // max(1.0, bytes_per_pair)))


class RowsJoiner:
    """Blocks of embeddings joined along dim 0 as they come, into one tensor per key made at the first block (a
    list of blocks joined at the end would hold every row twice: SCAN's regions of COCO 5K are 737 MB). Other dims
    are zero-padded to the largest block's, as :func:`_concat` does."""

    def __init__(self, rows: int):
        self.rows, self.filled = rows, 0
        self.joined: Embeddings = {}

    def add(self, block: Embeddings) -> None:
        count = next(iter(block.values())).shape[0]
        for key, part in block.items():
            held = self.joined.get(key)
            if held is None or any(p > h for p, h in zip(part.shape[1:], held.shape[1:])):
                grown = part.new_zeros((self.rows, *(max(p, h) for p, h in zip(
                    part.shape[1:], held.shape[1:] if held is not None else part.shape[1:]))))
                if held is not None:
                    grown[(slice(0, self.filled), *(slice(0, h) for h in held.shape[1:]))] = held[:self.filled]
                self.joined[key] = held = grown
            held[(slice(self.filled, self.filled + count), *(slice(0, p) for p in part.shape[1:]))] = part
        self.filled += count

    def result(self) -> Embeddings:
        return {key: value[:self.filled] for key, value in self.joined.items()}


@torch.no_grad()
def encode_split(model, data: SplitData, features: ImageFeatures, device: torch.device, batch_size: int = 128,
                 quiet: bool = False, captions: np.ndarray | None = None):
    """``(images, caption_blocks)``: every image's embeddings (joined along dim 0), caption blocks sorted by length.

    Each caption block is ``(caption indices, embeddings)``; ``captions``: only these indices (default: all).
    ``captions_in_split_order`` models (SEAM-C, authors' padding) are encoded in the authors' batches instead."""
    model.eval()
    images = RowsJoiner(data.num_images)
    for start in progress(range(0, data.num_images, batch_size), desc="encode images", quiet=quiet):
        idx = np.arange(start, min(start + batch_size, data.num_images))
        feats, mask = features.get(idx)
        images.add(model.encode_images(feats.to(device), mask.to(device)))
        release_free_memory()      # a block's activations, freed among the kept rows: handed back, not left as holes
    images = images.result()
    chosen = np.arange(data.num_captions) if captions is None else np.asarray(captions, dtype=np.int64)
    caption_blocks = []
    if getattr(model, "captions_in_split_order", False):
        wanted = np.zeros(data.num_captions, dtype=bool)
        wanted[chosen] = True
        for start in progress(range(0, data.num_captions, batch_size), desc="encode captions", quiet=quiet):
            idx = np.arange(start, min(start + batch_size, data.num_captions))
            if wanted[idx].any():
                tokens, lengths = pad_tokens([data.tokens[m] for m in idx])
                block = model.encode_captions(tokens.to(device, non_blocking=True), lengths)
                keep = np.flatnonzero(wanted[idx])
                caption_blocks.append((idx[keep], slice_embeddings(block, torch.as_tensor(keep, device=device))))
                release_free_memory()
        return images, caption_blocks
    order = chosen[np.argsort([len(data.tokens[m]) for m in chosen], kind="stable")]
    for start in progress(range(0, len(order), batch_size), desc="encode captions", quiet=quiet):
        idx = order[start:start + batch_size]
        tokens, lengths = pad_tokens([data.tokens[m] for m in idx])
        caption_blocks.append((idx, model.encode_captions(tokens.to(device, non_blocking=True), lengths)))
        release_free_memory()
    return images, caption_blocks


@dataclass
class SplitEmbeddings:
    """One model's embeddings of a split.

    ``images``: every image's embeddings joined along dim 0; ``caption_blocks``:
    ``[(caption indices [b], embeddings)]``; ``caption_source`` ``[M]``: the caption whose embeddings each caption
    shares (None: every caption is in a block)."""

    images: Embeddings
    caption_blocks: list[tuple[np.ndarray, Embeddings]]
    caption_source: np.ndarray | None = None

    @property
    def num_images(self) -> int:
        return next(iter(self.images.values())).shape[0]

    @property
    def num_captions(self) -> int:
        if self.caption_source is not None:
            return len(self.caption_source)
        return sum(len(idx) for idx, _ in self.caption_blocks)

    @property
    def sources(self) -> np.ndarray:
        """``caption_source``, or the identity."""
        return np.arange(self.num_captions) if self.caption_source is None else self.caption_source

    @classmethod
    def encode(cls, model, data: SplitData, features: ImageFeatures, device: torch.device | str = "cpu",
               batch_size: int = 128, quiet: bool = False) -> "SplitEmbeddings":
        # identical captions share one column, unless their embeddings depend on their batch (every caption then
        # stands where the authors' evaluation encodes it: encode_split)
        source = (np.arange(data.num_captions) if getattr(model, "captions_in_split_order", False)
                  else caption_sources(data.tokens))
        images, caption_blocks = encode_split(model, data, features, torch.device(device), batch_size, quiet,
                                              captions=np.flatnonzero(source == np.arange(len(source))))
        return cls(images, caption_blocks, source)


class Scorer:
    """A model's ``score`` over its :class:`SplitEmbeddings`: whole matrices and listed pairs.

    ``pair_memory`` bytes bound each call scoring listed pairs (None: :func:`pair_memory_budget` of the device,
    read when the pairs are scored)."""

    def __init__(self, model: MatchingModel, embeddings: SplitEmbeddings, pair_memory: int | None = None):
        self.model, self.embeddings = model, embeddings
        self.pair_memory = pair_memory
        self._wide_model = None
        caption_block = np.full(embeddings.num_captions, -1, dtype=np.int64)
        caption_row = np.full(embeddings.num_captions, -1, dtype=np.int64)
        for b, (idx, _) in enumerate(embeddings.caption_blocks):
            caption_block[idx] = b
            caption_row[idx] = np.arange(len(idx))
        self._caption_block, self._caption_row = caption_block, caption_row
        #: the number of pairs of each call the last :meth:`pairs` made (what its memory budget allowed)
        self.pair_chunks: list[int] = []

    def release(self) -> None:
        """Let the embeddings (and a float64 model copy) go: nothing of this scorer is used after it."""
        self.embeddings, self._wide_model = None, None

    def _model_for(self, dtype: torch.dtype):
        params = [p for p in self.model.parameters() if p.is_floating_point()]
        if (dtype != torch.float64 or not self.model.score_uses_parameters
                or all(p.dtype == torch.float64 for p in params)):
            return self.model
        if self._wide_model is None:
            self._wide_model = copy.deepcopy(self.model).to(torch.float64).eval()
        return self._wide_model

    def _with_dtype(self, dtype: torch.dtype, fn):
        """``fn(model)`` with the model for ``dtype`` (a float64 copy for float64), without gradients."""
        with torch.no_grad():
            return fn(self._model_for(dtype))

    @property
    def device(self) -> torch.device:
        """Where the embeddings (and so the scoring) are."""
        return next(iter(self.embeddings.images.values())).device

    def block_sizes(self, dtype: torch.dtype, image_block: int | None = None,
                    pair_budget: int | None = None) -> tuple[int, int]:
        """``(image_block, pair_budget)`` of :meth:`matrix`: the ones given, else chosen for the device."""
        if self.device.type != "cuda":
            return image_block or 128, pair_budget or CPU_PAIR_BUDGET
        if pair_budget is None:
            probe = cast_embeddings(slice_embeddings(self.embeddings.images, slice(0, 64)), dtype)
            measured = self._with_dtype(dtype, lambda model: bytes_per_pair(
                lambda im, cap: model.score(im, cap, dtype=dtype), probe,
                cast_embeddings(self.embeddings.caption_blocks[-1][1], dtype)))
            free, _ = torch.cuda.mem_get_info(self.device)
            pair_budget = gpu_pair_budget(free, measured)
        widest = max(len(idx) for idx, _ in self.embeddings.caption_blocks)
        return image_block or gpu_image_block(pair_budget, widest), pair_budget

    def matrix(self, dtype: torch.dtype, image_block: int | None = None, pair_budget: int | None = None,
               quiet: bool = True, out_dtype: type = np.float64) -> np.ndarray:
        """Every pair's score ``[N_img, M]`` (an ``out_dtype`` array), with embeddings and scoring in ``dtype``
        (block sizes: :meth:`block_sizes`)."""
        e = self.embeddings
        image_block, pair_budget = self.block_sizes(dtype, image_block, pair_budget)
        images = cast_embeddings(e.images, dtype)
        sims = self._with_dtype(dtype, lambda model: score_blocks(
            lambda im, cap: model.score(im, cap, dtype=dtype), images, e.caption_blocks, e.num_images, e.num_captions,
            image_block, pair_budget, cast=dtype, quiet=quiet, out_dtype=out_dtype))
        shared = np.flatnonzero(e.sources != np.arange(e.num_captions))
        sims[:, shared] = sims[:, e.sources[shared]]          # identical captions: the very same column
        return sims

    def _caption_shapes(self, captions: np.ndarray) -> dict[str, tuple[int, ...]]:
        """Per embeddings key, the row shape the blocks of ``captions`` pad to together (the largest of each dim)."""
        blocks = [self.embeddings.caption_blocks[b][1] for b in np.unique(self._caption_block[captions])]
        return {key: tuple(max(block[key].shape[d] for block in blocks) for d in range(1, blocks[0][key].dim()))
                for key in blocks[0]}

    def _captions(self, captions: np.ndarray, shapes: dict[str, tuple[int, ...]] | None = None) -> Embeddings:
        """The embeddings of ``captions`` (any order, any blocks), padded to their longest (or to ``shapes``):
        one gather per caption block they come from."""
        captions = np.asarray(captions, dtype=np.int64)
        blocks, rows = self._caption_block[captions], self._caption_row[captions]
        order = np.argsort(blocks, kind="stable")                  # the captions grouped by block
        parts = []
        for b in np.unique(blocks):
            block = self.embeddings.caption_blocks[b][1]
            index = torch.as_tensor(rows[blocks == b], device=next(iter(block.values())).device)
            parts.append(slice_embeddings(block, index))
        joined = _concat(parts, shapes)                             # rows in ``order``
        back = np.empty_like(order)
        back[order] = np.arange(len(order))
        return slice_embeddings(joined, torch.as_tensor(back, device=next(iter(joined.values())).device))

    def pair_step(self, caption_shapes: dict[str, tuple[int, ...]]) -> int:
        """Pairs one call of :meth:`pairs` scores: as many as :attr:`pair_memory` (else the device's
        :func:`pair_memory_budget`) holds at the bytes a pair takes — its image and caption rows in float64 (captions
        padded to ``caption_shapes``) gathered once by the scorer and ``pair_score_copies`` times by the model."""
        images = self.embeddings.images
        image = row_bytes({k: tuple(v.shape[1:]) for k, v in images.items()}, {k: v.dtype for k, v in images.items()},
                          torch.float64)
        first = self.embeddings.caption_blocks[0][1]
        caption = row_bytes(caption_shapes, {k: v.dtype for k, v in first.items()}, torch.float64)
        budget = self.pair_memory if self.pair_memory is not None else pair_memory_budget(self.device)
        return pairs_per_chunk(budget, (1 + self.model.pair_score_copies) * (image + caption))

    def pairs(self, image_rows: np.ndarray, captions: np.ndarray, strategy: str = "auto",
              quiet: bool = True) -> np.ndarray:
        """float64 scores ``[P]`` of the listed pairs (``image_rows[p]``, ``captions[p]``), in calls of at most
        :meth:`pair_step` pairs (the same scores whatever the chunks — every chunk pads its captions to the same
        length — but for elementwise functions' rounding of a call's last elements: docs/trainer.md); a progress
        bar over the pairs unless ``quiet``.

        ``strategy``: ``image`` (a call per image), ``block`` (``pair_score`` per caption block), ``aligned`` (one
        ``pair_score`` over every listed caption: models whose ``pair_score_is_aligned``), ``auto`` (``aligned``
        where the model allows it, else ``block`` on CUDA and ``image`` on a CPU)."""
        if strategy not in PAIR_STRATEGIES:
            raise ValueError(f"strategy must be one of {', '.join(PAIR_STRATEGIES)}, not {strategy!r}")
        if strategy == "aligned" and not self.model.pair_score_is_aligned:
            raise ValueError(f"strategy aligned needs a model whose pair_score scores aligned pairs, not "
                             f"{self.model.name or type(self.model).__name__}")
        if strategy == "auto":
            strategy = ("aligned" if self.model.pair_score_is_aligned
                        else "block" if self.device.type == "cuda" else "image")
        num_captions = self.embeddings.num_captions
        image_rows = np.asarray(image_rows, dtype=np.int64)
        keys = image_rows * num_captions + self.embeddings.sources[np.asarray(captions, dtype=np.int64)]
        keys, back = np.unique(keys, return_inverse=True)              # distinct pairs, by image then caption
        rows, cols = keys // num_captions, keys % num_captions
        # a chunk holds whole calls of its strategy where the budget allows (an image's pairs; a caption block's,
        # the pairs sorted by block): a block scored with other captions beside it may round otherwise
        groups = {"aligned": None, "image": rows, "block": self._caption_block[cols]}[strategy]
        order = np.argsort(groups, kind="stable") if strategy == "block" else np.arange(len(keys))
        shapes = self._caption_shapes(cols) if len(cols) else {}
        step = self.pair_step(shapes) if len(cols) else 1
        distinct = {"block": self._pairs_by_caption_block, "image": self._pairs_by_image,
                    "aligned": self._pairs_aligned}[strategy]
        out = np.empty(len(keys), dtype=np.float64)
        self.pair_chunks = []
        with progress(total=len(keys), desc="rescore", unit="pair", quiet=quiet) as bar:
            for start, stop in chunk_bounds(None if groups is None else groups[order], step, len(keys)):
                chunk = order[start:stop]
                out[chunk] = distinct(rows[chunk], cols[chunk], shapes)
                self.pair_chunks.append(stop - start)
                bar.update(stop - start)
                release_free_memory()     # the call's gathers: handed back, not left between the kept arrays
        return out[back.reshape(-1)]

    def _pairs_by_image(self, image_rows: np.ndarray, captions: np.ndarray, shapes) -> np.ndarray:
        """A ``score`` call per image of the listed pairs (sorted by image), against its listed captions."""
        out = np.empty(len(image_rows), dtype=np.float64)
        starts = np.flatnonzero(np.r_[True, np.diff(image_rows) != 0])
        for start, stop in zip(starts, np.r_[starts[1:], len(image_rows)]):
            row = int(image_rows[start])
            image = cast_embeddings(slice_embeddings(self.embeddings.images, slice(row, row + 1)), torch.float64)
            caps = cast_embeddings(self._captions(captions[start:stop], shapes), torch.float64)
            scores = self._with_dtype(torch.float64, lambda model: model.score(image, caps, dtype=torch.float64))
            out[start:stop] = scores[0].double().cpu().numpy()
        return out

    def _pairs_aligned(self, image_rows: np.ndarray, captions: np.ndarray, shapes) -> np.ndarray:
        """One ``pair_score`` call over the listed pairs: their images and captions (gathered from their blocks) in
        float64, each once (not a float64 copy of every image: SMAN's cells on COCO 5K are 2 GB)."""
        device = self.device
        rows, row_of = np.unique(image_rows, return_inverse=True)
        images = cast_embeddings(slice_embeddings(self.embeddings.images, torch.as_tensor(rows, device=device)),
                                 torch.float64)
        distinct, inverse = np.unique(captions, return_inverse=True)
        caps = cast_embeddings(self._captions(distinct, shapes), torch.float64)
        scores = self._with_dtype(torch.float64, lambda model: model.pair_score(
            images, caps, torch.as_tensor(row_of.reshape(-1), device=device),
            torch.as_tensor(inverse.reshape(-1), device=device), dtype=torch.float64))
        return scores.double().cpu().numpy()

    def _pairs_by_caption_block(self, image_rows: np.ndarray, captions: np.ndarray, shapes) -> np.ndarray:
        """``pair_score`` per caption block over every image as stored: the model casts what it scores to float64
        (the block's captions are cast here), so no float64 copy of every image is made."""
        out = np.empty(len(image_rows), dtype=np.float64)
        images = self.embeddings.images
        device = self.device
        blocks = self._caption_block[captions]
        for b in np.unique(blocks):
            listed = np.flatnonzero(blocks == b)
            caps = cast_embeddings(self.embeddings.caption_blocks[b][1], torch.float64)
            img_idx = torch.as_tensor(image_rows[listed], device=device)
            cap_idx = torch.as_tensor(self._caption_row[captions[listed]], device=device)
            scores = self._with_dtype(torch.float64, lambda model: model.pair_score(
                images, caps, img_idx, cap_idx, dtype=torch.float64))
            out[listed] = scores.double().cpu().numpy()
        return out


def bytes_per_pair(score, images: Embeddings, captions: Embeddings) -> float:
    """Peak CUDA memory one scored pair takes: ``score`` of ``images`` (a probe block) × ``captions`` (a caption
    block), measured with ``torch.cuda.max_memory_allocated`` above what was allocated before."""
    device = next(iter(images.values())).device
    pairs = next(iter(images.values())).shape[0] * next(iter(captions.values())).shape[0]
    torch.cuda.synchronize(device)
    torch.cuda.reset_peak_memory_stats(device)
    before = torch.cuda.memory_allocated(device)
    score(images, captions)
    torch.cuda.synchronize(device)
    return max(1.0, (torch.cuda.max_memory_allocated(device) - before) / max(1, pairs))


def gpu_image_block(pair_budget: int, widest_caption_block: int) -> int:
    """Images one GPU score call takes: as many as fill ``pair_budget`` against the widest caption block (at
    least 128, the CPU's block)."""
    return max(128, pair_budget // max(1, widest_caption_block))


def gpu_pair_budget(free_bytes: int, bytes_per_pair: float) -> int:
    """Pairs one score call may hold on a GPU: :data:`GPU_MEMORY_SHARE` of ``free_bytes`` at ``bytes_per_pair``,
    between :data:`CPU_PAIR_BUDGET` and :data:`GPU_PAIR_BUDGET_MAX`."""
    fits = int(GPU_MEMORY_SHARE * free_bytes / max(1.0, bytes_per_pair))
    return max(CPU_PAIR_BUDGET, min(GPU_PAIR_BUDGET_MAX, fits))


def caption_groups(caption_blocks, captions: int) -> list[list[int]]:
    """Consecutive caption blocks (their positions in ``caption_blocks``) grouped while they hold at most
    ``captions`` captions together."""
    groups: list[list[int]] = []
    size = 0
    for b, (idx, _) in enumerate(caption_blocks):
        if not groups or size + len(idx) > captions:
            groups.append([])
            size = 0
        groups[-1].append(b)
        size += len(idx)
    return groups


def merged_caption_blocks(caption_blocks, captions: int) -> Iterator[tuple[np.ndarray, Embeddings]]:
    """Consecutive caption blocks joined while they hold at most ``captions`` captions together (each padded to
    the longest; length-sorted blocks carry little padding), so a score call takes as many captions as its pair
    budget allows rather than one encoding batch. Made one at a time as they are used: joined all at once they
    would copy every caption's embeddings (1.5 GB for SCAN on COCO 5K)."""
    for group in caption_groups(caption_blocks, captions):
        parts = [caption_blocks[b] for b in group]
        yield parts[0] if len(parts) == 1 else (np.concatenate([idx for idx, _ in parts]),
                                                _concat([caps for _, caps in parts]))


def score_blocks(score, images: Embeddings, caption_blocks, num_images: int, num_captions: int,
                 image_block: int = 128, pair_budget: int = CPU_PAIR_BUDGET, cast: torch.dtype | None = None,
                 quiet: bool = True, out_dtype: type = np.float64) -> np.ndarray:
    """Fill ``[num_images, num_captions]`` (``out_dtype``) with ``score(image block, caption block)``."""
    caption_step = max(1, pair_budget // max(1, min(image_block, num_images)))
    sims = np.empty((num_images, num_captions), dtype=out_dtype)
    calls = sum(-(-sum(len(caption_blocks[b][0]) for b in group) // caption_step)
                for group in caption_groups(caption_blocks, caption_step))

    def work() -> Iterator[tuple[np.ndarray, Embeddings]]:
        for idx, caps in merged_caption_blocks(caption_blocks, caption_step):
            for s in range(0, len(idx), caption_step):
                yield idx[s:s + caption_step], slice_embeddings(caps, slice(s, s + caption_step))

    for cap_idx, caps in progress(work(), total=calls, desc="score", unit="block", quiet=quiet):
        if cast is not None:
            caps = cast_embeddings(caps, cast)
        for start in range(0, num_images, image_block):
            block = slice_embeddings(images, slice(start, start + image_block))
            scores = score(block, caps)
            sims[start:start + scores.shape[0], cap_idx] = scores.double().cpu().numpy()
        release_free_memory()         # the score calls' temporaries (COCO 5K: +0.4 GB of holes otherwise)
    return sims


# ------------------------------------------------------------------------------------------- refinement

def rank_deciding_pairs(sims: np.ndarray, caption_image: np.ndarray, margin: float,
                        device: torch.device | str | None = None, rows: slice = slice(None),
                        true: np.ndarray | None = None) -> np.ndarray:
    """``[N, M]`` bool (of the ``rows`` of ``sims`` only, when given): pairs within ``margin`` of the score they are
    ranked against — their caption's true pair, or their image's best true pair (``true`` ``[M]`` float64: the
    true pairs' scores, when ``sims`` does not hold them)."""
    columns = np.arange(sims.shape[1])
    true = sims[caption_image, columns].astype(np.float64) if true is None else true
    best = np.full(sims.shape[0], -np.inf)
    np.maximum.at(best, caption_image, true)
    first, last, _ = rows.indices(sims.shape[0])
    near = np.empty((max(0, last - first), sims.shape[1]), dtype=bool)
    if device is not None:
        true_t = torch.from_numpy(true).to(device)
        best_t = torch.from_numpy(best).to(device)
        for start in range(first, last, 1024):
            stop = min(start + 1024, last)
            block = torch.from_numpy(sims[start:stop]).to(device, non_blocking=True)
            close = ((block - true_t[None, :]).abs() <= margin) | \
                ((block - best_t[start:stop, None]).abs() <= margin)
            near[start - first:stop - first] = close.cpu().numpy()
        return near
    # 256 rows at a time into one reused buffer: no [N, M] float temporaries (COCO 5K's would be 1 GB each)
    distance = np.empty((min(256, max(1, last - first)), sims.shape[1]), dtype=np.float64)
    for start in range(first, last, 256):
        stop = min(start + 256, last)
        block, out, here = sims[start:stop], near[start - first:stop - first], distance[:stop - start]
        np.abs(np.subtract(block, true[None, :], out=here), out=here)
        np.less_equal(here, margin, out=out)
        np.abs(np.subtract(block, best[start:stop, None], out=here), out=here)
        out |= here <= margin
    return near


def with_shared_captions(rows: np.ndarray, cols: np.ndarray, source: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The pairs ``(rows[p], cols[p])`` and every ``(rows[p], c)`` with ``source[c] == source[cols[p]]``."""
    counts = np.bincount(source, minlength=len(source))
    lens = counts[source[cols]]
    if len(rows) == 0 or (lens == 1).all():
        return rows, cols
    members = np.argsort(source, kind="stable")                 # each source's captions, contiguous
    offsets = np.concatenate([[0], np.cumsum(counts)[:-1]])
    starts = offsets[source[cols]]
    index = np.repeat(starts - np.cumsum(lens) + lens, lens) + np.arange(lens.sum())
    keys = np.unique(np.repeat(rows, lens) * len(source) + members[index])
    return keys // len(source), keys % len(source)


#: rows of the matrix searched for rank-deciding pairs at a time (no [N, M] mask is ever made)
REFINE_ROWS = 1024


class PositiveScores:
    """The exact scores of a matrix's positive pairs, sorted by query: a row's (an image's captions) and a
    column's (a caption's images), for :meth:`near` to find every pair within a margin of one of them.

    A score is keyed ``query · W + score``, with ``W`` wider than the matrix's range of scores plus twice the
    margin, so one sorted array and ``searchsorted`` find each pair's nearest positive of its own query (a key's
    rounding, at most 2⁻⁵³ · W · queries — ~10⁻¹¹ for COCO's 25,000 captions — is far under any margin the
    refinement sets)."""

    #: rows of a block compared at a time (each comparison makes a few float64 arrays of this many rows)
    ROWS = 64

    def __init__(self, sims: np.ndarray, rows: np.ndarray, cols: np.ndarray, margin: float,
                 scores: np.ndarray | None = None):
        low, high = float(sims.min(initial=0.0)), float(sims.max(initial=0.0))
        if scores is not None and len(scores):
            low, high = min(low, float(scores.min())), max(high, float(scores.max()))
        self.offset, self.width = low, high - low + 4 * margin + 1.0
        scores = (sims[rows, cols].astype(np.float64) if scores is None else scores) - low
        self.by_row = np.sort(rows * self.width + scores)
        self.by_col = np.sort(cols * self.width + scores)

    @staticmethod
    def _within(keys: np.ndarray, sorted_keys: np.ndarray, margin: float) -> np.ndarray:
        at = np.searchsorted(sorted_keys, keys)
        above = sorted_keys[np.minimum(at, len(sorted_keys) - 1)]
        below = sorted_keys[np.maximum(at - 1, 0)]
        return (np.abs(above - keys) <= margin) | (np.abs(keys - below) <= margin)

    def near(self, block: np.ndarray, first_row: int, margin: float) -> np.ndarray:
        """``[R, M]`` bool: the pairs of ``block`` (rows ``first_row …`` of the matrix) within ``margin`` of a
        positive's score of their row or of their column."""
        near = np.empty(block.shape, dtype=bool)
        cols = np.arange(block.shape[1], dtype=np.float64)[None, :] * self.width
        for start in range(0, block.shape[0], self.ROWS):
            values = block[start:start + self.ROWS].astype(np.float64) - self.offset
            rows = np.arange(first_row + start, first_row + start + len(values), dtype=np.float64)[:, None]
            near[start:start + self.ROWS] = (self._within(rows * self.width + values, self.by_row, margin)
                                             | self._within(cols + values, self.by_col, margin))
        return near


class ExactScores:
    """The float64 scores of the pairs rescored so far: their keys (``row · M + column``), sorted, and values."""

    def __init__(self, num_captions: int):
        self.num_captions = num_captions
        self.keys = np.zeros(0, dtype=np.int64)
        self.values = np.zeros(0, dtype=np.float64)

    def add(self, keys: np.ndarray, values: np.ndarray) -> None:
        """Pairs not held yet, with their scores."""
        keys = np.concatenate([self.keys, keys])
        order = np.argsort(keys, kind="stable")
        self.keys, self.values = keys[order], np.concatenate([self.values, values])[order]

    def of(self, keys: np.ndarray) -> np.ndarray:
        """The scores of ``keys``, every one of them held."""
        at = np.searchsorted(self.keys, keys)
        if len(keys) and (at.max(initial=0) >= len(self.keys) or (self.keys[at] != keys).any()):
            raise ValueError("a pair asked for has not been rescored")
        return self.values[at]

    def write(self, sims: np.ndarray) -> None:
        """Put the scores into ``sims`` ``[N, M]``."""
        sims[self.keys // self.num_captions, self.keys % self.num_captions] = self.values


def refine(sims: np.ndarray, caption_image: np.ndarray,
           rescore: Callable[[np.ndarray, np.ndarray], np.ndarray], source: np.ndarray | None = None,
           device: torch.device | str | None = None,
           positives: tuple[np.ndarray, np.ndarray] | None = None) -> tuple[dict, ExactScores]:
    """Rescore the rank-deciding pairs of a float32 matrix; returns the statistics and the rescored pairs' float64
    scores (a float64 ``sims`` also receives them in place; a float32 one, the estimates only, is left as it is).

    ``rescore(image_rows [P], captions [P])`` → float64 ``[P]``; ``source`` ``[M]`` (:func:`caption_sources`):
    identical captions are rescored together and stay tied. ``positives`` (rows, columns): more pairs whose every
    place in their row's and their column's ranking counts (ECCV Caption's and CxC's positives, and so COCO's own
    pairs with them): they are rescored first, and so is every pair near one of their scores. The pairs rescored
    are kept as sorted keys (``row · M + column``), and the matrix is searched :data:`REFINE_ROWS` rows at a time,
    so what this adds to the matrix's own memory grows with the pairs rescored, not with the matrix."""
    num_images, num_captions = sims.shape
    caption_image = np.asarray(caption_image, dtype=np.int64)
    exact = ExactScores(num_captions)
    in_place = sims.dtype == np.float64
    worst = 0.0

    def rescore_pairs(rows: np.ndarray, cols: np.ndarray) -> None:
        nonlocal worst
        if source is not None:
            rows, cols = with_shared_captions(rows, cols, source)
        keys = rows * num_captions + cols
        fresh = ~np.isin(keys, exact.keys, assume_unique=True) if len(exact.keys) else np.ones(len(keys), dtype=bool)
        rows, cols = rows[fresh], cols[fresh]
        if len(rows) == 0:
            return
        values = rescore(rows, cols)
        worst = max(worst, float(np.max(np.abs(values - sims[rows, cols].astype(np.float64)))))
        exact.add(keys[fresh], values)
        if in_place:
            sims[rows, cols] = values

    # the probe block and every true pair in one call: the largest error they show sets the first margin
    probe = np.ix_(np.arange(min(PROBE, num_images)), np.arange(min(PROBE, num_captions)))
    rows, cols = (np.broadcast_to(a, (len(probe[0]), probe[1].shape[1])).ravel() for a in probe)
    true_cols = np.arange(num_captions)
    true_keys = caption_image * num_captions + true_cols
    keys = [rows * num_captions + cols, true_keys]
    if positives is not None:
        keys.append(keys_of(positives, num_captions))
    keys = np.unique(np.concatenate(keys))
    rescore_pairs(keys // num_captions, keys % num_captions)
    true = exact.of(true_keys)                           # every true pair's float64 score, from here on
    scale = max(float(np.max(np.abs(sims), initial=0.0)), float(np.max(np.abs(exact.values), initial=0.0)))
    margin = SAFETY * max(worst, 2.0 ** -23 * scale, np.finfo(np.float64).tiny)
    rounds = 0
    while True:
        rounds += 1
        found = []
        counted = None
        if positives is not None:                         # every positive's exact score, each round's margin
            every = np.unique(np.concatenate([keys_of(positives, num_captions), true_keys]))
            counted = PositiveScores(sims, every // num_captions, every % num_captions, margin, exact.of(every))
        for start in range(0, num_images, REFINE_ROWS):
            window = slice(start, start + REFINE_ROWS)
            near = rank_deciding_pairs(sims, caption_image, margin, device, window, true)
            if counted is not None:
                near |= counted.near(sims[window], start, margin)
            block_rows, block_cols = np.nonzero(near)
            found.append((block_rows + start) * num_captions + block_cols)
        keys = np.setdiff1d(np.concatenate(found), exact.keys, assume_unique=True)
        rescore_pairs(keys // num_captions, keys % num_captions)
        if worst <= margin / 2 or rounds == MAX_ROUNDS:
            break
        margin = SAFETY * worst
    if worst > margin / 2:
        raise UserError(f"refined evaluation: float32 scores are up to {worst:.3g} off their float64 values, more "
                        f"than the margin allows after {rounds} rounds; use --precision float64")
    stats = {"margin": margin, "max_float32_error": worst, "rounds": rounds, "rescored_pairs": int(len(exact.keys)),
             "rescored_fraction": float(len(exact.keys) / sims.size) if sims.size else 0.0}
    return stats, exact


def keys_of(pairs: tuple[np.ndarray, np.ndarray], num_captions: int) -> np.ndarray:
    """``row · M + column`` of each pair ``(rows [P], columns [P])``."""
    return np.asarray(pairs[0], dtype=np.int64) * num_captions + np.asarray(pairs[1], dtype=np.int64)


def combined_matrix(scorers: Sequence[Scorer], precision: str = DEFAULT_PRECISION,
                    caption_image: np.ndarray | None = None, image_block: int | None = None,
                    pair_budget: int | None = None, quiet: bool = True, stats: dict | None = None,
                    pair_strategy: str = "auto",
                    positives: tuple[np.ndarray, np.ndarray] | None = None, release: bool = False) -> np.ndarray:
    """The mean ``[N_img, M]`` float64 of the scorers' matrices at ``precision``.

    ``caption_image`` ``[M]`` (caption → image row) marks the true pairs for ``refined``, ``positives`` (rows,
    columns) more pairs whose every place counts (:func:`refine`); None block sizes: chosen for the device.
    ``refined`` of one model holds its float32 estimates as float32 and the rescored pairs' float64 scores beside
    them; the float64 matrix is made last, after the scorers' embeddings are let go when ``release`` (nothing of
    the scorers is used after): the matrix's float64 copy and the embeddings are never held at once. An ensemble
    averages its members' estimates in float64 (its matrix is the members' mean to float64 rounding)."""
    if precision not in PRECISIONS:
        raise UserError(f"precision must be one of {', '.join(PRECISIONS)}")
    if precision == "refined" and caption_image is None:
        raise ValueError("refined precision needs caption_image (which pairs are true)")
    dtype = torch.float64 if precision == "float64" else torch.float32
    # one refined model: its float32 estimates as float32; an ensemble sums its members' in float64, as before
    kept = np.float32 if precision == "refined" and len(scorers) == 1 else np.float64
    sims = None
    for scorer in scorers:
        part = scorer.matrix(dtype, image_block, pair_budget, quiet, out_dtype=kept)
        sims = part if sims is None else np.add(sims, part, out=sims)
        del part
    if len(scorers) > 1:
        sims /= len(scorers)
    exact = None
    if precision == "refined":
        def rescore(rows: np.ndarray, captions: np.ndarray) -> np.ndarray:
            return sum(s.pairs(rows, captions, pair_strategy, quiet) for s in scorers) / len(scorers)
        # captions identical for every member share a column
        source = caption_sources(np.stack([s.embeddings.sources for s in scorers], axis=1).tolist())
        device = scorers[0].device
        result, exact = refine(sims, caption_image, rescore, source, device if device.type == "cuda" else None,
                               positives)
        if stats is not None:
            stats.update(result)
    if release:
        for scorer in scorers:
            scorer.release()
    if sims.dtype != np.float64:                           # refine left the float32 estimates as they were
        sims = sims.astype(np.float64)
        exact.write(sims)
    return sims


@torch.no_grad()
def similarity_matrix(model, data: SplitData, features: ImageFeatures, device: torch.device | str = "cpu",
                      precision: str = DEFAULT_PRECISION, encode_batch: int = 128, image_block: int | None = None,
                      pair_budget: int | None = None, quiet: bool = False, stats: dict | None = None) -> np.ndarray:
    """One model's similarity matrix ``[N_img, M]`` float64 (manifest order); ``stats`` receives the refinement's."""
    if precision not in PRECISIONS:
        raise UserError(f"precision must be one of {', '.join(PRECISIONS)}")
    embeddings = SplitEmbeddings.encode(model, data, features, device, encode_batch, quiet)
    return combined_matrix([Scorer(model, embeddings)], precision, data.caption_image, image_block, pair_budget,
                           quiet, stats)
