"""Importers of region features users already have (SCAN's ``.npy``, bottom-up TSV, MILVLG ``.npz``) into
``regions`` feature sets.

Split mapping, ids, placeholders and box counts: docs/extraction.md ("Importing features made elsewhere"). MILVLG's
pickled ``info`` is read with an unpickler that accepts only arrays and plain values."""
from __future__ import annotations

import base64
import io
import zipfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterator, Sequence
import pickle

import numpy as np

from retr.common.errors import UserError
from retr.manifests.schema import ManifestRecord, manifest_sha256, write_manifest
from retr.store.features import (REGION_DATASETS, REGION_IMAGE_DATASETS, ClosesOrAborts, NonFiniteError,
                                 ShardWriter)

FEATURE_DIM = 2048
#: Images read from a SCAN ``{split}_ims.npy`` at a time (one block: 64 × 36 × 2048 float32 = 19 MB).
SCAN_BLOCK_IMAGES = 64
CAPTIONS_PER_IMAGE = 5
#: SCAN split file name → manifest split
SCAN_SPLITS = {"train": "train", "dev": "val", "test": "test", "testall": "test"}
BACKBONE = "resnet101-c4-caffe (bottom-up-attention Faster R-CNN, Visual Genome)"
TSV_FIELDS = {
    6: ("image_id", "image_w", "image_h", "num_boxes", "boxes", "features"),
    10: ("img_id", "img_h", "img_w", "objects_id", "objects_conf", "attrs_id", "attrs_conf", "num_boxes",
         "boxes", "features"),
}

Progress = Callable[..., Any]


def _no_progress(iterable=None, **_kwargs):
    return iterable


@dataclass
class ImportSummary:
    """What an importer wrote."""

    features: Path
    rows: int
    max_boxes: int
    manifest: Path | None = None
    splits: dict[str, int] = field(default_factory=dict)


@dataclass
class RegionRow:
    """One image's regions as read from a file (``n`` boxes)."""

    image_id: str
    features: np.ndarray                 # [n, 2048] float32
    boxes: np.ndarray | None = None      # [n, 4] float32
    image_hw: tuple[int, int] = (0, 0)
    object_ids: np.ndarray | None = None
    object_conf: np.ndarray | None = None
    attr_ids: np.ndarray | None = None
    attr_conf: np.ndarray | None = None
    source: str = ""                     # where it was read, for errors: "x.tsv line 3", "train_ims.npy row 5"


#: What to do about non-finite input values: no dtype stores them, so the advice is never "use float32".
NON_FINITE_ADVICE = ("retr stores no NaN or infinite values in any dtype (--dtype float32 would not help): that "
                     "row of the input is damaged; re-export it, or leave the image out of the input")


def region_extras(k: int) -> dict[str, tuple[tuple[int, ...], str]]:
    """The per-row datasets of a ``regions`` set with ``k`` boxes."""
    extras = {name: ((k, *shape), dtype) for name, (shape, dtype) in REGION_DATASETS.items()}
    extras.update({name: (shape, dtype) for name, (shape, dtype) in REGION_IMAGE_DATASETS.items()})
    return extras


def import_attrs(source: str, weights: str, **extra: Any) -> dict[str, Any]:
    attrs = {"kind": "regions", "extractor": "butd-regions", "backbone": BACKBONE, "weights": weights,
             "image_size": "short side 600, long side <= 1000 (as released)", "source": source,
             "manifest_sha256": "unknown (imported without a manifest)"}
    attrs.update(extra)
    return attrs


