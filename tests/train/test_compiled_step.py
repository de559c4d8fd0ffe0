"""``compile: step`` on the CPU: forward, loss and backward as one compiled graph, the optimizer step, the EMA of the
weights and the next learning rate as a second (``zoo.train.compiled.CompiledStep``).

One tiny ViT (depth 1, width 32, 16 x 16 images) is fitted through Lightning and the real data path (the uint8
image tree, the sampler that drops an incomplete last batch, validation each epoch, the EMA callback,
checkpoints) eagerly for two epochs and compiled for three; the compiled run is then resumed from its second
epoch's checkpoint in a fresh dynamo state (as a new process has). Checked against independent references: the
eager run's weights (the same arithmetic in another order), dynamo's own counters (graph breaks, recompiles,
Inductor's cache hits), torch's profiler (the aten ops a step dispatches, and those that read a device value on
the host), ``WarmupDecay``'s closed form. Inductor compiles C++ here, which takes a while on a small machine: the
fits are shared by the tests of this module."""

from __future__ import annotations

import math
from pathlib import Path

import lightning.pytorch as pl
import pytest
import torch
from lightning.pytorch.callbacks import ModelCheckpoint
from torch._dynamo.utils import counters
from torch.profiler import ProfilerActivity, profile

from zoo.bench.compiled_step import aten_ops
from zoo.bench.dispatch import SYNC_OPS
from zoo.train.callbacks import EMAWeightAveraging
from zoo.train.compiled import CompiledStep, compile_cache_dir, schedule_value, use_compile_cache
from zoo.train.data import ImageDataModule
from zoo.train.module import ImageClassifier, compiled_train_loss, train_loss
from zoo.train.preemption import RandomStates
from zoo.train.runs import AtomicCheckpointIO

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


class SyncWindows(pl.Callback):
    """The profiler's aten ops from the end of one training batch to the end of the next (the next batch's
    augmentation, forward, backward, optimizer step, EMA and schedule), for the steps in ``steps``."""

    def __init__(self, steps: range):
        self.steps, self.windows, self._prof = steps, [], None

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        if self._prof is not None:
            self._prof.__exit__(None, None, None)
            self.windows.append([(e.name, in_one_hot(e)) for e in self._prof.events()])
            self._prof = None
        if trainer.global_step in self.steps:
            self._prof = profile(activities=[ProfilerActivity.CPU])
            self._prof.__enter__()


def in_one_hot(event) -> bool:
    """Whether a profiler event runs inside ``one_hot``, whose check of the class indices reads them on the host on
    a CPU only (torchmetrics' accuracy calls it; on a GPU it checks on the device)."""
    while event is not None:
        if event.name == "aten::one_hot":
            return True
        event = event.cpu_parent
    return False


def fit(tree: Path, out: Path, *, compile, epochs: int, optimizer: str = "adamw", resume: Path | None = None,
        extra=(), muon_dtype: str = "auto") -> tuple[ImageClassifier, pl.Trainer, EMAWeightAveraging]:
    """A fit of the tiny ViT on ``tree``: checkpoints ``epoch=N.ckpt`` after each epoch, the EMA, the random states."""
    pl.seed_everything(0, verbose=False)
    dm = ImageDataModule(str(tree), img_size=16, batch_size=BATCH, val_size=4, cache_dir=str(out.parent / "cache"))
    module = ImageClassifier("vit_nano", TINY, num_classes=10, optimizer=optimizer, compile=compile,
                             nan_check_every=1000, muon_dtype=muon_dtype)
    ema = EMAWeightAveraging(0.9)
    every_epoch = ModelCheckpoint(str(out), "{epoch}", save_top_k=-1, every_n_epochs=1, enable_version_counter=False)
    trainer = pl.Trainer(accelerator="cpu", devices=1, max_epochs=epochs, logger=False, enable_progress_bar=False,
                         enable_model_summary=False, num_sanity_val_steps=0, default_root_dir=out,
                         callbacks=[ema, RandomStates(), every_epoch, *extra], plugins=[AtomicCheckpointIO()])
    trainer.fit(module, datamodule=dm, ckpt_path=resume)
    return module, trainer, ema


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
        result["compiled"] = fit(tree, root / "compiled", compile="step", epochs=3, extra=[windows])
    result["compiled_counts"], result["windows"] = since(before), windows.windows
    torch._dynamo.reset()  # what a new process starts from; Inductor's cache on disk stays
    before = snapshot()
    with torch._dynamo.config.patch(error_on_recompile=True):
        result["resumed"] = fit(tree, root / "resumed", compile="step", epochs=3,
                                resume=root / "compiled" / "epoch=1.ckpt")
    result["resumed_counts"] = since(before)
    result["root"] = root
    return result


