"""Cached-feature datasets: a feature set joined by id with the manifest's captions of some splits.

:class:`SplitData` (images in manifest order, captions flattened: caption ``m`` of image ``caption_image[m]``),
:class:`ImageFeatures` (``get`` → float32 ``[B, K, D]`` and mask ``[B, K]``), :class:`CaptionBatches` with
:class:`EpochBatchSampler` (batches from ``(seed, epoch)`` alone, cut per rank)."""
from __future__ import annotations

import hashlib
import json
import logging
import os
from dataclasses import dataclass
from typing import Iterator, Sequence

import numpy as np
import torch

from retr.common.errors import UserError
from retr.common.hashing import sha256_file
from retr.manifests.schema import ManifestRecord, read_manifest
from retr.store.features import FeatureSet
from retr.store.vocab import PAD_ID, Vocabulary
from retr.trainers.config import preload_choice

logger = logging.getLogger(__name__)

DEFAULT_PRELOAD_LIMIT = 2 << 30   # bytes of float16 features kept in memory without being asked


@dataclass
class SplitData:
    """Images of some splits (manifest order) and their captions, flattened in order."""

    image_ids: list[str]
    captions: list[str]
    caption_image: np.ndarray          # [M] int64: index into image_ids
    tokens: list[list[int]]            # [M] token ids with <start>/<end>

    @classmethod
    def from_records(cls, records: Sequence[ManifestRecord], vocab: Vocabulary) -> "SplitData":
        image_ids, captions, owner = [], [], []
        for i, record in enumerate(records):
            image_ids.append(record.id)
            captions.extend(record.captions)
            owner.extend([i] * len(record.captions))
        return cls(image_ids, captions, np.asarray(owner, dtype=np.int64), [vocab.encode(c) for c in captions])

    @property
    def num_images(self) -> int:
        return len(self.image_ids)

    @property
    def num_captions(self) -> int:
        return len(self.captions)

    def subset_images(self, start: int, stop: int) -> "SplitData":
        """Images ``start:stop`` and their captions (COCO 1K folds)."""
        keep = np.flatnonzero((self.caption_image >= start) & (self.caption_image < stop))
        return SplitData(self.image_ids[start:stop], [self.captions[m] for m in keep],
                         self.caption_image[keep] - start, [self.tokens[m] for m in keep])


def load_split(manifest: str | os.PathLike, splits: Sequence[str], vocab: Vocabulary,
               features: FeatureSet | None = None, missing: str = "error") -> tuple[SplitData, list[str]]:
    """The images of ``splits`` that have features; returns (data, ids without features).

    ``missing="error"`` (evaluation: a protocol must see every image) raises when an image has no features;
    ``missing="skip"`` (training) leaves such images out and returns their ids so the caller can say so."""
    records = read_manifest(manifest, splits=list(splits))
    if not records:
        raise UserError(f"{manifest} has no images in split(s) {', '.join(splits)}")
    absent: list[str] = []
    if features is not None:
        absent = [r.id for r in records if r.id not in features]
        if absent and missing == "error":
            raise UserError(f"{len(absent)} image(s) of split {'+'.join(splits)} have no features in "
                            f"{features.path} (first: {absent[0]}); extract them or pick the matching manifest")
        if len(absent) == len(records):
            raise UserError(f"no image of split {'+'.join(splits)} has features in {features.path}: "
                            "is this the feature set of that manifest?")
        records = [r for r in records if r.id in features]
    return SplitData.from_records(records, vocab), absent


class ImageFeatures:
    """Feature rows ``[N, K, D]`` of a list of image ids, preloaded or read per batch.

    ``preload``: ``host``, ``gpu`` (one device tensor; what does not fit stays in host memory, with :attr:`note`),
    ``off`` or ``auto`` (docs/trainer.md, "Training options in detail"); :attr:`where`: ``host``, ``gpu`` or ``file``.
    """

    _memory: np.ndarray | None = None                                  # rows in host memory
    _on_device: tuple[torch.Tensor, torch.Tensor] | None = None        # features [N, K, D], num_boxes [N] on the device

    def __init__(self, feature_set: FeatureSet, image_ids: Sequence[str], preload: str | bool | None = "auto",
                 preload_limit_bytes: int = DEFAULT_PRELOAD_LIMIT, device: torch.device | str | None = None):
        preload = preload_choice(preload)
        self.feature_set = feature_set
        self.rows = feature_set.rows_of(image_ids)
        k, d = feature_set.feature_shape
        self.feature_shape = (k, d)
        itemsize = np.dtype(feature_set.datasets["features"][1]).itemsize
        self.nbytes = int(len(self.rows) * k * d * itemsize)
        self.note: str | None = None
        device = torch.device(device) if device is not None else torch.device("cpu")
        if preload == "gpu" and not fits_on_device(self.nbytes, device):
            self.note = (f"the features ({self.nbytes / 2**30:.1f} GiB) do not fit in {device}'s free memory; "
                         "holding them in host memory (batches are copied from pinned memory)")
            preload = "host"
        if preload == "auto":
            small = self.nbytes <= preload_limit_bytes
            preload = "off" if not small else "gpu" if device.type == "cuda" and fits_on_device(
                self.nbytes, device) else "host"
        self.where = {"host": "host", "gpu": "gpu", "off": "file"}[preload]
        self.preloaded = self.where != "file"
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
        if self.preloaded:
            if len(self.rows) == len(feature_set) and np.array_equal(self.rows, np.arange(len(feature_set))):
                self._memory = feature_set.read_all()
            else:
                self._memory = feature_set.read_rows(self.rows)
        if self.where == "gpu":
            self._on_device = (torch.from_numpy(self._memory).to(device), torch.from_numpy(num_boxes).to(device))
            self._memory = None

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


