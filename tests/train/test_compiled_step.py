"""``compile: step`` on the CPU: forward, loss and backward as one compiled graph, the optimizer step, the EMA of the
weights and the next learning rate as a second (``zoo.train.compiled.CompiledStep``).

One tiny ViT (depth 1, width 32, 16 x 16 images) is trained by train.py's loop through the real data path (the
uint8 image tree, the sampler that drops an incomplete last batch, validation each epoch, the EMA, checkpoints)
eagerly and compiled for three epochs each; the compiled run is then resumed from its second epoch's checkpoint in
a fresh dynamo state (as a new process has). Checked against independent references: the
eager run's weights (the same arithmetic in another order), dynamo's own counters (graph breaks, recompiles,
Inductor's cache hits), torch's profiler (the aten ops a step dispatches, and those that read a device value on
the host), ``WarmupDecay``'s closed form. Inductor compiles C++ here, which takes a while on a small machine: the
fits are shared by the tests of this module."""

from __future__ import annotations

import functools
import math
import shutil
from pathlib import Path

import pytest
import torch
from torch._dynamo.utils import counters
from torch.profiler import ProfilerActivity, profile

from benchmarks.compiled_step import aten_ops
from zoo.bench.dispatch import SYNC_OPS
from zoo.train import loop
from zoo.train.compiled import CompiledStep, compile_cache_dir, schedule_value, use_compile_cache
from zoo.train.optim import EMA, WarmupDecay, build_optimizer, param_groups, set_rates
from zoo.train.progress import Progress
from zoo.train.step import compiled_train_loss, train_loss

TINY = {"embed_dim": 32, "depth": 1, "num_heads": 2, "img_size": 16}
BATCH = 8  # 46 training images (50 less 4 for validation): 5 steps an epoch, the last 6 images dropped
# AdamW divides each step by the root of its second moment, so a gradient near zero turns float rounding (Inductor
# fuses and reorders the sums, capturable AdamW computes its bias corrections as tensors) into a visible part of a
# step: a tenth of one step at lr 1e-3 bounds the difference after ten steps; Muon's update has a fixed norm
# per matrix, the same bound holds
ATOL = RTOL = 1e-4


def counts(name: str) -> dict:
    return dict(counters[name])


def snapshot() -> dict:
    return {"breaks": sum(counters["graph_break"].values()), "graphs": counters["stats"]["unique_graphs"],
            "hits": counters["inductor"]["fxgraph_cache_hit"], "misses": counters["inductor"]["fxgraph_cache_miss"]}


def since(before: dict) -> dict:
    now = snapshot()
    return {key: now[key] - before[key] for key in now}


class SyncWindows:
    """The profiler's aten ops from the end of one training step to the end of the next (the next batch's
    augmentation, forward, backward, optimizer step, EMA and schedule), for the steps in ``steps``."""

    def __init__(self, steps: range):
        self.steps, self.windows, self._prof = steps, [], None

    def on_train_batch_end(self, run):
        if self._prof is not None:
            self._prof.__exit__(None, None, None)
            self.windows.append([(e.name, in_one_hot(e)) for e in self._prof.events()])
            self._prof = None
        if run.position.step in self.steps:
            self._prof = profile(activities=[ProfilerActivity.CPU])
            self._prof.__enter__()


class KeepAt:
    """Keeps a copy of last.ckpt as it was written at step ``step`` (the second epoch's end), the run, and the
    model's weights when training ended (the test loads best.ckpt's after)."""

    def __init__(self, step: int, copy: Path):
        self.step, self.copy, self.run, self.weights = step, copy, None, None

    def on_train_batch_start(self, run):
        if run.position.step == self.step:
            shutil.copy(run.plan.run_dir / "checkpoints" / "last.ckpt", self.copy)

    def on_train_end(self, run):
        self.run, self.weights = run, {k: v.detach().clone() for k, v in run.net.state_dict().items()}


def in_one_hot(event) -> bool:
    """Whether a profiler event runs inside ``one_hot``, whose check of the class indices reads them on the host on
    a CPU only (torchmetrics' accuracy calls it; on a GPU it checks on the device)."""
    while event is not None:
        if event.name == "aten::one_hot":
            return True
        event = event.cpu_parent
    return False


