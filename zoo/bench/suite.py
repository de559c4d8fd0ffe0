"""The zoo's benchmark suite: the attention op and whole models side by side with timm and with the bare
torch floor, attention memory per backend, model FLOP utilisation, input-pipeline speed, and the
optimisation claims attention tutorials quote, re-measured on the zoo's own backends and masks, plus the
zoo's own speed claim (hybrid_tiny against timm's ViT). Unit tests check what here is not a timing (memory,
FLOPs, equal outputs of the compared candidates); speed claims live in these results, not in the tests.

Every timing is the median of several repeats after warm-up, with the candidates interleaved repeat by
repeat (zoo.bench.interleaved_medians), on one device (CUDA when there is one, else the CPU) and precision
(bf16-mixed on a GPU, fp32 on the CPU). Results: ``bench.json`` and ``bench.md``.
Run: ``python eval.py --bench-suite --out DIR`` (``run_suite(out)`` from Python).
"""

from __future__ import annotations

import os
import platform
import subprocess
import sys
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import torch
import torch.nn.functional as F
from timm.layers import to_2tuple
from torch import nn

from ..atomic import atomic_write_json, atomic_write_text
from ..layers.attention import MultiHeadAttention
from ..layers.masks import sliding_window_mask, spec
from ..models import create_model, list_models, model_info
from ..runtime.console import markdown_table
from .timing import PRECISIONS, autocast_for, inference_step, interleaved_medians, peak_memory, training_step


def default_device() -> torch.device:
    return torch.device("cuda" if torch.cuda.is_available() else "cpu")


def _fwd_bwd(module: Callable[[torch.Tensor], torch.Tensor], x: torch.Tensor, precision: str,
             **kwargs) -> Callable[[], None]:
    grad = torch.ones_like(x)  # every candidate maps (B, N, dim) -> (B, N, dim)

    def step():
        with autocast_for(x.device, precision):
            out = module(x, **kwargs)
        out.backward(grad.to(out.dtype))

    return step


class _FloorAttention(nn.Module):
    """The least work multi-head self-attention can do in torch: two F.linear and one SDPA call."""

    def __init__(self, ref: MultiHeadAttention):
        super().__init__()
        self.ref, self.h = ref, ref.num_heads

    def forward(self, x):
        b, n, c = x.shape
        qkv = F.linear(x, self.ref.qkv.weight, self.ref.qkv.bias)
        q, k, v = qkv.view(b, n, 3, self.h, -1).permute(2, 0, 3, 1, 4)
        out = F.scaled_dot_product_attention(q, k, v)
        return F.linear(out.transpose(1, 2).reshape(b, n, c), self.ref.proj.weight, self.ref.proj.bias)


def attention_candidates(dim: int, heads: int, device=None) -> dict[str, nn.Module]:
    """The three self-attention layers the op benchmark compares, sharing one set of weights: "zoo"
    (zoo.MultiHeadAttention, backend auto), "timm" (timm.layers.Attention) and "floor" (bare F.linear + SDPA)."""
    from timm.layers import Attention as TimmAttention

    zoo_attn = MultiHeadAttention(dim, heads).to(device)
    timm_attn = TimmAttention(dim, heads, qkv_bias=True).to(device)
    timm_attn.load_state_dict(zoo_attn.state_dict())  # same names and (3, heads, head_dim) layout
    return {"zoo": zoo_attn, "timm": timm_attn, "floor": _FloorAttention(zoo_attn)}


def bench_attention_op(ns=(65, 257, 1025), batch: int = 32, heads: int = 3, head_dim: int = 64, *,
                       repeats: int = 5, device=None, precision: str = "32") -> list[dict]:
    """Forward+backward of one attention layer: zoo (auto) vs timm's Attention (same weights) vs the floor."""
    device = torch.device(device or default_device())
    candidates = attention_candidates(heads * head_dim, heads, device)
    rows = []
    for n in ns:
        x = torch.randn(batch, n, heads * head_dim, device=device, requires_grad=True)
        med = interleaved_medians({name: _fwd_bwd(m, x, precision) for name, m in candidates.items()},
                                  device, repeats=repeats)
        rows.append({"n": n, **{f"{k}_ms": 1e3 * v for k, v in med.items()},
                     "zoo_vs_floor": med["zoo"] / med["floor"], "zoo_vs_timm": med["zoo"] / med["timm"]})
    return rows


