"""``retr-train serve``'s search page, through Flask's test client and through the real command: results are
``search``'s, images are served by gallery id only, attention is the report's drawings, and every bad request
gets one line while the next good one is answered as before.

One tiny SCAN run (synthetic images, region features with boxes: ``tests/report_synthetic.py``) serves the whole
module. Its manifest is copied with one test image's path changed to ``../outside.jpg`` (a file that exists beside
the image root), so a server that followed manifest paths out of the root would serve it, and another's to a file
that does not exist. No response may name a path of the server (the run's, the image root's, the drawings'
folder), nor hold a traceback. Wrong start-up inputs of the command: ``tests/test_serve_wrong_inputs.py``.
"""
from __future__ import annotations

import io
import json
import os
import re
import signal
import subprocess
import sys
import urllib.parse
import urllib.request
from pathlib import Path

import pytest
from PIL import Image

pytest.importorskip("flask", reason="the serve extra (flask, waitress) is not installed: pip install 'retr[serve]'")

from retr.trainers.search.retrieval import Retriever  # noqa: E402
from retr.trainers.search.serve_app import KEPT, SearchPage, create_app  # noqa: E402

QUERY = "a large red circle left of a small blue square"


def served_run(folder: Path) -> tuple[Path, Path, str, str]:
    """(run, manifest whose last test image leaves the root, that image's id, the id of a test image whose file is
    missing): a tiny SCAN on synthetic images."""
    from report_synthetic import make_images, train_tiny, write_scene_boxes

    manifest = make_images(folder / "data", images=60)
    run = train_tiny("scan", write_scene_boxes(folder / "data"), manifest, folder / "scan", "--epochs", "1",
                     "--device", "cpu")
    rows = [json.loads(line) for line in manifest.read_text().splitlines()]
    outside = [r for r in rows if r["split"] == "test"][-1]
    (folder / "outside.jpg").write_bytes((folder / "data" / outside["path"]).read_bytes())
    outside["path"] = "../outside.jpg"
    missing = [r for r in rows if r["split"] == "test"][-2]
    missing["path"] = "images/gone.jpg"
    served = folder / "data" / "served.jsonl"
    served.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return run, served, outside["id"], missing["id"]


@pytest.fixture(scope="module")
def site(tmp_path_factory):
    folder = tmp_path_factory.mktemp("serve")
    run, manifest, outside, missing = served_run(folder)
    retriever = Retriever.from_run(run, manifest=str(manifest), device="cpu")
    page = SearchPage(retriever, run, manifest=str(manifest), max_upload=40_000)
    yield page, create_app(page).test_client(), outside, missing
    page.close()
    assert not page.drawings.exists(), "closing the page removes its drawings"


def _error(response, status: int) -> str:
    assert response.status_code == status, response.get_data(as_text=True)
    message = response.get_json()["error"]
    assert message and "\n" not in message and "Traceback" not in message
    assert "/" not in message.replace("retr-train serve", ""), f"a path in {message!r}"
    return message


def test_text_and_image_queries_return_searchs_results(site):
    page, client, *_ = site
    body = client.get("/api/search", query_string={"q": QUERY, "k": 4}).get_json()
    assert body == page.r.text_to_images([QUERY], 4)[0].to_json()
    assert [h["rank"] for h in body["hits"]] == [1, 2, 3, 4]
    image = body["hits"][0]["image_id"]
    captions = client.get("/api/captions", query_string={"image": image, "k": 3}).get_json()
    assert captions == page.r.image_to_texts([image], 3)[0].to_json()
    unknown = client.get("/api/search", query_string={"q": "a zebra circle"}).get_json()
    assert unknown["unknown_words"] == ["zebra"] and len(unknown["hits"]) == min(page.top, len(page.paths))


