"""A feature set's rows read straight from its files: each row's byte offset found once, then positional reads.

HDF5 stores an uncompressed, unfiltered dataset's elements as they are in memory, in C order, inside its chunks (or
in one contiguous block). When a chunk spans whole rows (chunk shape ``(n, …)`` with ``…`` the dataset's row shape),
row ``r`` is ``row_bytes`` bytes at a fixed file offset: its chunk's address plus ``(r mod n) · row_bytes``. So
:func:`row_layout` asks HDF5 once, at open, where every chunk is (``DatasetID.chunk_iter``; ``get_offset`` for a
contiguous dataset) — through an index file's virtual datasets to the shard files they map — and :class:`RowReader`
then reads a batch with plain positional reads (``os.preadv``) straight into the output array, rows sorted by
file and offset, neighbours on disk merged into one read, without HDF5's per-selection and per-chunk work
(a random batch of 128 rows was 128 ``read_direct`` calls through the chunk cache and the virtual-dataset layer).
A batch's reads are first announced to the kernel (``posix_fadvise(WILLNEED)``), so that rows not in the page cache
are fetched from the disk together rather than one after another: twice the rate from a cold cache, a few per cent
slower from a warm one (measured: docs/benchmarks.md, "Reading features").

Why ``preadv`` and not a memory map: a mapped file's pages count in the process's resident set once touched, so a
map of a 4 GiB set read at random for an epoch grows the trainer's RSS to 4 GiB (what ``top``, a batch
scheduler's memory limit and the benchmark's peak RSS see), and each first touch of a 4 KiB page is a page fault
(36 of them for one 147 KB row of 36 × 2048 float16). A positional read copies from the page cache into the batch
and leaves RSS at the batch; it needs no address space for a large set, is safe in any process (an ``fd`` opened
lazily per process, like the h5py handle), and a file shortened under the reader is an error here, not a
``SIGBUS``. The cost is one copy, which the gather from a map would make anyway.

Anything that cannot be shown to hold the bytes h5py returns is left to h5py (:func:`row_layout` says why): a
filter (compression, shuffle, checksum), a chunk that cuts a row, a chunk not yet written, a byte order or type
other than the native one h5py reads, external or compact storage, a user block, a virtual mapping that is not
whole rows of a whole-row source, a source file that is missing. Every layout is also checked once against h5py on
the first and last row of each file it reads."""
from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

import h5py
import numpy as np

from retr.common.errors import UserError

#: the most buffers one ``preadv`` takes (``IOV_MAX``; POSIX guarantees 16, Linux and the BSDs take 1024)
_IOV_MAX = max(16, os.sysconf("SC_IOV_MAX")) if "SC_IOV_MAX" in getattr(os, "sysconf_names", {}) else 16


@dataclass(frozen=True)
class RowLayout:
    """Where each row of one dataset lies: ``files`` (absolute paths), ``file_of_row`` ``[N]`` int32 (index into
    ``files``), ``offset_of_row`` ``[N]`` int64 (byte offset in that file); every row is ``row_bytes`` bytes of
    ``dtype`` in C order, shaped ``row_shape``. ``stamps``: each file's (device, inode, size, modification time)
    when the offsets were found: a file replaced or rewritten since is refused, not read at stale offsets."""

    files: tuple[str, ...]
    file_of_row: np.ndarray
    offset_of_row: np.ndarray
    row_shape: tuple[int, ...]
    dtype: np.dtype
    stamps: tuple[tuple[int, int, int, int], ...] = ()

    @property
    def row_bytes(self) -> int:
        return int(np.prod(self.row_shape, dtype=np.int64)) * self.dtype.itemsize


class NotReadableDirectly(Exception):
    """Why a dataset's rows cannot be read at fixed offsets (the reader uses h5py for it)."""


def row_layout(dataset: h5py.Dataset, file_path: str | os.PathLike) -> tuple[RowLayout | None, str]:
    """The row layout of ``dataset`` (of the file at ``file_path``), or ``None`` and why h5py must read it."""
    if not hasattr(os, "preadv"):
        return None, "this platform has no preadv"
    try:
        layout = _layout(dataset, Path(file_path).resolve())
        _check_against_h5py(dataset, layout)
    except NotReadableDirectly as reason:
        return None, str(reason)
    files = len(layout.files)
    return layout, f"uncompressed rows at known offsets in {files} file{'s' if files != 1 else ''}"


def _layout(dataset: h5py.Dataset, path: Path) -> RowLayout:
    if dataset.ndim < 1:
        raise NotReadableDirectly(f"{dataset.name} has no rows")
    dtype = _plain_dtype(dataset)
    rows, row_shape = int(dataset.shape[0]), tuple(int(n) for n in dataset.shape[1:])
    plist = dataset.id.get_create_plist()
    if plist.get_layout() == h5py.h5d.VIRTUAL:
        return _virtual_layout(dataset, path, dtype, rows, row_shape)
    offsets = _stored_offsets(dataset, path, dtype)
    return RowLayout((str(path),), np.zeros(rows, dtype=np.int32), offsets, row_shape, dtype, (_stamp(path),))


