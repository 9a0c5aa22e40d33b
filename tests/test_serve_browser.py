"""The search page of ``retr-train serve`` driven in headless Chromium: a typed query shows the results ``search``
prints, their images load, the attention drawings load, and every bad request (empty query, unknown image,
oversized upload, a file that is no image) shows its one-line message while the next good query still works.

The real command serves the tiny SCAN run of ``tests/test_serve.py`` on a free loopback port (``--port 0``: it
prints the address it got). Selenium drives Debian's Chromium through Debian's ``chromedriver`` (package
``chromium-driver``; ``.ci/run`` installs both when root); without them the test skips.
``RETR_SERVE_SCREENSHOT=PATH`` also saves the page's screenshot there (``docs/img/serve.png``).
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


def _tools() -> tuple[str, str]:
    browser = next((path for name in BROWSERS if (path := shutil.which(name))), None)
    driver = shutil.which("chromedriver")
    if browser is None or driver is None:
        pytest.skip("chromium or chromedriver not installed (apt-get install -y chromium chromium-driver): "
                    "the search page is not driven in a browser")
    pytest.importorskip("selenium", reason="selenium is not installed (pip install 'retr[dev]')")
    return browser, driver


def _chrome(browser: str, driver: str):
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service

    options = webdriver.ChromeOptions()
    options.binary_location = browser
    for flag in ("--headless=new", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage",
                 "--hide-scrollbars", "--window-size=1280,1500"):
        options.add_argument(flag)
    return webdriver.Chrome(service=Service(driver), options=options)


def _search_json(run: Path, manifest: Path, *args: str) -> dict:
    """What ``retr-train search RUN … --json`` prints (one query)."""
    from retr.trainers.commands import cli

    result = CliRunner().invoke(cli, ["search", str(run), "--manifest", str(manifest), "--device", "cpu", "--json",
                                      "--quiet", *args], catch_exceptions=False)
    assert result.exit_code == 0, result.output
    return json.loads(result.output.strip().splitlines()[-1])


class Page:
    """The page in the browser: act, then wait until the page shows a result or a message."""

    def __init__(self, driver):
        from selenium.webdriver.support.ui import WebDriverWait

        self.d, self.wait = driver, WebDriverWait(driver, WAIT)

    def ready(self) -> None:
        """Wait for the page to load the run's info; fail with the browser's console lines."""
        from selenium.common.exceptions import TimeoutException

        try:
            self.wait.until(lambda d: self.js("return document.body.dataset.ready === '1'"))
        except TimeoutException:
            pytest.fail(f"the page did not load: {self.d.get_log('browser')}")

    def js(self, script: str, *args):
        return self.d.execute_script(script, *args)

    def act(self, action) -> str:
        """Clear the results and the message, run ``action``, wait for either; returns the message."""
        self.js("document.getElementById('results').replaceChildren();"
                "document.getElementById('message').textContent = ''; document.getElementById('message').className = '';")
        action()
        self.wait.until(lambda d: self.js("return document.getElementById('results').children.length > 0 || "
                                          "document.getElementById('message').className === 'error'"))
        return self.d.find_element("id", "message").text

    def type_and_submit(self, field: str, text: str) -> str:
        from selenium.webdriver.common.keys import Keys

        element = self.d.find_element("id", field)

        def submit():
            element.clear()
            element.send_keys(text + Keys.ENTER)
        return self.act(submit)

    def upload(self, path: Path) -> str:
        return self.act(lambda: self.d.find_element("id", "upload").send_keys(str(path)))

    def hits(self, attribute: str) -> list[tuple[str, float]]:
        return [(e.get_attribute(attribute), float(e.get_attribute("data-score")))
                for e in self.d.find_elements("css selector", "#hits .hit")]

    def image_widths(self, selector: str) -> list[int]:
        """naturalWidth of each image under ``selector`` once every one has loaded or failed."""
        self.wait.until(lambda d: self.js(f"return [...document.querySelectorAll({selector!r})]"
                                          ".every(img => img.complete)"))
        return self.js(f"return [...document.querySelectorAll({selector!r})].map(img => img.naturalWidth)")


def _jpeg(path: Path, side: int) -> Path:
    Image.effect_noise((side, side), 80).convert("RGB").save(path, format="JPEG", quality=95)
    return path


@pytest.mark.slow
def test_the_search_page_works_in_chromium(tmp_path):
    browser, driver_path = _tools()
    from test_serve import QUERY, served_run

    run, _, _ = served_run(tmp_path)
    manifest = tmp_path / "data" / "manifest.jsonl"       # the run's own: every image under the root
    expected = _search_json(run, manifest, "--query", QUERY, "--top", "4")
    server = subprocess.Popen([str(Path(sys.executable).parent / "retr-train"), "serve", str(run), "--manifest",
                               str(manifest), "--port", "0", "--top", "4", "--max-upload-mb", "0.04", "--device",
                               "cpu", "--quiet"], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                              env={**os.environ, "TMPDIR": str(tmp_path)})
    driver = None
    try:
        line = server.stdout.readline()
        found = re.search(r" at (http://127\.0\.0\.1:\d+/) ", line)
        assert found, line + (server.stderr.read() if server.poll() is not None else "")
        driver = _chrome(browser, driver_path)
        driver.get(found.group(1))
        page = Page(driver)
        page.ready()
        assert "class=\"members\"" in driver.find_element("id", "summary").get_attribute("innerHTML")

        def good_query():
            assert page.type_and_submit("query", QUERY) == ""
            assert page.hits("data-image-id") == [(h["image_id"], h["score"]) for h in expected["hits"]]
            widths = page.image_widths("#hits img")
            assert len(widths) == 4 and min(widths) > 0, widths          # every result's image loaded

        good_query()
        # the check above can see a broken image: one that cannot load reports width 0
        page.js("const img = document.createElement('img'); img.id = 'probe'; img.src = 'image/no-such-id';"
                "document.body.append(img);")
        assert page.image_widths("#probe") == [0]
        page.js("document.getElementById('probe').remove()")

        # attention of the first result: the report's drawings, every one loaded
        page.d.find_element("css selector", "#hits .hit button.explain").click()
        page.wait.until(lambda d: d.execute_script("return document.querySelectorAll('#attention .panels img')"
                                                   ".length > 0"))
        widths = page.image_widths("#attention img")
        assert len(widths) == 1 + len(QUERY.split()) + 2 and min(widths) > 0, widths
        shot = np.asarray(Image.open(io.BytesIO(driver.get_screenshot_as_png())).convert("L"), dtype=np.float64)
        assert shot.std() > 20 and (shot < 128).mean() > 0.01           # text and images, not a blank page
        if target := os.environ.get("RETR_SERVE_SCREENSHOT"):             # 256 colours: a small PNG
            driver.execute_script("window.scrollTo(0, 0)")
            png = Image.open(io.BytesIO(driver.get_screenshot_as_png())).convert("RGB")
            png.quantize(256, method=Image.Quantize.FASTOCTREE).save(target, optimize=True)

        # a chosen image → its captions, as search --image prints them
        image = expected["hits"][0]["image_id"]
        assert page.type_and_submit("image-id", image) == ""
        captions = _search_json(run, manifest, "--image", image, "--top", "4")
        assert page.hits("data-caption-index") == [(str(h["caption_index"]), h["score"]) for h in captions["hits"]]

        bad = {
            "empty query": lambda: page.type_and_submit("query", ""),
            "unknown image": lambda: page.type_and_submit("image-id", "synth_99999"),
            "oversized upload": lambda: page.upload(_jpeg(tmp_path / "big.jpg", 400)),
            "not an image": lambda: page.upload(tmp_path / "notes.txt"),
        }
        (tmp_path / "notes.txt").write_text("a red circle\n" * 40)
        tests = sum(json.loads(line)["split"] == "test" for line in manifest.read_text().splitlines())
        messages = {}
        for name, action in bad.items():
            messages[name] = action()
            assert page.d.find_element("id", "message").get_attribute("class") == "error", name
            assert page.js("return document.getElementById('results').children.length") == 0, name
            good_query()                                                   # the server keeps serving
        assert messages == {
            "empty query": "empty query: type a sentence describing the images you want",
            "unknown image": f"image 'synth_99999' is not in the gallery ({tests} images)",
            "oversized upload": "the upload is larger than the limit of 0.04 MB (retr-train serve --max-upload-mb)",
            "not an image": "notes.txt is not an image file (no image format Pillow knows)",
        }
        assert server.poll() is None
    finally:
        if driver is not None:
            driver.quit()
        server.send_signal(signal.SIGTERM)
        server.wait(timeout=60)