def test_info_gives_the_runs_summary_and_gallery(site):
    page, client, *_ = site
    info = client.get("/api/info").get_json()
    assert info["model"] == "scan" and info["gallery"] == "the test split"
    assert info["images"] == len(page.r.data.image_ids) == len(info["ids"]) and info["explains"] == ["word_to_region"]
    assert info["captions"] == page.r.data.num_captions
    assert "class='members'" in info["summary_html"] and info["run"] == page.name == "scan"
    assert f"<td>{page.name}</td>" in info["summary_html"] and "<td>scene-boxes.h5<br>" in info["summary_html"]
    assert "epoch 1 of 1" in info["summary_html"]           # the best validation epoch, from metrics.jsonl
    html = client.get("/").get_data(as_text=True)
    assert 'id="query"' in html and "static/app.js" in html
    assert client.get("/static/app.js").status_code == 200 and client.get("/report.css").mimetype == "text/css"
    page_files = [client.get(url).get_data(as_text=True) for url in ("/", "/static/app.js", "/static/style.css")]
    # self-contained: nothing fetched from another site (no CDN, fonts or scripts)
    assert not any(re.search(r"(src|href)=[\"']?(https?:)?//|@import|url\(\s*['\"]?(https?:)?//", text)
                   for text in page_files)


def test_images_are_served_by_gallery_id_only(site):
    page, client, outside, _ = site
    image = page.r.data.image_ids[0]
    response = client.get(f"/image/{image}")
    assert response.status_code == 200 and response.mimetype == "image/jpeg"
    assert response.data == page.image_path(image).read_bytes()
    assert "its manifest path leaves the image root ('..' climbs above the image root)" in _error(
        client.get(f"/image/{outside}"), 404)
    assert (page.root.parent / "outside.jpg").is_file()     # the file is there: refused for where it is
    for url in ("/image/../../etc/passwd", "/image/..%2F..%2Fetc%2Fpasswd", "/image/%2Fetc%2Fpasswd",
                "/image/data/images", "/assets/..%2F..%2Fetc%2Fpasswd", "/static/..%2Fserve_app.py"):
        assert client.get(url, follow_redirects=True).status_code == 404, url
    # an image query names a gallery id, never a file the server would read
    assert "not in the gallery" in _error(client.get("/api/captions", query_string={"image": "/etc/hostname"}), 404)


def test_attention_is_the_reports_drawing_of_the_pair(site):
    page, client, *_ = site
    image = page.r.data.image_ids[1]
    body = client.get("/api/explain", query_string={"image": image, "caption": QUERY}).get_json()
    html = body["html"]
    assert f"«{QUERY}»" in html and "word_to_region" in html and "— boxes" in html
    # the page writes the heading (the model once, the pair): the report's "run — model" heading is left out
    assert body["model"] == "scan" and "<h3>" not in html and not html.startswith("<h")
    sources = re.findall(r"src='([^']+)'", html)
    words = len(QUERY.split()) + 2                          # every token, <start> and <end> included
    assert len(sources) == 1 + words and all(s.startswith("assets/att-") for s in sources)
    for source in sources:
        response = client.get("/" + source)
        assert response.status_code == 200
        assert Image.open(io.BytesIO(response.data)).size[0] > 0
    assert client.get("/api/explain", query_string={"image": image, "caption": QUERY}).get_json() == body
    gallery = client.get("/api/explain", query_string={"image": image, "caption_index": 2}).get_json()["html"]
    assert f"«{page.r.data.captions[2]}»" in gallery


def test_old_drawings_are_deleted(site, monkeypatch):
    page, client, *_ = site
    monkeypatch.setattr("retr.trainers.search.serve_app.KEPT", 1)
    image = page.r.data.image_ids[2]
    first = re.findall(r"src='([^']+)'", client.get("/api/explain", query_string={
        "image": image, "caption": "a small green star"}).get_json()["html"])
    assert client.get("/" + first[0]).status_code == 200
    client.get("/api/explain", query_string={"image": image, "caption": "a large purple diamond"})
    assert client.get("/" + first[0]).status_code == 404 and KEPT > 1


def _jpeg(size: int) -> bytes:
    buffer = io.BytesIO()
    Image.effect_noise((size, size), 80).convert("RGB").save(buffer, format="JPEG", quality=95)
    return buffer.getvalue()