def timm_vit_like(model) -> nn.Module:
    """timm's VisionTransformer with the configuration (and parameter names) of a default zoo ViT."""
    from timm.models.vision_transformer import VisionTransformer

    return VisionTransformer(img_size=model.img_size, patch_size=model.patch_size,
                             embed_dim=model.embed_dim, depth=len(model.blocks),
                             num_heads=model.blocks[0].attn.num_heads, num_classes=10)


def bench_models(name: str = "vit_tiny", train_batch: int = 128, infer_batch: int = 256, *,
                 repeats: int = 3, device=None, precision: str = "32") -> dict:
    """Training and inference images/s of a zoo ViT vs timm's VisionTransformer of the same configuration."""
    device = torch.device(device or default_device())
    zoo_model = create_model(name).to(device)
    timm_model = timm_vit_like(zoo_model).to(device)
    shape = (3, *zoo_model.img_size)
    models = {"zoo": zoo_model, "timm": timm_model}
    for m in models.values():
        m.train()
    train = interleaved_medians({k: training_step(m, shape, train_batch, precision=precision)
                                 for k, m in models.items()}, device, repeats=repeats)
    for m in models.values():
        m.eval()
    infer = interleaved_medians({k: inference_step(m, shape, infer_batch, precision=precision)
                                 for k, m in models.items()}, device, repeats=repeats)
    out = {"model": name, "precision": precision, "train_batch": train_batch, "infer_batch": infer_batch}
    for k in models:
        out[f"{k}_train_img_s"] = train_batch / train[k]
        out[f"{k}_infer_img_s"] = infer_batch / infer[k]
    out["train_ratio"] = out["zoo_train_img_s"] / out["timm_train_img_s"]
    out["infer_ratio"] = out["zoo_infer_img_s"] / out["timm_infer_img_s"]
    return out


def bench_training_speed(names=None, batch: int = 128, *, repeats: int = 3, device=None,
                         precision: str = "32") -> list[dict]:
    """Training images/s of every zoo model (forward, backward, AdamW step), for the pipeline comparison."""
    device = torch.device(device or default_device())
    rows = []
    for name in names or list_models():
        model = create_model(name).to(device).train()
        shape = (3, *to_2tuple(getattr(model, "img_size", 32)))  # CNNs without an img_size: CIFAR's
        step = training_step(model, shape, batch, precision=precision)
        seconds = interleaved_medians({name: step}, device, repeats=repeats)[name]
        rows.append({"model": name, "train_img_s": batch / seconds})
    return rows


def baseline_vit() -> nn.Module:
    """timm's ViT of width 192, depth 6, patch 4 on 32x32 images: the CPU baseline the hybrid must beat."""
    import timm

    return timm.create_model("vit_tiny_patch16_224", pretrained=False, img_size=32, patch_size=4, depth=6,
                             num_classes=10)


def bench_hybrid_vs_vit(batch: int = 128, *, repeats: int = 3, device=None, precision: str = "32") -> dict:
    """The hybrid against the plain ViT of ``baseline_vit()``, as a claims row: ``hybrid_tiny`` (3.0M parameters,
    0.9x the ViT's FLOPs; 0.89 test top-1 after 10 CPU minutes, against 0.36 for that ViT after 8) still trains
    (forward, backward, AdamW step) faster than ``baseline_vit()``; measured is the ViT's step time over the
    hybrid's."""
    device = torch.device(device or default_device())
    models = {"hybrid_tiny": create_model("hybrid_tiny"), "vit": baseline_vit()}
    steps = {k: training_step(m.to(device).train(), (3, 32, 32), batch, precision=precision)
             for k, m in models.items()}
    med = interleaved_medians(steps, device, repeats=repeats)
    return {"claim": "hybrid_tiny trains faster than timm's ViT (192 wide, 6 deep, patch 4): ~1.2x fp32, ~1.8x bf16",
            "measured": med["vit"] / med["hybrid_tiny"],
            "unit": f"x training speed, ViT / hybrid_tiny step time (batch {batch}, precision {precision})"}


_MEMORY_SCRIPT = """
import sys, torch, zoo
from zoo.bench.timing import peak_memory
backend, n, window = sys.argv[1], int(sys.argv[2]), int(sys.argv[4])
backward, device, as_spec = sys.argv[3] == "1", torch.device(sys.argv[5]), sys.argv[6] == "1"
attn = zoo.MultiHeadAttention(192, 3, backend=backend).to(device)
x = torch.randn(1, n, 192, device=device, requires_grad=backward)
mask = zoo.masks.sliding_window_mask(n, window, device=device) if window else None
mask = zoo.masks.spec(window=window) if window and as_spec else mask
def call():
    with torch.set_grad_enabled(backward):
        out = attn(x, mask=mask)
        if backward:
            out.sum().backward()
call()  # warm-up with the very inputs measured: kernels loaded, flex compiled, its block mask cached
attn.zero_grad(set_to_none=True)
x.grad = None
peak = peak_memory(call, device)
print("nan" if peak is None else peak / 2**20)  # nan: not measurable on this device
"""


