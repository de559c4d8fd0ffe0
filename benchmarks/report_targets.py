"""BENCHMARKS.md's "Ten-minute targets": where the CPU targets stand, computed from the same records as the other
tables (paired means, or the best current record and what else was tried), so whether a target is met reads off
the data, never off a hand-written figure."""

from __future__ import annotations

import math
import re
import statistics
from collections import defaultdict

from .report_tables import TEN_MINUTES, Notes, budget_label, minutes, num, records_of, table

HYBRID, PORT = "hybrid_tiny", "airbench94"
VIT_TARGET, VIT_TEACHER_TARGET, SHIPPED_TARGET = 0.72, 0.78, 0.91
# the targets' names, as the table and the ``target`` of a ``tried`` record give them
PAIRING_GOAL = f"`{HYBRID}` above the airbench94 port"
SHIPPED_GOAL = f"shipped `{HYBRID}` ≥ {SHIPPED_TARGET} without TTA"
TEACHER = "teacher=pretrained:hybrid_tiny"
# the words of a setting that name the precision alone: the native-bf16 switch, --precision, or --set precision=
# (as benchmarks.anchor gives it)
PRECISION_ONLY = re.compile(r"ZOO_NATIVE_BF16=[01]|--precision \S+|--set precision=\S+")


def _precision(value: str) -> str:
    return "bf16" if str(value).startswith("bf16") else str(value)


def mean_se(values: list[float]) -> tuple[float, float]:
    """Mean and standard error (sample sd / sqrt(n); 0 for one value)."""
    se = statistics.stdev(values) / math.sqrt(len(values)) if len(values) > 1 else 0.0
    return statistics.mean(values), se


def show_mean_se(values: list[float]) -> str:
    """"0.7186 ± 0.0044 (n=3)", or "0.8243 (n=1)" for one value (also ``benchmarks.anchor``'s tables)."""
    if len(values) < 2:
        return f"{values[0]:.4f} (n=1)"
    mean, se = mean_se(values)
    return f"{mean:.4f} ± {se:.4f} (n={len(values)})"


def _is_recipe(setting: str) -> bool:
    """Whether a hybrid_tiny run is the plain CPU recipe (its setting changes the precision at most)."""
    return not PRECISION_ONLY.sub("", setting).strip()


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
        met = se > 0 and h - p > se
        rows.append([PAIRING_GOAL, f"`{machine}`", precision,
                     f"{show_mean_se(runs[HYBRID])} against {show_mean_se(runs[PORT])}: {h - p:+.4f} ± {se:.4f}"
                     + ("" if met else _tried_count(results, PAIRING_GOAL)), "yes" if met else "no"])
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
    """The shipped hybrid_tiny's test top-1 without TTA against its target; when not met, the hybrids' longer runs
    (without TTA) and the changes tried."""
    longer = sorted((minutes(n["budget"]), n["model"], n["budget"], n["test_top1_plain"])
                    for n in (r["numbers"] for r in records_of(results, "train")) if n["model"].startswith("hybrid")
                    and n["budget"] != TEN_MINUTES and n.get("test_top1_plain") is not None)
    runs = ("; longer runs without TTA: " + ", ".join(f"`{m}` {budget_label(b)} {num(x)}" for _, m, b, x in longer)
            if longer else "")
    rows = []
    for r in records_of(results, "shipped"):
        if r["numbers"]["model"] == HYBRID:
            met = r["numbers"]["test_top1"] >= SHIPPED_TARGET
            rows.append([SHIPPED_GOAL, f"`{r['machine']['id']}`", "—",
                         num(r["numbers"]["test_top1"]) + ("" if met else runs + _tried_count(results, SHIPPED_GOAL)),
                         "yes" if met else "no"])
    return rows


def _tried_count(results: list[dict], target: str) -> str:
    n = sum(len(r["numbers"]["rows"]) for r in records_of(results, "tried") if r["numbers"]["target"] == target)
    return f"; {n} change{'s' * (n != 1)} tried (below)" if n else ""


def _difference(row: dict) -> str:
    """With against without: the mean of the per-seed differences where both have each seed, else of the means; a
    ratio of the means where the row compares so (a speed)."""
    have, lack = row["with"], row["without"]
    if not (have and lack):
        return "—"
    if row.get("compare") == "ratio":
        return f"{statistics.mean(have) / statistics.mean(lack):.2f}×"
    if len(have) == len(lack):
        return f"{statistics.mean(a - b for a, b in zip(have, lack, strict=True)):+.4f}"
    return f"{statistics.mean(have) - statistics.mean(lack):+.4f}"


def tried_section(results: list[dict]) -> list[str]:
    """The changes tried toward the hybrid's targets (``tried`` records), each measured with and without it on one
    machine, per target and date."""
    notes, rows = Notes(), []
    for r in sorted(records_of(results, "tried"), key=lambda r: (r["numbers"]["target"], r["date"])):
        n, ref = r["numbers"], notes.cite(f"`{r['command']}`", r.get("note"))
        for row in n["rows"]:
            values = [", ".join(num(x) for x in row[side]) or "—" for side in ("with", "without")]
            rows.append([n["target"], row["change"], f"`{r['machine']['id']}`", n["precision"],
                         budget_label(n["budget"]), row.get("metric", n["metric"]),
                         ", ".join(str(s) for s in row.get("seeds", [])), *values, _difference(row),
                         "yes" if row.get("kept") else "no", ref])
    if not rows:
        return []
    return ["", "### What was tried", "",
            "Changes measured toward the hybrid's targets, each with and without it on one machine, in the budget "
            "and precision given (seeds run with and without the change are paired); *kept*: the recipe or model "
            "has it now. Those dated before the records began are transcribed from the tables of their commit.", "",
            *table(["target", "change", "machine", "precision", "budget", "measured", "seeds", "with", "without",
                    "difference", "kept", "notes"], rows), *notes.lines()]


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
            *table(["target", "machine", "precision", "measured", "met"], rows), *tried_section(results)]