def test_the_compiled_step_is_two_graphs_without_a_break_or_a_recompile(runs):
    """Three epochs, each with an incomplete last batch (dropped: every step has the same shapes) and validation
    (eager), compile two graphs once (``error_on_recompile`` would have raised) and break none."""
    assert runs["compiled_counts"]["breaks"] == 0, counts("graph_break")
    assert runs["compiled_counts"]["graphs"] == 2
    assert runs["compiled"][1].global_step == 15
    assert isinstance(runs["compiled"][1].optimizers[0], CompiledStep)


def test_the_compiled_steps_weights_equal_the_eager_steps(runs):
    """After two epochs (ten steps of AdamW, the EMA and the schedule), the checkpoints of the two runs hold the
    same weights (the averaged ones, and the current ones) and optimizer moments."""
    eager = torch.load(runs["root"] / "eager" / "epoch=1.ckpt", weights_only=True)
    compiled = torch.load(runs["root"] / "compiled" / "epoch=1.ckpt", weights_only=True)
    assert eager["global_step"] == compiled["global_step"] == 10
    for key in ("state_dict", "current_model_state"):
        assert eager[key].keys() == compiled[key].keys()
        for name, value in eager[key].items():
            torch.testing.assert_close(compiled[key][name], value, rtol=RTOL, atol=ATOL, msg=f"{key} {name}")
    (eager_opt,), (compiled_opt,) = eager["optimizer_states"], compiled["optimizer_states"]
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
    (compiled, *_), (resumed, *_) = runs["compiled"], runs["resumed"]
    assert runs["resumed"][1].global_step == 15
    for a, b in zip(compiled.state_dict().values(), resumed.state_dict().values(), strict=True):
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


def test_the_compiled_step_dispatches_at_most_a_fifth_of_the_eager_steps_ops(runs):
    """One training step (forward, loss, backward, optimizer, EMA, schedule) of each trained module: the compiled
    one runs fused C++ kernels and calls aten only for its matmuls, attention and buffers."""
    torch.manual_seed(0)
    images, targets = torch.randn(BATCH, 3, 16, 16), torch.randint(0, 10, (BATCH,))
    (eager, eager_trainer, eager_ema), (compiled, compiled_trainer, _) = runs["eager"], runs["compiled"]
    eager.train(), compiled.train()
    optimizer, scheduler = eager_trainer.optimizers[0], eager_trainer.lr_scheduler_configs[0].scheduler
    average = eager_ema._updater(eager)

    def eager_step():
        optimizer.zero_grad(set_to_none=True)
        train_loss(eager.model, images, targets, 0.0, torch.contiguous_format)[0].backward()
        optimizer.step()
        average()
        scheduler.step()

    step = compiled_trainer.optimizers[0]

    def compiled_step():
        step.zero_grad(set_to_none=True)
        compiled_train_loss("cpu")(compiled.model, images, targets, 0.0, torch.contiguous_format)[0].backward()
        step._graph()

    eager_step(), compiled_step()  # compiled for this batch's strides (Lightning's batches have their own)
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
    eager, *_ = fit(tree, tmp_path / "eager", compile=False, epochs=2, optimizer="muon", muon_dtype="float32")
    before = snapshot()
    compiled, *_ = fit(tree, tmp_path / "compiled", compile="step", epochs=2, optimizer="muon", muon_dtype="float32")
    assert since(before)["breaks"] == 0, counts("graph_break")
    for (name, a), b in zip(eager.state_dict().items(), compiled.state_dict().values(), strict=True):
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
    """A CompiledStep over AdamW (as ``compile: step`` builds it) on a small linear layer, with its StepSchedule."""
    from zoo.train.compiled import StepSchedule
    from zoo.train.optim import WarmupDecay, build_optimizer, param_groups

    layer = torch.nn.Linear(4, 3)
    inner = build_optimizer("adamw", param_groups(layer, lr, 0.05), lr, compiled=True)
    for group in inner.param_groups:
        group["lr"] = torch.tensor(float(group["lr"]))
    step = CompiledStep(inner)
    return layer, step, StepSchedule(step, WarmupDecay(2, 10, 0.1, "cosine"))


