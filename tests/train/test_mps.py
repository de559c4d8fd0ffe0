"""Apple silicon (MPS), with the device's availability forced either way since no Mac is at hand: what
``--accelerator auto`` and ``eval.py``'s default pick, the one-line refusals, the precision and Muon dtype chosen
there, torch.compile switched off in one line, one process for every device, and chunked attention keeping its
activations where recomputing would redraw dropout."""

from __future__ import annotations

import pytest
import torch

from zoo.runtime import device


@pytest.fixture
def mps(monkeypatch):
    """Pretend this machine has (True) or lacks (False) an MPS device, and no CUDA GPU."""
    def force(available: bool):
        monkeypatch.setattr(torch.backends.mps, "is_available", lambda: available)
        monkeypatch.setattr(torch.cuda, "device_count", lambda: 0)
        monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    return force


def test_auto_picks_mps_where_there_is_one(mps):
    mps(True)
    assert device.resolve_accelerator("auto", "auto") == "mps"
    assert device.resolve_accelerator("mps", 1) == "mps"
    assert device.resolve_accelerator("cpu", "auto") == "cpu"
    assert device.eval_device(None) == torch.device("mps") and device.eval_device("mps") == torch.device("mps")
    mps(False)
    assert device.resolve_accelerator("auto", "auto") == "cpu" and device.eval_device(None) == torch.device("cpu")


@pytest.mark.parametrize("call, message", [
    (lambda: device.resolve_accelerator("mps", "auto"), r"--accelerator mps requested but torch has no MPS device"),
    (lambda: device.eval_device("mps"), r"--device mps: torch has no MPS device here"),
])
def test_mps_requested_without_one_is_one_line(call, message, mps):
    mps(False)
    with pytest.raises(ValueError, match=message) as err:
        call()
    assert "\n" not in str(err.value)


def test_mps_is_one_device(mps):
    mps(True)
    with pytest.raises(ValueError, match="Apple MPS is one device"):
        device.resolve_accelerator("mps", 2)


def test_choices_on_mps_are_valid_there(mps, monkeypatch, capsys):
    mps(True)
    monkeypatch.setenv(device.NATIVE_BF16_ENV, "1")  # the host CPU's bf16 says nothing about the GPU's
    assert device.resolve_precision("auto", "mps") == "32"
    assert device.resolve_muon_dtype("auto", "mps") == "float32"
    assert device.compile_for("regions", "mps") is False
    assert "off on Apple MPS" in capsys.readouterr().out
    assert device.compile_for("regions", "cpu") == "regions" and capsys.readouterr().out == ""


def test_train_py_mps_without_one_is_exit_2(capsys):
    import train

    if torch.backends.mps.is_available():
        pytest.skip("needs a machine without MPS")
    assert train.main(["--model", "vit_nano", "--accelerator", "mps"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "no MPS device" in err


def test_every_device_on_a_mac_is_one_process(mps):
    from zoo.runtime.distributed import device_count

    mps(True)
    assert device_count(-1, "mps") == device_count("auto", "mps") == 1  # Lightning's count of a Mac's GPUs


def test_chunked_attention_keeps_its_activations_where_recomputing_would_redraw_dropout(monkeypatch):
    """torch's checkpointing restores the CPU's and CUDA's generators for the recomputation, not MPS's: there a
    recomputed chunk would draw another dropout mask than the forward used, and its gradients would be wrong."""
    from zoo import MultiHeadAttention
    from zoo.layers import backends

    assert backends.recompute_keeps_dropout(torch.device("cpu"))
    assert backends.recompute_keeps_dropout(torch.device("cuda", 0))
    assert not backends.recompute_keeps_dropout(torch.device("mps"))
    calls = []
    monkeypatch.setattr(backends, "checkpoint", lambda fn, *args, **kw: calls.append(1) or fn(*args))
    x = torch.randn(1, 8, 16, requires_grad=True)
    for drop, keeps in ((0.0, False), (0.1, True), (0.1, False)):
        monkeypatch.setattr(backends, "recompute_keeps_dropout", lambda device, keeps=keeps: keeps)
        attention = MultiHeadAttention(16, 2, attn_drop=drop, backend="chunked", chunk_size=4).train()
        calls.clear()
        attention(x).sum().backward()
        assert len(calls) == (0 if drop and not keeps else 2), (drop, keeps)  # two chunks of 4 queries


@pytest.mark.parametrize("optimizer", ["adamw", "sgd", "muon"])
def test_optimizers_run_fused_on_a_mac_as_on_a_gpu(optimizer):
    """torch's fused AdamW and SGD run on MPS (its for-each kernels do not: unfused would be a per-tensor loop),
    and fused AdamW takes a GradScaler's tensors under 16-mixed."""
    import zoo
    from zoo.train.loop import RunPlan, build_optimizer_for
    from zoo.train.recipe import Recipe

    net = zoo.create_model("vit_nano", embed_dim=32, depth=1, num_heads=2)
    plan = RunPlan(Recipe.from_dict({"model": "vit_nano", "optimizer": optimizer, "muon_dtype": "float32"}), "cpu",
                   "32", None, None)
    for place, fused in ((torch.device("cpu"), False), (torch.device("mps"), True)):
        built = build_optimizer_for(plan, net, place)  # the device the run's model is on
        assert (built.adamw if optimizer == "muon" else built).defaults["fused"] is fused
    assert "mps" in torch.utils._foreach_utils._get_fused_kernels_supported_devices()  # torch's own list


def test_a_run_recorded_in_fp16_resumes_in_fp16_on_a_mac_not_on_a_cpu(tmp_path):
    from zoo.train.runs import recorded_choice

    (tmp_path / "config.yaml").write_text("precision: 16-mixed\n")
    found = {place: recorded_choice(tmp_path, "precision", "32", place) for place in ("gpu", "mps", "cpu")}
    assert found == {"gpu": "16-mixed", "mps": "16-mixed", "cpu": "32"}  # Lightning has fp16 AMP but on a CPU
