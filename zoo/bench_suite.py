"""The zoo's benchmark suite: the attention op and whole models side by side with timm and with the bare
torch floor, attention memory per backend, model FLOP utilisation, input-pipeline speed, and the
optimisation claims attention tutorials quote, re-measured here.

Every timing is the median of several repeats after warm-up, and candidates are interleaved repeat by repeat
so that drift in the machine's speed hits all of them alike. Results: ``bench.json`` and ``bench.md``.
Run: ``python eval.py --bench-suite --out DIR`` (or ``python -m zoo.bench_suite --out DIR``).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from .attention import MultiHeadAttention
from .bench import inference_step, interleaved_medians, training_step
from .models import create_model, model_info


def _fwd_bwd(module: Callable[[torch.Tensor], torch.Tensor], x: torch.Tensor) -> Callable[[], None]:
    grad = torch.ones_like(x)  # every candidate maps (B, N, dim) -> (B, N, dim)

    def step():
        module(x).backward(grad)

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


def bench_attention_op(ns=(65, 257, 1025), batch: int = 32, heads: int = 3, head_dim: int = 64,
                       repeats: int = 5) -> list[dict]:
    """Forward+backward of one attention layer: zoo (auto) vs timm's Attention (same weights) vs the floor."""
    from timm.layers import Attention as TimmAttention

    dim = heads * head_dim
    zoo_attn = MultiHeadAttention(dim, heads)
    timm_attn = TimmAttention(dim, heads, qkv_bias=True)
    timm_attn.load_state_dict(zoo_attn.state_dict())  # same names and (3, heads, head_dim) layout
    floor = _FloorAttention(zoo_attn)
    rows = []
    for n in ns:
        x = torch.randn(batch, n, dim, requires_grad=True)
        med = interleaved_medians({"zoo": _fwd_bwd(zoo_attn, x), "timm": _fwd_bwd(timm_attn, x),
                                   "floor": _fwd_bwd(floor, x)}, repeats=repeats)
        rows.append({"n": n, **{f"{k}_ms": 1e3 * v for k, v in med.items()},
                     "zoo_vs_floor": med["zoo"] / med["floor"], "zoo_vs_timm": med["zoo"] / med["timm"]})
    return rows


def _timm_vit_like(model) -> nn.Module:
    from timm.models.vision_transformer import VisionTransformer

    return VisionTransformer(img_size=model.img_size, patch_size=model.patch_size,
                             embed_dim=model.embed_dim, depth=len(model.blocks),
                             num_heads=model.blocks[0].attn.num_heads, num_classes=10)


def bench_models(name: str = "vit_tiny", train_batch: int = 128, infer_batch: int = 256,
                 repeats: int = 3) -> dict:
    """Training and inference images/s of a zoo ViT vs timm's VisionTransformer of the same configuration."""
    zoo_model = create_model(name)
    timm_model = _timm_vit_like(zoo_model)
    shape = (3, *zoo_model.img_size)
    zoo_model.train(), timm_model.train()
    train = interleaved_medians({"zoo": training_step(zoo_model, shape, train_batch),
                                 "timm": training_step(timm_model, shape, train_batch)}, repeats=repeats)
    zoo_model.eval(), timm_model.eval()
    infer = interleaved_medians({"zoo": inference_step(zoo_model, shape, infer_batch),
                                 "timm": inference_step(timm_model, shape, infer_batch)}, repeats=repeats)
    out = {"model": name, "train_batch": train_batch, "infer_batch": infer_batch,
           "threads": torch.get_num_threads()}
    for k in ("zoo", "timm"):
        out[f"{k}_train_img_s"] = train_batch / train[k]
        out[f"{k}_infer_img_s"] = infer_batch / infer[k]
    out["train_ratio"] = out["zoo_train_img_s"] / out["timm_train_img_s"]
    out["infer_ratio"] = out["zoo_infer_img_s"] / out["timm_infer_img_s"]
    return out


