"""The search page of ``retr-train serve`` driven in headless Chromium, started as ``make demo`` prints it: from a
folder laid out like the repository after ``make demo``, with a relative run and a relative ``--image-root``.

What a user does is checked as a user sees it: a typed query (Enter) shows the results ``search`` prints as image
tiles whose images load; clicking a tile, or Enter/Space on it, searches with its image; the mode toggle switches
between text → images and image → captions (a gallery image picked, or a file uploaded, its name shown); every bad
request shows its one line in the page's words in place of the previous results; the controls are disabled and
a spinner turns while a request is under way; the attention drawings load under a heading naming the model once
and the pair; a 420-px window has no horizontal scrolling; the server's log stays quiet.

One tiny SCAN run (synthetic images, region features with boxes: ``tests/report_synthetic.py``) is served for the
whole module on a free loopback port (``--port 0``: it prints the address it got). Selenium drives Debian's
Chromium through Debian's ``chromedriver`` (package ``chromium-driver``; ``.ci/run`` installs both when root);
without them the tests skip. ``RETR_SERVE_SCREENSHOT=PATH`` also saves the page's screenshots: PATH (a wide
window: a query's images and the first one's attention) and PATH with ``-narrow`` before the suffix (420 px: an
image's captions); ``docs/img/serve.png`` and ``docs/img/serve-narrow.png`` are made so.
"""
from __future__ import annotations

import io
import json
import os
import re
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from click.testing import CliRunner
from PIL import Image

BROWSERS = ("chromium", "chromium-browser", "google-chrome", "google-chrome-stable")
WAIT = 120          # seconds for one page action: the 2 CI cores are shared
TOP = 6
QUERY = "a large red circle left of a small blue square"
WIDE, NARROW = (1280, 1100), (420, 900)


def _tools() -> tuple[str, str]:
    browser = next((path for name in BROWSERS if (path := shutil.which(name))), None)
    driver = shutil.which("chromedriver")
    if browser is None or driver is None:
        pytest.skip("chromium or chromedriver not installed (apt-get install -y chromium chromium-driver): "
                    "the search page is not driven in a browser")
    pytest.importorskip("selenium", reason="selenium is not installed (pip install 'retr[dev]')")
    return browser, driver


_PRINTED: dict[tuple, dict] = {}


def _search_json(run: Path, manifest: Path, *args: str) -> dict:
    """What ``retr-train search RUN … --json`` prints (one query; kept for the next test that asks)."""
    from retr.trainers.commands import cli

    if (key := (run, manifest, *args)) in _PRINTED:
        return _PRINTED[key]
    result = CliRunner().invoke(cli, ["search", str(run), "--manifest", str(manifest), "--device", "cpu", "--json",
                                      "--quiet", *args], catch_exceptions=False)
    assert result.exit_code == 0, result.output
    _PRINTED[key] = json.loads(result.output.strip().splitlines()[-1])
    return _PRINTED[key]


class Served:
    """The running server: its address, the run and manifest (absolute, for ``search``), its stderr so far."""

    def __init__(self, url: str, run: Path, manifest: Path, log: Path, process):
        self.url, self.run, self.manifest, self.log, self.process = url, run, manifest, log, process

    def stderr(self) -> str:
        return self.log.read_text()


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    """``retr-train serve demo-out/runs/scan --image-root demo-out/synthetic`` run in a folder laid out like the
    repository after ``make demo`` (plus test flags: any port, the CPU, small limits, two threads)."""
    _tools()
    from report_synthetic import make_images, train_tiny, write_scene_boxes

    repo = tmp_path_factory.mktemp("repo")
    data = repo / "demo-out" / "synthetic"
    manifest = make_images(data, images=120)
    run = train_tiny("scan", write_scene_boxes(data), manifest, repo / "demo-out" / "runs" / "scan", "--epochs", "1",
                     "--device", "cpu")
    log = repo.parent / f"{repo.name}-server.err"
    with open(log, "w") as err:
        server = subprocess.Popen([str(Path(sys.executable).parent / "retr-train"), "serve", "demo-out/runs/scan",
                                   "--image-root", "demo-out/synthetic", "--port", "0", "--top", str(TOP),
                                   "--max-upload-mb", "0.04", "--threads", "2", "--device", "cpu", "--quiet"],
                                  cwd=repo, stdout=subprocess.PIPE, stderr=err, text=True,
                                  env={**os.environ, "TMPDIR": str(repo.parent)})
    try:
        line = server.stdout.readline()
        found = re.fullmatch(r"serving demo-out/runs/scan at (http://127\.0\.0\.1:\d+/) .*\n", line)
        assert found, line + log.read_text()
        yield Served(found.group(1), run.resolve(), manifest.resolve(), log, server)
        assert server.poll() is None, "the server kept serving every request"
    finally:
        server.send_signal(signal.SIGTERM)
        server.wait(timeout=60)