def fit(tree: Path, out: Path, *, compile: bool, epochs: int, optimizer: str = "adamw", resume: Path | None = None,
        extra=(), muon_dtype: str = "auto") -> KeepAt:
    """train.py's loop on ``tree`` (in this process): last.ckpt every epoch (5 steps), the EMA; the decisions that
    read the NaN flag and the progress line (each a host read, allowed at their cadence) every 1000 steps, as on a
    GPU; returns what ``KeepAt`` kept."""
    from conftest import train_in_process

    keep = KeepAt(10, out.parent / f"{out.name}-step10.ckpt")
    args = ["--model", "vit_nano", "--data-dir", tree, "--img-size", "16", "--batch-size", str(BATCH), "--set",
            "val_size=4", "--precision", "32", "--epochs", str(epochs), "--set", "ema_decay=0.9", "--set",
            f"optimizer={optimizer}", "--set", f"muon_dtype={muon_dtype}", "--set", "label_smoothing=0",
            "--set", "augment.randaugment=null", "--set", "augment.mixup_alpha=0", "--set", "augment.cutmix_alpha=0",
            "--set", "model_args.drop_path_rate=0", "--set", "model_args.embed_dim=32", "--set",
            "model_args.depth=1", "--set", "model_args.num_heads=2", "--ckpt-every-n-steps", "5",
            "--ckpt-every-minutes", "0", "--out", out, "--cache-dir", out.parent / "cache",
            *(["--compile", "step"] if compile else []), *(["--resume", resume] if resume else [])]
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(loop, "fit", functools.partial(loop.fit, callbacks=[keep, *extra]))
        mp.setattr(loop, "host_sync_every", lambda device_type: 1000)
        mp.setattr(Progress, "due", lambda self, step: False)
        done = train_in_process(args)
    assert done.returncode == 0, done.stderr[-2000:]
    return keep


def resumable_copy(checkpoint: Path, run: Path, into: Path) -> Path:
    """A run directory like ``run`` (its config.yaml) whose last.ckpt is ``checkpoint``."""
    (into / "checkpoints").mkdir(parents=True)
    shutil.copy(run / "config.yaml", into / "config.yaml")
    shutil.copy(checkpoint, into / "checkpoints" / "last.ckpt")
    return into


@pytest.fixture(scope="module")
def runs(tmp_path_factory, image_tree_writer):
    """The eager run (three epochs), the compiled run (three; its dynamo counts, its profiled windows) and the
    compiled run resumed from its second epoch in a fresh dynamo state (its counts)."""
    root = tmp_path_factory.mktemp("compiled")
    tree = image_tree_writer(root / "tree", 16, counts=(("train", 5), ("test", 1)))
    result = {"eager": fit(tree, root / "eager", compile=False, epochs=3)}
    torch._dynamo.reset()
    before, windows = snapshot(), SyncWindows(range(6, 9))
    with torch._dynamo.config.patch(error_on_recompile=True):
        result["compiled"] = fit(tree, root / "compiled", compile=True, epochs=3, extra=[windows])
    result["compiled_counts"], result["windows"] = since(before), windows.windows
    torch._dynamo.reset()  # what a new process starts from; Inductor's cache on disk stays
    before = snapshot()
    resumable = resumable_copy(root / "compiled-step10.ckpt", result["compiled"].run.plan.run_dir,
                               root / "resumed" / "vit_nano" / "from-step10")
    with torch._dynamo.config.patch(error_on_recompile=True):
        result["resumed"] = fit(tree, root / "resumed", compile=True, epochs=3, resume=resumable)
    result["resumed_counts"] = since(before)
    result["root"] = root
    return result


def test_the_compiled_step_is_two_graphs_without_a_break_or_a_recompile(runs):
    """Three epochs, each with an incomplete last batch (dropped: every step has the same shapes) and validation
    (eager), compile two graphs once (``error_on_recompile`` would have raised) and break none."""
    assert runs["compiled_counts"]["breaks"] == 0, counts("graph_break")
    assert runs["compiled_counts"]["graphs"] == 2
    assert runs["compiled"].run.position.step == 15
    assert isinstance(runs["compiled"].run.optimizer.optimizer, CompiledStep)


