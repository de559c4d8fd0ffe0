"""What train.py and eval.py share at the console: a bad command line or a user error as one line on stderr with
exit code 2 (never a usage block or a traceback), output that reaches a pipe or a log line by line, Markdown tables
(``markdown_table``, the one table writer), the zoo's own warnings in one line, and the libraries' routine chatter
kept off the first screen (each notice matched by its
message, so every other warning and error still shows)."""

from __future__ import annotations

import argparse
import logging
import sys
import warnings
from pathlib import Path


class OneLineParser(argparse.ArgumentParser):
    """argparse that reports a bad command line as one line on stderr (and exit code 2), as every other user
    error of the zoo's programs, instead of the usage block followed by the error."""

    def error(self, message: str):
        self.exit(2, f"{self.prog}: error: {message} (see --help)\n")


def parse_or_exit_code(parse, argv) -> argparse.Namespace | int:
    """``parse(argv)``, or the exit code argparse chose (2 for a bad command line, 0 for --help)."""
    try:
        return parse(argv)
    except SystemExit as exit:
        return exit.code if isinstance(exit.code, int) else 0


def error_line(prog: str, err: Exception, code: int = 2) -> int:
    """Print ``prog: error: <first line of err that says something>`` on stderr (an error whose text opens with a
    blank line, as a library's may, is not reduced to nothing) and return ``code`` (the process's exit status)."""
    said = next((line.strip() for line in str(err).splitlines() if line.strip()), type(err).__name__)
    print(f"{prog}: error: {said}", file=sys.stderr)
    return code


def markdown_table(header, rows) -> list[str]:
    """A Markdown table's lines: ``header`` (cell texts) and ``rows`` (iterables of cells, each written with
    ``str``): the one table writer of the zoo's files and reports."""
    header = list(header)
    return ["| " + " | ".join(header) + " |", "|" + "---|" * len(header),
            *("| " + " | ".join(str(cell) for cell in row) + " |" for row in rows)]


def line_buffered_output() -> None:
    """Each printed line goes out at once also when stdout is a pipe or a file (``| tee``, nohup, a SLURM log),
    where Python would otherwise hold it in a block buffer until the run ends."""
    for stream in (sys.stdout, sys.stderr):
        if hasattr(stream, "reconfigure") and not stream.isatty():
            stream.reconfigure(line_buffering=True)

ZOO_DIR = Path(__file__).resolve().parents[1]  # the zoo package: its own warnings are notices to the user
_PYTHON_FORM = warnings.formatwarning  # Python's form, kept for every other warning

# Lightning Fabric's info lines (rank_zero_info) that repeat what the zoo's own lines say
INFO_PREFIXES = (
    "Using bfloat16 Automatic Mixed Precision",  # the plan line names the precision
    "Using 16-bit Automatic Mixed Precision",
    "LOCAL_RANK:",
)

# torch's warnings through logging, by logger: messages about a setup the zoo does not use
TORCH_LOGGED = {
    # inductor imports cpp_extension on a CPU; with CUDA_HOME set (or /usr/local/cuda present) it warns that
    # no CUDA runtime is found, which a CPU run does not need
    "torch.utils.cpp_extension": ("No CUDA runtime is found",),
}

# warnings raised inside Lightning / torch about their own internals or about settings the zoo makes on purpose
WARNING_MESSAGES = (
    r".*isinstance\(treespec, LeafSpec\)` is deprecated",    # torch's pytree, called by Lightning
    r"You are using a CUDA device .* that has Tensor Cores",  # the zoo sets float32_matmul_precision itself
    r"The `srun` command is available on your system",
)

LOGGERS = ("lightning.pytorch.utilities.rank_zero", "lightning.fabric.utilities.rank_zero",
           "lightning_utilities.core.rank_zero", "lightning.pytorch", "lightning.fabric")


class _DropRoutineInfo(logging.Filter):
    def __init__(self, prefixes: tuple[str, ...]):
        super().__init__()
        self.prefixes = prefixes

    def filter(self, record: logging.LogRecord) -> bool:
        return not str(record.getMessage()).startswith(self.prefixes)


_FILTER = _DropRoutineInfo(INFO_PREFIXES)
_TORCH_FILTERS = {name: _DropRoutineInfo(prefixes) for name, prefixes in TORCH_LOGGED.items()}


def quiet_libraries() -> None:
    """Install the filters (idempotent): on the loggers Lightning's info lines come from and on their handlers,
    on the torch loggers of ``TORCH_LOGGED``, and ``warnings`` filters for the messages in ``WARNING_MESSAGES``."""
    for name in LOGGERS:
        logger = logging.getLogger(name)
        for target in (logger, *logger.handlers):
            if _FILTER not in target.filters:
                target.addFilter(_FILTER)
    for name, log_filter in _TORCH_FILTERS.items():
        if log_filter not in logging.getLogger(name).filters:
            logging.getLogger(name).addFilter(log_filter)
    for message in WARNING_MESSAGES:
        warnings.filterwarnings("ignore", message=message)


def zoo_warnings_in_one_line(prog: str) -> None:
    """The zoo's own warnings (a rebuilt data cache, a skipped image, a measured choice redone) print as one line,
    ``prog: warning: message``, instead of Python's ``file:line: UserWarning:`` form followed by a line of the
    zoo's source; any other warning keeps Python's form, which says where it came from."""

    def format_warning(message, category, filename, lineno, line=None):
        if ZOO_DIR in Path(filename).resolve().parents:
            return f"{prog}: warning: {message}\n"
        return _PYTHON_FORM(message, category, filename, lineno, line)

    warnings.formatwarning = format_warning