@pytest.fixture(scope="module")
def chrome(served):
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service

    browser, driver = _tools()
    options = webdriver.ChromeOptions()
    options.binary_location = browser
    for flag in ("--headless=new", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage", "--hide-scrollbars",
                 f"--window-size={WIDE[0]},{WIDE[1]}"):
        options.add_argument(flag)
    chrome = webdriver.Chrome(service=Service(driver), options=options)
    yield chrome
    chrome.quit()


class Page:
    """The page in the browser: act, then wait until the page has the answer (its request counter moved)."""

    def __init__(self, driver, served: Served):
        from selenium.webdriver.support.ui import WebDriverWait

        self.d, self.served, self.wait = driver, served, WebDriverWait(driver, WAIT)

    def open(self, size=WIDE) -> "Page":
        """Load the page afresh in a window of ``size`` and wait for the run's info."""
        from selenium.common.exceptions import TimeoutException

        self.d.set_window_size(*size)
        self.d.get(self.served.url)
        try:
            self.wait.until(lambda d: self.js("return document.body.dataset.ready === '1'"))
        except TimeoutException:
            pytest.fail(f"the page did not load: {self.d.get_log('browser')}")
        return self

    def js(self, script: str, *args):
        return self.d.execute_script(script, *args)

    def find(self, selector: str):
        return self.d.find_element("css selector", selector)

    def answered(self) -> int:
        return int(self.js("return Number(document.body.dataset.answered || 0)"))

    def act(self, action) -> str:
        """Run ``action`` (a user's gesture that sends one request); wait for its answer; return the message."""
        before = self.answered()
        action()
        self.wait.until(lambda d: self.answered() > before)
        return self.find("#message").text

    def submit(self, field: str, text: str) -> str:
        """Type ``text`` in the field ``#field`` and press Enter."""
        from selenium.webdriver.common.keys import Keys

        element = self.find("#" + field)

        def typed():
            element.clear()
            element.send_keys(text + Keys.ENTER)
        return self.act(typed)

    def mode(self, name: str) -> None:
        """Click the mode toggle's label (``text`` or ``image``)."""
        self.find(f"label[for=mode-{name}]").click()

    def upload(self, path: Path) -> str:
        self.mode("image")
        return self.act(lambda: self.find("#upload").send_keys(str(path)))

    def hits(self, attribute: str) -> list[tuple[str, float]]:
        return [(e.get_attribute(attribute), float(e.get_attribute("data-score")))
                for e in self.d.find_elements("css selector", "#hits .hit")]

    def results(self) -> int:
        return int(self.js("return document.getElementById('results').children.length"))

    def error(self) -> str:
        assert self.find("#message").get_attribute("class") == "error"
        return self.find("#message").text

    def visible(self, selector: str) -> bool:
        return self.find(selector).is_displayed()

    def image_widths(self, selector: str) -> list[int]:
        """naturalWidth of each image under ``selector`` once there is one and every one has loaded or failed (a
        section the page fills after an event, e.g. the gallery once its box opens, is waited for)."""
        self.wait.until(lambda d: self.js(f"const images = [...document.querySelectorAll({selector!r})];"
                                          "return images.length > 0 && images.every(img => img.complete)"))
        return self.js(f"return [...document.querySelectorAll({selector!r})].map(img => img.naturalWidth)")

    def open_gallery(self) -> list:
        """Open the gallery picker and return its thumbnails' buttons once the page has added them (it fills the
        box on the box's toggle event, after the click returns)."""
        self.find("#gallery-box summary").click()
        self.wait.until(lambda d: d.find_elements("css selector", "#gallery .pick"))
        return self.d.find_elements("css selector", "#gallery .pick")

    def no_horizontal_scrolling(self) -> None:
        width, inner = self.js("return [document.documentElement.scrollWidth, window.innerWidth]")
        assert width <= inner, f"the page is {width} px wide in a {inner}-px window"

    def screenshot(self, suffix: str = "") -> None:
        """With RETR_SERVE_SCREENSHOT=PATH: the window, scrolled to the top, as a 256-colour PNG."""
        if not (target := os.environ.get("RETR_SERVE_SCREENSHOT")):
            return
        target = Path(target)
        self.js("window.scrollTo(0, 0)")
        png = Image.open(io.BytesIO(self.d.get_screenshot_as_png())).convert("RGB")
        png.quantize(256, method=Image.Quantize.FASTOCTREE).save(target.with_name(target.stem + suffix + target.suffix),
                                                                 optimize=True)


