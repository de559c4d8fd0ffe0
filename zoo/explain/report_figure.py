"""docs/report.png: the top of the report.html that ``eval.py --report`` writes for the two shipped models (the
command docs/explain.md shows, 50 leaderboard images), rendered by headless Chromium. The PNG carries what it was
drawn from in a text chunk (``REPORT_DATA_KEY``): the command, each model's most faithful method and numbers, and a
fingerprint of the page's layout (``layout_fingerprint``), so a test can tell when the picture no longer shows
what the report writes.

    python -m zoo.explain.report_figure --data-dir DATA --out docs/report.png
    python -m zoo.explain.report_figure --report-dir out/report --out docs/report.png   # a report already written
"""

from __future__ import annotations

import argparse
import hashlib
import json
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

from ..runtime.console import error_line
from . import html_report as report
from . import leaderboard as board

REPORT_DATA_KEY = "zoo-report"
SOURCES = ("pretrained:hybrid_tiny", "pretrained:vit_nano")
FAITHFULNESS_IMAGES = 50
WINDOW = (1200, 2000)  # the width of the page as drawn, and the height of its top that the picture shows


def layout_fingerprint() -> str:
    """A hash of the report page without its numbers and figures (its headings, texts, table columns, TTA's
    name): it changes when the page the report writes looks otherwise."""
    return hashlib.sha256(report._page({}, [], [], "", "").encode()).hexdigest()[:16]


def chromium() -> str | None:
    """The headless browser that renders the page, or None."""
    return next((found for name in ("chromium", "chromium-browser", "google-chrome")
                 if (found := shutil.which(name))), None)


def drawn_from(out: Path, sources=SOURCES) -> dict:
    """What the picture of ``out``/report.html shows, from the files the report wrote beside it."""
    rows = board.read_csv(out / "faithfulness.csv")
    models = json.loads((out / "metrics.json").read_text())
    best = {label: board.best_method(rows, label) for label in models}
    return {"command": "eval.py --report " + " ".join(sources) + f" --faithfulness-images {FAITHFULNESS_IMAGES}",
            "layout": layout_fingerprint(),
            "models": {label: {"best_method": None if b is None else b["method"],
                               "best_deletion_auc": None if b is None else round(b["auc"], 3),
                               "num_images": numbers["num_images"], "tta_level": numbers.get("tta_level")}
                       for (label, numbers), b in zip(models.items(), best.values(), strict=True)}}


def read_drawn_from(png: str | Path) -> dict | None:
    """The data a picture written by ``report_figure`` carries, or None (an older picture carries none)."""
    from PIL import Image

    with Image.open(png) as image:
        text = image.text.get(REPORT_DATA_KEY)
    return None if text is None else json.loads(text)


def screenshot(page: Path, png: Path, browser: str) -> None:
    """``page`` as headless Chromium draws it at ``WINDOW``, written to ``png``."""
    done = subprocess.run([browser, "--headless", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage",
                           "--hide-scrollbars", f"--window-size={WINDOW[0]},{WINDOW[1]}", f"--screenshot={png}",
                           page.as_uri()], capture_output=True, text=True, timeout=300)
    if done.returncode != 0 or not png.is_file():
        raise RuntimeError(f"{browser} could not render {page}: {done.stderr.strip()[-500:]}")


def report_figure(data_dir: str | None, out: str | Path, *, report_dir: str | Path | None = None,
                  cache_dir: str | None = None) -> Path:
    """Write the report of ``SOURCES`` (into a temporary folder), or take the one the same command already wrote
    into ``report_dir``, and render its top into the PNG ``out`` with what it was drawn from in the text chunk
    ``REPORT_DATA_KEY``. No Chromium, or a ``report_dir`` without report.html -> ValueError before any work."""
    from PIL import Image, PngImagePlugin

    browser = chromium()
    if browser is None:
        raise ValueError("the report is rendered by headless Chromium, and none is installed (apt-get install "
                         "chromium)")
    out = Path(out)
    if report_dir is not None and not (Path(report_dir) / "report.html").is_file():
        raise ValueError(f"--report-dir {report_dir} holds no report.html: give the --out folder of "
                         f"eval.py --report {' '.join(SOURCES)} --faithfulness-images {FAITHFULNESS_IMAGES}")
    with tempfile.TemporaryDirectory() as scratch:
        if report_dir is not None:
            folder, page = Path(report_dir), Path(report_dir) / "report.html"
        else:
            folder = Path(scratch) / "report"
            page = report.html_report(list(SOURCES), folder, data_dir=data_dir, num_images=FAITHFULNESS_IMAGES,
                                      cache_dir=cache_dir)
        shot = Path(scratch) / "shot.png"
        screenshot(page, shot, browser)
        info = PngImagePlugin.PngInfo()
        info.add_text(REPORT_DATA_KEY, json.dumps(drawn_from(folder), sort_keys=True))
        out.parent.mkdir(parents=True, exist_ok=True)
        with Image.open(shot) as image:
            image.convert("RGB").quantize(256).save(out, pnginfo=info, optimize=True)  # 256 colours: a page
    return out


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m zoo.explain.report_figure", description=__doc__.split("\n\n")[0])
    p.add_argument("--data-dir", help="CIFAR-10 folder (default: ./data)")
    p.add_argument("--out", default="docs/report.png", help="the PNG to write")
    p.add_argument("--report-dir", help="draw the report that eval.py --report (the command above) already wrote "
                   "into this folder instead of writing it again")
    p.add_argument("--cache-dir", help="where the decoded test images are cached")
    args = p.parse_args(argv)
    try:
        print(report_figure(args.data_dir, args.out, report_dir=args.report_dir, cache_dir=args.cache_dir))
    except (ValueError, RuntimeError, OSError) as err:
        return error_line("python -m zoo.explain.report_figure", err)
    return 0


if __name__ == "__main__":
    sys.exit(main())
