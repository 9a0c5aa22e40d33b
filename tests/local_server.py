"""A local HTTP server for download tests (no test ever reaches the internet).

``LocalServer`` serves byte strings from memory on 127.0.0.1 with HTTP ``Range`` support (206 with
``Content-Range``, 416 past the end) and a few ways to misbehave on purpose, per path:

* ``cut[path] = [n1, n2, …]`` — the next requests announce the full length but close the connection after
  ``n1``, ``n2``, … bytes of the body (an interrupted transfer);
* ``ignore_range`` — answer 200 with the whole file even when a range was asked for;
* ``fail[path] = [500, …]`` — answer the next requests with these statuses;
* anything not in ``files`` is a 404.

Every request is recorded in ``requests`` as ``(path, Range header or None)``.
"""
from __future__ import annotations

import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from urllib.parse import urlsplit


class _QuietServer(ThreadingHTTPServer):
    """A client that hangs up mid-reply (a download tested for resumes, or one that gave up on a 404) is normal
    here: record the error instead of printing a traceback onto the stderr a test is capturing."""

    def handle_error(self, request, client_address) -> None:
        import sys

        self.errors = [*getattr(self, "errors", []), sys.exc_info()[1]]


class LocalServer:
    def __init__(self):
        self.files: dict[str, bytes] = {}
        self.cut: dict[str, list[int]] = {}
        self.fail: dict[str, list[int]] = {}
        self.ignore_range: set[str] = set()
        self.requests: list[tuple[str, str | None]] = []
        server = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args):  # keep pytest's output clean
                pass

            def do_GET(self):  # noqa: N802 - http.server's name
                path = urlsplit(self.path).path
                asked = self.headers.get("Range")
                server.requests.append((path, asked))
                if server.fail.get(path):
                    self.send_error(server.fail[path].pop(0))
                    return
                body = server.files.get(path)
                if body is None:
                    self.send_error(404, "Not Found")
                    return
                start = 0
                if asked and path not in server.ignore_range:
                    start = int(asked.split("=", 1)[1].split("-", 1)[0])
                    if start >= len(body):
                        self.send_response(416)
                        self.send_header("Content-Range", f"bytes */{len(body)}")
                        self.send_header("Content-Length", "0")
                        self.end_headers()
                        return
                    self.send_response(206)
                    self.send_header("Content-Range", f"bytes {start}-{len(body) - 1}/{len(body)}")
                else:
                    self.send_response(200)
                self.send_header("Content-Length", str(len(body) - start))
                self.send_header("Content-Type", "application/octet-stream")
                self.end_headers()
                chunk = body[start:]
                if server.cut.get(path):
                    chunk = chunk[:server.cut[path].pop(0)]
                    self.wfile.write(chunk)
                    self.wfile.flush()
                    self.close_connection = True
                    return
                self.wfile.write(chunk)

        self.httpd = _QuietServer(("127.0.0.1", 0), Handler)
        self.httpd.daemon_threads = True
        self.thread = threading.Thread(target=self.httpd.serve_forever, daemon=True)

    @property
    def url(self) -> str:
        host, port = self.httpd.server_address[:2]
        return f"http://{host}:{port}"

    def __enter__(self) -> "LocalServer":
        self.thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()