@pytest.fixture
def page(chrome, served) -> Page:
    return Page(chrome, served).open()


def _jpeg(path: Path, side: int) -> Path:
    Image.effect_noise((side, side), 80).convert("RGB").save(path, format="JPEG", quality=95)
    return path


def _check_query(page: Page) -> None:
    """The query typed and submitted with Enter shows search's results, every tile's image loaded."""
    expected = _search_json(page.served.run, page.served.manifest, "--query", QUERY, "--top", str(TOP))
    if not page.visible("#text-form"):
        page.mode("text")
    assert page.submit("query", QUERY) == ""
    assert page.hits("data-image-id") == [(h["image_id"], h["score"]) for h in expected["hits"]]
    widths = page.image_widths("#hits img")
    assert len(widths) == TOP and min(widths) > 0, widths          # a relative --image-root still serves them


@pytest.mark.slow
def test_a_query_shows_searchs_results_as_tiles_whose_images_load(page):
    _check_query(page)
    tiles = page.d.find_elements("css selector", "#hits .tile")
    assert [t.find_element("css selector", ".rank").text for t in tiles] == [f"#{n}" for n in range(1, TOP + 1)]
    first = page.hits("data-image-id")[0]
    assert tiles[0].find_element("css selector", ".score").text == f"{first[1]:.4f}"
    assert f"Images for «{QUERY}»" in page.find("#results h2").text
    # the check above can see a broken image: one that cannot load reports width 0
    page.js("const img = document.createElement('img'); img.id = 'probe'; img.src = 'image/no-such-id';"
            "document.body.append(img);")
    assert page.image_widths("#probe") == [0]


@pytest.mark.slow
def test_clicking_a_result_searches_with_its_image(page):
    _check_query(page)
    image = page.hits("data-image-id")[1][0]
    assert page.act(lambda: page.find(f"#hits .tile[data-image-id='{image}'] img").click()) == ""
    captions = _search_json(page.served.run, page.served.manifest, "--image", image, "--top", str(TOP))
    assert page.hits("data-caption-index") == [(str(h["caption_index"]), h["score"]) for h in captions["hits"]]
    assert page.js("return document.getElementById('mode-image').checked")
    assert page.visible("#image-panel") and not page.visible("#text-form")
    assert page.find("#image-id").get_attribute("value") == image
    assert page.find("#results h2").text == f"Captions for {image}"
    assert min(page.image_widths("#results img")) > 0            # the query image and each caption's image
    # a caption's own image searches again; its "find images" button goes back to text → images
    other = page.find("#hits .hit:last-child").get_attribute("data-caption-index")
    caption = page.find(f"#hits .hit[data-caption-index='{other}'] .text").text.strip("«»")
    assert page.act(lambda: page.find(f"#hits .hit[data-caption-index='{other}'] button.as-query").click()) == ""
    assert page.visible("#text-form") and page.find("#query").get_attribute("value") == caption
    expected = _search_json(page.served.run, page.served.manifest, "--query", caption, "--top", str(TOP))
    assert page.hits("data-image-id") == [(h["image_id"], h["score"]) for h in expected["hits"]]