BAD = {
    "empty query": ("get", "/api/search", {"q": ""}, 400, "empty query"),
    "blank query": ("get", "/api/search", {"q": "   "}, 400, "empty query"),
    "k zero": ("get", "/api/search", {"q": QUERY, "k": "0"}, 400,
               "the number of results (k) must be a whole number from 1 to 100, not '0'"),
    "k text": ("get", "/api/search", {"q": QUERY, "k": "ten"}, 400, "number of results (k) must be"),
    "unknown image": ("get", "/api/captions", {"image": "synth_99999"}, 404, "'synth_99999' is not in the gallery"),
    "no image": ("get", "/api/captions", {"image": ""}, 400, "no image"),
    "no file": ("post", "/api/captions", {}, 400, "no file"),
    "empty file": ("post", "/api/captions", {"image": (b"", "empty.jpg")}, 400, "empty.jpg is empty"),
    "not an image": ("post", "/api/captions", {"image": (b"caption,score\n" * 20, "results.csv")}, 400,
                     "results.csv is not an image file"),
    "cut image": ("post", "/api/captions", {"image": (_jpeg(64)[:200], "cut.jpg")}, 400, "cut.jpg is not a readable"),
    # its header is whole: only decoding it finds the end missing (refused with its name, not by the extractor)
    "half image": ("post", "/api/captions", {"image": (_jpeg(64)[:len(_jpeg(64)) // 2], "C:\\photos\\half.jpg")},
                   400, "half.jpg is not a readable image file (image file is truncated"),
    "oversized": ("post", "/api/captions", {"image": (_jpeg(400), "big.jpg")}, 413, "larger than the limit"),
    "unknown caption": ("get", "/api/explain", {"image": "FIRST", "caption_index": "100000"}, 404,
                        "caption_index must be"),
    "unknown route": ("get", "/api/nothing", {}, 404, "not found"),
    "missing file": ("get", "/image/MISSING", {}, 404, "its file is missing from the image root"),
}


@pytest.mark.parametrize("case", BAD, ids=list(BAD))
def test_a_bad_request_gets_one_line_and_the_server_keeps_serving(site, case):
    page, client, *_ = site
    method, url, values, status, text = BAD[case]
    if method == "get":
        values = {k: page.r.data.image_ids[0] if v == "FIRST" else v for k, v in values.items()}
        url = url.replace("MISSING", site[3])
        response = client.get(url, query_string=values)
    else:
        form = {k: (io.BytesIO(data), name) for k, (data, name) in values.items()}
        response = client.post(url, data=form, content_type="multipart/form-data")
    assert text in _error(response, status)
    assert len(_jpeg(400)) > page.max_upload > len(_jpeg(64))   # the oversized case is over the limit
    good = client.get("/api/search", query_string={"q": QUERY, "k": 3})
    assert good.status_code == 200 and good.get_json() == page.r.text_to_images([QUERY], 3)[0].to_json()


def test_an_upload_of_a_run_without_extractor_gets_the_apis_one_line(site):
    page, client, *_ = site
    data = page.image_path(page.r.data.image_ids[0]).read_bytes()
    response = client.post("/api/captions", data={"image": (io.BytesIO(data), "photo.jpg")},
                           content_type="multipart/form-data")
    # this run's features come from no retr extractor: the API's own refusal reaches the page, naming the
    # feature set by its name, not by where the server keeps it
    message = _error(response, 400)
    assert message.startswith("scene-boxes.h5: the features were made by 'scene-boxes', not a retr extractor, so "
                              "no extractor is known"), message


def test_an_upload_is_named_by_its_file_name(site, monkeypatch):
    """The library names bytes ``<bytes>`` and may name its temporary files: the page says the upload's name."""
    from retr.common.errors import UserError

    page, client, *_ = site

    def unusable(images, k):
        raise UserError(f"image <bytes> cannot be used: cannot decode {page.drawings}/retr-images-x1/0")

    monkeypatch.setattr(page.r, "image_to_texts", unusable)
    data = page.image_path(page.r.data.image_ids[0]).read_bytes()
    response = client.post("/api/captions", data={"image": (io.BytesIO(data), "../holiday photo.jpg")},
                           content_type="multipart/form-data")
    assert _error(response, 400) == "image holiday photo.jpg cannot be used: cannot decode 0"


def test_a_relative_image_root_serves_its_images(site, tmp_path, monkeypatch):
    """Folders given relative to the working directory are made absolute once, when the page is made: images are
    served (not looked for beside the app's code), even once the working directory has changed."""
    page, *_ = site
    folder = Path(page.run).parent
    monkeypatch.chdir(folder.parent)
    relative = SearchPage(page.r, Path(folder.name) / "scan", manifest=f"{folder.name}/data/manifest.jsonl",
                          image_root=f"{folder.name}/data")
    try:
        assert relative.root.is_absolute() and relative.root == (folder / "data").resolve()
        monkeypatch.chdir(tmp_path)
        client = create_app(relative).test_client()
        for image in page.r.data.image_ids[:3]:
            response = client.get(f"/image/{image}")
            assert response.status_code == 200, response.get_data(as_text=True)
            assert response.data == (folder / "data" / "images" / f"{image}.jpg").read_bytes()
        info = client.get("/api/info").get_json()
        assert info["run"] == "scan" and str(folder) not in json.dumps(info)
    finally:
        relative.close()


def test_a_failure_is_one_generic_line_and_the_log_has_the_details(site, monkeypatch, caplog):
    page, client, *_ = site

    def broken(text, k):
        raise RuntimeError(f"cannot read {page.split_root}/secret.bin\nsecond line")

    monkeypatch.setattr(page, "search", broken)
    with caplog.at_level("ERROR", logger="retr.trainers.search.serve_app"):
        response = client.get("/api/search", query_string={"q": QUERY})
    assert _error(response, 500) == ("the server failed on this request (its log says why); try again or another "
                                     "query")
    assert "RuntimeError" not in response.get_data(as_text=True)
    assert f"{page.split_root}/secret.bin" in caplog.text and "Traceback" in caplog.text   # the operator's view


def test_no_response_names_a_path_of_the_server(site):
    page, client, outside, missing = site
    image = page.r.data.image_ids[0]
    bodies = [client.get(url, query_string=values).get_data(as_text=True) for url, values in (
        ("/api/info", {}), ("/api/explain", {"image": image, "caption": QUERY}), ("/image/" + outside, {}),
        ("/image/" + missing, {}), ("/api/captions", {"image": "/etc/hostname"}), ("/assets/nothing.jpg", {}),
        ("/api/explain", {"image": image, "caption_index": "99999"}), ("/api/search", {"q": QUERY, "k": "x"}))]
    bodies.append(client.post("/api/captions", data={"image": (io.BytesIO(_jpeg(64)), "x.jpg")},
                              content_type="multipart/form-data").get_data(as_text=True))
    folder = str(Path(page.run).parent)                  # the run, the data and the image root are all under it
    for body in bodies:
        assert folder not in body and page.run not in body and str(page.drawings) not in body, body[:300]
        assert "Traceback" not in body and str(Path(__file__).parents[1]) not in body


@pytest.mark.slow
def test_uploads_and_an_index_with_a_real_extractor(tmp_path, run_cli):
    """A run on features the real grid extractor made (random weights, four images, as tests/test_search_images.py
    does): the bytes of a gallery image, uploaded, are embedded anew and rank the captions as its stored row; a
    gallery index of the image folder is searched and its images served from that folder."""
    from retr.manifests.synthetic import generate_synthetic

    data = tmp_path / "data"
    generate_synthetic(data, num_images=4, seed=0)
    run_cli("pipeline", "extract", "--manifest", data / "manifest.jsonl", "--extractor", "resnet152-grid",
            "--weights", "random", "--image-size", "224", "--out", tmp_path / "features", "--workers", "0", "--quiet")
    run_cli("train", "vsepp", "--features", tmp_path / "features" / "resnet152-grid.h5", "--manifest",
            data / "manifest.jsonl", "--out", tmp_path / "run", "--embed-size", "16", "--word-dim", "8",
            "--batch-size", "4", "--val-images", "1", "--epochs", "1", "--device", "cpu", "--quiet")
    page = SearchPage(Retriever.from_run(tmp_path / "run", device="cpu"), tmp_path / "run")
    try:
        client = create_app(page).test_client()
        image = page.r.data.image_ids[0]
        upload = client.post("/api/captions", data={"image": (io.BytesIO(page.image_path(image).read_bytes()),
                                                              "mine.jpg")}, content_type="multipart/form-data")
        assert upload.status_code == 200, upload.get_data(as_text=True)
        by_id = client.get("/api/captions", query_string={"image": image}).get_json()
        assert upload.get_json()["query"] == "mine.jpg"
        assert [h["caption_index"] for h in upload.get_json()["hits"]] == [h["caption_index"] for h in by_id["hits"]]
        # the stored row was embedded in a batch of the split, the upload alone: float32 encoder rounding
        assert [h["score"] for h in upload.get_json()["hits"]] == pytest.approx([h["score"] for h in by_id["hits"]],
                                                                                  rel=0, abs=1e-6)
    finally:
        page.close()

    index = tmp_path / "photos.index"
    run_cli("train", "index", tmp_path / "run", "--images", data / "images", "--out", index, "--workers", "0",
            "--device", "cpu", "--quiet")
    retriever = Retriever.from_run(tmp_path / "run", device="cpu", index=index)
    page = SearchPage(retriever, tmp_path / "run", index=str(index))     # the index knows its files
    try:
        client = create_app(page).test_client()
        body = client.get("/api/search", query_string={"q": QUERY}).get_json()
        assert body == retriever.text_to_images([QUERY], page.top)[0].to_json()
        files = sorted(p.name for p in (data / "images").iterdir())
        assert sorted(h["image_id"] for h in body["hits"]) == files     # the folder's files are the gallery
        assert client.get("/api/info").get_json()["gallery"] == "the index photos.index"
        image = body["hits"][0]["image_id"]
        assert client.get(f"/image/{image}").data == (data / "images" / image).read_bytes()
        assert "drawn for the images of the run's feature set" in _error(
            client.get("/api/explain", query_string={"image": image, "caption": QUERY}), 400)
    finally:
        page.close()


# ------------------------------------------------------------------------------------------------ the command

@pytest.mark.slow
def test_the_command_serves_on_loopback_and_stops_cleanly(site, tmp_path):
    """Run as a user would, from the run's parent folder with relative paths; one request thread, so the images
    asked for at once wait in waitress's queue: it says nothing about it."""
    from concurrent.futures import ThreadPoolExecutor

    page, *_ = site
    env = {**os.environ, "TMPDIR": str(tmp_path)}
    folder = Path(page.run).parent
    server = subprocess.Popen([str(Path(sys.executable).parent / "retr-train"), "serve", "scan", "--image-root",
                               "data", "--port", "0", "--threads", "1", "--device", "cpu", "--quiet"],
                              cwd=folder, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
    try:
        line = server.stdout.readline()
        found = re.fullmatch(r"serving scan at (http://127\.0\.0\.1:\d+/) \(this machine only; "
                             r"--host 0\.0\.0\.0 exposes it to your network\); Ctrl-C stops it\n", line)
        assert found, line + server.stderr.read() if server.poll() is not None else line
        url = found.group(1) + "api/search?" + urllib.parse.urlencode({"q": QUERY, "k": 5})
        with urllib.request.urlopen(url, timeout=60) as response:
            body = json.loads(response.read())
        expected = page.r.text_to_images([QUERY], 5)[0].to_json()     # the split's manifest: same gallery
        assert [h["image_id"] for h in body["hits"]] == [h["image_id"] for h in expected["hits"]]
        assert any(p.name.startswith("retr-serve-") for p in tmp_path.iterdir())

        def fetch(image: str) -> int:
            with urllib.request.urlopen(found.group(1) + "image/" + image, timeout=60) as response:
                return len(response.read())
        with ThreadPoolExecutor(8) as pool:                            # a page's images, asked for at once
            sizes = list(pool.map(fetch, page.r.data.image_ids[:4] * 4))
        assert min(sizes) > 0
    finally:
        server.send_signal(signal.SIGTERM)
        code = server.wait(timeout=60)
    log = server.stderr.read()
    assert code == 0, log
    assert log == "", log                                              # no "Task queue depth is N" warnings
    assert not any(p.name.startswith("retr-serve-") for p in tmp_path.iterdir()), "the drawings' folder is removed"
