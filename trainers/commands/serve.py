"""``retr-train serve``: the search page of a run (:mod:`retr.trainers.search.serve_app`) on waitress."""
from __future__ import annotations

import logging
import signal
import sys

import click

from retr.common.cli import InputPath, quiet_option
from retr.trainers.commands.options import FEATURES, IMAGE_ROOT, MANIFEST, RUN
from retr.common.devices import exact_float32
from retr.trainers.runs.hub import local_run
from retr.trainers.search.retrieval import Retriever
from retr.trainers.search.serve_app import SearchPage, check_sources, create_app, listen, server_modules


@click.command("serve")
@click.argument("run", type=RUN)
@click.option("--index", type=InputPath("folder", "a gallery index folder"),
              help="A gallery index (retr-train index) instead of the split.")
@click.option("--host", default="127.0.0.1", show_default=True,
              help="Address to listen on: loopback, this machine only; 0.0.0.0 exposes the page to your network.")
@click.option("--port", default=8000, show_default=True, type=click.IntRange(0, 65535), help="0: any free port.")
@click.option("--split", default="test", show_default=True, help="The gallery: this split of the run's data.")
@click.option("--features", type=FEATURES, help="Override the run's feature set.")
@click.option("--manifest", type=MANIFEST, help="Override the run's manifest.")
@click.option("--image-root", type=IMAGE_ROOT,
              help="Folder the manifest's image paths are relative to (default: the manifest's folder).")
@click.option("--checkpoint", default="best", show_default=True, help="best, last, or a file in the run.")
@click.option("--device", default="auto", show_default=True)
@click.option("--top", default=10, show_default=True, type=click.IntRange(1, 100), help="Results per query.")
@click.option("--max-upload-mb", default=10.0, show_default=True, type=click.FloatRange(min=0, min_open=True),
              help="Largest image file a user may upload.")
@click.option("--threads", default=8, show_default=True, type=click.IntRange(1, 64),
              help="Request threads (images are served while a query holds the model).")
@click.option("--trust-checkpoint", is_flag=True,
              help="Read a checkpoint that holds Python objects besides tensors (only for files you trust).")
@quiet_option
def serve_command(run, index, host, port, split, features, manifest, image_root, checkpoint, device, top,
                  max_upload_mb, threads, trust_checkpoint, quiet):
    """Serve a search page for a trained run: a sentence → images, an image (picked or uploaded) → captions,
    each result's attention maps where the model has them, and the run's summary. Stop it with Ctrl-C.

    Listens on loopback (this machine only) unless --host says otherwise.

    \b
    Example:
      retr-train serve runs/scan-f30k --image-root data/f30k
      retr-train serve runs/scan-f30k --port 8080 --host 0.0.0.0     # reachable from your network
    """
    # every check that can fail runs before the model is loaded: the serve extra, the files, then the address
    server_modules()
    run = str(local_run(run))                   # an hf-hub: name: its snapshot (fetched on first use)
    check_sources(run, split, features, manifest, image_root, index)
    max_upload = int(max_upload_mb * (1 << 20))
    server, late = listen(host, port, threads, max_request_body_size=2 * max_upload + (1 << 20))
    # waitress warns "Task queue depth is N" whenever a request waits for a thread: a page's images do, by design
    logging.getLogger("waitress.queue").setLevel(logging.ERROR)
    # a plain kill still closes the socket and removes the drawings
    previous = signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
    page = None
    try:
        retriever = Retriever.from_run(run, features, manifest, split, checkpoint, device,
                                       trust_checkpoint=trust_checkpoint, quiet=quiet,
                                       **({"index": index} if index else {}))
        page = SearchPage(retriever, run, split, features, manifest, image_root, checkpoint, top, max_upload, index)
        late.app = create_app(page)
        where = ("this machine only; --host 0.0.0.0 exposes it to your network"
                 if host in ("127.0.0.1", "localhost", "::1") else f"open to whoever reaches {host}")
        shown = f"[{host}]" if ":" in host else host
        click.echo(f"serving {run} at http://{shown}:{server.effective_port}/ ({where}); Ctrl-C stops it")
        with exact_float32():       # for the server's life (its threads share these settings): eval's scores
            server.run()
    except KeyboardInterrupt:
        pass
    finally:
        server.close()
        if page is not None:
            page.close()
        signal.signal(signal.SIGTERM, previous)
