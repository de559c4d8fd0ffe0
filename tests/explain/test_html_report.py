"""report.html (eval.py --report) rendered in real headless Chromium: the page loads offline, every embedded
image decodes (their natural widths, written into the DOM by a probe script added to a copy of the page), and
every number of its tables equals metrics.json / faithfulness.csv. Skipped with the reason where Chromium is not
installed (``apt-get install chromium``; CI installs it). A constant map is said in words in the figures."""

from __future__ import annotations

import csv
import html
import json
import math
import re
import shutil
import subprocess

import pytest
import torch

from zoo.explain import figures as viz
from zoo.explain.html_report import html_report, measured_on

PROBE = """<script>window.addEventListener("load", () => {
  const p = document.createElement("pre"); p.id = "probe";
  p.textContent = Array.from(document.images).map(i => i.complete ? i.naturalWidth : -1).join(",");
  document.body.appendChild(p);
});</script>"""


def chromium() -> str | None:
    return shutil.which("chromium") or shutil.which("chromium-browser") or shutil.which("google-chrome")


def render(page, browser: str) -> str:
    """The DOM of ``page`` after Chromium loaded it (scripts run, images decoded)."""
    done = subprocess.run([browser, "--headless", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage",
                           "--virtual-time-budget=10000", "--dump-dom", page.as_uri()],
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    return done.stdout


def cells(dom: str) -> dict[str, float]:
    found = re.findall(r'data-key="([^"]*)" data-value="([^"]*)"', dom)
    return {html.unescape(k): float(v) for k, v in found}


def test_report_renders_in_chromium_with_the_files_numbers(cifar_dir, tmp_path):
    browser = chromium()
    if browser is None:
        pytest.skip("Chromium is not installed (apt-get install chromium): the report is not rendered")
    out = tmp_path / "report"
    path = html_report(["pretrained:vit_nano"], out, data_dir=str(cifar_dir), num_images=4, grid_images=2,
                       accuracy_images=64, bench_repeats=1, progress=False)
    page = path.read_text()
    sources = re.findall(r'<img[^>]* src="([^"]{0,30})', page)
    assert len(sources) == 2 and all(s.startswith("data:image/png;base64,") for s in sources)  # self-contained
    text = re.sub(r"data:image/png;base64,[A-Za-z0-9+/=]+", "", page)  # base64 may spell anything
    assert "<script" not in text and "http" not in text and "<link" not in text  # nothing fetched, no script
    probed = tmp_path / "probed.html"
    probed.write_text(page.replace("</body>", PROBE + "</body>"))
    dom = render(probed, browser)
    widths = re.search(r'<pre id="probe">([^<]*)</pre>', dom).group(1).split(",")
    assert len(widths) == 2 and all(int(w) > 100 for w in widths)

    shown = cells(dom)
    metrics = json.loads((out / "metrics.json").read_text())
    assert list(metrics) == ["vit_nano"] and metrics["vit_nano"]["num_images"] == 64
    for key in ("params", "flops", "test_top1", "test_top1_tta", "inference_images_per_s", "train_images_per_s"):
        assert shown[f"vit_nano|{key}"] == metrics["vit_nano"][key]
    with (out / "faithfulness.csv").open() as f:
        rows = list(csv.DictReader(f))
    assert len(rows) == 9 * 2  # 6 methods and 3 baselines x deletion / insertion
    for r in rows:
        for column in ("auc", "ci_low", "ci_high", "p_vs_random", "p_vs_rollout"):
            got = shown[f"{r['model']}|{r['method']}|{r['removal']}|{r['metric']}|{column}"]
            want = float(r[column])
            assert (math.isnan(got) and math.isnan(want)) or got == pytest.approx(want, rel=1e-9, abs=1e-12)


def test_a_constant_map_is_said_in_words():
    images = torch.rand(2, 3, 32, 32)
    fig = viz.methods_grid_figure(images, {"cbam_gate": torch.ones(2, 4, 4), "rollout": torch.rand(2, 8, 8)},
                                  absolute=True)
    texts = [t.get_text() for ax in fig.axes for t in ax.texts]
    assert texts == ["constant map:\nevery value 1", "constant map:\nevery value 1"]
    fig = viz.explanation_figure(images[0], true_name="cat", pred_name="cat", rollout=torch.rand(8, 8),
                                 cbam=[torch.rand(8, 8), torch.ones(4, 4)])
    assert [t.get_text() for ax in fig.axes for t in ax.texts] == ["constant map:\nevery value 1"]
    assert len(fig.axes[3].images) == 0  # no flat colour panel


def test_the_speed_footnote_names_the_device_the_speed_was_measured_on(monkeypatch):
    """A GPU's throughput is said to come from that GPU, not from the host's CPU."""
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: f"NVIDIA H200 ({device})")
    assert measured_on(torch.device("cuda", 1)).startswith("NVIDIA H200 (cuda:1), torch ")
    assert measured_on(torch.device("mps")).startswith("Apple GPU (mps), torch ")
    assert f"{torch.get_num_threads()} threads, torch " in measured_on(torch.device("cpu"))