def test_the_compiled_steps_weights_equal_the_eager_steps(runs):
    """After two epochs (ten steps of AdamW, the EMA and the schedule), the checkpoints of the two runs hold the
    same weights (the averaged ones, and the current ones) and optimizer moments."""
    eager = torch.load(runs["root"] / "eager-step10.ckpt", weights_only=True)
    compiled = torch.load(runs["root"] / "compiled-step10.ckpt", weights_only=True)
    assert eager["global_step"] == compiled["global_step"] == 10
    for key in ("state_dict", "trained_state_dict"):
        assert eager[key].keys() == compiled[key].keys()
        for name, value in eager[key].items():
            torch.testing.assert_close(compiled[key][name], value, rtol=RTOL, atol=ATOL, msg=f"{key} {name}")
    eager_opt, compiled_opt = eager["optimizer"], compiled["optimizer"]
    for index, state in eager_opt["state"].items():
        for name in ("exp_avg", "exp_avg_sq", "step"):
            torch.testing.assert_close(compiled_opt["state"][index][name], state[name], rtol=1e-3, atol=1e-6)
    for eager_group, compiled_group in zip(eager_opt["param_groups"], compiled_opt["param_groups"], strict=True):
        assert compiled_group["lr"] == pytest.approx(eager_group["lr"], rel=1e-6)  # a plain number, as eager's


def test_a_resumed_compiled_run_loads_its_kernels_and_ends_where_the_uninterrupted_one_does(runs):
    """The resume compiles the same two graphs, breaks and recompiles nothing, and its third epoch ends on the
    uninterrupted run's weights exactly. The forward and backward load from Inductor's cache; the optimizer's
    graph may compile once more: its state exists before the trace (it was created by the first step's), which
    orders the graph's inputs otherwise, so it is another graph to the cache."""
    assert runs["resumed_counts"]["breaks"] == 0 and runs["resumed_counts"]["graphs"] == 2
    assert runs["resumed_counts"]["hits"] >= 2 and runs["resumed_counts"]["misses"] <= 1, runs["resumed_counts"]
    compiled, resumed = runs["compiled"], runs["resumed"]
    assert resumed.run.position.step == 15
    for a, b in zip(compiled.weights.values(), resumed.weights.values(), strict=True):
        torch.testing.assert_close(b, a, rtol=0, atol=0)


def test_no_step_reads_a_device_value_on_the_host(runs):
    """The profiled windows of the compiled run (batch end to batch end, no NaN check in them) hold no op that
    reads a device value on the host (``.item()``, ``nonzero``, ...), and they did record whole steps."""
    windows = runs["windows"]
    assert len(windows) == 3
    for events in windows:
        assert sum(name.startswith("aten::mm") or name.startswith("aten::addmm") for name, _ in events) > 0
        syncs = [name for name, one_hot in events
                 if name.startswith("aten::") and name.removeprefix("aten::") in SYNC_OPS and not one_hot]
        assert syncs == []


def test_the_compiled_step_dispatches_at_most_a_fifth_of_the_eager_steps_ops():
    """One training step (forward, loss, backward, optimizer, EMA, schedule) of the tiny ViT, eager and compiled:
    the compiled one runs fused C++ kernels and calls aten only for its matmuls, attention and buffers."""
    import zoo

    torch.manual_seed(0)
    images, targets = torch.randn(BATCH, 3, 16, 16), torch.randint(0, 10, (BATCH,))
    schedule = WarmupDecay(2, 10, 0.0, "cosine")
    eager, compiled = (zoo.create_model("vit_nano", num_classes=10, **TINY).train() for _ in range(2))
    optimizer = build_optimizer("adamw", param_groups(eager, 1e-3, 0.05), 1e-3)
    base = [group["lr"] for group in optimizer.param_groups]
    eager_ema, compiled_ema = EMA(eager, 0.9), EMA(compiled, 0.9)
    count = [0]

    def eager_step():
        set_rates(optimizer, base, schedule(count[0]))
        optimizer.zero_grad(set_to_none=True)
        train_loss(eager, images, targets, 0.0)[0].backward()
        optimizer.step()
        eager_ema.update()
        count[0] += 1

    inner = build_optimizer("adamw", param_groups(compiled, 1e-3, 0.05), 1e-3, compiled=True)
    for group in inner.param_groups:
        group["lr"] = torch.tensor(float(group["lr"]))
    step = CompiledStep(inner)
    step.after_step.append(compiled_ema.update)
    step.sync_schedule(schedule, base, 0)

    def compiled_step():
        step.zero_grad(set_to_none=True)
        compiled_train_loss("cpu")(compiled, images, targets, 0.0, torch.contiguous_format)[0].backward()
        step.step()

    eager_step(), compiled_step()  # compiles
    ops = {"eager": aten_ops(eager_step), "compiled": aten_ops(compiled_step)}
    print(f"aten ops of one step: {ops}")  # recorded in the test's output
    assert ops["compiled"] * 5 <= ops["eager"], ops


