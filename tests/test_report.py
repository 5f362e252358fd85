"""``nasdiag report``: one self-contained HTML page, checked in a real browser (headless Chromium)."""

from __future__ import annotations

import base64
import re
import shutil
import subprocess

import numpy as np
import pytest

from nasdiag import vocabulary as V
from nasdiag.plot.report import write_report
from nasdiag.record import Recorder
from plot_records import EDGES, OPS, write_record

CHROMIUM = next((shutil.which(n) for n in ("chromium", "chromium-browser", "google-chrome") if shutil.which(n)), None)
#: appended to a copy of the page: records in the DOM how many images there are and how many did not load
IMAGE_CHECK = """<script>
window.addEventListener("load", function () {
  var imgs = Array.prototype.slice.call(document.images);
  var broken = imgs.filter(function (i) { return !(i.complete && i.naturalWidth > 0); });
  var out = document.createElement("div");
  out.id = "image-check";
  out.setAttribute("data-images", imgs.length);
  out.setAttribute("data-broken", broken.length);
  document.body.appendChild(out);
});
</script>"""


@pytest.fixture(scope="module")
def report(tmp_path_factory):
    folder = tmp_path_factory.mktemp("report")
    record = write_record(folder / "run.h5", epochs=2, cells=("normal",))
    return write_report(record, folder / "report.html", dpi=50)


def test_report_is_self_contained_and_complete(report):
    text = report.read_text(encoding="utf-8")
    # no network fetch: every src/href is inline data, and there is no external stylesheet or script
    assert not re.search(r"""(src|href)\s*=\s*["'](?!data:|#)""", text)
    assert "<link" not in text and "<script" not in text
    images = re.findall(r'src="data:image/png;base64,([^"]+)"', text)
    assert len(images) >= 8
    assert all(base64.b64decode(i)[:8] == b"\x89PNG\r\n\x1a\n" for i in images)
    for needle in ("method", "darts", "hyperparameters", "segments and resumes", "torch_version",
                   "search-val accuracy", "0.7500", "time per step", "max_pool_3x3 (1→2)",
                   "Mirrors wiring supplement Figs 5, 6", "Cost C = ∂L/∂Z"):
        assert needle in text, needle


def test_report_of_a_record_still_being_written(tmp_path):
    path = tmp_path / "live.h5"
    meta = {"method": "darts", "op_names": OPS, "edge_names": {"normal": EDGES}, "cell_types": ["normal"]}
    rng = np.random.default_rng(0)
    with Recorder(str(path), meta=meta, flush_every=1) as rec:
        for step in range(1, 4):
            rec.log(step, {"scalars/train_loss": 2.0 / step,
                           V.ARCH_PROBABILITIES.path(cell="normal"): rng.dirichlet(np.ones(len(OPS)), size=len(EDGES))})
        out = write_report(path, tmp_path / "live.html", figures=["scalars", "arch", "genotype"], dpi=40)
        text = out.read_text(encoding="utf-8")
    assert "still writing this record" in text and "3 committed rows" in text
    assert text.count("data:image/png;base64,") == 3


@pytest.mark.skipif(CHROMIUM is None, reason="Debian's chromium is not installed here (.ci/run installs it with "
                    "apt-get install -y chromium); the browser check of the report cannot run")
def test_report_renders_in_headless_chromium(report, tmp_path):
    from matplotlib.image import imread

    checked = tmp_path / "checked.html"
    checked.write_text(report.read_text(encoding="utf-8").replace("</body>", IMAGE_CHECK + "</body>"), encoding="utf-8")
    common = [CHROMIUM, "--headless", "--no-sandbox", "--disable-gpu", "--hide-scrollbars", "--no-first-run",
              f"--user-data-dir={tmp_path / 'profile'}"]
    dom = subprocess.run([*common, "--dump-dom", checked.as_uri()], capture_output=True, text=True, timeout=90).stdout
    found = re.search(r'id="image-check" data-images="(\d+)" data-broken="(\d+)"', dom)
    assert found, "the page's load handler did not run"
    assert int(found.group(1)) >= 8 and int(found.group(2)) == 0  # every image decoded (naturalWidth > 0)
    shot = tmp_path / "shot.png"
    subprocess.run([*common, "--window-size=1100,1400", f"--screenshot={shot}", report.as_uri()],
                   capture_output=True, timeout=90, check=True)
    pixels = imread(shot)[..., :3]
    assert pixels.shape[:2] == (1400, 1100)
    ink = (pixels.mean(axis=2) < 0.85).mean()  # fraction of pixels that are not (near-)white
    assert 0.02 < ink < 0.9, f"the screenshot looks blank or broken ({ink:.3f} of it is ink)"
    assert pixels.std() > 0.1
