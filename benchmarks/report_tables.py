"""The tables of BENCHMARKS.md, one function per section, each rendering ``benchmarks.results`` records (a list of
dicts, already validated) into markdown lines; ``benchmarks.report`` puts them together."""

from __future__ import annotations

import itertools
import re
import statistics
from collections.abc import Callable

from zoo.runtime.console import markdown_table as table

MODEL_ORDER = ("hybrid_tiny", "vit_nano", "vit_tiny", "hybrid_small", "vit_local_tiny", "resnet18_cbam",
               "resnet18", "vit_small")  # the order of the models in every table
TEN_MINUTES = "00:00:10:00"
MODE_COLUMNS = (("fp32", "fp32"), ("fp32_channels_last", "fp32 channels_last"), ("fp32_compiled", "fp32 compiled"),
                ("fp32_compiled_compile_s", "compile s"), ("fp32_regions_channels_last", "fp32 regions"),
                ("bf16_mixed_channels_last", "bf16-mixed channels_last"),
                ("bf16_mixed_compiled_channels_last", "bf16-mixed compiled"),
                ("bf16_mixed_compiled_channels_last_compile_s", "compile s"),
                ("bf16_mixed_regions_channels_last", "bf16-mixed regions"),
                ("bf16_mixed_step_channels_last", "bf16-mixed step"),
                ("bf16_mixed_step_channels_last_compile_s", "compile s"), ("bf16_true", "bf16-true"),
                ("inference_fp32", "inference fp32"), ("inference_bf16_mixed", "inference bf16-mixed"))
SPARSE_COLUMNS = ("dense", "math", "masked_sdpa", "banded", "flex", "auto", "projections")


def num(x) -> str:
    """A number for a table: from 1,000 up a whole number with separators, below it 4 significant digits (every
    transcribed figure has at most 4, so they read as measured); None -> —."""
    if x is None or x == "":
        return "—"
    if isinstance(x, bool):
        return "yes" if x else "no"
    if isinstance(x, int) or (isinstance(x, float) and abs(x) >= 1000):
        return f"{round(x):,}"
    return f"{x:.4g}" if isinstance(x, float) else str(x)


def mean_sd(values: list[float], count: bool = True) -> str:
    """"0.878 ± 0.001 (n=2)" (sample sd), or "0.736 (n=1)" for one value; without ``count`` no "(n=...)"."""
    n = f" (n={len(values)})" if count else ""
    if len(values) == 1:
        return num(values[0]) + n
    return f"{statistics.mean(values):.3f} ± {statistics.stdev(values):.3f}{n}"


def minutes(budget: str) -> float:
    """A DD:HH:MM:SS budget in minutes; another budget ("12 epochs") sorts after every timed one."""
    parts = budget.split(":")
    if len(parts) != 4 or not all(p.isdigit() for p in parts):
        return float("inf")
    days, hours, mins, secs = (int(p) for p in parts)
    return days * 1440 + hours * 60 + mins + secs / 60


def is_current(record: dict) -> bool:
    """Whether ``record`` measures today's code and recipes: not marked ``superseded`` (the code has changed since)
    nor, a training run, ``superseded_recipe`` (its recipe has)."""
    return not record.get("superseded") and not record["numbers"].get("superseded_recipe")


def records_of(results: list[dict], kind: str) -> list[dict]:
    """The current records (``is_current``) of ``kind``."""
    return [r for r in results if r["kind"] == kind and is_current(r)]


def _model_order(name: str) -> tuple:
    return (MODEL_ORDER.index(name) if name in MODEL_ORDER else len(MODEL_ORDER), name)


def _machine_records(results: list[dict]) -> list[dict]:
    """The current measurements that depend on the machine (not the parameter count)."""
    return [r for r in results if r["kind"] != "model_info" and is_current(r)]


def machines_of(results: list[dict]) -> dict[str, dict]:
    """Machine id -> its facts, from ``_machine_records``."""
    found = {}
    for r in _machine_records(results):
        found.setdefault(r["machine"]["id"], r["machine"])
    return found


