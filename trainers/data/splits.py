"""Cached-feature datasets: a feature set joined by id with the manifest's captions of some splits.

:class:`SplitData` (images in manifest order, captions flattened: caption ``m`` of image ``caption_image[m]``),
:class:`ImageFeatures` (``get`` → float32 ``[B, K, D]`` and mask ``[B, K]``), :class:`CaptionBatches` with
:class:`EpochBatchSampler` (batches from ``(seed, epoch)`` alone, cut per rank)."""
from __future__ import annotations

import functools
import os
from dataclasses import dataclass
from typing import Iterator, Sequence

import numpy as np
import torch

from retr.common.errors import UserError
from retr.common.memory import host_memory_available
from retr.common.progress import progress
from retr.manifests.schema import ManifestRecord, read_manifest
from retr.store.features import FeatureSet
from retr.store.vocab import PAD_ID, TokenizedCaptions, TokenLists, Vocabulary, concat_ranges
from retr.store.vocabularies import CaptionVocabulary
from retr.store.wordpiece import WordPieceVocabulary
from retr.trainers.config import preload_choice



@dataclass
class SplitData:
    """Images of some splits (manifest order) and their captions, flattened in order."""

    image_ids: list[str]
    captions: list[str]
    caption_image: np.ndarray          # [M] int64: index into image_ids
    tokens: Sequence[Sequence[int]]    # [M] token ids with <start>/<end> (a TokenLists, or lists)

    @property
    def num_images(self) -> int:
        return len(self.image_ids)

    @property
    def num_captions(self) -> int:
        return len(self.captions)

    def subset_images(self, start: int, stop: int) -> "SplitData":
        """Images ``start:stop`` and their captions (COCO 1K folds)."""
        keep = np.flatnonzero((self.caption_image >= start) & (self.caption_image < stop))
        tokens = (self.tokens.subset(keep) if isinstance(self.tokens, TokenLists)
                  else [self.tokens[m] for m in keep])
        return SplitData(self.image_ids[start:stop], [self.captions[m] for m in keep],
                         self.caption_image[keep] - start, tokens)


@dataclass
class ManifestCaptions:
    """The records of some of a manifest's splits, with every caption of theirs tokenised once: into words
    (:class:`~retr.store.vocab.TokenizedCaptions`, on first use), from which a vocabulary built from some of those
    splits and each split's :class:`SplitData` encoded with a word vocabulary come, so a training start reads the
    manifest and tokenises a caption once; a WordPiece vocabulary (BERT's) tokenises each split's captions itself.

    ``first_caption`` ``[R + 1]``: record ``r``'s captions are ``first_caption[r]:first_caption[r + 1]``."""

    manifest: str
    records: list[ManifestRecord]
    first_caption: np.ndarray
    quiet: bool = False

    @classmethod
    def read(cls, manifest: str | os.PathLike, splits: Sequence[str], quiet: bool = False) -> "ManifestCaptions":
        """The records of ``splits``; their captions are tokenised with a progress bar (unless ``quiet``) on first
        use."""
        records = read_manifest(manifest, splits=list(dict.fromkeys(splits)))
        counts = np.array([len(r.captions) for r in records], dtype=np.int64)
        return cls(str(manifest), records, np.concatenate([[0], np.cumsum(counts)]), quiet)

    @functools.cached_property
    def tokenized(self) -> TokenizedCaptions:
        """Every caption's words (:class:`~retr.store.vocab.TokenizedCaptions`), tokenised once."""
        return TokenizedCaptions.of((c for r in self.records for c in r.captions), total=int(self.first_caption[-1]),
                                    quiet=self.quiet)

    def _records_of(self, splits: Sequence[str]) -> np.ndarray:
        wanted = set(splits)
        return np.array([n for n, r in enumerate(self.records) if r.split in wanted], dtype=np.int64)

    def _captions_of(self, records: np.ndarray) -> np.ndarray:
        starts = self.first_caption[records]
        return concat_ranges(starts, self.first_caption[records + 1] - starts)

    def vocabulary(self, splits: Sequence[str], threshold: int) -> Vocabulary:
        """The vocabulary of ``splits``' captions (as :meth:`Vocabulary.build` makes it from their texts)."""
        captions = self._captions_of(self._records_of(splits))
        if not len(captions):
            raise UserError(f"{self.manifest} has no captions in {', '.join(splits)} to build the vocabulary from "
                            "(--vocab-split / --train-split)")
        return self.tokenized.vocabulary(captions, threshold)

    def split(self, splits: Sequence[str], vocab: CaptionVocabulary, features: FeatureSet | None = None,
              missing: str = "error") -> tuple[SplitData, list[str]]:
        """``splits``' images that have features and their captions encoded with ``vocab``; returns (data, ids
        without features), as :func:`load_split`."""
        chosen = self._records_of(splits)
        if not len(chosen):
            raise UserError(f"{self.manifest} has no images in split(s) {', '.join(splits)}")
        absent: list[str] = []
        if features is not None:
            has = np.array([self.records[r].id in features for r in chosen], dtype=bool)
            absent = [self.records[r].id for r in chosen[~has]]
            if absent and missing == "error":
                raise UserError(f"{len(absent)} image(s) of split {'+'.join(splits)} have no features in "
                                f"{features.path} (first: {absent[0]}); extract them or pick the matching manifest")
            if len(absent) == len(chosen):
                raise UserError(f"no image of split {'+'.join(splits)} has features in {features.path}: "
                                "is this the feature set of that manifest?")
            chosen = chosen[has]
        captions = self._captions_of(chosen)
        counts = self.first_caption[chosen + 1] - self.first_caption[chosen]
        records = [self.records[r] for r in chosen]
        texts = [c for r in records for c in r.captions]
        tokens = (vocab.encode_all(texts, quiet=self.quiet) if isinstance(vocab, WordPieceVocabulary)
                  else self.tokenized.encode(vocab, captions))
        return SplitData([r.id for r in records], texts, np.repeat(np.arange(len(chosen), dtype=np.int64), counts),
                         tokens), absent