_MEMORY_SCRIPT = """
import sys, torch, zoo
from zoo.bench import peak_memory
backend, n, backward = sys.argv[1], int(sys.argv[2]), sys.argv[3] == "1"
attn = zoo.MultiHeadAttention(192, 3, backend=backend)
attn(torch.randn(1, 8, 192)).sum().backward()  # load kernels before measuring
x = torch.randn(1, n, 192, requires_grad=backward)
def call():
    with torch.set_grad_enabled(backward):
        out = attn(x)
        if backward:
            out.sum().backward()
print(peak_memory(call, torch.device("cpu")) / 2**20)
"""


def attention_peak_memory_mb(backend: str, n: int, backward: bool) -> float:
    """Peak resident-memory growth (MiB, zoo.bench.peak_memory) of one attention call (B=1, 3 heads,
    head_dim 64) in a fresh subprocess once inputs exist and kernels are loaded. glibc's mmap threshold is
    pinned: its default grows with freed blocks, and the heap then keeps freed chunks, inflating the peak."""
    env = {**os.environ, "MALLOC_MMAP_THRESHOLD_": "131072"}
    res = subprocess.run([sys.executable, "-c", _MEMORY_SCRIPT, backend, str(n), str(int(backward))],
                         capture_output=True, text=True, check=True, env=env)
    return float(res.stdout.strip().splitlines()[-1])


def bench_memory(n: int = 4097, backends=("math", "sdpa", "chunked", "linear")) -> list[dict]:
    return [{"backend": b, "n": n, "inference_mb": attention_peak_memory_mb(b, n, False),
             "backward_mb": attention_peak_memory_mb(b, n, True)} for b in backends]


def gemm_peak_flops(size: int = 2048, repeats: int = 5, dtype=torch.float32) -> float:
    a, b = torch.randn(size, size, dtype=dtype), torch.randn(size, size, dtype=dtype)
    med = interleaved_medians({"mm": lambda: torch.mm(a, b)}, repeats=repeats)["mm"]
    return 2 * size**3 / med


def bench_mfu(name: str, train_img_s: float) -> dict:
    """Model FLOP utilisation: training FLOPs/s (3x forward FLOPs per image, attention included) over the
    fp32 GEMM peak measured here."""
    fwd = model_info(create_model(name))["flops"]
    peak = gemm_peak_flops()
    achieved = 3 * fwd * train_img_s
    return {"model": name, "forward_flops_per_image": fwd, "train_img_s": train_img_s,
            "achieved_gflops": achieved / 1e9, "gemm_peak_gflops": peak / 1e9, "mfu": achieved / peak}


def bench_pipeline(data_dir: str | None, batch: int = 128, batches: int = 50) -> dict:
    """The input pipeline alone: batch from the in-memory uint8 cache + augment + normalise, images/s."""
    from .data import ImageDataModule, measure_throughput

    dm = ImageDataModule(data_dir, batch_size=batch)
    dm.prepare_data()
    dm.setup("fit")
    return {"batch": batch, "img_s": measure_throughput(dm, num_batches=batches)}


def bench_claims(repeats: int = 5, memory: list[dict] | None = None) -> list[dict]:
    """Tutorial claims re-measured on the zoo's own backends and masks (B=8, 3 heads, head_dim 64, N=1025)."""
    from .masks import sliding_window_mask

    n, dim = 1025, 192
    attn = MultiHeadAttention(dim, 3)
    x = torch.randn(8, n, dim, requires_grad=True)
    window = sliding_window_mask(n, 64)

    def run(backend, mask=None):
        def step():
            attn.backend = backend
            attn(x, mask=mask).sum().backward()
        return step

    med = interleaved_medians({"math": run("math"), "sdpa": run("sdpa"),
                               "sdpa_window": run("sdpa", window), "math_window": run("math", window)},
                              repeats=repeats)
    rows = [{"claim": "memory-efficient attention ~1.5x faster", "measured": med["math"] / med["sdpa"],
             "unit": "x speed (math / sdpa, fwd+bwd)"}]
    if memory:
        by = {r["backend"]: r for r in memory}
        rows.append({"claim": "memory-efficient attention ~3x less memory",
                     "measured": by["math"]["backward_mb"] / max(by["sdpa"]["backward_mb"], 1e-3),
                     "unit": "x memory (math / sdpa, fwd+bwd peak)"})
    rows.append({"claim": "sliding-window attention ~3x faster", "measured": med["sdpa"] / med["sdpa_window"],
                 "unit": "x speed (dense sdpa / windowed sdpa)"})
    rows.append({"claim": "mixed precision ~2x faster, 1.5x less memory", "measured": None,
                 "unit": "needs a GPU (CPU bf16 is emulated here)"})
    return rows