class Notes:
    """Numbered notes under a table: a row cites ``[n]``; the same text gets the same number."""

    def __init__(self):
        self.texts: list[str] = []

    def cite(self, *texts: str | None) -> str:
        refs = []
        for text in texts:
            if text:
                if text not in self.texts:
                    self.texts.append(text)
                refs.append(f"[{self.texts.index(text) + 1}]")
        return " ".join(refs)

    def lines(self) -> list[str]:
        return [""] + [f"[{i}] {t}  " for i, t in enumerate(self.texts, 1)] if self.texts else []


def standard_command(n: dict) -> str:
    """The CPU recipe's command for a train result's numbers (``setting`` after it, environment first)."""
    env = [t for t in n["setting"].split() if "=" in t and not t.startswith("-") and t.split("=")[0].isupper()]
    rest = " ".join(t for t in n["setting"].split() if t not in env)
    parts = [*env, f"python train.py --model {n['model']} --config configs/cpu_budget.yaml --data-dir DATA "
             f"--max-time {n['budget']}", f"--seed {n['seed']}" if n["seed"] else "", rest]
    return " ".join(p for p in parts if p)


def shown_command(command: str) -> str:
    """A run's command as a note shows it: without ``--results DIR`` (where its record went) and with one seed's
    ``--seeds N`` as ``--seeds S`` (the row names its seeds), so the runs of a row share one note."""
    return re.sub(r"--seeds \d+(?= -|$)", "--seeds S", re.sub(r" --results \S+", "", command))


def _train_groups(results: list[dict]) -> dict[tuple, list[dict]]:
    groups: dict[tuple, list[dict]] = {}
    for r in records_of(results, "train"):
        n = r["numbers"]
        groups.setdefault((n["model"], n["budget"], r["machine"]["id"], n["setting"]), []).append(r)
    return {k: sorted(v, key=lambda r: r["numbers"]["seed"])
            for k, v in sorted(groups.items(), key=lambda kv: (_model_order(kv[0][0]), minutes(kv[0][1]),
                                                              kv[0][2], kv[0][3]))}


def budget_label(budget: str) -> str:
    """"100 min" for a DD:HH:MM:SS budget; another budget ("12 epochs") as it is."""
    return f"{minutes(budget):g} min" if minutes(budget) < float("inf") else budget


def _accuracy_rows(groups: dict[tuple, list[dict]], notes: Notes, with_budget: bool) -> list[list]:
    rows = []
    for (model, budget, machine, setting), runs in groups.items():
        tta = [r["numbers"]["test_top1"] for r in runs if r["numbers"]["tta"]]
        plain = [r["numbers"].get("test_top1_plain", r["numbers"]["test_top1"] if not r["numbers"]["tta"] else None)
                 for r in runs]
        plain = [p for p in plain if p is not None]
        cell = (lambda v: ", ".join(num(x) for x in v) + (f"; {mean_sd(v, False)}" if len(v) > 1 else "") if v else "—")
        odd = [r["command"] for r in runs if r["command"] != standard_command(r["numbers"])]
        refs = notes.cite(*dict.fromkeys([*(f"`{shown_command(c)}`" for c in odd), *(r.get("note") for r in runs)]))
        rows.append([f"`{model}`", *([budget_label(budget)] if with_budget else []), f"`{machine}`",
                     f"`{setting}`" if setting else "", runs[0]["numbers"]["precision"],
                     ", ".join(str(r["numbers"]["seed"]) for r in runs),
                     num(round(statistics.mean(r["numbers"]["steps"] for r in runs))),
                     num(round(statistics.mean(r["numbers"]["train_images_per_s"] for r in runs), 1)),
                     cell(tta), cell(plain), refs])
    return rows


