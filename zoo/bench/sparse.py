"""Attention that skips work, measured: one self-attention layer (B=1, 3 heads, head dim 64) under a
sliding-window mask, as

- ``dense``: no mask at all, SDPA (what the window saves against; N <= ``dense_max_n``),
- ``math``: no mask at all, the math backend (the N x N scores held, as tutorials' dense attention),
- ``masked_sdpa``: the window as a bool tensor handed to SDPA (computes everything; N <= ``dense_max_n``),
- ``banded``: backend "chunked" with ``zoo.masks.spec(window=w)`` (each query chunk reads its key band),
- ``flex``: backend "flex" with the same spec (forward only on a CPU: flex has no CPU backward in torch 2.14),
- ``auto``: backend "auto" with the spec, i.e. what ``backends.auto_sparse`` picks (banded on a CPU, flex on
  CUDA),
- ``projections``: the same layer with its attention left out (q + k + v goes to the output projection): the
  time and memory every candidate spends outside attention, so a peak can be read as this floor plus
  attention's own share, and no candidate can use less memory than it,

forward ("fwd", under no_grad) and forward + backward ("fwd+bwd"), time (interleaved medians) and peak memory
(the tensors' peak, read from the allocator's events: ``timing.tensor_peak_memory``), plus flex's compile
time (its first call minus a steady one; about 0 where an earlier row at the same shape compiled it).
``sparse_claims`` reads the sparse backends' targets off the rows.

Run: ``python -m zoo.bench.sparse --out DIR`` (``--quick`` for a smoke run of small sizes); ~10 minutes on
2 CPU cores with the defaults. Writes ``DIR/sparse.json`` and ``DIR/sparse.md``.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch
from einops import rearrange

from ..layers.attention import MultiHeadAttention
from ..layers.masks import spec
from ..runtime.console import markdown_table
from .timing import interleaved_medians, synchronize, tensor_peak_memory

DIM, HEADS = 192, 3
NS = (1024, 2048, 4096, 8192, 16384)
WINDOWS = (16, 64, 256)
BACKENDS = {"dense": "sdpa", "math": "math", "masked_sdpa": "sdpa", "banded": "chunked", "flex": "flex",
            "auto": "auto"}
QUADRATIC = ("dense", "math", "masked_sdpa")  # N x N work: only up to dense_max_n
WINDOWLESS = ("dense", "math", "projections")  # no window: measured once per (N, mode), on the first window's row
FLOOR = "projections"


def candidates(n: int, mode: str, device: torch.device, dense_max_n: int = 8192,
               first_window: bool = True) -> list[str]:
    """The candidates measured at N = n in ``mode``: quadratic ones only up to ``dense_max_n``, windowless
    ones only on the first window's row; flex's forward everywhere, its backward only on CUDA."""
    names = [c for c in (*BACKENDS, FLOOR) if (n <= dense_max_n or c not in QUADRATIC)
             and (first_window or c not in WINDOWLESS)]
    if mode == "fwd+bwd" and device.type != "cuda":
        names.remove("flex")
    return names


def _call(name: str, n: int, window: int, mode: str, device: torch.device):
    """A closure running candidate ``name`` once (its module, input and mask built here, outside the timing)."""
    attn = MultiHeadAttention(DIM, HEADS, backend=BACKENDS.get(name, "sdpa")).to(device)
    backward = mode == "fwd+bwd"
    x = torch.randn(1, n, DIM, device=device, requires_grad=backward)
    mask = {"dense": None, "math": None,
            "masked_sdpa": spec(window=window).dense(n, device=device)[0, 0]}.get(name, spec(window=window))

    def without_attention():
        q, k, v = attn._project(x, None)
        return attn.proj(rearrange(q + k + v, "b h n d -> b n (h d)"))

    def step():
        with torch.set_grad_enabled(backward):
            out = without_attention() if name == FLOOR else attn(x, mask=mask)
            if backward:
                out.sum().backward()

    return step


def _first_call_seconds(step, device: torch.device) -> float:
    synchronize(device)
    start = time.perf_counter()
    step()
    synchronize(device)
    return time.perf_counter() - start


def time_rows(ns=NS, windows=WINDOWS, modes=("fwd", "fwd+bwd"), *, dense_max_n: int = 8192, repeats: int = 3,
              device=None) -> list[dict]:
    """One row per (n, window, mode): ``<candidate>_ms`` (median of ``repeats`` after a warm-up, candidates
    interleaved) and, on flex's rows, ``flex_compile_s`` (its first call minus its median)."""
    device = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
    rows = []
    with torch._dynamo.config.patch(recompile_limit=256):  # one flex compile per shape: keep them all compiled
        for mode in modes:
            for n in ns:
                for window in windows:
                    names = candidates(n, mode, device, dense_max_n, first_window=window == windows[0])
                    steps = {name: _call(name, n, window, mode, device) for name in names}
                    first = _first_call_seconds(steps["flex"], device) if "flex" in steps else None
                    med = interleaved_medians(steps, device, warmup=1, repeats=repeats)
                    row = {"n": n, "window": window, "mode": mode, **{f"{k}_ms": 1e3 * v for k, v in med.items()}}
                    if first is not None:
                        row["flex_compile_s"] = first - med["flex"]
                    rows.append(row)
    return rows


