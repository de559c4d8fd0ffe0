"""Bad inputs through the Python API: every one raises a ValueError or TypeError whose message names the
argument and what was wrong (``match=``), where the mistake is made (the constructor, the call), never an
obscure error from deep inside torch, and never a silently wrong result. The CLI side is
tests/cli/test_bad_inputs.py."""

from __future__ import annotations

import copy

import pytest
import torch
import torchvision
from torch import nn

import zoo
from zoo import KVCache, MultiHeadAttention
from zoo.data import ImageData
from zoo.explain import AttentionRecording
from zoo.masks import padding_mask, sliding_window_mask
from zoo.runtime.device import eval_device
from zoo.train.recipe import Recipe
from zoo.train.warmstart import init_from

DIM = 16

# (what, call, exception, match): the constructor's arguments
CONSTRUCTOR = [
    ("dim=0", lambda: MultiHeadAttention(0, 2), ValueError, r"dim must be an int >= 1, got 0"),
    ("dim=2.5", lambda: MultiHeadAttention(2.5, 1), ValueError, r"dim must be an int >= 1, got 2.5"),
    ("dim='64'", lambda: MultiHeadAttention("64", 2), ValueError, r"dim must be an int >= 1, got '64'"),
    ("num_heads=0", lambda: MultiHeadAttention(DIM, 0), ValueError, r"num_heads must be an int >= 1, got 0"),
    ("num_heads=2.0", lambda: MultiHeadAttention(DIM, 2.0), ValueError, r"num_heads must be an int >= 1, got 2.0"),
    ("num_heads=True", lambda: MultiHeadAttention(DIM, True), ValueError, r"num_heads .* got True"),
    ("indivisible", lambda: MultiHeadAttention(10, 3), ValueError, r"dim \(10\) must be divisible by num_heads \(3\)"),
    ("context_dim=0", lambda: MultiHeadAttention(DIM, 2, context_dim=0), ValueError, r"context_dim must be"),
    ("attn_drop=1.5", lambda: MultiHeadAttention(DIM, 2, attn_drop=1.5), ValueError,
     r"attn_drop must be a probability in \[0, 1\), got 1.5"),
    ("attn_drop=-0.1", lambda: MultiHeadAttention(DIM, 2, attn_drop=-0.1), ValueError, r"attn_drop .* -0.1"),
    ("attn_drop='0.1'", lambda: MultiHeadAttention(DIM, 2, attn_drop="0.1"), ValueError, r"attn_drop .* '0.1'"),
    ("proj_drop=1.0", lambda: MultiHeadAttention(DIM, 2, proj_drop=1.0), ValueError, r"proj_drop .* 1.0"),
    ("backend", lambda: MultiHeadAttention(DIM, 2, backend="flash"), ValueError, r"unknown attention backend 'flash'"),
    ("rel_pos_grid=8", lambda: MultiHeadAttention(DIM, 2, rel_pos_grid=8), ValueError,
     r"rel_pos_grid must be two positive ints \(gh, gw\), got 8"),
    ("rel_pos_grid=(4, 0)", lambda: MultiHeadAttention(DIM, 2, rel_pos_grid=(4, 0)), ValueError, r"rel_pos_grid"),
    ("rel_pos_grid=(4, 4.0)", lambda: MultiHeadAttention(DIM, 2, rel_pos_grid=(4, 4.0)), ValueError,
     r"rel_pos_grid"),
    ("num_prefix_tokens=-1", lambda: MultiHeadAttention(DIM, 2, num_prefix_tokens=-1), ValueError,
     r"num_prefix_tokens must be an int >= 0, got -1"),
    ("num_prefix_tokens=1.0", lambda: MultiHeadAttention(DIM, 2, num_prefix_tokens=1.0), ValueError,
     r"num_prefix_tokens .* 1.0"),
    ("chunk_size=0", lambda: MultiHeadAttention(DIM, 2, chunk_size=0), ValueError, r"chunk_size must be an int >= 1"),
    ("chunk_size=None", lambda: MultiHeadAttention(DIM, 2, chunk_size=None), ValueError, r"chunk_size .* None"),
]