@pytest.mark.parametrize("shape", ["cosine", "linear"])
def test_the_schedule_in_the_graph_is_warmup_then_decay(shape):
    """``schedule_value`` against the closed form: (step + 1) / (warmup + 1) while warming up, then the cosine
    (or linear) decay from 1 to min_ratio over total - warmup steps, held at min_ratio after."""
    warmup, total, low = 10, 110, 0.1
    for step in (0, 5, 9, 10, 35, 60, 109, 110, 500):
        if step < warmup:
            expected = (step + 1) / (warmup + 1)
        else:
            t = min((step - warmup) / (total - warmup), 1.0)
            expected = low + (1 - low) * ((1 + math.cos(math.pi * t)) / 2 if shape == "cosine" else 1 - t)
        value = schedule_value(torch.tensor(float(step)), torch.tensor(float(warmup)), torch.tensor(float(total)),
                               low, shape)
        assert float(value) == pytest.approx(expected, abs=1e-6), step


def test_muon_compiled_trains_as_eager(tmp_path, image_tree_writer):
    """Ten steps of the batched Muon (with AdamW on the rest, the EMA and the schedule) in one graph: the weights
    of the eager run, the optimizer's graph without a break. Muon's iteration runs in float32 on every CPU: in
    bfloat16 (``auto`` where the CPU computes it natively) Inductor's fused kernels round its intermediates
    otherwise than eager's ops do, so the runs would differ by bf16 rounding, not by the graph."""
    tree = image_tree_writer(tmp_path / "tree", 16, counts=(("train", 5), ("test", 1)))
    eager = fit(tree, tmp_path / "eager", compile=False, epochs=2, optimizer="muon", muon_dtype="float32")
    before = snapshot()
    compiled = fit(tree, tmp_path / "compiled", compile=True, epochs=2, optimizer="muon", muon_dtype="float32")
    assert since(before)["breaks"] == 0, counts("graph_break")
    for (name, a), b in zip(eager.weights.items(), compiled.weights.values(), strict=True):
        torch.testing.assert_close(b, a, rtol=RTOL, atol=ATOL, msg=name)


def test_the_compile_cache_folder_is_one_per_torch_device_and_settings(tmp_path, monkeypatch):
    """One folder per torch version, machine and recipe settings; a TORCHINDUCTOR_CACHE_DIR set by the user wins."""
    settings = {"model": "vit_tiny", "compile": "step", "precision": "32"}
    folder = compile_cache_dir(tmp_path, "cpu", "CPU A", settings)
    assert folder.parent == tmp_path / "compile" and folder.name.startswith("vit_tiny-")
    assert compile_cache_dir(tmp_path, "cpu", "CPU A", dict(settings)) == folder
    assert compile_cache_dir(tmp_path, "cpu", "CPU B", settings) != folder
    assert compile_cache_dir(tmp_path, "cpu", "CPU A", {**settings, "precision": "bf16-mixed"}) != folder
    monkeypatch.setattr(torch, "__version__", "0.0.0")
    assert compile_cache_dir(tmp_path, "cpu", "CPU A", settings) != folder
    monkeypatch.delenv("TORCHINDUCTOR_CACHE_DIR", raising=False)
    assert use_compile_cache(folder) == folder and folder.is_dir()
    assert Path(__import__("os").environ["TORCHINDUCTOR_CACHE_DIR"]) == folder
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path / "mine"))
    assert use_compile_cache(folder) == tmp_path / "mine"


