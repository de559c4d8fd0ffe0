"""What train.py and eval.py share at the console: a bad command line or a user error as one line on stderr with
exit code 2 (never a usage block or a traceback), and output that reaches a pipe or a log line by line."""

from __future__ import annotations

import argparse
import sys


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


def line_buffered_output() -> None:
    """Each printed line goes out at once also when stdout is a pipe or a file (``| tee``, nohup, a SLURM log),
    where Python would otherwise hold it in a block buffer until the run ends."""
    for stream in (sys.stdout, sys.stderr):
        if hasattr(stream, "reconfigure") and not stream.isatty():
            stream.reconfigure(line_buffering=True)