def attn(**kw) -> MultiHeadAttention:
    return MultiHeadAttention(DIM, 2, **kw).eval()


x3 = torch.randn(2, 3, DIM)
FORWARD = [
    ("is_causal='yes'", lambda: attn()(x3, is_causal="yes"), ValueError, r"is_causal must be a bool, got 'yes'"),
    ("need_weights=1", lambda: attn()(x3, need_weights=1), ValueError, r"need_weights must be a bool, got 1"),
    ("x width", lambda: attn()(torch.randn(2, 3, 8)), ValueError, r"x must have shape \(B, N, dim=16\)"),
    ("x 2-D", lambda: attn()(torch.randn(3, DIM)), ValueError, r"x must have shape .* got \(3, 16\)"),
    ("x ints", lambda: attn()(torch.ones(2, 3, DIM, dtype=torch.long)), ValueError, r"x must be a floating-point"),
    ("x list", lambda: attn()([[0.0] * DIM]), ValueError, r"x must be a tensor .* got list"),
    ("context batch", lambda: attn()(x3, torch.randn(3, 5, DIM)), ValueError, r"context batch 3 != x batch 2"),
    ("mask ints", lambda: attn()(x3, mask=torch.ones(3, 3, dtype=torch.long)), ValueError, r"mask .* dtype"),
    ("mask list", lambda: attn()(x3, mask=[[True]]), ValueError, r"mask must be .* got list"),
    ("mask 1-D", lambda: attn()(x3, mask=torch.ones(3, dtype=torch.bool)), ValueError, r"mask .* got shape \(3,\)"),
    ("(B, M) mask, B == N", lambda: attn()(torch.randn(3, 3, DIM), mask=torch.ones(3, 3, dtype=torch.bool)),
     ValueError, r"2-D mask is ambiguous when B == N == 3.*\(B, 1, 1, M\)"),
    ("(B, M) mask, B != N", lambda: attn()(torch.randn(2, 3, DIM), mask=torch.ones(2, 3, dtype=torch.bool)),
     ValueError, r"looks like a \(B, M\) key-padding mask"),
    ("no context", lambda: attn(context_dim=8)(x3), ValueError, r"built for cross-attention \(context_dim=8\)"),
    ("kv_cache + context", lambda: attn()(x3, x3, kv_cache=KVCache()), ValueError, r"kv_cache is for causal"),
    ("rel bias N", lambda: attn(rel_pos_grid=(2, 2))(x3), ValueError, r"relative position bias over grid \(2, 2\)"),
]

MASKS = [
    ("lengths list of floats", lambda: padding_mask([1.5, 2], 4), ValueError, r"lengths must be integers"),
    ("lengths float tensor", lambda: padding_mask(torch.tensor([1.0, 2.0]), 4), ValueError,
     r"lengths must be integers .* torch.float32"),
    ("lengths bools", lambda: padding_mask([True, False], 4), ValueError, r"lengths must be integers"),
    ("lengths 2-D", lambda: padding_mask([[1, 2]], 4), ValueError, r"lengths must be 1-D"),
    ("lengths > n", lambda: padding_mask([5], 4), ValueError, r"lengths must lie in \[0, 4\], got \[5\]"),
    ("lengths < 0", lambda: padding_mask([-1], 4), ValueError, r"lengths must lie in \[0, 4\]"),
    ("window < 0", lambda: sliding_window_mask(4, -1), ValueError, r"window must be >= 0, got -1"),
]