def accuracy_section(results: list[dict]) -> list[str]:
    groups = _train_groups(records_of(results, "train"))
    short = {k: v for k, v in groups.items() if k[1] == TEN_MINUTES}
    long = {k: v for k, v in groups.items() if k[1] != TEN_MINUTES}
    head = ["model", "machine", "setting", "precision", "seeds", "steps (mean)", "train img/s (mean)",
            "test top-1 with TTA", "without TTA", "notes"]
    notes = Notes()
    earlier = sum(r["kind"] == "train" and not r.get("superseded") and bool(r["numbers"].get("superseded_recipe"))
                  for r in results)
    out = ["## Accuracy under a CPU budget", "",
           "Test top-1 on the 10,000 CIFAR-10 test images after a fixed wall-clock budget of training (validation "
           "included, the final test after it); the learning-rate schedule is fitted to the budget. Each row is "
           "`python train.py --model MODEL --config configs/cpu_budget.yaml --data-dir DATA --max-time BUDGET "
           "[--seed S] SETTING` (S: each of the row's seeds), unless a note gives another command. With TTA is "
           "what the run's summary.json reports (mirror + translate test-time augmentation); without TTA is `eval.py "
           "--checkpoint` on the same weights. Several seeds: each, then mean ± sample sd."
           + (f" {earlier} earlier runs of recipes that have changed since stay in `results/` (`superseded_recipe`), "
              "out of these tables." if earlier else ""), "", "### 10 minutes", ""]
    out += table(head, _accuracy_rows(short, notes, False)) + notes.lines()
    notes = Notes()
    out += ["", "### Longer budgets", ""]
    out += table(head[:1] + ["budget"] + head[1:], _accuracy_rows(long, notes, True)) + notes.lines()
    return out


def shipped_section(results: list[dict]) -> list[str]:
    notes, rows = Notes(), []
    for r in sorted(records_of(results, "shipped"), key=lambda r: _model_order(r["numbers"]["model"])):
        n = r["numbers"]
        rows.append([f"`{n['model']}`", num(n["test_top1"]), num(n["test_top1_tta"]), num(n["test_images"]),
                     n.get("training", ""), f"`{r['machine']['id']}`", notes.cite(f"`{r['command']}`", r.get("note"))])
    return ["## Shipped weights", "",
            "`zoo.create_model(NAME, pretrained=True)` loads them (`zoo/weights/NAME/`, with a model card); test "
            "top-1 on the 10,000 test images, as `python -m zoo.train.publish` measures it.", "",
            *table(["model", "test top-1", "with TTA", "test images", "training", "machine", "command"], rows),
            *notes.lines()]


def rows_section(title: str, intro: str, records: list[dict], columns: list[tuple[str, str]],
                  cell: Callable = num) -> list[str]:
    """A table per record under a line naming its machine, date and command. Consecutive records of one machine and
    date with the same columns and note share one table (their lines one under the other); a table's own note ends
    its heading, a note shared by consecutive tables is printed once, after the last of them."""
    def present(r: dict) -> list[tuple[str, str]]:
        return [(k, h) for k, h in columns if any(k in row for row in r["numbers"]["rows"])]

    def key(r: dict) -> tuple:
        return r["machine"]["id"], r["date"], present(r), r.get("note")

    groups = [list(group) for _, group in itertools.groupby(records, key)]
    out = [f"## {title}", "", intro]
    notes = [g[0].get("note") for g in groups]
    for i, group in enumerate(groups):
        cols, note = present(group[0]), notes[i]
        shared = note and note in (notes[i - 1] if i else None, notes[i + 1] if i + 1 < len(groups) else None)
        headings = [f"{r['title']}: `{r['machine']['id']}`, {r['date']}. Command: `{r['command']}`" for r in group]
        headings[-1] += f". {note}" if note and not shared else ""
        out += ["", "  \n".join(headings), "",
                *table([h for _, h in cols], [[cell(row.get(k)) if k != "model" else f"`{row[k]}`" for k, _ in cols]
                                              for r in group for row in r["numbers"]["rows"]])]
        if shared and (i + 1 == len(groups) or notes[i + 1] != note):
            out += ["", note]
    return out