def memory_rows(rows: list[dict], device=None) -> list[dict]:
    """Adds ``<candidate>_mb`` (the peak tensor memory one call holds, MiB: ``timing.tensor_peak_memory``,
    allocator-exact on the CPU too) to every timing row, each call run once before it is measured (kernels
    loaded, flex compiled)."""
    device = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
    for row in rows:
        for name in [k[:-3] for k in list(row) if k.endswith("_ms")]:
            step = _call(name, row["n"], row["window"], row["mode"], device)
            step()
            row[f"{name}_mb"] = tensor_peak_memory(step, device) / 2**20
    return rows


def bench_local_vit(img_sizes=(64, 96), batch: int = 32, *, repeats: int = 3, device=None) -> list[dict]:
    """Training images/s (forward, cross-entropy, backward, AdamW) of ``vit_local_tiny`` side by side with the
    dense ViT of the same size (``vit_tiny`` mean-pooled, no class token), local attention run by "auto" (what
    ``auto_sparse`` picks for the grid) and forced onto the banded path ("chunked"), fp32."""
    from ..models import create_model
    from .timing import training_step

    device = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
    rows = []
    for size in img_sizes:
        models = {"dense_vit": create_model("vit_tiny", img_size=size, global_pool="avg"),
                  "local_auto": create_model("vit_local_tiny", img_size=size),
                  "local_banded": create_model("vit_local_tiny", img_size=size, backend="chunked")}
        steps = {k: training_step(m.to(device).train(), (3, size, size), batch) for k, m in models.items()}
        med = interleaved_medians(steps, device, repeats=repeats)
        tokens = models["dense_vit"].patch_embed.num_patches
        rows.append({"img_size": size, "tokens": tokens, "batch": batch,
                     **{f"{k}_img_s": batch / v for k, v in med.items()},
                     "local_auto_vs_dense": med["dense_vit"] / med["local_auto"],
                     "local_banded_vs_dense": med["dense_vit"] / med["local_banded"]})
    return rows


def _row(rows: list[dict], n: int, window: int, mode: str) -> dict:
    return next(r for r in rows if (r["n"], r["window"], r["mode"]) == (n, window, mode))