@pytest.mark.slow  # a minute on 2 CPU cores; the default suite keeps the cache folder's key and one-process compiles
def test_a_second_process_loads_the_compiled_step_from_the_cache(cifar_dir, tmp_path):
    """train.py --compile step twice on the machine (two processes, one user cache folder): the first compiles
    and says so, the second loads every graph from the cache folder (Inductor's hits, no miss); summary.json
    records the compile seconds and the folder, one per torch version, machine and recipe."""
    import json
    import os
    import subprocess
    import sys

    repo = Path(__file__).resolve().parents[2]
    env = {k: v for k, v in os.environ.items() if k != "TORCHINDUCTOR_CACHE_DIR"}
    env["XDG_CACHE_HOME"] = str(tmp_path / "xdg")
    cmd = [sys.executable, "train.py", "--model", "vit_nano", "--data-dir", str(cifar_dir), "--epochs", "1",
           "--max-train-images", "64", "--max-test-images", "16", "--set", "val_size=16", "--batch-size", "8",
           "--limit-train-batches", "2", "--limit-val-batches", "1", "--limit-test-batches", "1", "--compile", "step",
           "--set", "model_args.depth=1", "--set", "model_args.embed_dim=32", "--set", "model_args.num_heads=2",
           "--cache-dir", str(tmp_path / "data"), "--precision", "32"]
    summaries = []
    for run in ("first", "second"):
        done = subprocess.run([*cmd, "--out", str(tmp_path / run)], cwd=repo, env=env, capture_output=True,
                              text=True, timeout=600)
        assert done.returncode == 0, done.stderr[-2000:]
        assert done.stdout.count("compiling the training step") == 1
        assert "compile the model (torch.compile)" not in done.stdout  # one line says it, not two
        (run_dir,) = (tmp_path / run / "vit_nano").iterdir()
        summaries.append(json.loads((run_dir / "summary.json").read_text()))
    first, second = summaries
    assert first["compile_cache"] == second["compile_cache"]
    assert Path(first["compile_cache"]).parent == tmp_path / "xdg" / "zoo" / "compile"
    assert first["compile_cache_misses"] > 0
    assert second["compile_cache_hits"] >= first["compile_cache_misses"] and second["compile_cache_misses"] == 0
    assert all(s["compile_s"] > 0 for s in summaries)


def _compiled_adamw(lr: float = 1e-3):
    """A CompiledStep over AdamW (as ``compile: step`` builds it) on a small linear layer, with its schedule."""
    layer = torch.nn.Linear(4, 3)
    inner = build_optimizer("adamw", param_groups(layer, lr, 0.05), lr, compiled=True)
    base = [float(group["lr"]) for group in inner.param_groups]
    for group in inner.param_groups:
        group["lr"] = torch.tensor(float(group["lr"]))
    return layer, CompiledStep(inner), WarmupDecay(2, 10, 0.1, "cosine"), base


def test_the_rates_written_from_the_host_follow_the_schedule_and_its_refit():
    """At the start of a fit and when the time budget refits the schedule, the rates of the next step are written
    into the groups' tensors (the same tensors the graph reads): base rate x the warm-up + cosine value."""
    _, step, schedule, base = _compiled_adamw()
    rates = [group["lr"] for group in step.param_groups]
    step.sync_schedule(schedule, base, 5)
    value = 0.1 + 0.9 * (1 + math.cos(math.pi * 3 / 8)) / 2  # step 5: 3 of the 8 decay steps done
    assert [float(r) for r in rates] == pytest.approx([1e-3 * value] * len(rates), rel=1e-6)
    assert float(step.count) == 5 and [g["lr"] for g in step.param_groups] == rates  # written in place
    schedule.total_steps, schedule.warmup_steps = 20, 4  # a refit
    step.sync_schedule(schedule, base, 5)
    value = 0.1 + 0.9 * (1 + math.cos(math.pi * 1 / 16)) / 2
    assert float(rates[0]) == pytest.approx(1e-3 * value, rel=1e-6) and float(step.total) == 20


def test_a_compiled_steps_checkpoint_holds_plain_rates_and_loads_into_the_same_tensors():
    """state_dict: rates as numbers and capturable off, as an eager AdamW's (which loads it); load_state_dict puts
    the loaded rates into the tensors the compiled graph reads."""
    layer, step, schedule, base = _compiled_adamw()
    for p in layer.parameters():  # some state to carry
        step.state[p].update(step=torch.tensor(3.0), exp_avg=torch.full_like(p, 0.5), exp_avg_sq=torch.ones_like(p))
    step.sync_schedule(schedule, base, 3)
    saved = step.state_dict()
    assert all(isinstance(g["lr"], float) and g["capturable"] is False for g in saved["param_groups"])
    eager = torch.optim.AdamW(param_groups_of(layer), lr=1e-3)
    eager.load_state_dict(saved)  # an eager run resumes it
    _, other, _, _ = _compiled_adamw(lr=5e-2)
    other_layer_params = [p for g in other.param_groups for p in g["params"]]
    rates = [group["lr"] for group in other.param_groups]
    other.load_state_dict(saved)
    assert [g["lr"] for g in other.param_groups] == rates  # the same tensor objects
    assert [float(r) for r in rates] == pytest.approx([g["lr"] for g in saved["param_groups"]])
    assert all(g["capturable"] for g in other.param_groups)
    assert float(other.state[other_layer_params[0]]["step"]) == 3.0
    assert other.inner.param_groups is other.param_groups and other.inner.state is other.state


def param_groups_of(layer):
    return param_groups(layer, 1e-3, 0.05)