MODELS = [
    ("num_classes=-1", lambda: zoo.create_model("vit_tiny", num_classes=-1), ValueError,
     r"num_classes must be an int >= 0 .* got -1"),
    ("num_classes=2.5", lambda: zoo.create_model("vit_nano", num_classes=2.5), ValueError, r"num_classes .* 2.5"),
    ("num_classes='10'", lambda: zoo.create_model("resnet18", num_classes="10"), ValueError, r"num_classes .* '10'"),
    ("unknown model", lambda: zoo.create_model("vit_tiyn"), ValueError, r"unknown model 'vit_tiyn'.*vit_tiny"),
    ("img_size", lambda: zoo.create_model("vit_nano", img_size=30), ValueError, r"img_size .* divisible"),
    ("add_cbam('resnet18')", lambda: zoo.add_cbam("resnet18"), TypeError,
     r"add_cbam: model must be a torchvision or timm ResNet .* got 'resnet18'"),
    ("add_cbam(Linear)", lambda: zoo.add_cbam(nn.Linear(2, 2)), ValueError, r"add_cbam expects a ResNet .* Linear"),
    ("add_cbam twice", lambda: zoo.add_cbam(zoo.add_cbam(torchvision.models.resnet18())), ValueError,
     r"already have a CBAM"),
    ("KVCache shapes", lambda: _cache().append(torch.zeros(2, 2, 1, 4), torch.zeros(2, 2, 1, 4)), ValueError,
     r"KV cache holds"),
]


def _cache() -> KVCache:
    cache = KVCache()
    cache.append(torch.zeros(1, 2, 3, 4), torch.zeros(1, 2, 3, 4))
    return cache


maps = [torch.softmax(torch.randn(1, 2, 5, 5), -1)]
EXPLAIN = [
    ("record_attention('vit')", lambda: zoo.record_attention("vit"), TypeError,
     r"record_attention: model must be an nn.Module, got 'vit'"),
    ("record_attention(resnet18)", lambda: zoo.record_attention(torchvision.models.resnet18()), ValueError,
     r"ResNet has nothing to record: looked for attention modules .* or CBAM spatial gates"),
    ("rollout of nothing", lambda: zoo.attention_rollout([]), ValueError, r"maps must be a non-empty list"),
    ("rollout of a tensor", lambda: zoo.attention_rollout(maps[0]), ValueError, r"maps must be a non-empty list"),
    ("rollout 3-D map", lambda: zoo.attention_rollout([maps[0][0]]), ValueError, r"maps\[0\] must be \(B, H, N, N\)"),
    ("head_fusion", lambda: zoo.attention_rollout(maps, head_fusion="median"), ValueError, r"head_fusion must be"),
    ("discard_ratio=1", lambda: zoo.attention_rollout(maps, discard_ratio=1.0), ValueError, r"discard_ratio must be"),
    ("num_prefix_tokens=-1", lambda: zoo.attention_rollout(maps, num_prefix_tokens=-1), ValueError,
     r"num_prefix_tokens must be in \[0, N=5\), got -1"),
    ("num_prefix_tokens=True", lambda: zoo.attention_rollout(maps, num_prefix_tokens=True), ValueError,
     r"num_prefix_tokens .* got True"),
]

TRAINING = [
    ("devices='abc'", lambda: Recipe(devices="abc"), ValueError, r"devices must be auto, a number of devices"),
    ("devices=0", lambda: Recipe(devices=0), ValueError, r"devices must be .* got 0"),
    ("max_time zero", lambda: Recipe(max_time="00:00:00:00"), ValueError,
     r"max_time '00:00:00:00' leaves no time for one training step"),
    ("max_time format", lambda: Recipe(max_time="10m"), ValueError, r"--max-time expects DD:HH:MM:SS"),
    ("init_partial='yes'", lambda: Recipe(init_partial="yes"), ValueError, r"init_partial must be true or false"),
    ("unknown recipe key", lambda: Recipe.from_dict({"learning_rate": 1}), ValueError,
     r"unknown config key 'learning_rate'"),
    ("data splits", lambda: ImageData("x", splits=("train",)), ValueError, r"splits must be"),
    ("eval device bogus", lambda: eval_device("bogus"), ValueError, r"--device must be cpu, cuda or cuda:N, got"),
    ("eval device meta", lambda: eval_device("meta"), ValueError, r"evaluation runs on cpu or cuda"),
    ("eval device cuda:99", lambda: eval_device("cuda:99"), ValueError, r"--device cuda:99: (no CUDA|only \d)"),
]

CASES = CONSTRUCTOR + FORWARD + MASKS + MODELS + EXPLAIN + TRAINING


