"""Word vectors in GloVe's text format (``word v1 … vD`` per line): the sets retr fetches on first use, the one
reader of the format, and a vocabulary's rows cached once per (vectors file, vocabulary).

A vectors *spec* is a name of :data:`GLOVE_SETS` or a GloVe-format file (``.txt``, or a ``.zip`` holding one
``.txt``). A named set is downloaded into :func:`vectors_dir` on first use by :func:`retr.common.downloads.fetch_source`
(size and sha256 checked, resumable, ``RETR_OFFLINE`` / ``RETR_MIRROR``) and read straight out of its zip: the
840B text (5.6 GB) is never unpacked. Reading streams the file once and keeps only the words asked for.

A word's vector: its own line, else CVSE's cleaned form (``-``, ``.``, ``'`` dropped, the part before ``/``), else
the mean of its ``_``-joined parts (multi-word concepts such as ``tennis_racket``); otherwise it is absent.
Lines whose word holds spaces (840B has a few, e.g. ``. . .``) are skipped.

:func:`vocabulary_vectors` caches the ``[V, D]`` float32 rows and the ``[V]`` found mask as ``.npz`` in
:func:`vectors_dir`, named by the file's sha256 and the words' digest, written atomically and loaded without
pickle: later runs with the same vocabulary read no text.
"""
from __future__ import annotations

import hashlib
import io
import logging
import os
import zipfile
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Iterator, Sequence

import numpy as np

from retr.common.atomic import atomic_file
from retr.common.downloads import SOURCES, fetch_source, format_bytes
from retr.common.errors import MissingResourceError, UserError
from retr.common.hashing import sha256_file

logger = logging.getLogger(__name__)

#: where named sets and the caches live (default ``~/.cache/retr/word-vectors``)
VECTORS_ENV = "RETR_WORD_VECTORS"
#: name → (``SOURCES`` key, the text file read from its zip). ``glove``: Common Crawl 840B, the set SMAN ("GloVe
#: pre-trained on the Common-Crawl dataset") and CVSE (``torchtext.vocab.GloVe()``'s default) used
GLOVE_SETS = {"glove": ("glove-840b", "glove.840B.300d.txt"), "glove-6b": ("glove-6b", "glove.6B.300d.txt")}
RANDOM = "random"


def vectors_dir() -> Path:
    """``$RETR_WORD_VECTORS``, else ``~/.cache/retr/word-vectors``."""
    return Path(os.environ.get(VECTORS_ENV) or Path.home() / ".cache" / "retr" / "word-vectors")


@dataclass(frozen=True)
class VectorsFile:
    """A vectors file located: ``path``, the ``member`` read when it is a zip, and its ``sha256`` (``verify``: the
    table's, checked against the file before it is read)."""

    path: Path
    member: str | None
    sha256: str
    verify: bool = False

    @property
    def label(self) -> str:
        """``glove.840B.300d.zip sha256:<hex>``: what a run records of the vectors it started from."""
        return f"{self.path.name} sha256:{self.sha256}"


def fetch_hint(name: str) -> str:
    return (f"run `retr-pipeline fetch-word-vectors {name}` on a connected machine and copy "
            f"{SOURCES[GLOVE_SETS[name][0]].filename} into {vectors_dir()} (or set {VECTORS_ENV})")


def resolve_vectors(spec: str, quiet: bool = False) -> VectorsFile:
    """The file ``spec`` names: a :data:`GLOVE_SETS` name (downloaded on first use) or a path."""
    if spec in GLOVE_SETS:
        source = SOURCES[GLOVE_SETS[spec][0]]
        if (folder := vectors_dir()).exists() and not folder.is_dir():
            raise UserError(f"the word-vectors folder {folder} is a file (${VECTORS_ENV}, else "
                            "~/.cache/retr/word-vectors): point it at a folder")
        path = fetch_source(source, folder, how=fetch_hint(spec), quiet=quiet)
        if source.size is not None and path.stat().st_size != source.size:
            raise UserError(f"{path} is {format_bytes(path.stat().st_size)}, not the {format_bytes(source.size)} of "
                            f"{source.filename}: remove it and run `retr-pipeline fetch-word-vectors {spec}`")
        return VectorsFile(path, GLOVE_SETS[spec][1], source.sha256 or sha256_file(path), verify=True)
    path = Path(spec)
    if path.is_dir():
        raise UserError(f"{path} is a folder, not a GloVe-format .txt or .zip file (or {' / '.join(GLOVE_SETS)})")
    if not path.is_file():
        raise MissingResourceError(f"word-vector file {path}", str(path.parent.absolute()),
                                   f"give a GloVe-format .txt or .zip, or {' / '.join(GLOVE_SETS)} (GloVe, "
                                   f"downloaded on first use; `retr-pipeline fetch-word-vectors` fetches ahead)")
    is_zip = zipfile.is_zipfile(path)
    if path.suffix.lower() == ".zip" and not is_zip:
        raise UserError(f"{path} is named .zip but is not a zip archive: give the GloVe download itself, or its "
                        "GloVe-format text file named .txt")
    return VectorsFile(path, _text_member(path) if is_zip else None, sha256_file(path))


