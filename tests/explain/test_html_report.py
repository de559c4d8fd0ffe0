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


@pytest.mark.slow  # a report and a headless browser; the default suite checks the page's text and figures below
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
    # a CBAM gate multiplies its stage's features: all 1 passes them unchanged, said as a saturated gate
    assert [t.get_text() for ax in fig.axes for t in ax.texts] == [
        "constant map:\nthis stage's spatial gate\nis saturated (every value 1:\nit passes every feature\nunchanged)"]
    assert len(fig.axes[3].images) == 0  # no flat colour panel


def test_the_speed_footnote_names_the_device_the_speed_was_measured_on(monkeypatch):
    """A GPU's throughput is said to come from that GPU, not from the host's CPU."""
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: f"NVIDIA H200 ({device})")
    assert measured_on(torch.device("cuda", 1)).startswith("NVIDIA H200 (cuda:1), torch ")
    assert measured_on(torch.device("mps")).startswith("Apple GPU (mps), torch ")
    assert f"{torch.get_num_threads()} threads, torch " in measured_on(torch.device("cpu"))


def test_a_cbam_gate_lower_on_the_object_is_said_to_suppress_it():
    """The spatial gate multiplies the stage's features (x * sigmoid(...)): where it is lower in the centre, where
    a CIFAR object lies, than around it, the caption says the stage suppresses the centre; a gate higher there
    does not get that sentence; a closed or uniform gate is said as such."""
    image = torch.rand(3, 32, 32)
    dip = torch.full((8, 8), 0.9)
    dip[2:6, 2:6] = 0.3  # the inner half of each side
    peak = 1 - dip
    fig = viz.explanation_figure(image, true_name="cat", pred_name="dog", cbam=[dip, peak])
    captions = [ax.get_xlabel() for ax in fig.axes[1:3]]
    assert "lower in the centre (0.30) than around it (0.90)" in captions[0] and "suppresses" in captions[0]
    assert "centre" not in captions[1] and captions[1].startswith("gate x features: lower = suppressed")
    assert "closed" in viz.constant_gate_note(torch.zeros(2, 2))
    assert "by 0.5" in viz.constant_gate_note(torch.full((2, 2), 0.5))


def test_class_names_that_read_as_mathtext_are_drawn_as_written(tmp_path, capsys):
    """A class folder named like matplotlib mathtext ($\\bogus$) made saving the figure fail with an error whose
    text opens with a blank line; it is drawn as written, and eval.py's error line never comes out empty."""
    from zoo.runtime.console import error_line

    names = ["$\\bogus$", "plain", "a $b$ c"]
    viz.save(viz.confusion_matrix_figure(torch.eye(3), names), tmp_path / "matrix.png")
    fig = viz.explanation_figure(torch.rand(3, 32, 32), true_name=names[0], pred_name=names[2],
                                 rollout=torch.rand(8, 8))
    viz.save(fig, tmp_path / "explained.png")
    viz.save(viz.methods_grid_figure(torch.rand(3, 3, 32, 32), {"rollout": torch.rand(3, 8, 8)}, captions=names,
                                     title=names[0]), tmp_path / "grid.png")
    assert all((tmp_path / f).stat().st_size > 1000 for f in ("matrix.png", "explained.png", "grid.png"))
    assert fig.get_suptitle().startswith("true: $\\bogus$")
    assert error_line("eval.py", ValueError("\n\\bogus\n^\nParseFatalException: Unknown symbol")) == 2
    assert capsys.readouterr().err == "eval.py: error: \\bogus\n"