@pytest.mark.slow
def test_the_keyboard_alone_searches(page):
    from selenium.webdriver.common.action_chains import ActionChains
    from selenium.webdriver.common.keys import Keys

    _check_query(page)                                              # Enter in the query field submits
    hits = page.hits("data-image-id")

    def tab_to_tile(n: int):
        for _ in range(60):
            ActionChains(page.d).send_keys(Keys.TAB).perform()
            if page.js("return document.activeElement.dataset.imageId || ''") == hits[n][0] and \
                    page.js("return document.activeElement.classList.contains('tile')"):
                return page.d.switch_to.active_element
        pytest.fail(f"Tab never reached result {n + 1}")

    tile = tab_to_tile(0)
    style = page.js("const s = getComputedStyle(document.activeElement); return [s.outlineStyle, s.outlineWidth]")
    assert style[0] != "none" and style[1] != "0px", style          # a visible focus ring
    assert page.act(lambda: ActionChains(page.d).send_keys(Keys.ENTER).perform()) == ""
    assert page.find("#results h2").text == f"Captions for {hits[0][0]}"
    assert tile is not None

    page.mode("text")
    assert page.submit("query", QUERY) == ""
    page.find("#query").click()
    tab_to_tile(2)
    assert page.act(lambda: ActionChains(page.d).send_keys(Keys.SPACE).perform()) == ""
    assert page.find("#results h2").text == f"Captions for {hits[2][0]}"
    # Enter in the results field re-runs the search of the mode shown, with that many results
    field = page.find("#top")
    field.clear()
    field.send_keys("3")
    assert page.act(lambda: field.send_keys(Keys.ENTER)) == ""
    assert len(page.hits("data-caption-index")) == 3


@pytest.mark.slow
def test_the_mode_toggle_switches_between_text_and_image_search(page):
    from selenium.webdriver.common.action_chains import ActionChains
    from selenium.webdriver.common.keys import Keys

    assert page.visible("#text-form") and not page.visible("#image-panel")
    page.mode("image")
    assert page.visible("#image-panel") and not page.visible("#text-form")
    # pick an image of the gallery: its thumbnails load; a click finds its captions
    thumbs = page.open_gallery()
    tests = sum(json.loads(line)["split"] == "test" for line in page.served.manifest.read_text().splitlines())
    assert len(thumbs) == min(tests, 24) and min(page.image_widths("#gallery img")) > 0
    image = thumbs[3].get_attribute("data-image-id")
    assert page.act(thumbs[3].click) == ""
    assert page.find("#results h2").text == f"Captions for {image}"
    assert page.submit("image-id", image) == ""                     # or typed, Enter
    assert page.find("#results h2").text == f"Captions for {image}"
    # the toggle is a radio group: arrow keys move between the modes
    page.js("document.getElementById('mode-image').focus()")
    ActionChains(page.d).send_keys(Keys.ARROW_LEFT).perform()
    assert page.js("return document.getElementById('mode-text').checked")
    assert page.visible("#text-form") and not page.visible("#image-panel")


@pytest.mark.slow
def test_an_error_replaces_the_results_in_the_pages_words(page, tmp_path):
    (tmp_path / "notes.txt").write_text("a red circle\n" * 40)
    photo = _jpeg(tmp_path / "my holiday.jpg", 64)
    tests = sum(json.loads(line)["split"] == "test" for line in page.served.manifest.read_text().splitlines())

    def results_count(value: str):
        from selenium.webdriver.common.keys import Keys

        page.mode("text")
        field = page.find("#top")
        field.clear()
        return page.act(lambda: field.send_keys(value + Keys.ENTER))

    bad = {
        "empty query": lambda: page.submit("query", ""),
        "no results": lambda: results_count("0"),
        "unknown image": lambda: (page.mode("image"), page.submit("image-id", "synth_99999"))[1],
        "oversized upload": lambda: page.upload(_jpeg(tmp_path / "big.jpg", 400)),
        "not an image": lambda: page.upload(tmp_path / "notes.txt"),
        "upload to a run without extractor": lambda: page.upload(photo),
    }
    messages = {}
    for name, action in bad.items():
        page.mode("text")
        page.find("#top").clear()
        page.find("#top").send_keys(str(TOP))
        _check_query(page)
        assert page.results() > 0
        action()
        messages[name] = page.error()
        if name == "upload to a run without extractor":
            assert page.find("#upload-name").text == "my holiday.jpg"     # the upload's own name, shown
        assert page.results() == 0, f"{name}: the previous results are still shown under the error"
        assert not page.d.find_elements("css selector", "#hits .hit"), name
    _check_query(page)                                                 # the server keeps serving
    assert page.find("#message").text == ""
    refused = messages.pop("upload to a run without extractor")     # the API's own refusal, naming no server path
    assert refused.startswith("scene-boxes.h5: the features were made by 'scene-boxes'"), refused
    assert all(str(page.served.run.parents[2]) not in m for m in [refused, *messages.values()])
    assert messages == {
        "empty query": "empty query: type a sentence describing the images you want",
        "no results": "the number of results (k) must be a whole number from 1 to 100, not '0'",
        "unknown image": f"image 'synth_99999' is not in the gallery ({tests} images)",
        "oversized upload": "the upload is larger than the limit of 0.04 MB (retr-train serve --max-upload-mb)",
        "not an image": "notes.txt is not an image file (no image format Pillow knows)",
    }