def load_split(manifest: str | os.PathLike, splits: Sequence[str], vocab: CaptionVocabulary,
               features: FeatureSet | None = None, missing: str = "error") -> tuple[SplitData, list[str]]:
    """The images of ``splits`` that have features; returns (data, ids without features).

    ``missing="error"`` (evaluation: a protocol must see every image) raises when an image has no features;
    ``missing="skip"`` (training) leaves such images out and returns their ids so the caller can say so."""
    return ManifestCaptions.read(manifest, splits, quiet=True).split(splits, vocab, features, missing)


#: sets this small are held in memory (on the GPU where they fit) whatever memory is free: reading them per batch
#: would save next to nothing
ALWAYS_HELD_BYTES = 256 << 20
#: host memory ``auto`` leaves free after holding the features: the larger of 4 GiB and a quarter of what is
#: available, for the model, its activations and optimiser state, validation, evaluation's blocks and the rest of
#: the machine (a d = 1024 SCAN trains at batch 128 on a CPU in about 2 GiB)
HOST_KEEP_FREE_BYTES = 4 << 30
HOST_KEEP_FREE_SHARE = 0.25
#: share of a GPU's total memory left free for the model, activations and evaluation after holding the features
DEVICE_HEADROOM = 0.25
#: rows are preloaded in slices of about this many bytes (one read each where rows lie in file order; the bar moves)
PRELOAD_SLICE_BYTES = 64 << 20


def size_text(nbytes: float) -> str:
    """``4.3 GiB``, ``12.5 MiB`` under a GiB, ``40.0 KiB`` under a MiB."""
    for unit, scale in (("GiB", 2**30), ("MiB", 2**20)):
        if nbytes >= scale:
            return f"{nbytes / scale:.1f} {unit}"
    return f"{nbytes / 2**10:.1f} KiB"


