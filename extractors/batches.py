"""Running an extractor over image files in order: DataLoader workers decode, the network runs in this process.

Shared by the extraction stage (:mod:`retr.pipeline.extract`, which writes the outputs into shards) and by search
(:mod:`retr.trainers.search.index`, which encodes a gallery): an image that cannot be used is reported as a
failure ``(position, one-line reason)`` and the others go on.
"""
from __future__ import annotations

import multiprocessing as mp
from dataclasses import dataclass
from typing import Any, Callable, Iterator, Sequence

import numpy as np
import torch
from torch.utils.data import DataLoader, Dataset

from retr.common.prefetch import DevicePrefetcher
from retr.extractors.base import Extractor, ImageError


class ImageFiles(Dataset):
    """Rows of one shard for a DataLoader: item ``i`` → ``(i, sample or None, error reason or None)``.

    ``refused``: positions not to open at all, with the reason recorded instead (paths outside the image root).
    """

    def __init__(self, paths: Sequence[str], preprocess: Callable[[str], Any],
                 refused: dict[int, str] | None = None):
        self.paths = list(paths)
        self.preprocess = preprocess
        self.refused = dict(refused or {})

    def __len__(self) -> int:
        return len(self.paths)

    def __getitem__(self, i: int) -> tuple[int, Any, str | None]:
        if i in self.refused:
            return i, None, self.refused[i]
        try:
            return i, self.preprocess(self.paths[i]), None
        except ImageError as exc:
            return i, None, str(exc) or "unusable image"


@dataclass
class Batch:
    """A collated batch: positions (within the shard) of usable images, their batch, and the failed ones."""

    positions: list[int]
    samples: Any
    failures: list[tuple[int, str]]

    def pin_memory(self) -> "Batch":
        """Called by the DataLoader with ``pin_memory=True`` (CUDA): page-locks the sample tensor (or the
        samples' own ``pin_memory``, e.g. an :class:`~retr.extractors.device_decode.EncodedBatch`)."""
        if self.samples is not None and hasattr(self.samples, "pin_memory"):
            self.samples = self.samples.pin_memory()
        return self


class BatchCollator:
    """DataLoader ``collate_fn``: splits failed images off and batches the rest with ``extractor.collate``."""

    def __init__(self, collate: Callable[[list[Any]], Any]):
        self.collate = collate

    def __call__(self, items: list[tuple[int, Any, str | None]]) -> Batch:
        good = [(i, sample) for i, sample, reason in items if reason is None]
        failures = [(i, reason) for i, _sample, reason in items if reason is not None]
        samples = self.collate([s for _, s in good]) if good else None
        return Batch([i for i, _ in good], samples, failures)



def _worker_context() -> mp.context.BaseContext:
    """``fork`` where the platform has it: workers start in milliseconds and receive nothing by pickling (a
    ``spawn``ed worker re-imports torch, seconds per worker per shard). Workers only decode images; they never
    touch CUDA, so forking after CUDA initialisation is safe here. Elsewhere the platform default."""
    return mp.get_context("fork") if "fork" in mp.get_all_start_methods() else mp.get_context()



@dataclass
class ExtractedBatch:
    """One batch through the network: ``positions`` (in the path list) of ``out``'s rows, and the failures."""

    positions: list[int]
    out: dict[str, np.ndarray] | None
    failures: list[tuple[int, str]]


def extracted_batches(extractor: Extractor, paths: Sequence[str], *, batch_size: int, workers: int,
                      refused: dict[int, str] | None = None) -> Iterator[ExtractedBatch]:
    """Run ``extractor`` over ``paths`` in order: DataLoader workers (``extractor.preprocessor()``), pinned
    batches on CUDA, ``extractor.to_device`` one batch ahead (:class:`DevicePrefetcher`), ``extract``.

    ``refused``: positions not to open, with the reason reported as their failure. Yields one
    :class:`ExtractedBatch` per loader batch; failures from the workers come before those found on the device.
    """
    device = torch.device(getattr(extractor, "device", "cpu"))
    loader = DataLoader(ImageFiles(paths, extractor.preprocessor(), refused), batch_size=batch_size, shuffle=False,
                        num_workers=workers, collate_fn=BatchCollator(extractor.collator()),
                        pin_memory=device.type == "cuda",
                        prefetch_factor=2 if workers > 0 else None,
                        multiprocessing_context=_worker_context() if workers > 0 else None)

    def move(batch: Batch) -> tuple[Batch, Any, list[tuple[int, str]]]:
        if not batch.positions:
            return batch, None, []
        samples, dropped = extractor.to_device(batch.samples)
        return batch, samples, dropped

    for batch, samples, dropped in DevicePrefetcher(loader, move, device):
        failures = list(batch.failures) + [(batch.positions[row], reason) for row, reason in dropped]
        gone = {row for row, _reason in dropped}
        positions = [p for row, p in enumerate(batch.positions) if row not in gone]
        out = extractor.extract(samples) if positions else None
        yield ExtractedBatch(positions, out, failures)


def extract_paths(extractor: Extractor, paths: Sequence[str], *, batch_size: int = 8,
                  workers: int = 2) -> tuple[dict[str, np.ndarray], list[tuple[int, str]]]:
    """Every output of ``extractor`` over ``paths``, in memory (no shard file): what ``bench/gpu.py`` times.

    Returns ``(outputs, failures)``: ``outputs["features"]`` ``[N', K, D]`` (and each extra) for the ``N'``
    usable paths in order; ``failures`` ``[(position in paths, one-line reason)]``. The decode path and
    precision are the extractor's own (``build_extractor(name, decode=..., autocast=..., half=...)``).
    """
    names = ["features", *extractor.extras]
    parts: dict[str, list[np.ndarray]] = {name: [] for name in names}
    failures: list[tuple[int, str]] = []
    for done in extracted_batches(extractor, paths, batch_size=batch_size, workers=workers):
        failures.extend(done.failures)
        if done.out is not None:
            for name in names:
                parts[name].append(done.out[name])
    K, D = extractor.feature_shape
    empty = {"features": np.zeros((0, K, D), np.float32),
             **{name: np.zeros((0, *shape), dtype) for name, (shape, dtype) in extractor.extras.items()}}
    outputs = {name: np.concatenate(parts[name]) if parts[name] else empty[name] for name in names}
    return outputs, sorted(failures)
