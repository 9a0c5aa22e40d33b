"""Downloads: the :data:`SOURCES` table of every file retr fetches, :func:`download` and :func:`unpack_zip`
(resume, retries, checks, locks, offline, mirrors: docs/extraction.md, "Downloads").
"""
from __future__ import annotations

import errno
import hashlib
import http.client
import os
import shutil
import socket
import tarfile
import time
import urllib.error
import urllib.parse
import urllib.request
import zipfile
import zlib
from dataclasses import dataclass, field
from pathlib import Path, PurePosixPath
from typing import Callable

from retr.common.atomic import PARTIAL_SUFFIX, partial_path
from retr.common.progress import progress
from retr.common.errors import MissingResourceError, UserError
from retr.common.locks import waiting_lock
from retr.common.paths import nearest_existing, write_problem

#: set to 1 (or true/yes/on) and retr never opens a network connection
OFFLINE_ENV = "RETR_OFFLINE"
#: base URL of a mirror holding the files of :data:`SOURCES` under their file names
MIRROR_ENV = "RETR_MIRROR"
#: consecutive failed attempts before a download stops (the partial file stays for the next run)
DEFAULT_RETRIES = 5
#: seconds before the first retry (doubled after each failure, at most 60)
DEFAULT_RETRY_WAIT = 2.0
#: seconds a connection may stay silent
DEFAULT_TIMEOUT = 60.0
CHUNK_BYTES = 1 << 20
#: HTTP statuses worth another attempt (the server is busy or failed, not the request)
RETRYABLE_STATUS = frozenset({408, 425, 429, 500, 502, 503, 504})
USER_AGENT = "retr-downloader (python urllib)"


# ------------------------------------------------------------------------------------------------ the table

@dataclass(frozen=True)
class Source:
    """One file retr downloads. ``size`` is exact (checked) when known; ``approx_bytes`` is for planning."""

    key: str
    what: str
    url: str
    filename: str
    size: int | None = None          #: exact bytes; None when no one publishes it (the server's length is checked)
    sha256: str | None = None        #: hex, checked when given
    md5: str | None = None           #: hex, checked when given
    approx_bytes: int = 0            #: download size for the disk check and the README when ``size`` is None
    unpacked_bytes: int = 0          #: disk its unpacked contents take (archives; an upper estimate)
    files: int | None = None         #: files the archive unpacks to (a folder holding them all counts as done)
    origin: str = ""                 #: who publishes the file, and where the size/checksum come from
    gated: bool = False              #: handed out on request only: retr never downloads it (``url`` is the form)

    @property
    def download_bytes(self) -> int:
        return self.size if self.size is not None else self.approx_bytes

    def url_for(self, mirror: str | None = None) -> str:
        """The public URL, or ``MIRROR/<filename>`` with a mirror (argument, else ``$RETR_MIRROR``)."""
        mirror = mirror or mirror_base()
        return f"{mirror.rstrip('/')}/{self.filename}" if mirror else self.url