def test_at_least_forty_kinds_of_bad_input():
    assert len(CASES) >= 40


@pytest.mark.parametrize("what, call, error, match", CASES, ids=[c[0] for c in CASES])
def test_bad_input_names_the_problem(what, call, error, match):
    with pytest.raises(error, match=match):
        call()


def test_a_four_d_mask_with_b_equal_to_n_is_still_accepted():
    a, x = attn(), torch.randn(3, 3, DIM)
    keys = torch.tensor([[True, True, False]] * 3)
    out = a(x, mask=keys[:, None, None, :])
    torch.testing.assert_close(out[0], a(x[:1, :, :], mask=keys[:1, None, None, :])[0], atol=1e-6, rtol=1e-5)


def test_eval_device_defaults_to_the_gpu_when_there_is_one():
    assert eval_device(None).type == ("cuda" if torch.cuda.is_available() else "cpu")
    assert eval_device("cpu") == torch.device("cpu")


# ---------------------------------------------------------------------- silent wrong results, now explicit

def test_recording_knows_the_models_prefix_tokens_and_rollout_uses_them():
    vit = zoo.create_model("vit_nano").eval()
    avg = zoo.create_model("vit_nano", global_pool="avg").eval()
    images = torch.randn(1, 3, 32, 32)
    for model, prefix in ((vit, 1), (avg, 0)):
        with torch.no_grad(), zoo.record_attention(model) as rec:
            model(images)
        assert rec.num_prefix_tokens == rec.maps.num_prefix_tokens == prefix
        for source in (rec.maps, rec):
            torch.testing.assert_close(zoo.attention_rollout(source, discard_ratio=0.5),
                                       zoo.attention_rollout(list(rec.maps), discard_ratio=0.5,
                                                             num_prefix_tokens=prefix))
    assert zoo.attention_rollout.__doc__.count("rec.num_prefix_tokens") == 1
    assert AttentionRecording().num_prefix_tokens == 0


def test_record_attention_allows_an_empty_model_when_asked():
    with zoo.record_attention(torchvision.models.resnet18(), allow_empty=True) as rec:
        pass
    assert rec.maps == [] and rec.cbam == []


def _save(model: nn.Module, path) -> str:
    torch.save(model.state_dict(), path)
    return str(path)


def test_init_from_reports_and_refuses_under_half(tmp_path):
    nano = _save(zoo.create_model("vit_nano"), tmp_path / "nano.pth")
    same = zoo.create_model("vit_nano", num_classes=100)
    report = init_from(same, nano)
    assert report.skipped_for_shape == ["head.bias", "head.weight"] and report.missing == []
    assert 0.9 < report.fraction < 1
    assert "skipped 2 for shape (head.bias, head.weight), 0 missing" in report.summary()
    other = zoo.create_model("vit_nano", depth=16)  # 10 of its 16 blocks are not in the file
    before = {k: v.clone() for k, v in other.state_dict().items()}
    with pytest.raises(ValueError, match=r"of the model's parameter elements.*under 50% .*--init-partial"):
        init_from(other, nano)
    assert all(torch.equal(before[k], v) for k, v in other.state_dict().items())  # nothing was loaded
    partial = init_from(other, nano, allow_partial=True)
    assert partial.fraction < 0.5 and len(partial.missing) > 0
    with pytest.raises(ValueError, match=r"no weight matches the model"):
        init_from(zoo.create_model("resnet18"), nano, allow_partial=True)


