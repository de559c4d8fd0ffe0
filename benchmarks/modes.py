"""Training throughput of each model under each way to run it on this machine: fp32, fp32 channels_last,
bf16 autocast with channels_last ("bf16-mixed"), the model cast to bf16 ("bf16-true"), and torch.compile'd
fp32 (by default; compiled channels_last fp32 and bf16-mixed, the regionally compiled ones of
``zoo.models.compile_regions`` and the compiled step of ``compile: step``, on request), with the compile time paid
once, measured apart. Candidates of one model are interleaved repeat by repeat (``interleaved_medians``), so their
ratios are side by side; each step is a forward, cross-entropy, backward and AdamW step at ``batch``, on random
images. ``optimizer_costs`` measures what each optimizer's step adds to a training step (its share of the step), in
fp32 and bf16-mixed, with Muon's iteration in the dtype a run would choose here (``ZOO_NATIVE_BF16=0`` plays a CPU
without native bf16).

    python -m benchmarks.modes --models hybrid_tiny vit_tiny --out modes.json
    python -m benchmarks.modes --models resnet18_cbam --modes fp32_channels_last bf16_mixed_channels_last
    python -m benchmarks.modes --models hybrid_tiny --modes fp32 --optimizers adamw muon muon_conv
"""

from __future__ import annotations

import argparse
import copy
import time
from collections.abc import Callable

import torch
from timm.layers import to_2tuple
from torch import nn

from zoo.bench.timing import interleaved_medians, measure_inference, print_result, training_step
from zoo.models import compile_regions, create_model
from zoo.runtime.device import cpu_has_native_bf16, resolve_muon_dtype
from zoo.runtime.machine import machine_name
from zoo.runtime.memory import keep_freed_memory
from zoo.train.optim import OPTIMIZERS, NothingToStep, build_optimizer, param_groups
from zoo.train.probes import timed_step_seconds
from zoo.train.step import compiled_train_loss

from . import results
from .results import command_line

MODES = ("fp32", "fp32_channels_last", "bf16_mixed_channels_last", "bf16_true", "fp32_compiled",
         "fp32_compiled_channels_last", "bf16_mixed_compiled_channels_last", "fp32_regions_channels_last",
         "bf16_mixed_regions_channels_last", "fp32_step_channels_last", "bf16_mixed_step_channels_last")
DEFAULT_MODES = MODES[:5]


def _img_size(model: nn.Module) -> tuple[int, int]:
    return to_2tuple(getattr(model, "img_size", 32))  # the CIFAR ResNets take any size: 32x32 here


def mode_steps(name: str, batch: int, modes=DEFAULT_MODES) -> tuple[dict[str, Callable[[], None]], dict[str, float]]:
    """One training-step closure per mode (each on its own copy of the model; a mode is its name's parts:
    fp32 / bf16_mixed / bf16_true, compiled or regions, channels_last), and {compiled mode: seconds its first
    step took} (the compile time)."""
    base = create_model(name).train()
    shape = (3, *_img_size(base))
    steps, compile_s = {}, {}
    for mode in modes:
        if mode not in MODES:
            raise ValueError(f"mode must be one of {MODES}, got {mode!r}")
        model = copy.deepcopy(base)
        memory_format = torch.channels_last if "channels_last" in mode else torch.contiguous_format
        dtype = torch.bfloat16 if mode.startswith("bf16_true") else torch.float32
        model = model.to(dtype=dtype, memory_format=memory_format)
        if "compiled" in mode:
            model = torch.compile(model)
        if "regions" in mode:
            compile_regions(model)
        loss = compiled_train_loss("cpu") if "_step" in mode else None  # recipe's compile: step
        steps[mode] = training_step(model, shape, batch, num_classes=base.num_classes, dtype=dtype,
                                    memory_format=memory_format, loss=loss,
                                    precision="bf16-mixed" if mode.startswith("bf16_mixed") else "32")
        if "compiled" in mode or "regions" in mode or loss:
            start = time.perf_counter()
            steps[mode]()
            compile_s[mode] = time.perf_counter() - start
    return steps, compile_s