class RegionSetWriter(ClosesOrAborts):
    """Buffers :class:`RegionRow` s into ``[B, K, …]`` blocks and appends them to a :class:`ShardWriter`."""

    def __init__(self, path: Path, attrs: dict[str, Any], k: int, dtype: str, block: int = 64):
        self.k, self.block, self.rows = k, block, 0
        self._pending: list[RegionRow] = []
        self.writer = ShardWriter(path, attrs, (k, FEATURE_DIM), dtype=dtype, extras=region_extras(k))

    def add(self, row: RegionRow) -> None:
        n = len(row.features)
        if row.features.ndim != 2 or row.features.shape[1] != FEATURE_DIM:
            raise UserError(f"{row.image_id}: features have shape {row.features.shape}, expected [n, {FEATURE_DIM}]")
        for name in ("features", "boxes", "object_conf", "attr_conf"):
            value = getattr(row, name)
            if value is not None and np.asarray(value).dtype.kind == "f" and not np.isfinite(value).all():
                where = f"{row.source}: " if row.source else ""
                raise UserError(f"{where}{name} of id {row.image_id!r} hold NaN or infinite values; "
                                f"{NON_FINITE_ADVICE}")
        if n > self.k:
            raise UserError(f"{row.image_id}: {n} boxes, more than the {self.k} this feature set holds "
                            f"(give --max-boxes {n} or more)")
        self._pending.append(row)
        if len(self._pending) >= self.block:
            self.flush()

    def flush(self) -> None:
        if not self._pending:
            return
        b, k = len(self._pending), self.k
        out = {"boxes": np.zeros((b, k, 4), np.float32), "object_ids": np.full((b, k), -1, np.int32),
               "object_conf": np.zeros((b, k), np.float32), "attr_ids": np.full((b, k), -1, np.int32),
               "attr_conf": np.zeros((b, k), np.float32), "num_boxes": np.zeros(b, np.int32),
               "image_hw": np.zeros((b, 2), np.int32)}
        features = np.zeros((b, k, FEATURE_DIM), np.float32)
        for i, row in enumerate(self._pending):
            n = len(row.features)
            features[i, :n] = row.features
            out["num_boxes"][i] = n
            out["image_hw"][i] = row.image_hw
            for name in ("boxes", "object_ids", "object_conf", "attr_ids", "attr_conf"):
                value = getattr(row, name)
                if value is not None:
                    value = np.asarray(value)
                    if len(value) != n:
                        raise UserError(f"{row.image_id}: {name} has {len(value)} rows for {n} boxes")
                    out[name][i, :n] = value
        try:
            self.writer.append([row.image_id for row in self._pending], features, **out)
        except NonFiniteError as exc:
            raise UserError(f"{exc}; {NON_FINITE_ADVICE}") from None
        except ValueError as exc:  # duplicate id, or values beyond float16
            raise UserError(str(exc)) from None
        self.rows += b
        self._pending = []

    def close(self) -> Path:
        self.flush()
        return self.writer.close()

    def abort(self) -> None:
        self.writer.abort()


def _check_out(out: Path, name: str) -> Path:
    out.mkdir(parents=True, exist_ok=True)
    return out / name


# -- SCAN -------------------------------------------------------------------------------------------------
class NpyRows:
    """The rows of a ``.npy`` array ``[N, K, D]``, read a block at a time with plain file reads (not a memory map,
    whose pages stay resident: docs/extraction.md, "Importing SCAN's files: memory"); Fortran-order files use the map.

    Attributes: ``shape`` ``(N, K, D)``, ``dtype`` (the file's).
    """

    def __init__(self, path: Path, mapped: np.ndarray):
        self.path = path
        self.shape, self.dtype = tuple(mapped.shape), mapped.dtype
        self._offset = int(getattr(mapped, "offset", 0))
        self._row_bytes = int(np.prod(self.shape[1:])) * self.dtype.itemsize
        self._mapped = mapped if not mapped.flags.c_contiguous else None  # kept only for Fortran order

    def read(self, start: int, stop: int, step: int = 1) -> np.ndarray:
        """Rows ``start:stop:step`` as a new ``[B, K, D]`` float32 array."""
        rows = range(start, min(stop, self.shape[0]), step)
        if self._mapped is not None:
            return np.array(self._mapped[start:stop:step], dtype=np.float32)
        out = np.empty((len(rows), *self.shape[1:]), dtype=self.dtype)
        with open(self.path, "rb") as handle:
            if step == 1:
                self._read_into(handle, start, out)
            else:
                for i, row in enumerate(rows):
                    self._read_into(handle, row, out[i:i + 1])
        return out.astype(np.float32, copy=False)

    def _read_into(self, handle, row: int, out: np.ndarray) -> None:
        handle.seek(self._offset + row * self._row_bytes)
        got = handle.readinto(memoryview(out).cast("B"))
        if got != out.nbytes:
            raise UserError(f"{self.path} ends inside row {row + got // max(1, self._row_bytes)} (the header says "
                            f"{self.shape[0]} rows); the file is cut short — download it again")


@dataclass
class ScanSplit:
    """One SCAN split's files and what they hold."""

    name: str
    features: NpyRows            # [rows, 36, 2048], read in blocks
    captions: list[str]
    ids: list[str]
    rows_per_image: int          # 1, or 5 when the file repeats each image once per caption
    ims_path: Path | None = None


