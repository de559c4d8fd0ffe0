"""Evaluate, explain, benchmark and compare trained runs; the same program is installed as ``zoo-eval``.
See ``python eval.py --help`` and ``zoo.explain.cli``."""

import sys

from zoo.explain.cli import main

if __name__ == "__main__":
    sys.exit(main())