def place_features(nbytes: int, host_available: int | None, device: str = "cpu",
                   device_memory: tuple[int, int] | None = None, processes: int = 1) -> tuple[str, str]:
    """Where ``preload="auto"`` holds ``nbytes`` of features, and why: ``("gpu" | "host" | "file", reason)``.

    ``host_available``: bytes of host memory free (:func:`retr.common.memory.host_memory_available`; ``None``
    unknown), shared by ``processes`` training processes on this host (each holds its own copy);
    ``device``: the training device's name; ``device_memory``: its ``(free, total)`` bytes on CUDA.

    * on the GPU when the device is CUDA and holding them leaves :data:`DEVICE_HEADROOM` of its memory free;
    * else in host memory when they take at most :data:`ALWAYS_HELD_BYTES`, or when holding them leaves the larger
      of :data:`HOST_KEEP_FREE_BYTES` and :data:`HOST_KEEP_FREE_SHARE` of the available memory free;
    * else read from the file per batch."""
    gpu_why = ""
    if device_memory is not None and device.startswith("cuda"):
        free, total = device_memory
        keep = DEVICE_HEADROOM * total
        if nbytes <= free - keep:
            return "gpu", (f"{device} has {size_text(free)} free: {size_text(free - nbytes)} stay free, over the "
                           f"{size_text(keep)} auto keeps")
        gpu_why = f"; {device} has {size_text(free)} free, too little to keep {size_text(keep)} free"
    if nbytes <= ALWAYS_HELD_BYTES:
        return "host", f"under {size_text(ALWAYS_HELD_BYTES)}: always held{gpu_why}"
    if host_available is None:
        return "file", f"the free host memory is unknown{gpu_why}"
    share = host_available // max(1, processes)
    of = f"{size_text(share)} available" + (f" to each of {processes} processes" if processes > 1 else "")
    keep = max(HOST_KEEP_FREE_BYTES, HOST_KEEP_FREE_SHARE * share)
    if nbytes <= share - keep:
        return "host", f"{of}: {size_text(share - nbytes)} stay free, over the {size_text(keep)} auto keeps{gpu_why}"
    left = max(0, share - nbytes)
    return "file", (f"holding them would leave {size_text(left)} of the {of}, under the {size_text(keep)} auto "
                    f"keeps free{gpu_why}")


def processes_on_this_host() -> int:
    """Training processes started together on this host (``torchrun`` sets ``LOCAL_WORLD_SIZE``), 1 otherwise."""
    try:
        return max(1, int(os.environ.get("LOCAL_WORLD_SIZE", "1")))
    except ValueError:
        return 1