# the model's arguments (types from the constructor's annotations, ranges from its own checks) and the dtype
# of what meets the weights
x_images = torch.randn(2, 3, 32, 32)
CONTRACT = [
    ("img_size='32'", lambda: zoo.create_model("vit_nano", img_size="32"), ValueError,
     r"img_size of vit_nano must be int or tuple\[int, int\], got '32'"),
    ("depth='4'", lambda: zoo.create_model("vit_nano", depth="4"), ValueError,
     r"depth of vit_nano must be int, got '4'"),
    ("depth=2.0", lambda: zoo.create_model("hybrid_tiny", depth=2.0), ValueError, r"depth of hybrid_tiny must be int"),
    ("depth=0", lambda: zoo.create_model("vit_nano", depth=0), ValueError,
     r"depth must be an int in \[1, 1,000\], got 0"),
    ("hybrid depth=-1", lambda: zoo.create_model("hybrid_tiny", depth=-1), ValueError,
     r"depth must be an int in \[0, 1,000\]"),
    ("depth=10**9", lambda: zoo.create_model("vit_nano", depth=10**9), ValueError,
     r"depth must be an int in \[1, 1,000\], got 1000000000"),
    ("drop_path_rate=2.0", lambda: zoo.create_model("vit_nano", drop_path_rate=2.0), ValueError,
     r"drop_path_rate must be a probability in \[0, 1\), got 2.0"),
    ("hybrid drop_path_rate=1", lambda: zoo.create_model("hybrid_tiny", drop_path_rate=1), ValueError,
     r"drop_path_rate must be a probability"),
    ("resnet drop_path_rate=2.0", lambda: zoo.create_model("resnet18", drop_path_rate=2.0), ValueError,
     r"drop_path_rate must be a probability"),
    ("patch_size=0", lambda: zoo.create_model("vit_nano", patch_size=0), ValueError,
     r"patch_size must be two positive ints"),
    ("num_classes=10**12 on the meta device", lambda: zoo.models.check_model_fits("vit_nano", num_classes=10**12),
     ValueError, r"would hold over 128,000,001,2\d\d,\d+ parameter elements .* more than this machine's"),
    ("in_chans=0", lambda: zoo.create_model("vit_nano", in_chans=0), ValueError,
     r"in_chans must be an int >= 1, got 0"),
    ("resnet in_chans=0", lambda: zoo.create_model("resnet18", in_chans=0), ValueError, r"in_chans must be an int"),
    ("hybrid in_chans=0", lambda: zoo.create_model("hybrid_tiny", in_chans=0), ValueError, r"in_chans must be"),
    ("drop_path_rate='0.1'", lambda: zoo.create_model("resnet18", drop_path_rate="0.1"), ValueError,
     r"drop_path_rate of resnet18 must be float, got '0.1'"),
    ("float64 into attention", lambda: attn()(x3.double()), ValueError,
     r"x has dtype torch.float64, the module's weights torch.float32: .*torch.autocast"),
    ("float16 into attention", lambda: attn()(x3.half()), ValueError, r"x has dtype torch.float16, .*autocast"),
    ("float64 context", lambda: attn()(x3, x3.double()), ValueError, r"context has dtype torch.float64"),
    ("float64 into vit", lambda: zoo.create_model("vit_nano").eval()(x_images.double()), ValueError,
     r"x has dtype torch.float64, the module's weights torch.float32: cast one to the other .*autocast"),
    ("float64 into hybrid", lambda: zoo.create_model("hybrid_tiny").eval()(x_images.double()), ValueError,
     r"x has dtype torch.float64"),
    ("float64 into resnet", lambda: zoo.create_model("resnet18").eval()(x_images.double()), ValueError,
     r"x has dtype torch.float64"),
]


@pytest.mark.parametrize("what, call, error, match", CONTRACT, ids=[c[0] for c in CONTRACT])
def test_model_arguments_and_dtypes_are_checked_by_the_zoo(what, call, error, match):
    with pytest.raises(error, match=match) as info:
        call()
    assert "/zoo/" in str(info.traceback[-1].path), info.traceback[-1]  # raised by the zoo's check, not torch's


def test_matching_dtypes_and_autocast_still_run():
    """A module cast to the input's dtype computes what float32 does; under autocast a float32 input is cast."""
    module = attn()
    expected = module(x3)
    assert torch.allclose(copy.deepcopy(module).double()(x3.double()), expected.double(), atol=1e-5)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert torch.allclose(module(x3).float(), expected, atol=0.1)
    model = zoo.create_model("vit_nano").eval()
    assert torch.allclose(copy.deepcopy(model).double()(x_images.double()), model(x_images).double(), atol=1e-4)