def bench_modes(names, batch: int = 128, repeats: int = 5, modes=DEFAULT_MODES, infer_batch: int = 256) -> list[dict]:
    """[{"model", "batch", "<mode>_img_s" per mode, "<mode>_compile_s" per compiled mode, "<mode>_vs_fp32"
    ratios, "infer_img_s" and "infer_bf16_mixed_img_s" (eval-mode forward at ``infer_batch`` in fp32 and under bf16
    autocast, channels_last for the conv models as train.py runs them)}]. ``modes`` must hold "fp32" (the ratios'
    baseline)."""
    if "fp32" not in modes:
        raise ValueError(f"modes must include 'fp32' (the ratios are against it), got {list(modes)}")
    rows = []
    for name in names:
        model = create_model(name)
        if name.startswith(("resnet", "hybrid")):  # as train.py runs them (channels_last "auto")
            model = model.to(memory_format=torch.channels_last)
        infer = {f"infer{suffix}_img_s": measure_inference(model, (3, *_img_size(model)), infer_batch,
                                                            precision=precision, repeats=repeats)
                 for suffix, precision in (("", "32"), ("_bf16_mixed", "bf16-mixed"))}
        steps, compile_s = mode_steps(name, batch, modes)
        seconds = interleaved_medians(steps, repeats=repeats)
        row = {"model": name, "batch": batch, **infer}
        row.update({f"{m}_compile_s": s for m, s in compile_s.items()})
        row.update({f"{m}_img_s": batch / s for m, s in seconds.items()})
        row.update({f"{m}_vs_fp32": seconds["fp32"] / s for m, s in seconds.items() if m != "fp32"})
        rows.append(row)
    return rows


class _NoStep:
    """An optimizer that does nothing: the forward + backward baseline of ``optimizer_costs``."""

    def zero_grad(self, set_to_none: bool = True) -> None:
        pass

    def step(self) -> None:
        pass


def applicable(optimizers: dict[str, Callable], model: nn.Module) -> dict[str, Callable]:
    """``optimizers`` (name -> builder of an optimizer for a model) less those with nothing of ``model`` to step
    (muon on a model whose weights are conv filters: ``NothingToStep``)."""
    kept = {}
    for name, build in optimizers.items():
        try:
            build(model)
        except NothingToStep:
            continue
        kept[name] = build
    return kept


def optimizer_costs(name: str, optimizers=("adamw", "muon", "muon_conv"), batch: int = 128, repeats: int = 5,
                    precisions=("32", "bf16-mixed")) -> list[dict]:
    """Per precision and optimizer: ``step_ms`` (forward, cross-entropy, backward and the optimizer's step),
    ``optimizer_ms`` (the optimizer's step, timed apart: ``probes.timed_step_seconds``), ``optimizer_share`` (that
    over the whole step) and ``vs_adamw`` (AdamW's step time over this one's: the throughput a run keeps with it); the
    model in the memory format train.py uses, the steps interleaved. Muon's iteration runs in ``muon_dtype``, the
    dtype a run picks on this machine. An optimizer with no tensor of the model to step (muon on conv filters only)
    gets no row."""
    muon_dtype = resolve_muon_dtype("auto", "cpu")
    model = create_model(name)
    x = torch.randn(batch, 3, *_img_size(model))
    if name.startswith(("resnet", "hybrid")):
        model, x = model.to(memory_format=torch.channels_last), x.contiguous(memory_format=torch.channels_last)

    def build(optimizer: str) -> Callable:
        def make(trained: nn.Module):
            head = {id(p) for p in trained.get_classifier().parameters()}
            return build_optimizer(optimizer, param_groups(trained, 2e-3, 0.05), 2e-3, momentum=0.95,
                                   muon_exclude=head, muon_dtype=muon_dtype)
        return make

    builds = applicable({o: build(o) for o in dict.fromkeys(("adamw", *optimizers))}, model)
    optimizers = [o for o in optimizers if o in builds]
    candidates = {"none": lambda trained: _NoStep(), **builds}
    rows = []
    for precision in precisions:
        seconds = timed_step_seconds(model, x, candidates, precision, repeats=repeats)
        for optimizer in optimizers:
            step, added = seconds[optimizer], seconds[optimizer] - seconds["none"]
            rows.append({"model": name, "precision": precision, "optimizer": optimizer, "muon_dtype": muon_dtype,
                         "batch": batch, "step_ms": 1000 * step, "optimizer_ms": 1000 * added,
                         "optimizer_share": added / step, "vs_adamw": seconds["adamw"] / step})
    return rows