def _text_member(path: Path) -> str:
    with zipfile.ZipFile(path) as archive:
        names = [n for n in archive.namelist() if n.endswith(".txt")]
    if len(names) != 1:
        raise UserError(f"{path} holds {len(names)} .txt files, not one: unpack the one to use and give it")
    return names[0]


@contextmanager
def _open(path: Path, member: str | None) -> Iterator[IO[bytes]]:
    if member is None:
        with open(path, "rb") as handle:
            yield handle
        return
    try:
        archive = zipfile.ZipFile(path)
    except (zipfile.BadZipFile, OSError) as exc:
        raise UserError(f"{path} is not a readable zip archive ({exc})") from None
    with archive:
        if member not in archive.namelist():
            raise UserError(f"{path} holds no {member}")
        with archive.open(member) as raw:
            yield io.BufferedReader(raw, 1 << 20)


#: what a line of a GloVe-format text file holds (for messages)
GLOVE_FORMAT = "GloVe text format: 'word v1 … vD', one word a line"


def _is_number(text: bytes) -> bool:
    try:
        float(text)
    except ValueError:
        return False
    return True


def _forms(word: str) -> list[str]:
    clean = word.replace("-", "").replace(".", "").replace("'", "").split("/")[0]
    return [word, clean, *word.split("_")]


def read_word_vectors(path: str | os.PathLike, words: Sequence[str],
                      member: str | None = None) -> tuple[np.ndarray, list[str]]:
    """Vectors ``[len(words), D]`` float32 of ``words`` from a GloVe-format file (or its zip's ``member``), by the
    rules of the module docstring, and the words it does not cover (their rows are zero)."""
    path = Path(path)
    if not path.is_file():
        raise MissingResourceError(f"word-vector file {path}", str(path.parent),
                                   "give GloVe vectors (e.g. --concept-vectors glove: glove.840B.300d, downloaded "
                                   "on first use) or train concept vectors with --concept-vectors learned")
    wanted = {f.encode("utf-8") for w in words for f in _forms(w) if f}
    found: dict[bytes, np.ndarray] = {}
    dim = None
    with _open(path, member) as handle:
        for number, line in enumerate(handle, start=1):
            head = line[:line.find(b" ")]
            if dim is None:
                dim = len(line.split()) - 1
            if head not in wanted or head in found:
                continue
            parts = line.split()
            if len(parts) > dim + 1:
                continue                       # a word with spaces whose first piece looks like a wanted word
            if len(parts) < dim + 1:
                given = len(parts) - 1
                raise UserError(f"{path} line {number}: {given} value{'s' * (given != 1)} where the first line has "
                                f"{dim} ({GLOVE_FORMAT})")
            try:
                found[head] = np.array(parts[1:], dtype=np.float32)
            except ValueError:
                bad = next(p for p in parts[1:] if not _is_number(p)).decode("utf-8", "replace")
                raise UserError(f"{path} line {number}: {bad!r} is not a number ({GLOVE_FORMAT})") from None
    if not found:
        raise UserError(f"{path} covers none of the {len(words)} words asked for: is it a GloVe-format file "
                        f"({GLOVE_FORMAT})?")
    out = np.zeros((len(words), dim), dtype=np.float32)
    missing = []
    for i, word in enumerate(words):
        whole, clean, *parts = [f.encode("utf-8") for f in _forms(word)]
        hits = [found[f] for f in (whole, clean) if f in found][:1] or [found[p] for p in parts if p in found]
        if hits:
            out[i] = np.mean(hits, axis=0)
        else:
            missing.append(word)
    return out, missing


def words_digest(words: Sequence[str]) -> str:
    return hashlib.sha256("\n".join(words).encode("utf-8")).hexdigest()


def vocabulary_vectors(vectors: VectorsFile, words: Sequence[str],
                       cache_dir: str | os.PathLike | None = None) -> tuple[np.ndarray, np.ndarray]:
    """``[V, D]`` float32 vectors and ``[V]`` bool found mask of ``words`` (a vocabulary's ``idx2word``), from the
    cache when there (else read once, the sha256 of a downloaded set verified, and cached)."""
    folder = Path(cache_dir) if cache_dir is not None else vectors_dir()
    cache = folder / f"{vectors.path.stem}.{vectors.sha256[:16]}.{words_digest(words)[:16]}.npz"
    try:
        with np.load(cache, allow_pickle=False) as stored:
            matrix, found = stored["vectors"], stored["found"]
        if matrix.shape[0] == len(words) == found.shape[0]:
            return matrix, found
    except (OSError, ValueError, KeyError, zipfile.BadZipFile):
        pass                                    # absent or damaged: read again
    if vectors.verify and sha256_file(vectors.path) != vectors.sha256:
        raise UserError(f"{vectors.path} fails its sha256 check (not {vectors.label}); remove it and fetch it again")
    matrix, missing = read_word_vectors(vectors.path, words, vectors.member)
    absent = set(missing)
    found = np.array([w not in absent for w in words], dtype=bool)
    try:
        with atomic_file(cache) as partial, open(partial, "wb") as handle:
            np.savez(handle, vectors=matrix, found=found)
    except OSError as exc:                       # a shared, read-only vectors folder: read again next time
        logger.debug(f"the vocabulary's rows were not cached in {cache.parent} ({exc.strerror or exc})")
    return matrix, found
