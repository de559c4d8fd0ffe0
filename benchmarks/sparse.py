"""Sliding-window attention (``zoo.bench.sparse``: dense, masked, banded, flex) measured and recorded in
``results/`` for the report, one record per mode (training, inference).

    python -m benchmarks.sparse --out OUT --results results
"""

from __future__ import annotations

import sys

from zoo.bench import sparse

from . import results


def results_records(found: dict, command: str, window: int = 64) -> list[dict]:
    """``results`` records of a run of ``zoo.bench.sparse``: one per mode (training = fwd+bwd, inference = fwd), a
    row per N with each candidate's {"ms", "mib"} at ``window`` (the windowless candidates from that N's first
    row), and the claims of that mode."""
    records = []
    for mode, what in (("fwd+bwd", "training"), ("fwd", "inference")):
        rows = []
        for n in sorted({r["n"] for r in found["rows"] if r["mode"] == mode}):
            cells = {}
            # the window's own row first; a first-window row adds only the windowless candidates (dense, math)
            for r in sorted(found["rows"], key=lambda r: r["window"] != window):
                if r["n"] == n and r["mode"] == mode and (r["window"] == window or "dense_ms" in r):
                    for name in (k[:-3] for k in r if k.endswith("_ms")):
                        cells.setdefault(name, {"ms": r[f"{name}_ms"], "mib": r.get(f"{name}_mb")})
            if cells:
                rows.append({"n": n, **cells})
        # a claim belongs to the mode its words name ("fwd+bwd" contains "fwd": test the longer first)
        claims = [{"claim": f"{c['claim']} ({c['unit']})", "measured": f"{c['measured']:.3g}x"} for c in found["claims"]
                  if ("fwd+bwd" in c["claim"] + c["unit"]) == (mode == "fwd+bwd")]
        if rows:
            records.append(results.make("sparse", f"Sliding-window attention that skips work, {what}", command, {
                "setting": f"one self-attention layer, B=1, 3 heads, head dim 64, window ±{window}, {mode}; "
                           "memory: peak of the allocator's tensor events", "rows": rows, "claims": claims}))
    return records


def main(argv=None) -> None:
    argv = list(sys.argv[1:] if argv is None else argv)
    folder = argv[argv.index("--results") + 1] if "--results" in argv else None
    measured = [a for i, a in enumerate(argv) if a != "--results" and (i == 0 or argv[i - 1] != "--results")]
    found = sparse.main(measured)
    if folder:
        for record in results_records(found, results.command_line("benchmarks.sparse", argv)):
            print(results.write(record, folder))


if __name__ == "__main__":
    main()