def sparse_claims(rows: list[dict], n: int = 4096, window: int = 64) -> list[dict]:
    """The sparse backends' targets as claim rows (measured ratio; the target in the claim's words), where the rows hold
    what they need: flex inference and "auto" training against masked SDPA, training memory against dense,
    and the growth of the banded path's time and memory over N."""
    claims = []
    fwd, train = _row(rows, n, window, "fwd"), _row(rows, n, window, "fwd+bwd")
    claims.append({"claim": f"window ±{window} inference, flex >= 3x faster than masked SDPA",
                   "measured": fwd["masked_sdpa_ms"] / fwd["flex_ms"], "unit": f"x speed (fwd, N={n})"})
    claims.append({"claim": f"window ±{window} training, auto >= 3x faster than masked SDPA",
                   "measured": train["masked_sdpa_ms"] / train["auto_ms"], "unit": f"x speed (fwd+bwd, N={n})"})
    windowless = next(r for r in rows if (r["n"], r["mode"]) == (n, "fwd+bwd") and "dense_ms" in r)
    for name in ("dense", "math"):
        if f"{name}_mb" in windowless and "auto_mb" in train:
            claims.append({"claim": f"window ±{window} training, auto >= 4x less peak memory than dense ({name})",
                           "measured": windowless[f"{name}_mb"] / max(train["auto_mb"], 1e-3),
                           "unit": f"x memory (fwd+bwd peak, N={n})"})
    if f"{FLOOR}_mb" in windowless and "dense_mb" in windowless:
        claims.append({"claim": "the most any candidate can save against dense (sdpa): dense's peak over the "
                                "layer without attention",
                       "measured": windowless["dense_mb"] / max(windowless[f"{FLOOR}_mb"], 1e-3),
                       "unit": f"x memory (fwd+bwd peak, N={n})"})
    ns = sorted({r["n"] for r in rows})
    for mode in ("fwd", "fwd+bwd"):
        small, large = _row(rows, ns[0], window, mode), _row(rows, ns[-1], window, mode)
        for what, unit in (("ms", "time"), ("mb", "memory")):
            key = f"banded_{what}"
            if key in small:
                grow = ns[-1] // ns[0]
                claims.append({"claim": f"banded {unit} linear in N: <= {1.25 * grow:g}x for {grow}x the tokens "
                                        f"({mode})",
                               "measured": large[key] / max(small[key], 1e-3),
                               "unit": f"x {unit}, N={ns[-1]} / N={ns[0]} (window ±{window})"})
    return claims


def _table(rows: list[dict]) -> str:
    keys = list(dict.fromkeys(k for r in rows for k in r))
    fmt = lambda v: f"{v:.3g}" if isinstance(v, float) else ("—" if v is None else str(v))  # noqa: E731
    return "\n".join(markdown_table(keys, [[fmt(r.get(k)) for k in keys] for r in rows]))


def run(out: str | Path, quick: bool = False, device=None, memory: bool = True) -> dict:
    """Time (and measure the memory of) every candidate, write OUT/sparse.json and OUT/sparse.md, return them.
    ``quick``: N in (256, 1024), windows (16, 64), one repeat: a smoke run, not numbers to report."""
    ns, windows = ((256, 1024), (16, 64)) if quick else (NS, WINDOWS)
    rows = time_rows(ns, windows, repeats=1 if quick else 3, device=device)
    if memory:
        rows = memory_rows(rows, device)
    claim_n = 1024 if quick else 4096
    results = {"rows": rows, "claims": sparse_claims(rows, n=claim_n, window=64), "threads": torch.get_num_threads()}
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "sparse.json").write_text(json.dumps(results, indent=2))
    (out / "sparse.md").write_text(f"## sliding-window attention\n\n{_table(rows)}\n\n## claims\n\n"
                                   f"{_table(results['claims'])}\n")
    return results


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(prog="python -m zoo.bench.sparse", description=__doc__.split("\n\n")[0])
    p.add_argument("--out", default="bench_sparse", help="folder for sparse.json and sparse.md")
    p.add_argument("--quick", action="store_true", help="small sizes, one repeat: a smoke run")
    p.add_argument("--device", default=None, help="cuda or cpu (default: cuda when there is one)")
    p.add_argument("--no-memory", action="store_true", help="timings only (no memory pass)")
    args = p.parse_args(argv)
    found = run(args.out, quick=args.quick, device=args.device, memory=not args.no_memory)
    print(_table(found["claims"]))
    return found


if __name__ == "__main__":
    main()