_TORCHVISION = "torchvision's weight enum (IMAGENET1K_V1); the file name's hex is the start of its sha256"
#: Every file retr downloads itself (``retr-pipeline fetch-weights`` lists and fetches weights in this order).
#: Checksums: COCO and Karpathy's splits as published in TensorFlow Datasets' url_checksums (coco_captions.txt),
#: VGG's as torchvision's file names and public listings give them.
SOURCES: dict[str, Source] = {s.key: s for s in (
    Source("coco-train2014", "COCO 2014 train images (82,783 JPEGs)",
           "http://images.cocodataset.org/zips/train2014.zip", "train2014.zip",
           size=13_510_573_713, sha256="ede4087e640bddba550e090eae701092534b554b42b05ac33f0300b984b31775",
           unpacked_bytes=13_600_000_000, files=82_783,
           origin="cocodataset.org; size and sha256 from TensorFlow Datasets' checksum list"),
    Source("coco-val2014", "COCO 2014 val images (40,504 JPEGs)",
           "http://images.cocodataset.org/zips/val2014.zip", "val2014.zip",
           size=6_645_013_297, sha256="fe9be816052049c34717e077d9e34aa60814a55679f804cd043e3cbee3b9fde0",
           unpacked_bytes=6_700_000_000, files=40_504,
           origin="cocodataset.org; size and sha256 from TensorFlow Datasets' checksum list"),
    Source("coco-annotations", "COCO 2014 train/val annotations (captions_*2014.json: the caption ids; instances)",
           "http://images.cocodataset.org/annotations/annotations_trainval2014.zip", "annotations_trainval2014.zip",
           size=252_872_794, sha256="031296bbc80c45a1d1f76bf9a90ead27e94e99ec629208449507a4917a3bf009",
           unpacked_bytes=100_000_000,
           origin="cocodataset.org; size and sha256 from TensorFlow Datasets' checksum list (only the two caption "
                  "files are unpacked)"),
    Source("karpathy-splits", "Karpathy's splits (dataset_coco.json, dataset_flickr30k.json, dataset_flickr8k.json)",
           "https://cs.stanford.edu/people/karpathy/deepimagesent/caption_datasets.zip", "caption_datasets.zip",
           size=36_745_453, sha256="4cfd70132527b80933105e5829dc9034eaab9573482e2e680abbab6130244817",
           unpacked_bytes=200_000_000,
           origin="Andrej Karpathy (NeuralTalk); size and sha256 from TensorFlow Datasets' checksum list"),
    Source("f30k-images", "Flickr30K images (31,783 JPEGs; gated: the archive the authors send on request)",
           "https://shannon.cs.illinois.edu/DenotationGraph/", "flickr30k-images.tar.gz", approx_bytes=4_400_000_000,
           unpacked_bytes=4_500_000_000, files=31_783, gated=True,
           origin="University of Illinois (request form); given to fetch-data f30k --images-zip"),
    Source("resnet152", "ResNet-152 ImageNet weights (torchvision IMAGENET1K_V1)",
           "https://download.pytorch.org/models/resnet152-394f9c45.pth", "resnet152-394f9c45.pth",
           approx_bytes=241_600_000, origin=_TORCHVISION),
    Source("vgg16", "VGG-16 ImageNet weights (torchvision IMAGENET1K_V1)",
           "https://download.pytorch.org/models/vgg16-397923af.pth", "vgg16-397923af.pth",
           size=553_433_881, sha256="397923af8e79cdbb6a7127f12361acd7a2f83e06b05044ddf496e83de57a5bf0",
           origin=_TORCHVISION),
    Source("vgg19", "VGG-19 ImageNet weights (torchvision IMAGENET1K_V1)",
           "https://download.pytorch.org/models/vgg19-dcbb9e9d.pth", "vgg19-dcbb9e9d.pth",
           size=574_673_361, sha256="dcbb9e9dad569fff7a846263a77324fc34978fea2bfb039c012d710e1776ae44",
           origin=_TORCHVISION),
    Source("inception_resnet_v2", "Inception-ResNet-v2 ImageNet weights (timm inception_resnet_v2.tf_in1k)",
           "https://huggingface.co/timm/inception_resnet_v2.tf_in1k/resolve/main/model.safetensors",
           "model.safetensors", approx_bytes=223_800_000,
           origin="timm on the Hugging Face hub (downloaded by huggingface_hub into its cache, which checks it)"),
    Source("butd", "bottom-up-attention Faster R-CNN R101, fixed 36 boxes (MILVLG conversion of the Caffe model)",
           "https://awma1-my.sharepoint.com/:u:/g/personal/yuz_l0_tn/"
           "EUKhQ3hSRv9JrrW64qpNLSIBGoOjEGCkF8zvgBP9gKax-w?download=1", "bua-caffe-frcn-r101-k36.pth",
           approx_bytes=262_000_000,
           origin="MILVLG/bottom-up-attention.pytorch model zoo (R101-k36, OneDrive); no published size or hash: "
                  "the server's length and a key/shape load are checked, the sha256 is recorded in the features"),
    Source("glove-840b", "GloVe word vectors, Common Crawl 840B tokens, 2.2M cased words, 300-d",
           "https://nlp.stanford.edu/data/glove.840B.300d.zip", "glove.840B.300d.zip",
           size=2_176_768_927, sha256="c06db255e65095393609f19a4cfca20bf3a71e20cc53e892aafa490347e3849f",
           unpacked_bytes=5_646_236_541,
           origin="Stanford NLP; size and sha256 as two independent public download tables give them (read from "
                  "the zip, never unpacked)"),
    Source("glove-6b", "GloVe word vectors, Wikipedia 2014 + Gigaword 5 (6B tokens), 400K uncased words, 50-300-d",
           "https://nlp.stanford.edu/data/glove.6B.zip", "glove.6B.zip",
           size=862_182_613, sha256="617afb2fe6cbd085c235baf7a465b96f4112bd7f7ccb2b2cbd649fed9cbcf2fb",
           md5="056ea991adb4740ac6bf1b6d9b50408b", unpacked_bytes=2_254_000_000,
           origin="Stanford NLP; size, sha256 and md5 as several public download tables give them (retr reads "
                  "glove.6B.300d.txt from the zip)"),
    *(Source(f"clip-{arch.lower()}", f"CLIP {arch} weights (OpenAI's, open_clip tag openai)",
             f"https://huggingface.co/timm/{repo}/resolve/main/open_clip_model.safetensors",
             f"{repo}/open_clip_model.safetensors", approx_bytes=params * 4,
             origin="open_clip's hub copy of OpenAI's CLIP (downloaded by huggingface_hub into its cache, which "
                    "checks it); the size is the float32 parameter count's, an estimate")
      for arch, repo, params in (("ViT-B-32", "vit_base_patch32_clip_224.openai", 151_277_313),
                                 ("ViT-B-16", "vit_base_patch16_clip_224.openai", 149_620_737),
                                 ("ViT-L-14", "vit_large_patch14_clip_224.openai", 427_616_513),
                                 ("ViT-L-14-336", "vit_large_patch14_clip_336.openai", 427_944_193))),
    Source("stanza", "stanza English models (tokenize, pos, lemma, depparse, constituency; 'default' package)",
           "https://huggingface.co/stanfordnlp/stanza-en", "stanza_resources", approx_bytes=500_000_000,
           origin="Stanford NLP on the Hugging Face hub (downloaded by stanza.download, which checks md5s)"),
)}