#: share of a GPU's total memory left free for the model, activations and evaluation after holding the features
DEVICE_HEADROOM = 0.25


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


def data_identity(features: FeatureSet, manifest: str, inputs: dict | None = None) -> dict:
    """What a resume must find again: the feature set's ids digest, shape, dtype and extraction attributes, the
    digest of its shards' per-row checksums (None for shards written before checksums; no feature value is read),
    the manifest's SHA-256 and each side file's SHA-256 (``inputs``: ``{name: path}``)."""
    attrs = {k: v for k, v in features.attrs.items()
             if k in ("kind", "extractor", "backbone", "weights", "image_size", "manifest_sha256")}
    identity = {"features_ids_sha256": hashlib.sha256("\n".join(features.ids).encode("utf-8")).hexdigest(),
                "features_shape": [len(features), *map(int, features.feature_shape)],
                "features_dtype": str(features.dtype),
                "features_attrs": json.loads(json.dumps(attrs, default=str)),
                "features_rows_crc_sha256": _rows_digest(features),
                "manifest_sha256": sha256_file(manifest)}
    if inputs:
        # a missing side file is left to the model's reader, whose error says what the file is and how to get it
        identity["inputs_sha256"] = {name: sha256_file(path) if os.path.isfile(path) else None
                                     for name, path in sorted(inputs.items())}
    return identity


def _rows_digest(features: FeatureSet) -> str | None:
    """SHA-256 over the per-row CRC-32s every shard stores (``store.features.CHECKSUMS``): a fingerprint of the
    values at 4 bytes a row; None when a shard has none."""
    import h5py

    from retr.store.features import CHECKSUMS

    shards = features.attrs.get("shards")
    paths = [features.path.resolve().parent / s["file"] for s in shards] if shards else [features.path]
    digest = hashlib.sha256()
    for path in paths:
        with h5py.File(path, "r") as f:
            if CHECKSUMS not in f:
                return None
            digest.update(np.asarray(f[CHECKSUMS][:], dtype="<u4").tobytes())
    return digest.hexdigest()


@dataclass
class RunSplit:
    """A trained run opened on one split: its model (eval mode), vocabulary and config, the feature set (checked
    against the model) and the split's data, with the paths actually read."""

    model: object
    vocab: Vocabulary
    config: dict
    features: FeatureSet
    data: SplitData
    features_path: str
    manifest_path: str


def open_run_split(run, split: str, features: str | None = None, manifest: str | None = None,
                   which: str = "best", device="cpu", trust_checkpoint: bool = False) -> RunSplit:
    """Load ``run``'s ``which`` checkpoint and ``split`` of its feature set and manifest (or the ones given),
    every image of the split required (evaluation and search see the whole split)."""
    from retr.trainers.training import checkpoint as ckpt

    model, vocab, config = ckpt.load_run_model(run, which, device, trust=trust_checkpoint)
    features = features or config.get("features")
    manifest = manifest or config.get("manifest")
    if not features or not manifest:
        raise UserError(f"{run} does not record its features/manifest (imported run?); pass --features and "
                        "--manifest")
    feature_set = FeatureSet(features)
    check_feature_contract(feature_set, config["model_args"].get("img_dim"))
    for note in check_manifest_pairing(feature_set, manifest):   # refuses a manifest of other images
        logger.warning(f"note: {note}")
    data, _ = load_split(manifest, [split], vocab, feature_set, missing="error")
    return RunSplit(model, vocab, config, feature_set, data, str(features), str(manifest))


# ------------------------------------------------------------------------------------ features ↔ manifest

#: folders searched for the manifest a feature set was made from, as levels above the feature file: its own
#: folder, the extraction's ``--out`` and the dataset folder above it (``data/f30k/features/E.h5`` was made from
#: ``data/f30k/manifest.jsonl`` in the layout the README and ``make extract`` use)
SOURCE_MANIFEST_LEVELS = 3
#: at most this many candidate manifests are hashed when looking for the one a feature set was made from
SOURCE_MANIFEST_CANDIDATES = 64
#: image files of shared ids compared byte for byte (evenly spaced over the ids) when two manifests give an id the
#: same relative path in different folders; sizes are compared for every id
COMPARED_IMAGE_FILES = 256