def results_records(rows: list[dict], optimizer_rows: list[dict], command: str,
                    keep_freed_memory: bool | None = None) -> list[dict]:
    """``benchmarks.results`` records of a run of this command: a "modes" record (per model, images/s per mode
    and for inference) and, with optimizer rows, an "optimizer_cost" record (per model and precision, each
    optimizer's step speed against AdamW's); ``keep_freed_memory`` (whether the process kept freed host memory, as
    training does) goes into both."""
    kept = {} if keep_freed_memory is None else {"keep_freed_memory": keep_freed_memory}
    renamed = [{"model": r["model"], "batch": r["batch"], "inference_fp32": r["infer_img_s"],
                "inference_bf16_mixed": r["infer_bf16_mixed_img_s"],
                **{k.removesuffix("_img_s"): v for k, v in r.items() if k.endswith("_img_s") and not
                   k.startswith("infer")}, **{k: v for k, v in r.items() if k.endswith(("_compile_s", "_vs_fp32"))}}
               for r in rows]
    records = [results.make("modes", "Training and inference images/s per way of running", command,
                            {"rows": results.significant(renamed), **kept})]
    pivot: dict[tuple, dict] = {}
    for r in optimizer_rows:
        key = (r["model"], r["precision"], r["muon_dtype"])
        pivot.setdefault(key, {"model": key[0], "precision": key[1], "muon_dtype": key[2]})[
            f"{r['optimizer']}_vs_adamw"] = r["vs_adamw"]
    if pivot:
        records.append(results.make("optimizer_cost", "A training step with each optimizer against AdamW", command,
                                    {"rows": results.significant(list(pivot.values())), **kept}))
    return records


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--models", nargs="+", default=["hybrid_tiny", "vit_tiny"], help="registered model names")
    p.add_argument("--batch", type=int, default=128, help="training batch size")
    p.add_argument("--repeats", type=int, default=5, help="timed repeats per mode (medians are reported)")
    p.add_argument("--modes", nargs="+", choices=MODES, default=list(DEFAULT_MODES),
                   help="ways of running to measure (fp32 is always measured: the ratios are against it)")
    p.add_argument("--optimizers", nargs="*", choices=OPTIMIZERS, default=["adamw", "muon", "muon_conv"],
                   help="optimizers whose step's share of a training step to measure (none: skip)")
    p.add_argument("--out", help="write the rows as JSON here")
    p.add_argument("--results", metavar="DIR", help="also record the measurement in DIR (results/) for the report")
    args = p.parse_args(argv)
    kept = keep_freed_memory()  # as fit() runs training
    rows = bench_modes(args.models, args.batch, args.repeats, ("fp32", *(m for m in args.modes if m != "fp32")))
    optimizer_rows = [row for name in args.models if args.optimizers
                      for row in optimizer_costs(name, args.optimizers, args.batch, args.repeats)]
    result = {"machine": machine_name(), "native_bf16": cpu_has_native_bf16(), "threads": torch.get_num_threads(),
              "keep_freed_memory": kept, "torch": torch.__version__, "rows": rows, "optimizer_rows": optimizer_rows}
    print_result(result, args.out)
    if args.results:
        for record in results_records(rows, optimizer_rows, command_line("benchmarks.modes", argv), kept):
            print(results.write(record, args.results))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
