"""The project's measurements, beside the package rather than in it (as timm keeps its benchmark and validation
scripts): each command measures something on this machine and records it as a file in ``results/`` (``results``:
the record format, validation and writing), from which ``report`` renders BENCHMARKS.md and README's table
(``report_tables``; ``report_targets``: the project's targets and what was tried toward them). The runs: the CPU
recipe's ablation (``ablation``), the recipe beside the airbench94 port (``anchor``), training throughput per way
of running (``modes``), what ``compile: step`` changes (``compiled_step``), Muon's step (``muon``), the loop's
overhead against a bare PyTorch loop (``overhead``), the one-call GPU check (``gpu_check``), and the recorded forms
of the package's own measurements (``suite``, ``sparse``). Run them from the repository root:
``python -m benchmarks.report``."""