def _plain_dtype(dataset: h5py.Dataset) -> np.dtype:
    """The dataset's numpy dtype when its file type is a plain number in this machine's byte order, exactly the type
    h5py reads it as (so its bytes need no conversion)."""
    dtype = dataset.dtype
    if dtype.kind not in "fiub" or not dtype.isnative or dtype.fields is not None or dtype.subdtype is not None:
        raise NotReadableDirectly(f"{dataset.name} holds {dtype}, not numbers in this machine's byte order")
    if not dataset.id.get_type().equal(h5py.h5t.py_create(dtype)):
        raise NotReadableDirectly(f"{dataset.name} is stored as another type than the {dtype} it reads as")
    return dtype


def _stored_offsets(dataset: h5py.Dataset, path: Path, dtype: np.dtype) -> np.ndarray:
    """``[N]`` int64 byte offsets of the rows of a chunked or contiguous dataset stored in ``path`` itself."""
    name = dataset.name
    plist = dataset.id.get_create_plist()
    if plist.get_nfilters():
        filters = ", ".join(_filter_name(plist, i) for i in range(plist.get_nfilters()))
        raise NotReadableDirectly(f"{name} is filtered ({filters})")
    if plist.get_external_count():
        raise NotReadableDirectly(f"{name} is stored in external files")
    if dataset.file.id.get_create_plist().get_userblock():
        raise NotReadableDirectly(f"{path.name} starts with a user block")
    rows = int(dataset.shape[0])
    row_bytes = int(np.prod(dataset.shape[1:], dtype=np.int64)) * dtype.itemsize
    layout = plist.get_layout()
    if layout == h5py.h5d.CONTIGUOUS:
        start = dataset.id.get_offset()
        if start is None or (rows and dataset.id.get_storage_size() < rows * row_bytes):
            raise NotReadableDirectly(f"{name} is not written yet")
        return start + np.arange(rows, dtype=np.int64) * row_bytes
    if layout != h5py.h5d.CHUNKED:
        raise NotReadableDirectly(f"{name} is stored compact, not in chunks or one block")
    chunks = dataset.chunks
    if tuple(chunks[1:]) != tuple(dataset.shape[1:]):
        raise NotReadableDirectly(f"{name}'s chunks {chunks} cut its rows {tuple(dataset.shape[1:])}")
    per_chunk = int(chunks[0])
    chunk_bytes = per_chunk * row_bytes
    count = -(-rows // per_chunk)
    starts = np.full(count, -1, dtype=np.int64)
    sizes = np.zeros(count, dtype=np.int64)

    def note(info) -> None:
        index = info.chunk_offset[0] // per_chunk
        if index < count:
            starts[index], sizes[index] = info.byte_offset, info.size

    if hasattr(dataset.id, "chunk_iter"):              # HDF5 ≥ 1.14: one pass over the chunk index
        dataset.id.chunk_iter(note)
    else:
        for index in range(count):
            info = dataset.id.get_chunk_info_by_coord((index * per_chunk,) + (0,) * (dataset.ndim - 1))
            if info.byte_offset is not None:
                note(info)
    if (starts < 0).any():
        raise NotReadableDirectly(f"{name} has chunks that are not written (they read as the fill value)")
    if (sizes != chunk_bytes).any():
        raise NotReadableDirectly(f"{name} has chunks of another size than {chunk_bytes} bytes")
    row = np.arange(rows, dtype=np.int64)
    return starts[row // per_chunk] + (row % per_chunk) * row_bytes


def _filter_name(plist, index: int) -> str:
    code = plist.get_filter(index)[0]
    return {h5py.h5z.FILTER_DEFLATE: "gzip", h5py.h5z.FILTER_SHUFFLE: "shuffle",
            h5py.h5z.FILTER_FLETCHER32: "fletcher32", h5py.h5z.FILTER_SZIP: "szip",
            h5py.h5z.FILTER_SCALEOFFSET: "scale-offset", 32000: "lzf"}.get(code, f"filter {code}")


def _full_rows(space, rows_total: int, row_shape: tuple[int, ...], what: str) -> tuple[int, int]:
    """``(first, stop)`` when the selection of ``space`` is whole rows ``first:stop`` (every element of each)."""
    kind = space.get_select_type()
    if kind == h5py.h5s.SEL_ALL:
        return 0, rows_total
    if kind != h5py.h5s.SEL_HYPERSLABS:
        raise NotReadableDirectly(f"{what} is not a block of rows")
    low, high = space.get_select_bounds()
    first, stop = int(low[0]), int(high[0]) + 1
    if (tuple(low[1:]) != (0,) * len(row_shape) or tuple(h + 1 for h in high[1:]) != row_shape
            or space.get_select_npoints() != (stop - first) * int(np.prod(row_shape, dtype=np.int64))):
        raise NotReadableDirectly(f"{what} is not whole rows")
    return first, stop


def _virtual_layout(dataset: h5py.Dataset, path: Path, dtype: np.dtype, rows: int,
                    row_shape: tuple[int, ...]) -> RowLayout:
    """Each mapping of the virtual ``dataset`` resolved to whole rows of a source dataset and that source's offsets;
    every row must be mapped once (an unmapped row reads as the fill value)."""
    if os.environ.get("HDF5_VDS_PREFIX"):
        raise NotReadableDirectly("HDF5_VDS_PREFIX moves the virtual datasets' sources")
    files: list[str] = []
    file_of_row = np.full(rows, -1, dtype=np.int32)
    offset_of_row = np.zeros(rows, dtype=np.int64)
    for mapping in dataset.virtual_sources():
        first, stop = _full_rows(mapping.vspace, rows, row_shape, f"a mapping of {dataset.name}")
        if "%" in mapping.file_name or "%" in mapping.dset_name:
            raise NotReadableDirectly(f"{dataset.name} maps sources by a name pattern")
        source_path = path if mapping.file_name == "." else (path.parent / mapping.file_name).resolve()
        if not source_path.is_file():
            raise NotReadableDirectly(f"{dataset.name}'s source {mapping.file_name} is missing")
        with h5py.File(source_path, "r") as source_file:
            source = source_file.get(mapping.dset_name)
            if not isinstance(source, h5py.Dataset) or source.shape[1:] != tuple(row_shape):
                raise NotReadableDirectly(f"{mapping.file_name} has no dataset {mapping.dset_name} of rows "
                                          f"{tuple(row_shape)}")
            if source.id.get_create_plist().get_layout() == h5py.h5d.VIRTUAL:
                raise NotReadableDirectly(f"{dataset.name}'s source {mapping.file_name} is itself virtual")
            if _plain_dtype(source) != dtype:
                raise NotReadableDirectly(f"{mapping.file_name}'s {mapping.dset_name} is {source.dtype}, "
                                          f"read as {dtype}")
            source_first, source_stop = _full_rows(mapping.src_space, int(source.shape[0]), row_shape,
                                                   f"a source of {dataset.name}")
            if source_stop - source_first != stop - first or source_stop > source.shape[0]:
                raise NotReadableDirectly(f"{dataset.name} maps {stop - first} rows to {mapping.file_name}, "
                                          f"which has {source.shape[0]}")
            offsets = _stored_offsets(source, source_path, dtype)
        if (file_of_row[first:stop] >= 0).any():
            raise NotReadableDirectly(f"{dataset.name} maps some rows twice")
        if str(source_path) not in files:
            files.append(str(source_path))
        file_of_row[first:stop] = files.index(str(source_path))
        offset_of_row[first:stop] = offsets[source_first:source_stop]
    if (file_of_row < 0).any():
        raise NotReadableDirectly(f"{dataset.name} has rows no source maps (they read as the fill value)")
    return RowLayout(tuple(files), file_of_row, offset_of_row, row_shape, dtype, tuple(map(_stamp, files)))


def _stamp(path: str | os.PathLike) -> tuple[int, int, int, int]:
    return _stamp_of(os.stat(path))


def _stamp_of(stat: os.stat_result) -> tuple[int, int, int, int]:
    return stat.st_dev, stat.st_ino, stat.st_size, stat.st_mtime_ns


def _check_against_h5py(dataset: h5py.Dataset, layout: RowLayout) -> None:
    """The first and last row of every file, read both ways, must be the same bytes."""
    probe = sorted({int(rows[i]) for f in range(len(layout.files))
                    for rows in [np.flatnonzero(layout.file_of_row == f)] if rows.size for i in (0, -1)})
    if not probe:
        return
    direct = np.empty((len(probe), *layout.row_shape), dtype=layout.dtype)
    reader = RowReader(layout)
    try:
        reader.read(np.asarray(probe, dtype=np.int64), direct)
    except (OSError, UserError) as exc:
        raise NotReadableDirectly(f"reading {dataset.name} at its offsets failed ({exc})") from None
    finally:
        reader.close()
    if direct.tobytes() != dataset[probe].tobytes():
        raise NotReadableDirectly(f"{dataset.name} read at its offsets differs from h5py's reading")


class RowReader:
    """Reads rows of one :class:`RowLayout` with ``os.preadv``; file descriptors are opened lazily in each process
    (so the reader may be pickled to DataLoader workers or inherited across ``fork``)."""

    def __init__(self, layout: RowLayout):
        self.layout = layout
        self._fds: dict[int, int] = {}
        self._pid: int | None = None

    def read(self, rows: np.ndarray, out: np.ndarray) -> None:
        """Rows ``rows`` ``[B]`` int64 (in range; any order, repeats allowed) into ``out`` ``[B, *row_shape]``
        (C-contiguous, of the layout's dtype), ``out[i]`` = row ``rows[i]``."""
        layout = self.layout
        row_bytes = layout.row_bytes
        if not out.flags.c_contiguous or out.dtype != layout.dtype or out.shape != (len(rows), *layout.row_shape):
            raise ValueError(f"out must be a C-contiguous {layout.dtype} array of shape "
                             f"{(len(rows), *layout.row_shape)}")
        if not len(rows) or not row_bytes:
            return
        files, offsets = layout.file_of_row[rows], layout.offset_of_row[rows]
        order = np.lexsort((offsets, files))                   # by file, then by place in the file
        files, offsets = files[order], offsets[order]
        repeat = np.zeros(len(order), dtype=bool)
        repeat[1:] = (files[1:] == files[:-1]) & (offsets[1:] == offsets[:-1])
        kept, files, offsets = order[~repeat], files[~repeat], offsets[~repeat]
        # a read starts where the file changes or the next row is not the next bytes of the file; a buffer where
        # that, or the next row's place in `out`, is not adjacent
        new_read = np.ones(len(kept), dtype=bool)
        new_read[1:] = (files[1:] != files[:-1]) | (offsets[1:] != offsets[:-1] + row_bytes)
        new_buffer = new_read.copy()
        new_buffer[1:] |= kept[1:] != kept[:-1] + 1
        starts = np.flatnonzero(new_buffer)
        lengths = np.diff(np.append(starts, len(kept)))
        target = memoryview(out.reshape(-1).view(np.uint8))
        reads: list[tuple[int, int, list[memoryview]]] = []
        for start, length in zip(starts.tolist(), lengths.tolist()):
            first = int(kept[start]) * row_bytes
            buffer = target[first:first + length * row_bytes]
            if new_read[start]:
                reads.append((int(files[start]), int(offsets[start]), [buffer]))
            else:
                reads[-1][2].append(buffer)
        if len(reads) > 1 and hasattr(os, "posix_fadvise"):     # every read announced first: see the module doc
            for file_index, offset, buffers in reads:
                os.posix_fadvise(self._fd(file_index), offset, sum(map(len, buffers)), os.POSIX_FADV_WILLNEED)
        for file_index, offset, buffers in reads:
            self._read_into(file_index, offset, buffers)
        if repeat.any():                                       # a row asked for twice: copied from its first read
            source = np.flatnonzero(~repeat)[np.cumsum(~repeat) - 1]
            where = np.flatnonzero(repeat)
            out[order[where]] = out[order[source[where]]]

    def _read_into(self, file_index: int, offset: int, buffers: list[memoryview]) -> None:
        """Fill ``buffers`` in turn from ``offset`` of file ``file_index`` (short reads continued)."""
        fd = self._fd(file_index)
        pending = list(buffers)           # a read returns less than asked (Linux: at most 2 GiB a call): go on
        at = 0
        while at < len(pending):
            batch = pending[at:at + _IOV_MAX]
            got = os.preadv(fd, batch, offset)
            if got <= 0:
                raise UserError(f"{self.layout.files[file_index]} ends before byte {offset + sum(map(len, batch))} "
                                "(shortened while open?); run `retr-pipeline verify` on it")
            offset += got
            for piece in batch:
                if got >= len(piece):
                    got -= len(piece)
                    at += 1
                else:
                    pending[at] = piece[got:]
                    break

    def _fd(self, file_index: int) -> int:
        if self._pid != os.getpid():
            self._fds, self._pid = {}, os.getpid()         # descriptors of the parent stay the parent's
        fd = self._fds.get(file_index)
        if fd is None:
            path = self.layout.files[file_index]
            fd = os.open(path, os.O_RDONLY)
            if self.layout.stamps and _stamp_of(os.fstat(fd)) != self.layout.stamps[file_index]:
                os.close(fd)
                raise UserError(f"{path} was replaced or changed after the feature set was opened; open it again")
            self._fds[file_index] = fd
        return fd

    def close(self) -> None:
        if self._pid == os.getpid():
            for fd in self._fds.values():
                os.close(fd)
        self._fds, self._pid = {}, None

    def __del__(self):
        try:
            self.close()
        except Exception:       # interpreter shutdown: os may be gone
            pass

    def __getstate__(self):
        return {"layout": self.layout, "_fds": {}, "_pid": None}