def _read_lines(path: Path) -> list[str]:
    """The lines of a UTF-8 text file (a non-UTF-8 line is one error naming the file and line)."""
    raw = path.read_bytes()
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        line_no = raw.count(b"\n", 0, exc.start) + 1
        raise UserError(f"{path} line {line_no}: not UTF-8 text (byte 0x{raw[exc.start]:02x}); re-encode the file "
                        f"as UTF-8 (e.g. iconv -f latin1 -t utf-8)") from None
    lines = text.split("\n")
    if lines and lines[-1] == "":
        lines.pop()
    return [line.rstrip("\r") for line in lines]


def read_scan_split(data_dir: Path, split: str, id_prefix: str = "") -> ScanSplit:
    """Open ``{split}_ims.npy`` (memory-mapped), ``{split}_caps.txt`` and, if present, ``{split}_ids.txt``."""
    ims_path, caps_path = data_dir / f"{split}_ims.npy", data_dir / f"{split}_caps.txt"
    for path in (ims_path, caps_path):
        if not path.is_file():
            raise UserError(f"{path} does not exist (SCAN data folders hold {{split}}_ims.npy and {{split}}_caps.txt)")
    try:
        mapped = np.load(ims_path, mmap_mode="r", allow_pickle=False)  # reads the header only
    except (ValueError, OSError, EOFError) as exc:
        raise UserError(f"{ims_path} is not a plain .npy array ({str(exc).splitlines()[0]})") from None
    if not isinstance(mapped, np.ndarray) or mapped.ndim != 3 or mapped.shape[2] != FEATURE_DIM:
        raise UserError(f"{ims_path} has shape {getattr(mapped, 'shape', '?')}, expected [N, K, {FEATURE_DIM}]")
    if mapped.dtype.kind not in "fiu":
        raise UserError(f"{ims_path} holds {mapped.dtype} values, expected float32")
    features = NpyRows(ims_path, mapped)
    captions = _read_lines(caps_path)
    for line_no, caption in enumerate(captions, start=1):
        if not caption.strip():
            raise UserError(f"{caps_path} line {line_no} is empty")
    if len(captions) % CAPTIONS_PER_IMAGE:
        raise UserError(f"{caps_path} has {len(captions)} lines, not a multiple of {CAPTIONS_PER_IMAGE}")
    num_images = len(captions) // CAPTIONS_PER_IMAGE
    rows = features.shape[0]
    if rows == num_images:
        rows_per_image = 1
    elif rows == len(captions):
        rows_per_image = CAPTIONS_PER_IMAGE   # VSE-style files repeat each image once per caption
    else:
        raise UserError(f"{ims_path} has {rows} rows but {caps_path} describes {num_images} images "
                        f"({len(captions)} captions)")
    ids_path = data_dir / f"{split}_ids.txt"
    if ids_path.is_file():
        raw_ids = [line.strip() for line in _read_lines(ids_path)]
        if len(raw_ids) == len(captions) and len(raw_ids) != num_images:
            # one id per caption (the released COCO files: 25,000 lines for 5,000 images), 5 in a row per image
            grouped = [raw_ids[i:i + CAPTIONS_PER_IMAGE] for i in range(0, len(raw_ids), CAPTIONS_PER_IMAGE)]
            bad = next((n for n, g in enumerate(grouped) if len(set(g)) != 1), None)
            if bad is not None:
                raise UserError(f"{ids_path} has one id per caption, but lines {bad * CAPTIONS_PER_IMAGE + 1}-"
                                f"{bad * CAPTIONS_PER_IMAGE + CAPTIONS_PER_IMAGE} name different images "
                                f"({', '.join(sorted(set(grouped[bad])))})")
            raw_ids = raw_ids[::CAPTIONS_PER_IMAGE]
        if len(raw_ids) != num_images:
            raise UserError(f"{ids_path} has {len(raw_ids)} ids for {num_images} images")
        ids = [f"{id_prefix}{i}" for i in raw_ids]
    else:
        ids = [f"{id_prefix}{split}_{row}" for row in range(num_images)]
    return ScanSplit(split, features, captions, ids, rows_per_image, ims_path)


