"""Train a zoo model on CIFAR-10 (or an ImageFolder tree); the same program is installed as ``zoo-train``.
See ``python train.py --help`` and ``zoo.train.cli``."""

import sys

from zoo.train.cli import main

if __name__ == "__main__":
    sys.exit(main())