def modes_section(results: list[dict]) -> list[str]:
    records = sorted(records_of(results, "modes"), key=lambda r: (r["machine"]["id"], r["date"]))
    return rows_section(
        "Throughput per way of running",
        "Training images/s at batch 128 (forward, cross-entropy, backward, AdamW on random images) and inference "
        "images/s at batch 256; medians of interleaved repeats. *compiled*: the whole model (`compile: true`); "
        "*regions*: each CBAM and transformer block compiled in place (`compile: regions`); *step*: the forward, "
        "loss and backward compiled as one graph (`compile: step`); *compile s*: the first step's seconds.", records,
        [("model", "model"), *MODE_COLUMNS])


def optimizer_section(results: list[dict]) -> list[str]:
    cols = [("model", "model"), ("precision", "precision"), ("muon_dtype", "Muon's iteration"),
            ("muon_vs_adamw", "`muon` vs AdamW"), ("muon_conv_vs_adamw", "`muon_conv` vs AdamW"),
            ("matrices", "matrices"), ("shapes", "shapes"), ("torch_loop_bf16_ms", "torch's loop, bf16 ms"),
            ("batched_bf16_ms", "batched, bf16 ms"), ("batched_fp32_ms", "batched, fp32 ms"),
            ("floor_bf16_ms", "floor, bf16 ms"), ("loop_vs_floor", "loop / floor")]
    return rows_section(
        "What an optimizer step costs",
        "A training step's speed with Muon against AdamW (1.0 = as fast), and one Muon step over a model's "
        "matrices: torch's loop against the zoo's iteration batched per shape. *floor*: the iteration's matmul "
        "FLOPs at the best bf16 matmul rate measured here, a time no exact batching can beat; *loop / floor* bounds "
        "its speed-up.",
        sorted(records_of(results, "optimizer_cost") + records_of(results, "muon"),
               key=lambda r: (r["kind"], r["command"])), cols)


def suite_section(results: list[dict]) -> list[str]:
    out = ["## Attention kernels against timm and the floor", "",
           "zoo = `zoo.MultiHeadAttention` (backend auto = sdpa); timm = `timm.layers.Attention` with the same "
           "weights; floor = bare `F.linear` + `F.scaled_dot_product_attention` + `F.linear`."]
    for r in records_of(results, "suite"):
        n = r["numbers"]
        out += ["", f"`{r['machine']['id']}`, {r['date']}. Command: `{r['command']}`", "",
                f"Attention op, {n['attention_op_setting']}:", "",
                *table(["N", "zoo ms", "timm ms", "floor ms", "zoo / floor", "zoo / timm"],
                       [[num(x["n"]), num(x["zoo_ms"]), num(x["timm_ms"]), num(x["floor_ms"]),
                         f"{x['zoo_ms'] / x['floor_ms']:.3f}", f"{x['zoo_ms'] / x['timm_ms']:.3f}"]
                        for x in n["attention_op"]]),
                "", f"Whole model, {n['whole_model_setting']}: "
                + "; ".join(f"{x['mode']}: zoo {num(x['zoo'])}, timm {num(x['timm'])} (zoo / timm "
                            f"{x['zoo'] / x['timm']:.3f})" for x in n["whole_model"]) + "."]
        if "memory" in n:
            out.append(f"Memory, {n['memory_setting']}, MiB for inference / forward + backward: "
                       + "; ".join(f"{x['backend']} {num(x['inference_mib'])} / {num(x['train_mib'])}"
                                   for x in n["memory"]) + ".")
        extra = []
        if "training_images_per_s" in n:
            speeds = sorted(n["training_images_per_s"].items(), key=lambda kv: -kv[1])
            setting = n.get("training_setting", "batch 128, fp32")
            extra.append(f"Training images/s of other models in the same run ({setting}): "
                         + ", ".join(f"`{k}` {num(v)}" for k, v in speeds) + ".")
        if "mfu" in n:
            m = n["mfu"]
            extra.append(f"Model FLOP utilisation, `{m['model']}` training: {num(m['achieved_gflops'])} GFLOP/s "
                         f"against the {num(m['gemm_gflops'])} of {n.get('mfu_setting', 'a 2048² fp32 GEMM')}: "
                         f"**MFU {num(m['mfu'])}**.")
        if "pipeline_images_per_s" in n:
            setting = n.get("pipeline_setting", "batches of 128 from the uint8 cache, crop + flip + normalise")
            extra.append(f"Input pipeline alone ({setting}): "
                         f"{num(n['pipeline_images_per_s'])} images/s.")
        if r.get("note"):
            extra.append(r["note"])
        out += extra
    return out