def test_the_rates_written_from_the_host_follow_the_schedule_and_its_refit():
    """At the start of a fit and when the time budget refits the schedule, the rates of the next step are written
    into the groups' tensors (the same tensors the graph reads): base rate x the warm-up + cosine value."""
    _, step, scheduler = _compiled_adamw()
    rates = [group["lr"] for group in step.param_groups]
    step.sync_schedule(scheduler, 5)
    value = 0.1 + 0.9 * (1 + math.cos(math.pi * 3 / 8)) / 2  # step 5: 3 of the 8 decay steps done
    assert [float(r) for r in rates] == pytest.approx([1e-3 * value] * len(rates), rel=1e-6)
    assert float(step.count) == 5 and [g["lr"] for g in step.param_groups] == rates  # written in place
    scheduler.lr_lambdas[0].total_steps, scheduler.lr_lambdas[0].warmup_steps = 20, 4  # a refit
    step.sync_schedule(scheduler, 5)
    value = 0.1 + 0.9 * (1 + math.cos(math.pi * 1 / 16)) / 2
    assert float(rates[0]) == pytest.approx(1e-3 * value, rel=1e-6) and float(step.total) == 20
    before = scheduler.last_epoch
    scheduler.step()  # Lightning's scheduler step only counts: the graph writes the rates
    assert scheduler.last_epoch == before + 1 and float(rates[0]) == pytest.approx(1e-3 * value, rel=1e-6)


def test_a_compiled_steps_checkpoint_holds_plain_rates_and_loads_into_the_same_tensors():
    """state_dict: rates as numbers and capturable off, as an eager AdamW's (which loads it); load_state_dict puts
    the loaded rates into the tensors the compiled graph reads."""
    layer, step, scheduler = _compiled_adamw()
    for p in layer.parameters():  # some state to carry
        step.state[p].update(step=torch.tensor(3.0), exp_avg=torch.full_like(p, 0.5), exp_avg_sq=torch.ones_like(p))
    step.sync_schedule(scheduler, 3)
    saved = step.state_dict()
    assert all(isinstance(g["lr"], float) and g["capturable"] is False for g in saved["param_groups"])
    eager = torch.optim.AdamW(param_groups_of(layer), lr=1e-3)
    eager.load_state_dict(saved)  # an eager run resumes it
    _, other, _ = _compiled_adamw(lr=5e-2)
    other_layer_params = [p for g in other.param_groups for p in g["params"]]
    rates = [group["lr"] for group in other.param_groups]
    other.load_state_dict(saved)
    assert [g["lr"] for g in other.param_groups] == rates  # the same tensor objects
    assert [float(r) for r in rates] == pytest.approx([g["lr"] for g in saved["param_groups"]])
    assert all(g["capturable"] for g in other.param_groups)
    assert float(other.state[other_layer_params[0]]["step"]) == 3.0
    assert other.inner.param_groups is other.param_groups and other.inner.state is other.state


def param_groups_of(layer):
    from zoo.train.optim import param_groups

    return param_groups(layer, 1e-3, 0.05)
