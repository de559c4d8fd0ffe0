"""benchmarks.muon: the Newton-Schulz FLOP count against torch's FLOP counter on torch's own iteration, and the floor
as that count over the matmul rate."""

import pytest
import torch
from torch.optim._muon import _zeropower_via_newtonschulz
from torch.utils.flop_counter import FlopCounterMode

from benchmarks import muon as bench


@pytest.mark.parametrize("shapes", [[(576, 192)], [(192, 768), (64, 3, 3, 3)], [(8, 8), (5, 40), (40, 5)]])
def test_the_flop_count_is_what_torch_counts_in_its_own_iteration(shapes):
    counter = FlopCounterMode(display=False)
    with counter:
        for shape in shapes:
            grad = torch.randn(shape[0], torch.Size(shape[1:]).numel())
            _zeropower_via_newtonschulz(grad, (3.4445, -4.7750, 2.0315), bench.NS_STEPS, 1e-7)
    assert bench.newton_schulz_flops(shapes) == counter.get_total_flops()


def test_the_floor_is_the_iteration_at_the_given_rate(monkeypatch):
    monkeypatch.setattr(bench, "interleaved_medians",
                        lambda candidates, device=None, repeats=5: dict.fromkeys(candidates, 0.004))
    row = bench.bench_muon("vit_nano", repeats=1, peak_bf16_flops=1e12)
    flops = bench.newton_schulz_flops([p.shape for p in bench.muon_matrices("vit_nano")])
    assert row["newton_schulz_gflop"] == flops / 1e9
    assert row["floor_bf16_ms"] == pytest.approx(flops / 1e12 * 1000)
    assert row["loop_vs_floor"] == pytest.approx(4.0 / row["floor_bf16_ms"])