# ------------------------------------------------------------------------------------------------ switches

def is_offline() -> bool:
    """True when ``RETR_OFFLINE`` is set to 1/true/yes/on: nothing may open a network connection."""
    return os.environ.get(OFFLINE_ENV, "").strip().lower() in ("1", "true", "yes", "on")


def set_offline() -> None:
    """Turn offline mode on for this process and its children (what ``--offline`` does)."""
    os.environ[OFFLINE_ENV] = "1"


def mirror_base() -> str | None:
    """``$RETR_MIRROR``, or None."""
    return os.environ.get(MIRROR_ENV) or None


def set_mirror(url: str | None) -> None:
    """Use ``url`` as the mirror for this process and its children (what ``--mirror`` does)."""
    if url:
        if not url.startswith(("http://", "https://", "file://")):
            raise UserError(f"mirror {url!r} is not an http(s):// or file:// URL", parameters=["mirror"])
        os.environ[MIRROR_ENV] = url


def format_bytes(n: float) -> str:
    """``13.5 GB``, ``262 MB``, ``4.1 kB`` (decimal units, as download pages give them)."""
    for unit, scale in (("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if abs(n) >= scale:
            value = n / scale
            return f"{value:.1f} {unit}" if value < 100 else f"{value:.0f} {unit}"
    return f"{int(n)} bytes"


def ensure_free_space(folder: str | os.PathLike, needed: int, what: str) -> None:
    """One-line :class:`UserError` when the file system of ``folder`` has less than ``needed`` bytes free."""
    probe = Path(folder).absolute()
    while not probe.exists() and probe != probe.parent:
        probe = probe.parent
    free = shutil.disk_usage(probe).free
    if free < needed:
        raise UserError(f"not enough free disk space in {folder}: {what} needs {format_bytes(needed)}, "
                        f"{format_bytes(free)} free; free some space or choose another folder")


def writer_lock(dest: Path):
    """The lock on ``.<name>.lock`` beside ``dest`` (:func:`retr.common.locks.waiting_lock`): one process
    downloads a file at once."""
    return waiting_lock(dest.with_name(f".{dest.name}.lock"))


# ------------------------------------------------------------------------------------------------ download

class _Retry(Exception):
    """An attempt failed in a way another attempt may fix (the reason is the message)."""


@dataclass
class _State:
    received: int = 0                     # bytes in the partial file
    total: int | None = None              # the file's full length as the server gives it
    hashers: dict = field(default_factory=dict)


def _new_hashers(sha256: str | None, md5: str | None) -> dict:
    return {name: hashlib.new(name) for name, want in (("sha256", sha256), ("md5", md5)) if want}


def _hash_existing(path: Path, hashers: dict) -> None:
    if not hashers:
        return
    with open(path, "rb") as handle:
        for block in iter(lambda: handle.read(CHUNK_BYTES), b""):
            for h in hashers.values():
                h.update(block)


def _content_range(header: str | None) -> tuple[int | None, int | None]:
    """``(start, total)`` of ``bytes START-END/TOTAL`` (``bytes */TOTAL`` gives ``(None, TOTAL)``)."""
    if not header or not header.startswith("bytes "):
        return None, None
    spec, _, total = header[6:].partition("/")
    start = spec.split("-", 1)[0]
    return (int(start) if start.strip().isdigit() else None), (int(total) if total.strip().isdigit() else None)


def _refuse(partial: Path, message: str) -> UserError:
    partial.unlink(missing_ok=True)
    return UserError(message)


def _download_folder(folder: Path) -> None:
    """Create ``folder`` (a download's destination), or one :class:`UserError` line saying why it cannot be."""
    existing = nearest_existing(folder)
    if existing.exists() and not existing.is_dir():
        raise UserError(f"cannot download into {folder}: it, or a folder above it, is a file")
    problem = write_problem(existing) if existing.is_dir() else None
    if problem is not None:                  # read-only, no permission, /proc: said before any request
        raise UserError(f"cannot download into {folder}: {existing} takes no files ({problem})")
    try:
        folder.mkdir(parents=True, exist_ok=True)
    except (FileExistsError, NotADirectoryError):
        raise UserError(f"cannot download into {folder}: it, or a folder above it, is a file") from None
    except PermissionError:
        raise UserError(f"cannot download into {folder}: permission denied") from None


def download(url: str, dest: str | os.PathLike, *, size: int | None = None, sha256: str | None = None,
             md5: str | None = None, what: str | None = None, how: str | None = None,
             validate: Callable[[Path], None] | None = None, quiet: bool = False,
             retries: int | None = None, retry_wait: float | None = None,
             timeout: float | None = None) -> Path:
    """Download ``url`` to ``dest`` (resumable, verified, atomic); returns ``dest`` (at once when complete).

    ``size``/``sha256``/``md5``: expected (None: unknown); ``validate(partial_path)`` runs last, before the rename;
    ``what``/``how`` word the offline :class:`MissingResourceError`. Other failures: :class:`UserError`."""
    retries = DEFAULT_RETRIES if retries is None else retries
    retry_wait = DEFAULT_RETRY_WAIT if retry_wait is None else retry_wait
    timeout = DEFAULT_TIMEOUT if timeout is None else timeout
    dest = Path(dest)
    if dest.is_file():
        return dest
    what = what or dest.name
    if is_offline():
        raise MissingResourceError(what, str(dest), how or f"on a connected machine download {url} to {dest} "
                                   f"(retr does not while {OFFLINE_ENV} is set)")
    _download_folder(dest.parent)
    with writer_lock(Path(dest)):
        if dest.is_file():          # another process finished it while this one waited
            return dest
        partial = partial_path(dest)
        state = _State(hashers=_new_hashers(sha256, md5))
        if partial.is_file():
            state.received = partial.stat().st_size
            if size is not None and state.received > size:
                partial.unlink()
                state.received = 0
            _hash_existing(partial, state.hashers)
        failures, wait, reason = 0, retry_wait, ""
        while not (size is not None and state.received == size) and not (
                state.total is not None and state.received == state.total):
            before = state.received
            try:
                if _attempt(url, partial, state, size, quiet, timeout, what):
                    break
            except _Retry as exc:
                reason = str(exc)
                if state.received > before:          # it moved data: a new streak of failures starts
                    failures, wait = 0, retry_wait
                failures += 1
                if failures > retries:
                    attempts = f"{failures} failed attempt" + ("s" if failures > 1 else "")
                    if not state.received:
                        partial.unlink(missing_ok=True)
                        raise UserError(f"download of {url} failed after {attempts} ({reason}); nothing was "
                                        f"received, run again later") from None
                    have = f"{format_bytes(state.received)}" + (f" of {format_bytes(state.total)}"
                                                                 if state.total else "")
                    raise UserError(f"download of {url} stopped after {attempts} ({reason}); "
                                    f"{partial} keeps the {have} received and the next run resumes from there"
                                    ) from None
                time.sleep(wait)
                wait = min(wait * 2, 60.0)
        _verify(url, partial, state, size, sha256, md5, validate, what)
        os.replace(partial, dest)
    return dest


def _attempt(url: str, partial: Path, state: _State, size: int | None, quiet: bool, timeout: float,
             what: str) -> bool:
    """One request for the bytes after ``state.received``. True when the file is complete (length known and
    reached, or an unknown length and a clean end of stream); raises :class:`_Retry` for a transient failure,
    :class:`UserError` for a final one."""
    request = urllib.request.Request(url, headers={"User-Agent": USER_AGENT, "Accept-Encoding": "identity"})
    if state.received:
        request.add_header("Range", f"bytes={state.received}-")
    try:
        response = urllib.request.urlopen(request, timeout=timeout)
    except urllib.error.HTTPError as exc:
        if exc.code == 416 and state.received:     # nothing after what we have: complete, or longer than the file
            _start, total = _content_range(exc.headers.get("Content-Range"))
            if total is not None and total == state.received:
                state.total = total
                return True
            partial.unlink(missing_ok=True)
            state.received, state.total = 0, None
            for name in list(state.hashers):
                state.hashers[name] = hashlib.new(name)
            raise _Retry("the partial file was longer than the server's; started again") from None
        if exc.code in RETRYABLE_STATUS:
            raise _Retry(f"HTTP {exc.code} {exc.reason}") from None
        raise UserError(f"download of {url} failed: HTTP {exc.code} {exc.reason}") from None
    except (urllib.error.URLError, http.client.HTTPException, OSError) as exc:
        detail = getattr(exc, "reason", None) or exc
        if isinstance(detail, socket.gaierror):      # no name service: no network here, retrying will not help
            host = urllib.parse.urlsplit(url).hostname
            why = detail.strerror or str(detail)
            raise UserError(f"cannot download {url}: the host name {host} does not resolve ({why}); without "
                            f"network access set RETR_OFFLINE=1 (or --offline), or give --mirror") from None
        raise _Retry(f"{type(exc).__name__}: {detail}") from None
    with response:
        status = getattr(response, "status", 200)
        length = response.headers.get("Content-Length")
        length = int(length) if length and length.strip().isdigit() else None
        if state.received and status == 206:
            start, total = _content_range(response.headers.get("Content-Range"))
            if start != state.received:
                raise _Retry(f"the server answered the range request from byte {start}, not {state.received}")
            state.total = total if total is not None else (state.received + length if length is not None else None)
            mode = "ab"
        else:                                        # 200: the whole file (a server may ignore Range)
            if state.received:
                state.received = 0
                for name in list(state.hashers):
                    state.hashers[name] = hashlib.new(name)
            state.total = length
            mode = "wb"
        if size is not None and state.total is not None and state.total != size:
            raise _refuse(partial, f"{url} is {state.total:,} bytes, not the {size:,} bytes of {what}: not the file "
                                   f"retr expects; removed {partial}")
        bar = progress(total=state.total, desc=partial.name[:-len(PARTIAL_SUFFIX)], unit="B", quiet=quiet,
                       unit_scale=True, unit_divisor=1000, initial=state.received)
        try:
            with open(partial, mode) as out:
                while True:
                    try:
                        block = response.read(CHUNK_BYTES)
                    except (http.client.HTTPException, OSError) as exc:
                        raise _Retry(f"connection lost after {format_bytes(state.received)} "
                                     f"({type(exc).__name__}: {exc})") from None
                    if not block:
                        break
                    try:
                        out.write(block)
                    except OSError as exc:
                        if exc.errno == errno.ENOSPC:
                            raise UserError(f"the disk holding {partial} is full after "
                                            f"{format_bytes(state.received)}; free some space and run again to "
                                            f"resume") from None
                        raise
                    state.received += len(block)
                    for h in state.hashers.values():
                        h.update(block)
                    bar.update(len(block))
        finally:
            bar.close()
    if state.total is None:
        return True                                  # no length given: a clean end of stream is the end
    if state.received < state.total:
        raise _Retry(f"connection closed after {format_bytes(state.received)} of {format_bytes(state.total)}")
    return True


def _verify(url: str, partial: Path, state: _State, size: int | None, sha256: str | None, md5: str | None,
            validate: Callable[[Path], None] | None, what: str) -> None:
    """Every check before the rename; a failure removes the partial file and is one line."""
    actual = partial.stat().st_size if partial.is_file() else 0
    if state.total is not None and actual != state.total:
        raise _refuse(partial, f"{what}: received {actual:,} bytes but the server announced {state.total:,}; "
                               f"removed {partial}, run again to download it afresh")
    if size is not None and actual != size:
        raise _refuse(partial, f"{what}: {actual:,} bytes, expected {size:,}; removed {partial}, run again to "
                               f"download it afresh")
    for name, want in (("sha256", sha256), ("md5", md5)):
        if not want:
            continue
        got = state.hashers[name].hexdigest() if name in state.hashers else _file_digest(partial, name)
        if got != want.lower():
            raise _refuse(partial, f"{what} from {url} fails its {name} check ({got[:16]}…, published "
                                   f"{want[:16]}…); removed the download, run again to download it afresh")
    if validate is not None:
        try:
            validate(partial)
        except Exception as exc:  # noqa: BLE001 - any refusal removes the file
            text = str(exc).splitlines()[0] if str(exc).strip() else type(exc).__name__
            raise _refuse(partial, f"{what} downloaded from {url} was refused: {text}; removed it") from None


def _file_digest(path: Path, name: str) -> str:
    h = hashlib.new(name)
    _hash_existing(path, {name: h})
    return h.hexdigest()


def fetch_source(source: Source, folder: str | os.PathLike, *, mirror: str | None = None, how: str | None = None,
                 validate: Callable[[Path], None] | None = None, quiet: bool = False,
                 filename: str | None = None, what: str | None = None, **options) -> Path:
    """:func:`download` of a :data:`SOURCES` entry into ``folder`` (public URL or the mirror's copy)."""
    if source.gated:
        raise UserError(f"{source.what} cannot be downloaded by retr: request it at {source.url}")
    dest = Path(folder) / (filename or source.filename)
    return download(source.url_for(mirror), dest, size=source.size, sha256=source.sha256, md5=source.md5,
                    what=what or source.what, how=how, validate=validate, quiet=quiet, **options)


# ------------------------------------------------------------------------------------------------ archives

def safe_member_path(name: str) -> PurePosixPath | None:
    """The member's relative path, or None when it is absolute or climbs out with ``..`` (never unpacked)."""
    path = PurePosixPath(name.replace("\\", "/"))
    if path.is_absolute() or ".." in path.parts or not path.parts:
        return None
    return path


@dataclass
class UnpackSummary:
    archive: Path
    written: int = 0       # members unpacked by this call
    present: int = 0       # members already in place
    skipped: int = 0       # members the mapping left out (or unsafe paths)
    bytes: int = 0


def _remove_if(archive: Path, remove: bool) -> str:
    if remove:
        archive.unlink(missing_ok=True)
        return f"removed {archive}, run again to download it afresh"
    return "get an intact copy"


def _member_destination(name: str | None, dest: Path, target: Callable[[PurePosixPath], PurePosixPath | None],
                        size: int, summary: "UnpackSummary") -> Path | None:
    """Where an archive member named ``name`` is unpacked, or None (counted in ``summary``) when it is skipped
    (``name`` None, unsafe, or not wanted by ``target``) or already there at its full ``size``."""
    member = safe_member_path(name) if name is not None else None
    rel = target(member) if member is not None else None
    if rel is None:
        summary.skipped += 1
        return None
    out = dest / rel
    if out.is_file() and out.stat().st_size == size:
        summary.present += 1
        return None
    return out


def unpack_zip(archive: str | os.PathLike, dest: str | os.PathLike, *,
               target: Callable[[PurePosixPath], PurePosixPath | None] = lambda p: p,
               remove_bad_archive: bool = True, quiet: bool = False) -> UnpackSummary:
    """Unpack ``archive`` into ``dest``, each member through ``<file>.partial`` renamed after its CRC-32 check.

    ``target(member) → path`` (None: skip); members in place are kept; a damaged one is a :class:`UserError`
    (``remove_bad_archive`` deletes the archive too)."""
    archive, dest = Path(archive), Path(dest)
    summary = UnpackSummary(archive)
    try:
        handle = zipfile.ZipFile(archive)
    except (zipfile.BadZipFile, OSError) as exc:
        raise UserError(f"{archive} is not a readable zip archive ({exc}); {_remove_if(archive, remove_bad_archive)}"
                        ) from None
    with handle:
        plan = []
        for info in handle.infolist():
            if info.is_dir():
                continue
            out = _member_destination(info.filename, dest, target, info.file_size, summary)
            if out is not None:
                plan.append((info, out))
        needed = sum(info.file_size for info, _ in plan)
        if needed:
            ensure_free_space(dest, needed, f"unpacking {archive.name}")
        bar = progress(total=needed, desc=f"unpack {archive.name}", unit="B", quiet=quiet, unit_scale=True,
                       unit_divisor=1000)
        try:
            for info, out in plan:
                out.parent.mkdir(parents=True, exist_ok=True)
                part = partial_path(out)
                try:
                    with handle.open(info) as src, open(part, "wb") as dst:
                        for block in iter(lambda: src.read(CHUNK_BYTES), b""):
                            dst.write(block)
                            bar.update(len(block))
                except (zipfile.BadZipFile, EOFError, zlib.error, OSError) as exc:
                    part.unlink(missing_ok=True)
                    if isinstance(exc, OSError) and exc.errno == errno.ENOSPC:
                        raise UserError(f"the disk holding {dest} is full; free some space and run again") from None
                    raise UserError(f"{archive}: member {info.filename} fails its check ({exc}): the archive is "
                                    f"damaged; {_remove_if(archive, remove_bad_archive)}") from None
                os.replace(part, out)
                summary.written += 1
                summary.bytes += info.file_size
        finally:
            bar.close()
    return summary


def unpack_tar(archive: str | os.PathLike, dest: str | os.PathLike, *,
               target: Callable[[PurePosixPath], PurePosixPath | None] = lambda p: p,
               quiet: bool = False) -> UnpackSummary:
    """Unpack a ``.tar``/``.tar.gz`` (a tar has no per-member checksum; gzip's CRC covers the whole stream and
    is checked when the stream ends). Regular files only, each through ``.partial``; others are skipped."""
    archive, dest = Path(archive), Path(dest)
    summary = UnpackSummary(archive)
    try:
        with tarfile.open(archive, "r:*") as handle:
            for info in handle:
                out = _member_destination(info.name if info.isreg() else None, dest, target, info.size, summary)
                if out is None:
                    continue
                out.parent.mkdir(parents=True, exist_ok=True)
                part = partial_path(out)
                src = handle.extractfile(info)
                with src, open(part, "wb") as dst:
                    shutil.copyfileobj(src, dst, CHUNK_BYTES)
                if part.stat().st_size != info.size:
                    part.unlink(missing_ok=True)
                    raise UserError(f"{archive}: member {info.name} is cut short: the archive is damaged")
                os.replace(part, out)
                summary.written += 1
                summary.bytes += info.size
    except (tarfile.TarError, EOFError, OSError, zlib.error) as exc:
        raise UserError(f"{archive} is not a readable tar archive or is damaged ({type(exc).__name__}: {exc}); "
                        f"get an intact copy") from None
    return summary


def is_unpacked(folder: str | os.PathLike, source: Source, files_in: str | os.PathLike | None = None) -> bool:
    """Whether ``folder`` holds what ``source`` unpacks to: its stamp (written by :func:`mark_unpacked`), or —
    for data copied by hand — at least ``source.files`` files in ``files_in`` (default ``folder``)."""
    folder = Path(folder)
    if (folder / f".{source.key}.unpacked").is_file():
        return True
    files_in = Path(files_in) if files_in is not None else folder
    if source.files and files_in.is_dir():
        count = 0
        with os.scandir(files_in) as entries:
            for entry in entries:
                count += entry.is_file()
                if count >= source.files:
                    return True
    return False


def mark_unpacked(folder: str | os.PathLike, source: Source, summary: UnpackSummary) -> None:
    """Stamp ``folder`` as holding ``source``'s complete contents (so its archive may go)."""
    stamp = Path(folder) / f".{source.key}.unpacked"
    stamp.parent.mkdir(parents=True, exist_ok=True)
    stamp.write_text(f"{summary.archive.name}: {summary.written + summary.present} files\n")