def sparse_section(results: list[dict]) -> list[str]:
    out = ["## Sparse attention: sliding windows that skip work",
           "", "`banded`: backend chunked with `zoo.masks.spec(window=w)` (each query chunk reads its key band); "
           "`flex`: FlexAttention with a block mask; `auto`: what `zoo.layers.backends.auto_sparse` picks; "
           "`projections`: the layer with its attention left out (the floor). Cells: ms / peak MiB."]
    for r in sorted(records_of(results, "sparse"), key=lambda r: r["date"], reverse=True):
        n = r["numbers"]
        present = [c for c in SPARSE_COLUMNS if any(c in row for row in n["rows"])]
        cell = (lambda c: "—" if c is None else num(c["ms"]) + (f" / {num(c['mib'])}" if c["mib"] is not None else ""))
        out += ["", f"{r['title']}: `{r['machine']['id']}`, {r['date']}; {n['setting']}. "
                f"Command: `{r['command']}`", "",
                *table(["N", *present], [[num(row["n"]), *(cell(row.get(c)) for c in present)] for row in n["rows"]]),
                ""]
        if len(n["claims"]) == 1:  # one claim reads as a sentence, the note in its paragraph
            claim = n["claims"][0]
            out.append(" ".join(x for x in (f"{claim['claim'][:1].upper()}{claim['claim'][1:]}: {claim['measured']}.",
                                            r.get("note")) if x))
        else:
            out += table(["claim", "measured"], [[c["claim"], c["measured"]] for c in n["claims"]])
            out += ["", r["note"]] if r.get("note") else []
    return out


def _auc(row: dict, key: str, best: float) -> str:
    """"0.456 [0.445, 0.467]" (measured to 3 decimals), bold where it is the model's best method's."""
    v = f"{row[key]:.3f} [{row[key + '_ci'][0]:.3f}, {row[key + '_ci'][1]:.3f}]"
    return f"**{v}**" if row["method"] not in BASELINES and row[key] == best else v


BASELINES = ("random", "centre", "edges")  # zoo.explain.methods.BASELINES: maps any method must beat


def _board(setting: str) -> str:
    """A faithfulness setting without the words that differ between records of the same measurement."""
    return setting.replace(" per model", "")