def _is_sha256(value) -> bool:
    """A recorded manifest digest that names a manifest: 64 hex digits, not all zeros (the placeholder of sets
    written without a manifest, such as synthetic test sets; importers record a sentence instead)."""
    return (isinstance(value, str) and len(value) == 64 and all(c in "0123456789abcdef" for c in value)
            and value != "0" * 64)


def find_source_manifest(features_path: str | os.PathLike, manifest: str | os.PathLike,
                         recorded_sha256: str) -> str | None:
    """The manifest file whose SHA-256 is ``recorded_sha256`` (the one a feature set was made from), looked for
    among the ``*.jsonl`` files of the feature file's folder and the :data:`SOURCE_MANIFEST_LEVELS` − 1 folders
    above it, and of ``manifest``'s folder; None when none is."""
    from pathlib import Path

    folders, here = [], Path(features_path).resolve().parent
    for _ in range(SOURCE_MANIFEST_LEVELS):
        folders.append(here)
        here = here.parent
    folders.append(Path(manifest).resolve().parent)
    given = Path(manifest).resolve()
    seen: set = set()
    for folder in dict.fromkeys(folders):
        try:
            candidates = sorted(p for p in folder.glob("*.jsonl") if p.is_file())
        except OSError:
            continue
        for path in candidates:
            if path.resolve() == given or path in seen:
                continue
            seen.add(path)
            if len(seen) > SOURCE_MANIFEST_CANDIDATES:
                return None
            try:
                if sha256_file(path) == recorded_sha256:
                    return str(path)
            except OSError:
                continue
    return None


def _different_image(first: str, second: str) -> bool:
    """Whether two image files that both exist hold other bytes (the same file, or equal bytes: False)."""
    import filecmp

    if os.path.samefile(first, second):
        return False
    return not filecmp.cmp(first, second, shallow=False)


def check_manifest_pairing(features: FeatureSet, manifest: str | os.PathLike) -> list[str]:
    """Refuse (one line) a ``manifest`` whose ids name other images than the ones ``features`` was made from;
    return the notes to print when it differs otherwise.

    A feature set records the SHA-256 of the manifest it was extracted from (``manifest_sha256``) and its ids,
    not each image's path or content. So: the same SHA-256 (or none recorded: an import, :func:`_is_sha256`) is
    the same data. Else
    the manifest it was made from is looked for by its SHA-256 (:func:`find_source_manifest`); found, every
    shared id must have the same image there and in ``manifest`` — the same relative path, and, where both
    manifests' images are on disk (paths relative to each manifest's folder), the same size and, for up to
    :data:`COMPARED_IMAGE_FILES` ids, the same bytes. Same images with other captions or splits: one note, and
    the captions of ``manifest`` are used. Not found: one note that the images cannot be compared."""
    from pathlib import Path

    from retr.manifests.schema import read_manifest

    recorded = features.attrs.get("manifest_sha256")
    if not _is_sha256(recorded):
        return []
    given = sha256_file(manifest)
    if given == recorded:
        return []
    records = [r for r in read_manifest(manifest) if r.id in features]
    if not records:
        return []                     # no shared id: the split loaders refuse (no image has features)
    source = find_source_manifest(features.path, manifest, recorded)
    if source is None:
        return [f"{features.path} was made from another manifest than {manifest} (sha256 {recorded[:12]}…, not "
                f"found beside the features or the manifest), so whether its {len(records)} shared ids name the "
                "same images cannot be checked; put the manifest it was made from beside it, or re-extract"]
    original = {r.id: r for r in read_manifest(source)}
    moved = [(r, original[r.id]) for r in records if r.id in original and r.path != original[r.id].path]
    if moved:
        new, old = moved[0]
        raise UserError(f"{manifest} names other images than {features.path} was made from ({source}): "
                        f"{len(moved)} shared id(s) have another path (first: {new.id} is {new.path} here, "
                        f"{old.path} there); give the manifest the features were made from, or re-extract")
    here, there = Path(manifest).resolve().parent, Path(source).resolve().parent
    pairs = [(r.id, str(here / r.path), str(there / original[r.id].path)) for r in records if r.id in original]
    pairs = [p for p in pairs if os.path.isfile(p[1]) and os.path.isfile(p[2])]
    differ = [p for p in pairs if os.path.getsize(p[1]) != os.path.getsize(p[2])]
    if not differ and pairs:
        step = max(1, len(pairs) // COMPARED_IMAGE_FILES)
        differ = [p for p in pairs[::step][:COMPARED_IMAGE_FILES] if _different_image(p[1], p[2])]
    if differ:
        raise UserError(f"{manifest} names other images than {features.path} was made from ({source}): "
                        f"{len(differ)} shared id(s) are other image files (first: {differ[0][0]}, {differ[0][1]} "
                        f"≠ {differ[0][2]}); give the manifest the features were made from, or re-extract")
    changed = sum(r.captions != original[r.id].captions for r in records if r.id in original)
    resplit = sum(r.split != original[r.id].split for r in records if r.id in original)
    return [f"{manifest} is not the manifest {features.path} was made from ({source}), but its {len(records)} "
            f"shared ids name the same images; {changed} have other captions and {resplit} another split: "
            f"using {manifest}'s"]
