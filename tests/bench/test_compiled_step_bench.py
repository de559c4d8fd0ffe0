"""benchmarks.compiled_step: a row is built from two processes that share one new compile cache folder, the first
process's op counts, and each process's own compile seconds and cache counts (the processes themselves compile, and
are run by the slow tests and the command)."""

from pathlib import Path

import pytest

from benchmarks import compiled_step as bench
from benchmarks import results


def test_a_row_pairs_a_first_and_a_second_process_on_one_cache_folder():
    calls = []

    def runner(name, batch, cache):
        calls.append((name, batch, cache, Path(cache).is_dir()))
        first = len(calls) == 1
        return {"compile_s": 30.0 if first else 4.0, "compile_cache_hits": 0 if first else 3,
                "compile_cache_misses": 3 if first else 0, "eager_aten_ops": 1000 if first else 999,
                "compiled_aten_ops": 100 if first else 99}

    row = bench.bench_model("vit_tiny", 16, runner)
    assert [c[:2] for c in calls] == [("vit_tiny", 16)] * 2 and calls[0][2] == calls[1][2] and calls[0][3]
    assert not Path(calls[0][2]).exists()  # the folder goes with the measurement
    assert row["eager_aten_ops"] == 1000 and row["compiled_aten_ops"] == 100 and row["ops_ratio"] == 10
    assert row["compile_s_first_process"] == 30.0 and row["compile_s_second_process"] == 4.0
    assert row["cache_misses_first_process"] == 3 and row["cache_hits_second_process"] == 3
    assert row["cache_misses_second_process"] == 0


def test_the_record_kind_is_known():
    record = results.make("compiled_step", "t", "python -m benchmarks.compiled_step", {"rows": [{"model": "m"}]})
    assert results.validate(record)["kind"] == "compiled_step"


@pytest.mark.slow  # two processes compile the model's step (minutes on a small CPU)
@pytest.mark.parametrize("name", ["vit_tiny", "hybrid_tiny"])
def test_the_command_counts_fewer_ops_compiled_and_hits_the_cache_in_the_second_process(name):
    row = bench.bench_model(name, 8)
    assert row["compiled_aten_ops"] * 5 <= row["eager_aten_ops"], row
    assert row["cache_misses_first_process"] > 0 and row["cache_misses_second_process"] == 0
    assert row["cache_hits_second_process"] > 0