def attention_peak_memory_mb(backend: str, n: int, backward: bool, window: int = 0, device=None,
                             as_spec: bool = False) -> float:
    """Peak memory growth (MiB, zoo.bench.peak_memory: CUDA allocator peak, or peak RSS on a Linux CPU) of
    one attention call (B=1, 3 heads, head_dim 64; a sliding-window mask when ``window``, as a bool tensor or,
    with ``as_spec``, as ``zoo.masks.spec(window=window)``, built before the call) in a fresh
    subprocess, once inputs exist and kernels are loaded. glibc's mmap threshold is pinned: its default grows
    with freed blocks, and the heap then keeps freed chunks, inflating the CPU peak."""
    env = {**os.environ, "MALLOC_MMAP_THRESHOLD_": "131072"}
    args = [backend, str(n), str(int(backward)), str(window), str(device or default_device()), str(int(as_spec))]
    res = subprocess.run([sys.executable, "-c", _MEMORY_SCRIPT, *args], capture_output=True, text=True,
                         check=True, env=env)
    return float(res.stdout.strip().splitlines()[-1])


def bench_memory(n: int = 4097, backends=("math", "sdpa", "chunked", "linear"), device=None) -> list[dict]:
    """``attention_peak_memory_mb`` per backend, inference and backward; two subprocesses at a time (each
    measures its own peak, and most of a subprocess's seconds go to importing torch)."""
    cases = [(backend, backward) for backend in backends for backward in (False, True)]
    with ThreadPoolExecutor(max_workers=2) as pool:
        measured = pool.map(lambda case: attention_peak_memory_mb(case[0], n, case[1], device=device), cases)
        mb = dict(zip(cases, measured, strict=True))
    return [{"backend": b, "n": n, "inference_mb": mb[b, False], "backward_mb": mb[b, True]} for b in backends]


def _gemm_shape(device: torch.device) -> tuple[int, int]:
    """``gemm_peak_flops``' default matrix size and matmuls per timing on ``device``: 8 back-to-back 8192² on a GPU
    (a single small matmul is launch-bound there and would understate the peak), one 2048² on the CPU."""
    return (8192, 8) if device.type == "cuda" else (2048, 1)


def gemm_peak_flops(size: int | None = None, repeats: int = 5, device=None, dtype=torch.float32) -> float:
    """The matmul FLOP/s this device reaches: the best of ``repeats`` timings (one sync each) of ``_gemm_shape``'s
    square matmuls (``size`` overrides its size)."""
    device = torch.device(device or default_device())
    default_size, calls = _gemm_shape(device)
    size = size or default_size
    a, b = (torch.randn(size, size, device=device, dtype=dtype) for _ in range(2))
    out = torch.empty(size, size, device=device, dtype=dtype)

    def matmuls():
        for _ in range(calls):
            torch.mm(a, b, out=out)

    interleaved_medians({"mm": matmuls}, device, repeats=1)  # warm-up
    best = min(interleaved_medians({"mm": matmuls}, device, warmup=0, repeats=1)["mm"] for _ in range(repeats))
    return calls * 2 * size**3 / best


def bench_mfu(name: str, train_img_s: float, device=None, precision: str = "32") -> dict:
    """Model FLOP utilisation: training FLOPs/s (3x forward FLOPs per image, attention included) over the
    GEMM peak measured here in the same dtype (fp32, or bf16 for bf16-mixed)."""
    dtype = PRECISIONS[precision] or torch.float32
    fwd = model_info(create_model(name))["flops"]
    peak = gemm_peak_flops(device=device, dtype=dtype)
    achieved = 3 * fwd * train_img_s
    return {"model": name, "forward_flops_per_image": fwd, "train_img_s": train_img_s,
            "achieved_gflops": achieved / 1e9, "gemm_peak_gflops": peak / 1e9, "mfu": achieved / peak,
            "gemm": gemm_setting(torch.device(device or default_device()), dtype)}


def gemm_setting(device: torch.device, dtype: torch.dtype) -> str:
    """What ``gemm_peak_flops`` times on ``device`` by default, in words."""
    size, calls = _gemm_shape(device)
    return f"{f'{calls} back-to-back ' if calls > 1 else ''}{size}² {str(dtype).removeprefix('torch.')} GEMMs"