def default_scan_splits(data_dir: Path) -> list[str]:
    """The SCAN splits found in ``data_dir``; ``testall`` replaces ``test`` when both exist (COCO)."""
    found = [s for s in SCAN_SPLITS if (data_dir / f"{s}_ims.npy").is_file()]
    if "testall" in found and "test" in found:
        found.remove("test")
    return found


def import_scan(data_dir: str | Path, out: str | Path, splits: Sequence[str] | None = None,
                dtype: str = "float16", id_prefix: str = "", progress: Progress = _no_progress) -> ImportSummary:
    """SCAN ``{split}_ims.npy`` + ``{split}_caps.txt`` → ``out/manifest.jsonl`` + ``out/regions.h5``, streamed
    :data:`SCAN_BLOCK_IMAGES` images at a time."""
    data_dir, out = Path(data_dir), Path(out)
    if not data_dir.is_dir():
        raise UserError(f"SCAN data folder {data_dir} does not exist")
    chosen = list(splits) if splits else default_scan_splits(data_dir)
    if not chosen:
        raise UserError(f"no SCAN splits in {data_dir} (expected files like train_ims.npy and train_caps.txt)")
    unknown = [s for s in chosen if s not in SCAN_SPLITS]
    if unknown:
        raise UserError(f"unknown SCAN split {unknown[0]!r} (expected {', '.join(SCAN_SPLITS)})")
    if "test" in chosen and "testall" in chosen:
        raise UserError("splits test and testall overlap (COCO's test is the first 1,000 images of testall); "
                        "import one of them")
    opened = [read_scan_split(data_dir, s, id_prefix) for s in chosen]
    k = max(s.features.shape[1] for s in opened)
    records, seen = [], {}
    for split in opened:
        for row, image_id in enumerate(split.ids):
            if image_id in seen:
                raise UserError(f"id {image_id!r} occurs in {seen[image_id]} and {split.name}; give distinct ids")
            seen[image_id] = split.name
            caps = split.captions[row * CAPTIONS_PER_IMAGE:(row + 1) * CAPTIONS_PER_IMAGE]
            records.append(ManifestRecord(image_id, f"precomputed/{split.name}/{row}", SCAN_SPLITS[split.name],
                                          tuple(c.strip() for c in caps), {"source": "scan-precomp"}))
    manifest_path = _check_out(out, "manifest.jsonl")
    write_manifest(manifest_path, records)
    attrs = import_attrs("scan-precomp", "SCAN precomputed bottom-up-attention features (36 boxes)",
                         manifest_sha256=manifest_sha256(manifest_path),
                         placeholder_datasets=["boxes", "image_hw", "object_ids", "object_conf", "attr_ids",
                                               "attr_conf"],
                         scan_splits={s.name: SCAN_SPLITS[s.name] for s in opened})
    counts: dict[str, int] = {}
    total = sum(len(s.ids) for s in opened)
    path = _check_out(out, "regions.h5")
    with RegionSetWriter(path, attrs, k, dtype) as writer:
        bar = progress(total=total, desc="import-scan", unit="img")
        for split in opened:
            step = split.rows_per_image
            name = split.ims_path.name if split.ims_path is not None else f"{split.name}_ims.npy"
            for start in range(0, len(split.ids), SCAN_BLOCK_IMAGES):
                stop = min(start + SCAN_BLOCK_IMAGES, len(split.ids))
                block = split.features.read(start * step, stop * step, step)   # [stop - start, K, 2048]
                for offset, image_id in enumerate(split.ids[start:stop]):
                    row = (start + offset) * step
                    writer.add(RegionRow(image_id, block[offset], source=f"{name} row {row}"))
                if bar is not None:
                    bar.update(stop - start)
            counts[SCAN_SPLITS[split.name]] = counts.get(SCAN_SPLITS[split.name], 0) + len(split.ids)
        if bar is not None:
            bar.close()
    return ImportSummary(path, total, k, manifest_path, counts)