def cpu_bf16_fact(name: str = "vit_tiny", batch: int = 8) -> dict:
    """Record, at a tiny batch, how much slower bf16 autocast inference is than fp32 on this CPU."""
    model = create_model(name).eval()
    shape = (3, *model.img_size)
    steps = {"fp32": inference_step(model, shape, batch),
             "bf16": inference_step(model, shape, batch, precision="bf16-mixed")}
    med = interleaved_medians(steps, repeats=3)
    return {"model": name, "batch": batch, "fp32_ms": 1e3 * med["fp32"], "bf16_ms": 1e3 * med["bf16"],
            "bf16_slowdown": med["bf16"] / med["fp32"]}


def machine() -> dict:
    return {"python": platform.python_version(), "torch": torch.__version__, "cpu": platform.processor() or
            platform.machine(), "threads": torch.get_num_threads(), "cuda": torch.cuda.is_available()}


def _table(rows: list[dict]) -> str:
    if not rows:
        return ""
    keys = list(rows[0])
    fmt = lambda v: f"{v:.3g}" if isinstance(v, float) else ("—" if v is None else str(v))
    lines = ["| " + " | ".join(keys) + " |", "|" + "---|" * len(keys)]
    lines += ["| " + " | ".join(fmt(r.get(k)) for k in keys) + " |" for r in rows]
    return "\n".join(lines)


def run_suite(out: str | Path, data_dir: str | None = None, quick: bool = False) -> dict:
    """Run every benchmark, write OUT/bench.json and OUT/bench.md, return the results."""
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    repeats = 2 if quick else 5
    results: dict = {"machine": machine()}
    results["attention_op"] = bench_attention_op(ns=(65, 257) if quick else (65, 257, 1025), repeats=repeats)
    results["models"] = [bench_models("vit_tiny", train_batch=32 if quick else 128,
                                      infer_batch=64 if quick else 256, repeats=2 if quick else 3)]
    results["memory"] = bench_memory(n=1025 if quick else 4097)
    results["mfu"] = [bench_mfu("vit_tiny", results["models"][0]["zoo_train_img_s"])]
    results["pipeline"] = bench_pipeline(data_dir)
    fastest = max(r["zoo_train_img_s"] for r in results["models"])
    results["pipeline"]["vs_fastest_model_training"] = results["pipeline"]["img_s"] / fastest
    results["claims"] = bench_claims(repeats=repeats, memory=results["memory"])
    results["cpu_bf16"] = [cpu_bf16_fact()] if not torch.cuda.is_available() else []
    (out / "bench.json").write_text(json.dumps(results, indent=2))
    sections = [f"## {k}\n\n{_table(v if isinstance(v, list) else [v])}\n" for k, v in results.items()]
    (out / "bench.md").write_text("\n".join(sections))
    return results


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", required=True)
    parser.add_argument("--data-dir", default=None)
    parser.add_argument("--quick", action="store_true", help="smaller sizes, for a smoke run")
    args = parser.parse_args(argv)
    run_suite(args.out, args.data_dir, args.quick)
    print(Path(args.out) / "bench.md")


if __name__ == "__main__":
    main()