def faithfulness_section(results: list[dict]) -> list[str]:
    out = ["## Faithfulness of the explanations",
           "", "Area under the true class's probability as patches are removed most important first (deletion: "
           "lower = more faithful) or inserted into a blank image (insertion: higher = better); mean with bootstrap "
           "95% CI; p: one-sided paired sign-flip test against random, p_rollout: against rollout (0.0001 is the "
           "floor); p_base: against the best of the baselines random, centre (a Gaussian blob) and edges (Sobel), "
           "where measured. Bold: the best method of a model per curve."]
    records, boards = records_of(results, "faithfulness"), []
    for r in records:
        # a model's board measured again later in the same setting (its images, removal, patches) replaces this one
        later = {row["model"] for newer in records if newer["date"] > r["date"]
                 and _board(newer["numbers"]["setting"]) == _board(r["numbers"]["setting"])
                 for row in newer["numbers"]["rows"]}
        rows, lines = [row for row in r["numbers"]["rows"] if row["model"] not in later], []
        if not rows:
            continue
        for model in dict.fromkeys(row["model"] for row in rows):
            mine = [row for row in rows if row["model"] == model and row["method"] not in BASELINES]
            best_del = min(row["deletion"] for row in mine)
            best_ins = max(row["insertion"] for row in mine)
            for i, row in enumerate(x for x in rows if x["model"] == model):
                lines.append([f"`{model}`" if i == 0 else "", row["method"], _auc(row, "deletion", best_del),
                              num(row["deletion_p"]), num(row["deletion_p_rollout"]), num(row.get("deletion_p_base")),
                              _auc(row, "insertion", best_ins), num(row["insertion_p"]),
                              num(row["insertion_p_rollout"]), num(row.get("insertion_p_base"))])
        models = ", ".join(f"`{m}`" for m in dict.fromkeys(row["model"] for row in rows))
        note = [f"{models}: {r['note']}."] if r.get("note") else []
        key = (r["machine"]["id"], r["date"], _board(r["numbers"]["setting"]))
        if boards and boards[-1][0] == key:  # the same measurement of another model: one table
            boards[-1][1].append(f"`{r['command']}`")
            boards[-1][2].extend(note)
            boards[-1][3].extend(lines)
        else:
            boards.append((key, [f"`{r['command']}`"], note, lines, r["numbers"]["setting"]))
    for (machine, date, _), commands, notes, lines, setting in boards:
        out += ["", " ".join([f"`{machine}`, {date}; {setting}. Command{'s' * (len(commands) > 1)}: "
                              f"{'; '.join(commands)}.", *notes]), "",
                *table(["model", "method", "deletion", "p", "p_rollout", "p_base", "insertion", "p", "p_rollout",
                        "p_base"], lines)]
    return out


def gpu_section(results: list[dict]) -> list[str]:
    records = records_of(results, "gpu")
    if not records:
        return ["## GPU", "", "Not measured yet: no GPU measurement is in `results/`. `python -m benchmarks.gpu_check "
                "--data-dir DATA --out OUT` runs the CUDA tests, a `vit_tiny` run and the GPU recipe's speedrun "
                "(`configs/gpu_speedrun.yaml`) on one."]
    out = ["## GPU"]
    for r in records:
        steps = dict.fromkeys(row["step"] for row in r["numbers"]["rows"])
        cells = [[f"`{step}`", "; ".join(f"{row['measure']} {num(row['value'])}" for row in r["numbers"]["rows"]
                                         if row["step"] == step)] for step in steps]
        out += ["", f"{r['title']}: `{r['machine']['id']}` ({r['machine']['gpu']}), {r['date']}. "
                f"Command: `{r['command']}`" + (f". {r['note']}" if r.get("note") else ""), "",
                *table(["step", "measured"], cells)]  # the note ends the heading, as in every other section
    return out


def machines_section(results: list[dict]) -> list[str]:
    rows = []
    for ident, m in sorted(machines_of(results).items()):
        software = sorted({", ".join(f"{k} {r['versions'][k]}" for k in ("python", "torch", "timm", "lightning"))
                           for r in _machine_records(results) if r["machine"]["id"] == ident})
        rows.append([f"`{ident}`", m["cpu"], f"{num(m['family'])} / {num(m['model'])}",
                     num(m["flags"]["avx512_bf16"]), num(m["flags"]["amx"]),
                     f"{num(m['cores'])} / {num(m.get('threads'))}", f"{num(m['memory_gib'])} GiB",
                     m["gpu"] or "none", "; ".join(software)])
    return ["## Machines", "",
            *table(["machine", "CPU", "family / model", "avx512_bf16", "AMX", "cores / torch threads", "memory",
                    "GPU", "software"], rows),
            "", "A CPU with `avx512_bf16` or AMX computes bf16 natively; on one without, `--precision auto` is fp32. "
            "Speeds differ between machines and drift from day to day on one: compare within a table."]