# -- TSV ----------------------------------------------------------------------------------------------------
def _b64_array(text: str, dtype: str, shape: tuple[int, ...], what: str) -> np.ndarray:
    try:
        raw = base64.b64decode(text, validate=True)
    except (ValueError, base64.binascii.Error):
        raise UserError(f"{what} is not valid base64") from None
    array = np.frombuffer(raw, dtype=np.dtype(dtype).newbyteorder("<"))
    if shape[-1] == -1:
        if shape[0] == 0:
            return array.reshape(0, FEATURE_DIM).astype(dtype)
        shape = (shape[0], array.size // max(shape[0], 1))
    if array.size != int(np.prod(shape)):
        raise UserError(f"{what} holds {array.size} values, expected {int(np.prod(shape))} for shape {shape}")
    return array.reshape(shape).astype(dtype)


def parse_tsv_line(line: str, where: str, id_prefix: str = "") -> RegionRow:
    """One TSV line (6 or 10 fields) → :class:`RegionRow`."""
    fields = line.rstrip("\r\n").split("\t")
    names = TSV_FIELDS.get(len(fields))
    if names is None:
        raise UserError(f"{where}: {len(fields)} tab-separated fields; expected 6 (bottom-up TSV) or 10 (LXMERT)")
    values = dict(zip(names, fields))
    try:
        n = int(values["num_boxes"])
        if len(fields) == 6:
            hw = (int(values["image_h"]), int(values["image_w"]))
        else:
            hw = (int(values["img_h"]), int(values["img_w"]))
    except ValueError:
        raise UserError(f"{where}: num_boxes, image width and height must be integers") from None
    image_id = id_prefix + values.get("image_id", values.get("img_id", "")).strip()
    if not image_id:
        raise UserError(f"{where}: empty image id")
    row = RegionRow(image_id, _b64_array(values["features"], "float32", (n, -1), f"{where}: features"),
                    _b64_array(values["boxes"], "float32", (n, 4), f"{where}: boxes"), hw, source=where)
    if len(fields) == 10:
        row.object_ids = _b64_array(values["objects_id"], "int64", (n,), f"{where}: objects_id").astype(np.int32)
        row.object_conf = _b64_array(values["objects_conf"], "float32", (n,), f"{where}: objects_conf")
        row.attr_ids = _b64_array(values["attrs_id"], "int64", (n,), f"{where}: attrs_id").astype(np.int32)
        row.attr_conf = _b64_array(values["attrs_conf"], "float32", (n,), f"{where}: attrs_conf")
    return row


def _tsv_lines(path: Path) -> Iterator[tuple[int, str]]:
    with open(path, encoding="ascii", errors="strict", newline="") as handle:
        try:
            for line_no, line in enumerate(handle, start=1):
                if line.strip():
                    yield line_no, line
        except UnicodeDecodeError:
            raise UserError(f"{path} is not a text TSV file") from None


def import_tsv(tsv: str | Path, out: str | Path, dtype: str = "float16", max_boxes: int | None = None,
               id_prefix: str = "", name: str = "regions", progress: Progress = _no_progress) -> ImportSummary:
    """A bottom-up-attention TSV (6- or 10-field) → ``out/<name>.h5``."""
    tsv = Path(tsv)
    if not tsv.is_file():
        raise UserError(f"TSV file {tsv} does not exist")
    # first pass: count rows and the largest box count (cheap: only the leading fields are parsed)
    count, largest, width = 0, 0, None
    for line_no, line in _tsv_lines(tsv):
        fields = line.split("\t", 8)
        width = width or len(line.split("\t"))
        index = 3 if width == 6 else 7
        try:
            largest = max(largest, int(fields[index]))
        except (ValueError, IndexError):
            raise UserError(f"{tsv} line {line_no}: cannot read num_boxes (is this a bottom-up TSV?)") from None
        count += 1
    if count == 0:
        raise UserError(f"{tsv} has no rows")
    k = _choose_k(largest, max_boxes)
    layout = "bottom-up 6-field" if width == 6 else "LXMERT 10-field"
    attrs = import_attrs(f"tsv ({layout})", f"bottom-up-attention TSV {tsv.name}", source_file=tsv.name)
    if width == 6:
        attrs["placeholder_datasets"] = ["object_ids", "object_conf", "attr_ids", "attr_conf"]
    path = _check_out(Path(out), f"{name}.h5")
    with RegionSetWriter(path, attrs, k, dtype) as writer:
        for line_no, line in progress(_tsv_lines(tsv), total=count, desc="import-tsv", unit="img"):
            writer.add(parse_tsv_line(line, f"{tsv} line {line_no}", id_prefix))
    return ImportSummary(path, count, k)


def _choose_k(largest: int, max_boxes: int | None) -> int:
    if max_boxes is None:
        return max(largest, 1)
    if max_boxes < largest:
        raise UserError(f"an image has {largest} boxes, more than --max-boxes {max_boxes}")
    return max_boxes


# -- MILVLG npz ----------------------------------------------------------------------------------------------
def _read_npy_member(archive: zipfile.ZipFile, member: str, where: str) -> np.ndarray:
    """An array from an ``.npz`` member; object arrays go through the arrays-only unpickler."""
    from retr.extractors.butd.checkpoint import _ArrayUnpickler  # cost: torchvision (retr-pipeline --help loads none)
    with archive.open(member) as handle:
        data = io.BytesIO(handle.read())
    version = np.lib.format.read_magic(data)
    read_header = (np.lib.format.read_array_header_1_0 if version == (1, 0)
                   else np.lib.format.read_array_header_2_0)
    _shape, _fortran, dtype = read_header(data)
    if dtype.hasobject:
        try:
            return _ArrayUnpickler(data, encoding="latin1").load()
        except pickle.UnpicklingError as exc:
            raise UserError(f"{where}: {member} holds Python objects beyond arrays ({exc})") from None
    data.seek(0)
    return np.lib.format.read_array(data, allow_pickle=False)


def read_milvlg_npz(path: Path, id_prefix: str = "") -> RegionRow:
    """One MILVLG ``.npz`` → :class:`RegionRow` (the id is the file stem)."""
    try:
        with zipfile.ZipFile(path) as archive:
            members = {name[:-4]: name for name in archive.namelist() if name.endswith(".npy")}
            missing = [m for m in ("x", "bbox", "image_h", "image_w") if m not in members]
            if missing:
                raise UserError(f"{path}: no {', '.join(missing)} (is this a MILVLG feature file?)")
            arrays = {key: _read_npy_member(archive, member, str(path)) for key, member in members.items()}
    except zipfile.BadZipFile:
        raise UserError(f"{path} is not an .npz file") from None
    features = np.asarray(arrays["x"], dtype=np.float32)
    n = len(features)
    if "num_bbox" in arrays and int(arrays["num_bbox"]) != n:
        raise UserError(f"{path}: num_bbox is {int(arrays['num_bbox'])} but x has {n} rows")
    row = RegionRow(id_prefix + path.stem, features, np.asarray(arrays["bbox"], np.float32).reshape(n, 4),
                    (int(arrays["image_h"]), int(arrays["image_w"])), source=str(path))
    info = arrays.get("info")
    if info is not None:
        info = info.item() if isinstance(info, np.ndarray) and info.dtype.hasobject and info.ndim == 0 else info
        if not isinstance(info, dict):
            raise UserError(f"{path}: info is not a dict")
        row.object_ids = np.asarray(info.get("objects_id"), np.int32) if "objects_id" in info else None
        row.object_conf = np.asarray(info.get("objects_conf"), np.float32) if "objects_conf" in info else None
        row.attr_ids = np.asarray(info.get("attrs_id"), np.int32) if "attrs_id" in info else None
        row.attr_conf = np.asarray(info.get("attrs_conf"), np.float32) if "attrs_conf" in info else None
    return row


def import_npz(folder: str | Path, out: str | Path, dtype: str = "float16", max_boxes: int | None = None,
               id_prefix: str = "", name: str = "regions", progress: Progress = _no_progress) -> ImportSummary:
    """A folder of MILVLG per-image ``.npz`` files (sorted by name) → ``out/<name>.h5``."""
    folder = Path(folder)
    if not folder.is_dir():
        raise UserError(f"npz folder {folder} does not exist")
    files = sorted(folder.glob("*.npz"))
    if not files:
        raise UserError(f"no .npz files in {folder}")
    largest = 0
    for path in files:   # first pass: box counts (reads only the small num_bbox/x headers)
        try:
            with np.load(path, allow_pickle=False) as data:
                largest = max(largest, int(data["x"].shape[0]))
        except (ValueError, OSError, KeyError, zipfile.BadZipFile) as exc:
            raise UserError(f"{path}: cannot read x ({type(exc).__name__}: {exc})") from None
    k = _choose_k(largest, max_boxes)
    attrs = import_attrs("milvlg-npz", f"MILVLG bottom-up-attention features from {folder.name}/")
    path = _check_out(Path(out), f"{name}.h5")
    with RegionSetWriter(path, attrs, k, dtype) as writer:
        for npz in progress(files, total=len(files), desc="import-npz", unit="img"):
            writer.add(read_milvlg_npz(npz, id_prefix))
    return ImportSummary(path, len(files), k)
