"""BENCHMARKS.md's "Ten-minute targets": where the CPU targets stand, computed from the same records as the other
tables (paired means, or the best current record and what else was tried), so whether a target is met reads off
the data, never off a hand-written figure."""

from __future__ import annotations

import math
import statistics
from collections import defaultdict

from .report_tables import TEN_MINUTES, num, records_of, table

HYBRID, PORT = "hybrid_tiny", "airbench94"
VIT_TARGET, VIT_TEACHER_TARGET, SHIPPED_TARGET = 0.72, 0.78, 0.91
TEACHER = "teacher=pretrained:hybrid_tiny"
PRECISION_ONLY = ("ZOO_NATIVE_BF16=0", "--precision 32", "--set precision=32")  # settings that change precision alone


def _precision(value: str) -> str:
    return "bf16" if str(value).startswith("bf16") else str(value)


def mean_se(values: list[float]) -> tuple[float, float]:
    """Mean and standard error (sample sd / sqrt(n); 0 for one value)."""
    se = statistics.stdev(values) / math.sqrt(len(values)) if len(values) > 1 else 0.0
    return statistics.mean(values), se


def show_mean_se(values: list[float]) -> str:
    """"0.7186 ± 0.0044 (n=3)", or "0.8243 (n=1)" for one value (also ``zoo.bench.anchor``'s tables)."""
    if len(values) < 2:
        return f"{values[0]:.4f} (n=1)"
    mean, se = mean_se(values)
    return f"{mean:.4f} ± {se:.4f} (n={len(values)})"


def _is_recipe(setting: str) -> bool:
    """Whether a hybrid_tiny run is the plain CPU recipe (its setting changes the precision at most)."""
    for words in PRECISION_ONLY:
        setting = setting.replace(words, "")
    return not setting.strip()


def _ten_minute_runs(results: list[dict]) -> list[dict]:
    return [r for r in records_of(results, "train") if r["numbers"]["budget"] == TEN_MINUTES]


def pairing_rows(results: list[dict]) -> list[list]:
    """hybrid_tiny's recipe against the airbench94 port per machine and precision (TTA test top-1 of each seed):
    both means ± standard error, the difference ± its standard error, met where it is above one standard error."""
    found: dict[tuple, dict[str, list[float]]] = defaultdict(lambda: defaultdict(list))
    for r in _ten_minute_runs(results):
        n = r["numbers"]
        if n.get("tta") and (n["model"] == PORT or (n["model"] == HYBRID and _is_recipe(n["setting"]))):
            found[(r["machine"]["id"], _precision(n["precision"]))][n["model"]].append(n["test_top1"])
    rows = []
    for (machine, precision), runs in sorted(found.items()):
        if not (runs[HYBRID] and runs[PORT]):
            continue
        (h, h_se), (p, p_se) = mean_se(runs[HYBRID]), mean_se(runs[PORT])
        se = math.hypot(h_se, p_se)
        rows.append([f"`{HYBRID}` above the airbench94 port", f"`{machine}`", precision,
                     f"{show_mean_se(runs[HYBRID])} against {show_mean_se(runs[PORT])}: {h - p:+.4f} ± {se:.4f}",
                     "yes" if se > 0 and h - p > se else "no"])
    return rows


def best_rows(results: list[dict], model: str, target: float, teacher: bool) -> list[list]:
    """Per machine, the best current ten-minute record of ``model`` with (``teacher``) or without the hybrid
    teacher, and how many other settings were tried there."""
    by_machine: dict[str, list[dict]] = defaultdict(list)
    for r in _ten_minute_runs(results):
        n = r["numbers"]
        if n["model"] == model and (TEACHER in n["setting"]) == teacher:
            by_machine[r["machine"]["id"]].append(n)
    rows = []
    for machine, runs in sorted(by_machine.items()):
        best = max(runs, key=lambda n: n["test_top1"])
        settings = {n["setting"] for n in runs} - {best["setting"]}
        tried = f"; {len(settings)} other setting{'s' * (len(settings) != 1)} tried" if settings else ""
        goal = f"`{model}` ≥ {target}" + (" from the hybrid teacher" if teacher else " without a teacher")
        setting = f"`{best['setting']}`" if best["setting"] else "the recipe"
        rows.append([goal, f"`{machine}`", _precision(best["precision"]),
                     f"{num(best['test_top1'])} ({setting}, seed {best['seed']}){tried}",
                     "yes" if best["test_top1"] >= target else "no"])
    return rows


def shipped_rows(results: list[dict]) -> list[list]:
    """The shipped hybrid_tiny's test top-1 without TTA against its target."""
    return [[f"shipped `{HYBRID}` ≥ {SHIPPED_TARGET} without TTA", f"`{r['machine']['id']}`", "—",
             num(r["numbers"]["test_top1"]), "yes" if r["numbers"]["test_top1"] >= SHIPPED_TARGET else "no"]
            for r in records_of(results, "shipped") if r["numbers"]["model"] == HYBRID]


def targets_section(results: list[dict]) -> list[str]:
    rows = [*pairing_rows(results), *best_rows(results, "vit_tiny", VIT_TARGET, teacher=False),
            *best_rows(results, "vit_tiny", VIT_TEACHER_TARGET, teacher=True), *shipped_rows(results)]
    if not rows:
        return []
    return ["## Ten-minute targets", "",
            "Where the CPU targets stand, from the records in the tables: test top-1 after 10 minutes of training "
            "(TTA where the run used it). The pairing is per machine and precision, mean ± standard error over "
            "seeds, met when the difference is above its standard error; the others give the best record per "
            "machine and the setting that reached it, every setting being a row of the 10-minute table above.", "",
            *table(["target", "machine", "precision", "measured", "met"], rows)]