@pytest.mark.slow
def test_the_page_shows_a_request_under_way(page):
    from selenium.webdriver.common.keys import Keys

    # hold the next request until released: the page's busy state can be looked at
    page.js("window.__release = null; const real = window.fetch;"
            "window.fetch = (...args) => new Promise((resolve, reject) => {"
            "  window.__release = () => real(...args).then(resolve, reject); });")
    before = page.answered()
    page.find("#query").send_keys(QUERY + Keys.ENTER)
    page.wait.until(lambda d: page.js("return window.__release !== null"))
    assert page.js("return document.getElementById('controls').disabled")
    assert not page.find("#query").is_enabled() and not page.find("#text-form button").is_enabled()
    assert page.visible("#spinner") and page.find("#message").text == "searching…"
    assert page.find("#results").get_attribute("aria-busy") == "true"
    page.js("window.__release()")
    page.wait.until(lambda d: page.answered() > before)
    assert page.find("#query").is_enabled() and not page.visible("#spinner")
    assert page.find("#results").get_attribute("aria-busy") == "false" and len(page.hits("data-image-id")) == TOP
    assert page.d.switch_to.active_element == page.find("#query")   # focus returns where it was


@pytest.mark.slow
def test_attention_is_drawn_under_a_heading_naming_the_model_and_the_pair(page):
    _check_query(page)
    image = page.hits("data-image-id")[0][0]
    assert page.act(lambda: page.find("#hits .hit button.explain").click()) == ""
    heading = page.find("#attention h2").text
    assert heading.startswith(f"Attention of scan: «{QUERY}» and {image}"), heading
    assert page.js("return document.querySelectorAll('#attention h2, #attention h3').length") == 1
    widths = page.image_widths("#attention img")
    assert len(widths) == 1 + len(QUERY.split()) + 2 and min(widths) > 0, widths
    assert page.results() > 0                                          # the results stay above their attention
    page.no_horizontal_scrolling()
    shot = np.asarray(Image.open(io.BytesIO(page.d.get_screenshot_as_png())).convert("L"), dtype=np.float64)
    assert shot.std() > 20 and (shot < 128).mean() > 0.01               # text and images, not a blank page
    page.screenshot()


@pytest.mark.slow
def test_a_narrow_window_keeps_the_layout(chrome, served):
    page = Page(chrome, served).open(NARROW)
    page.no_horizontal_scrolling()
    _check_query(page)
    page.no_horizontal_scrolling()
    boxes = page.js("return [...document.querySelectorAll('#hits .tile')].map(t => t.getBoundingClientRect())"
                    ".map(r => [r.left, r.right, r.width])")
    inner = page.js("return window.innerWidth")
    assert all(left >= 0 and right <= inner and width > 100 for left, right, width in boxes), boxes
    assert len({round(left) for left, _, _ in boxes}) >= 2              # a grid: tiles side by side, not a column
    image = page.hits("data-image-id")[0][0]
    assert page.act(lambda: page.find("#hits .tile img").click()) == ""
    assert page.find("#results h2").text == f"Captions for {image}"
    page.no_horizontal_scrolling()
    assert page.find("#summary-box").is_displayed()
    page.screenshot("-narrow")
    page.find("#hits .hit button.explain").click()
    page.wait.until(lambda d: page.js("return document.querySelectorAll('#attention .panels img').length > 0"))
    page.image_widths("#attention img")
    page.no_horizontal_scrolling()


@pytest.mark.slow
def test_the_servers_log_stays_quiet(page):
    """Two threads, a page of images and the gallery's thumbnails at once: waitress queues requests, and says
    nothing about it; no request fails."""
    _check_query(page)
    page.mode("image")
    page.open_gallery()
    assert min(page.image_widths("#gallery img")) > 0
    log = page.served.stderr()
    assert "Task queue depth" not in log and "Traceback" not in log and "ERROR" not in log, log