class ImageFeatures:
    """Feature rows ``[N, K, D]`` of a list of image ids, held on the GPU, in host memory, or read per batch.

    ``preload``: ``host``, ``gpu`` (one device tensor; what does not fit stays in host memory, with :attr:`note`),
    ``off`` or ``auto`` (:func:`place_features` decides from the memory free now); :attr:`where`: ``gpu``,
    ``host`` or ``file``; :attr:`reader`: what gives a batch its rows — ``gpu``, ``host``, or the file's reader
    (``pread``, or ``h5py`` for a compressed set: :meth:`FeatureSet.how_read`); :attr:`decision`: one line saying
    where they are and why (``features: 4.3 GiB, held in host memory (…)``). Preloading reads the rows in slices
    of :data:`PRELOAD_SLICE_BYTES`, with a progress bar for sets over :data:`ALWAYS_HELD_BYTES` (not with
    ``quiet``); rows held on the GPU go there slice by slice, never all in host memory at once.
    """

    _memory: np.ndarray | None = None                                  # rows in host memory
    _on_device: tuple[torch.Tensor, torch.Tensor] | None = None        # features [N, K, D], num_boxes [N] on the device

    def __init__(self, feature_set: FeatureSet, image_ids: Sequence[str], preload: str | bool | None = "auto",
                 device: torch.device | str | None = None, quiet: bool = False):
        preload = preload_choice(preload)
        self.feature_set = feature_set
        self.rows = feature_set.rows_of(image_ids)
        k, d = feature_set.feature_shape
        self.feature_shape = (k, d)
        itemsize = np.dtype(feature_set.datasets["features"][1]).itemsize
        self.nbytes = int(len(self.rows) * k * d * itemsize)
        self.note: str | None = None
        device = torch.device(device) if device is not None else torch.device("cpu")
        device_memory = torch.cuda.mem_get_info(device) if device.type == "cuda" else None
        if preload == "auto":
            where, why = place_features(self.nbytes, host_memory_available(), str(device), device_memory,
                                        processes_on_this_host())
        elif preload == "gpu" and not fits_on_device(self.nbytes, device, device_memory):
            where = "host"
            free = f" ({size_text(device_memory[0])} free)" if device_memory is not None else ""
            why = (f"asked for {device}, where they would leave less than {DEVICE_HEADROOM:.0%} of its memory free"
                   f"{free}")
            self.note = (f"the features ({size_text(self.nbytes)}) do not fit in {device}'s free memory; "
                         "holding them in host memory (batches are copied from pinned memory)")
        else:
            where, why = {"host": "host", "gpu": "gpu", "off": "file"}[preload], "as asked"
        self.where = where
        self.preloaded = where != "file"
        self.reader = where if self.preloaded else feature_set.how_read("features")[0]
        held = {"gpu": f"held on {device}", "host": "held in host memory",
                "file": f"read from the file per batch with {self.reader}"}[where]
        self.decision = f"features: {size_text(self.nbytes)}, {held} ({why})"
        if self.reader == "h5py":
            self.decision += f"; h5py reads them: {feature_set.how_read('features')[1]}"
        if "num_boxes" in feature_set.datasets:
            num_boxes = feature_set.read_rows(self.rows, "num_boxes").astype(np.int64).reshape(-1)
            if (num_boxes < 1).any() or (num_boxes > k).any():
                bad = int(np.flatnonzero((num_boxes < 1) | (num_boxes > k))[0])
                raise UserError(f"{feature_set.path}: image {image_ids[bad]} has num_boxes={num_boxes[bad]} "
                                f"(must be 1..{k})")
        else:
            num_boxes = np.full(len(self.rows), k, dtype=np.int64)
        self.num_boxes = num_boxes
        self._memory = None
        self._on_device = None
        if where == "gpu":
            held_rows = torch.empty((len(self.rows), k, d), device=device,
                                    dtype=torch.from_numpy(np.empty(0, dtype=feature_set.dtype)).dtype)
            self._preload(held_rows, quiet)
            self._on_device = (held_rows, torch.from_numpy(num_boxes).to(device))
        elif where == "host":
            self._memory = np.empty((len(self.rows), k, d), dtype=feature_set.dtype)
            self._preload(self._memory, quiet)

    def _preload(self, target: np.ndarray | torch.Tensor, quiet: bool) -> None:
        """Every row into ``target`` (``[N, K, D]``, host array or device tensor), a slice at a time."""
        fs, count = self.feature_set, len(self.rows)
        step = max(1, PRELOAD_SLICE_BYTES // max(1, self.nbytes // max(1, count)))
        on_host = isinstance(target, np.ndarray) or target.device.type == "cpu"
        host = target if isinstance(target, np.ndarray) else target.numpy() if on_host else None
        staging = None if on_host else np.empty((min(step, count), *self.feature_shape), dtype=fs.dtype)
        with progress(total=count, desc="load features", unit="img",
                      quiet=quiet or self.nbytes <= ALWAYS_HELD_BYTES) as bar:
            for start in range(0, count, step):
                stop = min(count, start + step)
                if host is not None:
                    fs.read_rows(self.rows[start:stop], out=host[start:stop])
                else:
                    part = fs.read_rows(self.rows[start:stop], out=staging[:stop - start])
                    target[start:stop].copy_(torch.from_numpy(part))
                bar.update(stop - start)

    def __len__(self) -> int:
        return len(self.rows)

    def get(self, images: Sequence[int] | np.ndarray | torch.Tensor,
            as_stored: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
        """Features ``[B, K, D]`` float32 (``as_stored``: the stored dtype, e.g. float16, for the caller to convert
        after copying it to the device: half the bytes over the bus) and region mask ``[B, K]`` bool of image
        indices ``images``, on the device the rows are held on (the CPU unless ``gpu``)."""
        k = self.feature_shape[0]
        if self._on_device is not None:
            held, boxes = self._on_device
            index = torch.as_tensor(np.asarray(images, dtype=np.int64), device=held.device)
            features, num_boxes = held[index], boxes[index]
            mask = torch.arange(k, device=held.device).view(1, -1) < num_boxes.view(-1, 1)
            return (features if as_stored else features.float()), mask
        images = np.asarray(images, dtype=np.int64)
        block = self._memory[images] if self._memory is not None else self.feature_set.read_rows(self.rows[images])
        features = torch.from_numpy(np.ascontiguousarray(block))
        mask = torch.arange(k).view(1, -1) < torch.from_numpy(self.num_boxes[images]).view(-1, 1)
        return (features if as_stored else features.float()), mask


def fits_on_device(nbytes: int, device: torch.device, free_and_total: tuple[int, int] | None = None) -> bool:
    """Whether ``nbytes`` of features may be held on ``device``: on CUDA, when they leave at least
    :data:`DEVICE_HEADROOM` of the device's total memory free (``torch.cuda.mem_get_info``, or the
    ``free_and_total`` bytes given); on the CPU, always (host memory is what ``host`` uses too)."""
    if device.type != "cuda":
        return True
    free, total = free_and_total if free_and_total is not None else torch.cuda.mem_get_info(device)
    return nbytes <= free - DEVICE_HEADROOM * total


def pad_tokens(token_lists: Sequence[Sequence[int]]) -> tuple[torch.Tensor, torch.Tensor]:
    """Token ids ``[B, L_max]`` (padded with ``<pad>``) and lengths ``[B]``."""
    lengths = torch.tensor([len(t) for t in token_lists], dtype=torch.long)
    tokens = torch.full((len(token_lists), int(lengths.max()) if len(token_lists) else 0), PAD_ID, dtype=torch.long)
    for row, ids in enumerate(token_lists):
        tokens[row, :len(ids)] = torch.tensor(ids, dtype=torch.long)
    return tokens, lengths


class CaptionBatches(torch.utils.data.Dataset):
    """Item = one batch of caption indices → ``features`` [B, K, D] (float32, or stored with ``as_stored``),
    ``mask`` [B, K] bool, ``tokens`` [B, L] long, ``lengths`` [B], ``image_index`` [B], ``caption_index`` [B]."""

    def __init__(self, data: SplitData, features: ImageFeatures, as_stored: bool = False):
        self.data, self.features, self.as_stored = data, features, as_stored

    def __len__(self) -> int:
        return self.data.num_captions

    def __getitem__(self, captions: Sequence[int]) -> dict[str, torch.Tensor]:
        captions = np.asarray(captions, dtype=np.int64)
        images = self.data.caption_image[captions]
        features, mask = self.features.get(images, as_stored=self.as_stored)
        tokens, lengths = pad_tokens([self.data.tokens[m] for m in captions])
        return {"features": features, "mask": mask, "tokens": tokens, "lengths": lengths,
                "image_index": torch.from_numpy(images), "caption_index": torch.from_numpy(captions)}


class EpochBatchSampler(torch.utils.data.Sampler):
    """Batches of caption indices: a permutation drawn from ``(seed, epoch)``, cut into global batches of
    ``batch_size``; with ``world_size`` > 1 each rank gets its contiguous part of every global batch (so a
    DDP step sees exactly the global batch a single process would). The last, smaller batch is kept unless
    ``drop_last`` (and there is a full one)."""

    def __init__(self, num_items: int, batch_size: int, seed: int, rank: int = 0, world_size: int = 1,
                 drop_last: bool = False):
        if batch_size % world_size:
            raise UserError(f"batch size {batch_size} is not divisible by the {world_size} processes")
        self.num_items, self.batch_size, self.seed, self.drop_last = num_items, batch_size, seed, drop_last
        self.rank, self.world_size = rank, world_size
        self.epoch = 0

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch

    def global_batches(self) -> list[np.ndarray]:
        generator = torch.Generator().manual_seed(self.seed * 100_003 + self.epoch)
        order = torch.randperm(self.num_items, generator=generator).numpy()
        batches = [order[i:i + self.batch_size] for i in range(0, self.num_items, self.batch_size)]
        if self.drop_last and len(batches) > 1 and len(batches[-1]) < self.batch_size:
            batches.pop()
        return [b for b in batches if len(b) >= self.world_size]

    def __iter__(self) -> Iterator[list[int]]:
        for batch in self.global_batches():
            parts = np.array_split(batch, self.world_size)
            yield parts[self.rank].tolist()

    def __len__(self) -> int:
        return len(self.global_batches())


def check_feature_contract(features: FeatureSet, img_dim: int | None = None) -> None:
    """Refuse in one line a feature set the trainer cannot read as ``[N, K, D]`` floats (or whose ``D`` is not
    the model's ``img_dim``, when one is given)."""
    if len(features.feature_shape) != 2:
        shape = "×".join(map(str, (len(features), *features.feature_shape)))
        raise UserError(f"{features.path}: features are [{shape}]; the trainer reads [N, K, D] (a global vector "
                        "is K = 1); run `retr-pipeline verify` on it")
    if not np.issubdtype(features.dtype, np.floating):
        raise UserError(f"{features.path}: features are {features.dtype}; the trainer reads float16 or float32 "
                        "features (re-extract, or import them as floats)")
    if img_dim is not None and features.feature_shape[1] != img_dim:
        raise UserError(f"{features.path}: features have D = {features.feature_shape[1]}, the model takes "
                        f"D = {img_dim}; give the feature set it was trained on")
