"""The search page of ``retr-train serve``: a Flask app over a :class:`~retr.trainers.search.retrieval.Retriever`.

Routes; a bad request gets HTTP 4xx with ``{"error": "one line"}``, and the server goes on serving::

    GET  /                                   the page (web/index.html, app.js, style.css; report.css: the report's)
    GET  /api/info                           the run's summary (the report's tables), the gallery, the limits
    GET  /api/search?q=TEXT&k=K              text → images (Retriever.text_to_images: search's results)
    GET  /api/captions?image=ID&k=K          a gallery image → captions (Retriever.image_to_texts)
    POST /api/captions  (form file "image")  an uploaded image → captions; at most ``max_upload`` bytes
    GET  /api/explain?image=ID&caption=TEXT  the report's attention drawings of that pair (``caption_index=N``:
                                             a gallery caption)
    GET  /image/ID                           a gallery image's file: the manifest's path under the image root
                                             (a request names an id, never a path)
    GET  /assets/NAME                        the drawings /api/explain made (a temporary folder)

One request uses the model at a time (a lock). No response names a file of the server: messages name files by
their last part (:meth:`SearchPage.public`), and a failure's details go to the server's log, not to the page.

Before anything heavy, ``retr-train serve`` runs :func:`check_sources` (the run, its data, the index, the image
root) and :func:`listen` (the address): a wrong input is one line before the model is loaded.
"""
from __future__ import annotations

import errno
import hashlib
import io
import logging
import re
import socket
import tempfile
import threading
from collections import OrderedDict
from pathlib import Path, PurePosixPath

from PIL import Image, UnidentifiedImageError

from retr.common.errors import UserError
from retr.common.optional import require
from retr.trainers.reporting.explain import ASSETS, Assets, Explainer, ImageSource, Pair
from retr.trainers.reporting.html import CSS, Member, member_rows, run_metrics, stored_results
from retr.trainers.search.index import GalleryIndex
from retr.manifests.schema import outside_root_reason, read_manifest, resolve_image_root
from retr.trainers.runs import checkpoint as ckpt

WEB = Path(__file__).with_name("web")
MAX_K = 100
KEPT = 64            # explained pairs whose drawings are kept (the oldest are deleted)
CHECKED_IMAGES = 16  # gallery images looked for under the image root at start-up (evenly spaced over the split)
logger = logging.getLogger(__name__)
#: an absolute POSIX path inside a message (after the page's known paths are replaced): shortened to its last part
_ABSOLUTE = re.compile(r"""(^|[\s'"(\[=,])(/(?:[^\s'"()\[\],/<>]+/)*[^\s'"()\[\],/<>]*)""")


class RequestError(UserError):
    """A bad request: its one-line message goes back with ``status``."""

    def __init__(self, message: str, status: int = 400):
        super().__init__(message)
        self.status = status