def bench_pipeline(data_dir: str | None, batch: int = 128, batches: int = 50, device=None,
                   recipe_model: str = "vit_tiny", **data_kwargs) -> dict:
    """The input pipeline alone, as a training run feeds it: batches from the uint8 cache resident on the device,
    the ``recipe_model``'s own augmentation (vit_tiny's: crop, flip, RandAugment, mixup / cutmix), normalised, in
    images/s. ``data_kwargs`` go to zoo.data.ImageData (e.g. max_train_images, cache_dir)."""
    import yaml

    from ..data import ImageData
    from .pipeline import measure_throughput

    device = torch.device(device or default_device())
    augment = yaml.safe_load((Path(__file__).parents[1] / "configs" / f"{recipe_model}.yaml").read_text())["augment"]
    dm = ImageData(data_dir, batch_size=batch, augment=augment, device_cache=device, **data_kwargs)
    dm.prepare_data()
    dm.setup("fit")
    img_s = measure_throughput(dm, num_batches=batches, device=device)
    return {"batch": batch, "augment": f"{recipe_model}'s recipe", "img_s": img_s}


def bench_precision(name: str = "vit_tiny", batch: int = 8, *, repeats: int = 3, device=None) -> dict:
    """fp32 vs bf16 autocast for one model: training and inference time, and a training step's peak memory.
    On a CPU only at a tiny batch, to record what bf16 costs there."""
    device = torch.device(device or default_device())
    model = create_model(name).to(device)
    shape = (3, *model.img_size)
    precisions = ("32", "bf16-mixed")
    model.train()
    train = interleaved_medians({p: training_step(model, shape, batch, precision=p) for p in precisions},
                                device, repeats=repeats)
    model.eval()
    infer = interleaved_medians({p: inference_step(model, shape, batch, precision=p) for p in precisions},
                                device, repeats=repeats)
    saving = None
    if device.type == "cuda":  # the CPU's peak RSS cannot resolve one small step inside a warm process
        model.train()
        memory = {p: peak_memory(training_step(model, shape, batch, precision=p), device) for p in precisions}
        saving = memory["32"] / memory["bf16-mixed"]
    return {"model": name, "device": device.type, "batch": batch,
            "bf16_train_speedup": train["32"] / train["bf16-mixed"],
            "bf16_infer_speedup": infer["32"] / infer["bf16-mixed"], "bf16_memory_saving": saving}


def bench_claims(memory: list[dict], precision_row: dict, *, n: int = 1025, batch: int = 8, repeats: int = 5,
                 device=None) -> list[dict]:
    """Tutorial claims re-measured on the zoo's own backends and masks (3 heads, head_dim 64)."""
    device = torch.device(device or default_device())
    dim = 192
    attn = MultiHeadAttention(dim, 3).to(device)
    x = torch.randn(batch, n, dim, device=device, requires_grad=True)
    window = sliding_window_mask(n, 64, device=device)
    window_spec = spec(window=64)

    def run(backend, mask=None):
        def step():
            attn.backend = backend
            attn(x, mask=mask).sum().backward()
        return step

    med = interleaved_medians({"math": run("math"), "sdpa": run("sdpa"), "sdpa_window": run("sdpa", window),
                               "auto_spec": run("auto", window_spec)}, device, repeats=repeats)
    by = {r["backend"]: r for r in memory}
    n_mem = memory[0]["n"]
    window_mb = attention_peak_memory_mb("sdpa", n_mem, True, window=64, device=device)
    spec_mb = attention_peak_memory_mb("auto", n_mem, True, window=64, device=device, as_spec=True)
    where = precision_row["device"]
    return [
        {"claim": "memory-efficient attention ~1.5x faster", "measured": med["math"] / med["sdpa"],
         "unit": f"x speed, math / sdpa (fwd+bwd, B={batch}, N={n})"},
        {"claim": "memory-efficient attention ~3x less memory",
         "measured": by["math"]["backward_mb"] / max(by["sdpa"]["backward_mb"], 1e-3),
         "unit": f"x memory, math / sdpa (fwd+bwd peak, N={n_mem})"},
        {"claim": "sliding-window attention ~3x faster", "measured": med["sdpa"] / med["sdpa_window"],
         "unit": f"x speed, dense / window-64 mask (sdpa, fwd+bwd, B={batch}, N={n})"},
        {"claim": "sliding-window attention ~4x less memory",
         "measured": by["sdpa"]["backward_mb"] / max(window_mb, 1e-3),
         "unit": f"x memory, dense / window-64 mask (sdpa, fwd+bwd peak, N={n_mem})"},
        {"claim": "sliding-window attention ~3x faster, as zoo.masks.spec (auto: banded on CPU, flex on CUDA)",
         "measured": med["sdpa"] / med["auto_spec"],
         "unit": f"x speed, dense / window-64 spec (auto, fwd+bwd, B={batch}, N={n})"},
        {"claim": "sliding-window attention ~4x less memory, as zoo.masks.spec (auto)",
         "measured": by["math"]["backward_mb"] / max(spec_mb, 1e-3),
         "unit": f"x memory, dense (math) / window-64 spec (auto, fwd+bwd peak, N={n_mem})"},
        {"claim": "mixed precision ~2x faster", "measured": precision_row["bf16_train_speedup"],
         "unit": f"x training speed, fp32 / bf16-mixed ({where}, batch {precision_row['batch']})"},
        {"claim": "mixed precision ~1.5x less memory", "measured": precision_row["bf16_memory_saving"],
         "unit": f"x training-step peak memory, fp32 / bf16-mixed ({where}; GPU only)"},
    ]


