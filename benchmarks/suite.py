"""The side-by-side suite (``eval.py --bench-suite``: the zoo's attention and models beside timm's, the input
pipeline, precision) run and recorded in ``results/`` for the report.

    python -m benchmarks.suite --data-dir DATA --out OUT --results results
"""

from __future__ import annotations

import argparse

from zoo.bench.suite import run_suite

from . import results


def main(argv=None) -> None:
    p = argparse.ArgumentParser(prog="python -m benchmarks.suite", description=__doc__.split("\n\n")[0])
    p.add_argument("--data-dir", help="CIFAR-10 for the input pipeline's measurement")
    p.add_argument("--out", required=True, help="folder for bench.json and bench.md")
    p.add_argument("--device", help="cpu or cuda (default: cuda when there is one)")
    p.add_argument("--results", metavar="DIR", help="record the measurement in DIR (results/)")
    args = p.parse_args(argv)
    found = run_suite(args.out, data_dir=args.data_dir, device=args.device)
    if args.results:
        print(results.write(results.from_suite(found, results.command_line("benchmarks.suite", argv)), args.results))


if __name__ == "__main__":
    main()