def check_sources(run, split: str = "test", features: str | None = None, manifest: str | None = None,
                  image_root: str | None = None, index: str | None = None) -> None:
    """Refuse in one :class:`UserError` what would make the page fail, before the model is loaded: a run folder
    without ``config.json``, a feature set or manifest that is not a file, an index folder without ``meta.json``,
    an ``image_root`` that is not a folder, or (a split's gallery) an image root under which none of
    :data:`CHECKED_IMAGES` images of the split, evenly spaced, has its file."""
    config = ckpt.read_config(run)              # "RUN is not a run folder (it holds no config.json)"
    given = {"features": features, "manifest": manifest}
    for name, path in given.items():
        if path is not None and not Path(path).is_file():
            raise UserError(f"{name} {path} is not a file", parameters=(name,))
        recorded = config.get(name)
        if path is None and not (recorded and Path(recorded).is_file()):
            raise UserError(f"{run} records no usable {name} file ({recorded or 'none'}: moved or imported run?); "
                            f"pass --{name}")
    manifest = manifest or config["manifest"]
    if index is not None:
        if not Path(index).is_dir():
            what = "a file" if Path(index).exists() else "absent"
            raise UserError(f"{index} is not a gallery index (not a folder: {what}); build one with retr-train index")
        if GalleryIndex(index).meta is None:
            raise UserError(f"{index} is not a gallery index (no meta.json); build one with retr-train index")
    if image_root is not None and not Path(image_root).is_dir():
        what = "a file" if Path(image_root).exists() else "absent"
        raise UserError(f"image_root {image_root} is not a folder ({what}); give the folder the manifest's image "
                        "paths are relative to", parameters=("image_root",))
    if index is not None:
        return                                  # an index serves the files it read
    root = resolve_image_root(manifest, image_root)
    records = [r for r in read_manifest(manifest, splits=[split]) if outside_root_reason(r.path) is None]
    sample = records[::max(1, len(records) // CHECKED_IMAGES)][:CHECKED_IMAGES]
    if sample and not any((root / r.path).is_file() for r in sample):
        raise UserError(f"no image of the {split} split is under {root} (looked for {len(sample)}, e.g. "
                        f"{sample[0].path}): give image_root, the folder the manifest's image paths are relative to",
                        parameters=("image_root",))


class LateApp:
    """A WSGI application whose Flask app (:attr:`app`) is set once the model is loaded: the server's socket is
    bound first, so a wrong address is refused before any work. Requests wait in the socket's queue meanwhile."""

    app = None

    def __call__(self, environ, start_response):
        return self.app(environ, start_response)


def listen(host: str, port: int, threads: int, max_request_body_size: int):
    """``(server, LateApp)``: a waitress server bound to ``host:port`` (not yet serving), or one line saying why
    not (an address that is no address of this machine, a port in use or not allowed)."""
    _, waitress = server_modules()
    try:
        socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    except (socket.gaierror, UnicodeError) as exc:
        reason = getattr(exc, "strerror", None) or str(exc)
        raise UserError(f"cannot listen on {host}: no such address ({reason}); host takes an address of this "
                        "machine (127.0.0.1, ::1; 0.0.0.0 for all of them) or its name", parameters=("host",)) from None
    late = LateApp()
    try:
        server = waitress.create_server(late, host=host, port=port, threads=threads,
                                        max_request_body_size=max_request_body_size)
    except (OSError, ValueError) as exc:
        code = getattr(exc, "errno", None)
        reason = getattr(exc, "strerror", None) or str(exc)
        advice = {errno.EADDRINUSE: "something else listens there: choose another port (0: any free one)",
                  errno.EACCES: "ports below 1024 need privileges: choose another port (0: any free one)"}.get(
            code, "host must be an address of this machine")
        raise UserError(f"cannot listen on {host}:{port} ({reason}); {advice}", parameters=("host", "port")) from None
    return server, late


class SearchPage:
    """What the routes need of a run: the retriever, the gallery's image files, the report's summary
    (:mod:`retr.trainers.reporting.html`) and explainer (:mod:`retr.trainers.reporting.explain`), the drawings'
    folder.

    The gallery is the retriever's: the split's images, found through the manifest under ``image_root`` (default:
    the manifest's folder), or those of the gallery index ``index``, read from the files it recorded when each
    image was added. Captions are the split's. Every folder and file given is made absolute here, once: the
    working directory of the server is not the routes' business."""

    def __init__(self, retriever, run, split: str = "test", features: str | None = None,
                 manifest: str | None = None, image_root: str | None = None, checkpoint: str = "best",
                 top: int = 10, max_upload: int = 10 << 20, index: str | None = None):
        run = Path(run).resolve()
        self.r, self.run, self.split, self.top, self.max_upload = retriever, str(run), split, top, max_upload
        self.name = run.name                    # how the page names the run
        config = ckpt.read_config(run)
        manifest = Path(manifest or config["manifest"]).resolve()
        index = None if index is None else Path(index).resolve()
        data, fs = retriever.data, retriever.feature_set
        by_id = {r.id: r for r in read_manifest(manifest, splits=[split])}
        self.records = [by_id[i] for i in data.image_ids]
        self.split_row = {image_id: i for i, image_id in enumerate(data.image_ids)}
        self.gallery = f"the index {index.name}" if index else f"the {split} split"
        # the split's images: the gallery's files (no index) and the attention drawings' pictures
        self.split_root = resolve_image_root(manifest, image_root).resolve()
        self.root = None if index else self.split_root
        # gallery id → the index's recorded file, or the manifest's path under the root
        self.paths = ({i: p.resolve() for i, p in GalleryIndex(index).image_paths().items()} if index
                      else {r.id: r.path for r in self.records})
        self.member = Member(self.name, config, retriever.model, retriever.vocab,
                             ckpt.resolve_checkpoint(run, checkpoint), fs, run_metrics(self.run), data, str(manifest))
        self.image_hw = fs.read_rows(fs.rows_of(data.image_ids), "image_hw") if "image_hw" in fs.datasets else None
        self.keys = [f"{r.id}#{n}" for r in self.records for n in range(len(r.captions))]
        self.lock = threading.Lock()
        self._tmp = tempfile.TemporaryDirectory(prefix="retr-serve-")
        self.drawings = Path(self._tmp.name)
        self._explained: OrderedDict[str, str] = OrderedDict()
        # the server's own paths, longest first, and how responses name them instead
        named = {self.run: self.name, str(manifest): manifest.name, str(self.split_root): "the image root",
                 str(self.drawings): "drawings", str(Path(fs.path).resolve()): Path(fs.path).name}
        if index:
            named[str(index)] = index.name
        self._named = sorted(named.items(), key=lambda item: -len(item[0]))
        self.summary = self.public(member_rows([self.member]) + stored_results([self.run]))

    def close(self) -> None:
        self._tmp.cleanup()

    def public(self, text: str) -> str:
        """``text`` without a path of the server: the page's own files and folders by name (the run, the feature
        set, the manifest; the image root as "the image root"), any file under them or other absolute path by its
        last part."""
        for path, name in self._named:          # a file under one of them: by its own last part
            text = re.sub(re.escape(path) + r"""(/[^\s'"()\[\],<>]+)?""",
                          lambda m: PurePosixPath(m.group(1)).name if m.group(1) else name, text)
        return _ABSOLUTE.sub(lambda m: m.group(1) + (PurePosixPath(m.group(2)).name or "/"), text)

    # -- the gallery -------------------------------------------------------------------------------------
    def check_id(self, image_id: str) -> str:
        """``image_id`` when it is an image of the gallery (else a one-line 400/404)."""
        if not image_id:
            raise RequestError("no image: pick an image of the gallery, or upload one")
        if image_id not in self.paths:
            raise RequestError(f"image {image_id!r} is not in the gallery ({len(self.paths)} images)", 404)
        return image_id

    def image_path(self, image_id: str) -> Path:
        """The file of gallery image ``image_id``, an absolute path (404: not in the gallery, outside the root, no
        file; the response names no path, the server's log does)."""
        path = self.paths[self.check_id(image_id)]
        if self.root is None:                   # an index: the file it read, recorded by whoever built it
            if not path.is_file():
                logger.warning(f"image {image_id!r}: the index's file {path} is gone")
                raise RequestError(f"image {image_id!r}: its file is gone from where the index read it", 404)
            return path
        if (why := outside_root_reason(path)) is not None:
            logger.warning(f"image {image_id!r}: its manifest path {path!r} leaves the image root ({why})")
            raise RequestError(f"image {image_id!r} is not served: its manifest path leaves the image root ({why})",
                               404)
        file = self.root / path
        if not file.is_file():
            logger.warning(f"image {image_id!r}: no file {file}")
            raise RequestError(f"image {image_id!r}: its file is missing from the image root", 404)
        return file

    # -- queries -----------------------------------------------------------------------------------------
    def search(self, text: str, k: int) -> dict:
        if not text.strip():
            raise RequestError("empty query: type a sentence describing the images you want")
        with self.lock:
            return self.r.text_to_images([text], k)[0].to_json()

    def captions(self, image, k: int) -> dict:
        """Captions of a gallery image id (str) or of an uploaded file's bytes."""
        if isinstance(image, str):
            self.check_id(image)      # an id of the gallery: never a path the API would open
        with self.lock:
            return self.r.image_to_texts([image], k)[0].to_json()

    def explain(self, image_id: str, caption: str | None, caption_index: int | None) -> str:
        """The report's HTML (and drawings) of ``explain`` for the pair, without the report's heading (the page
        writes its own); kept for the :data:`KEPT` last pairs."""
        if self.check_id(image_id) not in self.split_row or image_id not in self.member.feature_set:
            raise RequestError(f"no attention maps for {image_id!r}: they are drawn for the images of the run's "
                               "feature set")
        row = self.split_row[image_id]
        if caption_index is not None:
            if not 0 <= caption_index < len(self.keys):
                raise RequestError(f"caption_index must be from 0 to {len(self.keys) - 1}", 404)
            captions, keys = [self.r.data.captions[caption_index]], [self.keys[caption_index]]
        elif caption and caption.strip():
            captions, keys = [caption], ["query"]
        else:
            raise RequestError("no caption: give the sentence (caption) or a gallery caption (caption_index)")
        tag = hashlib.sha256(f"{image_id}\0{keys[0]}\0{captions[0]}".encode()).hexdigest()[:16]
        with self.lock:
            if tag not in self._explained:
                fs = self.member.feature_set
                images = ImageSource(self.records, self.split_root, self.image_hw,
                                     bool(fs.attrs.get("exif_orientation", False)))
                explainer = Explainer(self.member, self.r.data.image_ids, captions, images, Assets(self.drawings),
                                      self.r.device, keys)
                html = explainer.section([Pair(row, 0, "a search result", "the maps of its score")], tag)
                self._explained[tag] = self.public(re.sub(r"\A<h3>.*?</h3>\n?", "", html))
                while len(self._explained) > KEPT:
                    old, _ = self._explained.popitem(last=False)
                    for file in (self.drawings / ASSETS).glob(f"att-{old}-*"):
                        file.unlink()
            self._explained.move_to_end(tag)
            return self._explained[tag]

    def too_large(self) -> str:
        return (f"the upload is larger than the limit of {self.max_upload / (1 << 20):.3g} MB "
                "(retr-train serve --max-upload-mb)")

    def info(self) -> dict:
        model = self.r.model
        return {"run": self.name, "model": self.member.config.get("model"), "gallery": self.gallery,
                "images": len(self.paths), "captions": self.r.data.num_captions, "top": self.top, "max_k": MAX_K,
                "max_upload": self.max_upload, "explains": list(getattr(model, "explains", ()) or ()),
                "ids": list(self.paths)[:1000], "summary_html": self.summary}


def check_image(name: str, data: bytes) -> None:
    """A one-line :class:`RequestError` unless ``data`` is an image file PIL can open and decode whole (a file
    cut short is refused here, with its name, not by the extractor)."""
    name = name or "the upload"
    if not data:
        raise RequestError(f"{name} is empty")
    try:
        with Image.open(io.BytesIO(data)) as image:
            image.verify()
        with Image.open(io.BytesIO(data)) as image:
            image.load()
    except UnidentifiedImageError:
        raise RequestError(f"{name} is not an image file (no image format Pillow knows)") from None
    except Exception as exc:   # noqa: BLE001 - a damaged image raises many types
        reason = (str(exc).strip().splitlines() or [type(exc).__name__])[0]
        raise RequestError(f"{name} is not a readable image file ({reason})") from None


def server_modules():
    """(flask, waitress): the ``serve`` extra, or one line naming it."""
    return require("flask", "serve", "retr-train serve"), require("waitress", "serve", "retr-train serve")


def create_app(page: SearchPage):
    """The Flask app of ``page``."""
    flask, _ = server_modules()
    from werkzeug.exceptions import HTTPException  # optional: werkzeug comes with flask, the serve extra

    app = flask.Flask(__name__, static_folder=str(WEB), static_url_path="/static")
    app.config["MAX_CONTENT_LENGTH"] = page.max_upload + (64 << 10)     # room for the form around the file

    def top() -> int:
        value = flask.request.values.get("k", str(page.top))
        if not value.isdigit() or not 1 <= int(value) <= MAX_K:
            raise RequestError(f"the number of results (k) must be a whole number from 1 to {MAX_K}, not {value!r}")
        return int(value)

    def one_line(message: str, status: int):
        return flask.jsonify(error=" ".join(page.public(message).split())), status

    @app.errorhandler(RequestError)
    def request_error(exc: RequestError):
        return one_line(str(exc), exc.status)

    @app.errorhandler(UserError)
    def user_error(exc: UserError):
        return one_line(str(exc), 400)

    @app.errorhandler(HTTPException)
    def http_error(exc: HTTPException):
        return one_line(page.too_large() if exc.code == 413 else exc.description, exc.code)

    @app.errorhandler(Exception)
    def failure(exc: Exception):
        logger.exception(f"{flask.request.method} {flask.request.full_path}: {type(exc).__name__}: {exc}")
        return flask.jsonify(error="the server failed on this request (its log says why); try again or another "
                                   "query"), 500

    @app.get("/")
    def index():
        return flask.send_from_directory(WEB, "index.html")

    @app.get("/report.css")
    def report_css():
        return flask.Response(CSS, mimetype="text/css")

    @app.get("/api/info")
    def info():
        return flask.jsonify(page.info())

    @app.get("/api/search")
    def search():
        return flask.jsonify(page.search(flask.request.args.get("q", ""), top()))

    @app.route("/api/captions", methods=["GET", "POST"])
    def captions():
        if flask.request.method == "GET":
            return flask.jsonify(page.captions(flask.request.args.get("image", ""), top()))
        upload = flask.request.files.get("image")
        if upload is None:
            raise RequestError("no file: choose an image to upload (form field 'image')")
        name = PurePosixPath((upload.filename or "").replace("\\", "/")).name or "the upload"
        data = upload.read(page.max_upload + 1)
        if len(data) > page.max_upload:
            raise RequestError(page.too_large(), 413)
        check_image(name, data)
        k = top()
        try:
            result = page.captions(data, k)
        except RequestError:
            raise
        except UserError as exc:              # the library names bytes "<bytes>": the user knows the file's name
            raise RequestError(str(exc).replace("<bytes>", name)) from None
        return flask.jsonify({**result, "query": name})

    @app.get("/api/explain")
    def explain():
        values = flask.request.args
        index = values.get("caption_index")
        if index is not None and not index.isdigit():
            raise RequestError(f"caption_index must be a whole number, not {index!r}")
        return flask.jsonify(html=page.explain(values.get("image", ""), values.get("caption"),
                                               None if index is None else int(index)),
                             model=page.member.config.get("model"))

    @app.get("/image/<path:image_id>")
    def image(image_id: str):
        return flask.send_file(page.image_path(image_id), max_age=3600)

    @app.get("/assets/<name>")
    def assets(name: str):
        return flask.send_from_directory(page.drawings / "assets", name, max_age=3600)

    return app
