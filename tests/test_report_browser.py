"""The report of a freshly trained run, rendered by a real browser (headless Chromium): every ``<img>`` loads,
the sections are there, and the screenshot shows a page, not a blank.

A tiny SCAN trains on synthetic images (region features with boxes from the scene descriptions,
``tests/report_synthetic.py``), ``retr-train show`` writes its report, and Chromium loads a copy of
``index.html`` with a small script appended that, on ``load``, writes each image's ``naturalWidth`` into the DOM
(``--dump-dom``); a second run takes a ``--screenshot``. Without Chromium (``apt-get install -y chromium``) the
test skips.
"""
from __future__ import annotations

import re
import shutil
import subprocess
from pathlib import Path

import numpy as np
import pytest
import torch
from click.testing import CliRunner
from PIL import Image

BROWSERS = ("chromium", "chromium-browser", "google-chrome", "google-chrome-stable")
FLAGS = ["--headless", "--disable-gpu", "--no-sandbox", "--hide-scrollbars", "--disable-dev-shm-usage",
         "--allow-file-access-from-files"]
PROBE = """<script>window.addEventListener('load', function () {
  var out = [];
  for (var img of document.images) out.push(img.naturalWidth + ' ' + img.getAttribute('src'));
  var pre = document.createElement('pre'); pre.id = 'probe'; pre.textContent = out.join('\\n');
  document.body.appendChild(pre);
});</script>"""
#: an image that cannot load: the probe must report it as 0 wide (the check would be blind otherwise)
BROKEN = "<img src='assets/does-not-exist.png' alt='broken on purpose'>"


def _browser() -> str | None:
    return next((path for name in BROWSERS if (path := shutil.which(name))), None)


def _chromium(browser: str, *args: str, cwd: Path) -> subprocess.CompletedProcess:
    return subprocess.run([browser, *FLAGS, *args], cwd=cwd, capture_output=True, text=True, timeout=120)


def _explain_regions(self, images, captions):
    """A stand-in for SCAN's explain while it has none: each word's softmax over the real regions."""
    regions = images["regions"][0][images["mask"][0]]
    return {"word_to_region": torch.softmax(captions["words"][0] @ regions.t(), dim=1)}


@pytest.mark.slow
def test_the_report_renders_in_a_browser(tmp_path, monkeypatch):
    browser = _browser()
    if browser is None:
        pytest.skip("chromium not installed (apt-get install -y chromium): the report is not rendered in a browser")
    from report_synthetic import make_images, train_tiny, write_scene_boxes

    from retr.trainers.commands import cli
    from retr.trainers.models.scan import SCAN

    manifest = make_images(tmp_path / "data", images=100)
    run = train_tiny("scan", write_scene_boxes(tmp_path / "data"), manifest, tmp_path / "scan", "--epochs", "2")
    if "explain" not in SCAN.__dict__:
        monkeypatch.setattr(SCAN, "explains", ("word_to_region",))
        monkeypatch.setattr(SCAN, "explain", _explain_regions)
    out = tmp_path / "report"
    result = CliRunner().invoke(cli, ["show", str(run), "--protocol", "f30k-1k", "--allow-size-mismatch",
                                      "--samples", "3", "--top", "4", "--attention", "1", "--quiet", "--out",
                                      str(out)])
    assert result.exit_code == 0, result.output
    page = (out / "index.html").read_text(encoding="utf-8")
    expected = len(re.findall(r"<img ", page))
    assert expected > 20

    probe = out / "_probe.html"
    probe.write_text(page.replace("</body>", f"{BROKEN}{PROBE}</body>"), encoding="utf-8")
    dom = _chromium(browser, "--dump-dom", probe.as_uri(), cwd=tmp_path)
    assert dom.returncode == 0, dom.stderr[-2000:]
    found = re.search(r'<pre id="probe">(.*?)</pre>', dom.stdout, re.S)
    assert found, "the probe script did not run: " + dom.stdout[-500:]
    widths = [(int(line.split(" ", 1)[0]), line.split(" ", 1)[1]) for line in found.group(1).strip().splitlines()]
    assert widths[-1] == (0, "assets/does-not-exist.png")          # the probe sees a broken image
    loaded = widths[:-1]
    assert len(loaded) == expected
    assert [src for width, src in loaded if width <= 0] == []       # every image of the report loaded
    for section in ("summary", "curves", "t2i-sampled", "t2i-worst", "i2t-sampled", "i2t-worst", "attention"):
        assert f'id="{section}"' in dom.stdout, section
    assert "Training curves" in dom.stdout and "Attention" in dom.stdout

    shot = tmp_path / "shot.png"
    taken = _chromium(browser, f"--screenshot={shot}", "--window-size=1280,2400", (out / "index.html").as_uri(),
                      cwd=tmp_path)
    assert taken.returncode == 0 and shot.is_file(), taken.stderr[-2000:]
    pixels = np.asarray(Image.open(shot).convert("L"), dtype=np.float64)
    assert pixels.shape == (2400, 1280)
    assert pixels.std() > 20                                         # not blank: text, tables, images
    assert (pixels < 128).mean() > 0.01 and (pixels > 200).mean() > 0.3