def machine() -> dict:
    info = {"python": platform.python_version(), "torch": torch.__version__, "cpu": platform.processor() or
            platform.machine(), "threads": torch.get_num_threads()}
    if torch.cuda.is_available():
        info["gpu"] = torch.cuda.get_device_name()
    return info


def _table(rows: list[dict]) -> str:
    keys = list(rows[0])
    fmt = lambda v: f"{v:.3g}" if isinstance(v, float) else ("—" if v is None else str(v))  # noqa: E731
    return "\n".join(markdown_table(keys, [[fmt(r.get(k)) for k in keys] for r in rows]))


def run_suite(out: str | Path, data_dir: str | None = None, quick: bool = False, device=None) -> dict:
    """Run every benchmark, write OUT/bench.json and OUT/bench.md (after each section), return the results.
    ``quick``: smaller sizes and fewer repeats (a smoke run of the suite itself, not numbers to report)."""
    device = torch.device(device or default_device())
    precision = "bf16-mixed" if device.type == "cuda" else "32"
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    repeats = 1 if quick else 5
    results: dict = {"machine": machine()}

    def add(section: str, value) -> None:  # each section on disk as soon as it is measured
        results[section] = value
        _write(out, results)

    add("attention_op", bench_attention_op(ns=(33,) if quick else (65, 257, 1025), batch=2 if quick else 32,
                                           repeats=repeats, device=device, precision=precision))
    add("models", [bench_models("vit_tiny", train_batch=2 if quick else 128, infer_batch=2 if quick else 256,
                                repeats=1 if quick else 3, device=device, precision=precision)])
    add("training_speed", bench_training_speed(["hybrid_tiny"] if quick else None, batch=2 if quick else 128,
                                               repeats=1 if quick else 3, device=device, precision=precision))
    add("memory", bench_memory(n=2049 if quick else 4097, device=device))
    add("mfu", [bench_mfu("vit_tiny", results["models"][0]["zoo_train_img_s"], device, precision)])
    subset = dict(max_train_images=2000, max_test_images=100, val_size=200) if quick else {}
    pipeline = bench_pipeline(data_dir, batches=5 if quick else 50, device=device, **subset)
    fastest = max(r["train_img_s"] for r in results["training_speed"])
    add("pipeline", {**pipeline, "vs_fastest_model_training": pipeline["img_s"] / fastest})
    tiny = 2 if quick else 8  # bf16 on a CPU: a tiny batch only, to record what it costs there
    add("precision", [bench_precision(batch=128 if device.type == "cuda" else tiny, device=device,
                                      repeats=1 if quick else 3)])
    claims = bench_claims(results["memory"], results["precision"][0], n=257 if quick else 1025,
                          batch=2 if quick else 8, repeats=repeats, device=device)
    add("claims", [*claims, bench_hybrid_vs_vit(batch=2 if quick else 128, repeats=1 if quick else 3,
                                                device=device, precision=precision)])
    return results


def _write(out: Path, results: dict) -> None:
    """OUT/bench.json and OUT/bench.md of the sections measured so far (rewritten after each, so a suite stopped
    from outside keeps them)."""
    atomic_write_json(out / "bench.json", results)
    sections = [f"## {k}\n\n{_table(v if isinstance(v, list) else [v])}\n" for k, v in results.items()]
    atomic_write_text(out / "bench.md", "\n".join(sections))
