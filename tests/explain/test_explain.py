"""zoo.explain: record_attention against need_weights on the math backend, attention rollout against a
hand-computed example, heatmaps, and the deletion test on a toy model whose right explanation is known."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import zoo
from zoo.explain import (
    curve_auc,
    deletion_curve,
    deletion_test,
    explain,
    rollout_heatmap,
)


class TinyViT(nn.Module):
    """A stand-in class-token ViT made of zoo.MultiHeadAttention: 4x4 patches on 32x32 -> an 8x8 grid."""

    def __init__(self, dim=24, depth=2, heads=3, num_classes=10, backend="auto", chunk_size=256,
                 global_pool="token"):
        super().__init__()
        self.grid_size, self.num_prefix_tokens, self.global_pool = (8, 8), 1, global_pool
        self.patch_embed = nn.Conv2d(3, dim, 4, stride=4)
        self.cls_token = nn.Parameter(torch.randn(1, 1, dim))
        self.pos_embed = nn.Parameter(torch.randn(1, 65, dim) * 0.5)
        self.norms = nn.ModuleList(nn.LayerNorm(dim) for _ in range(depth))
        self.blocks = nn.ModuleList(zoo.MultiHeadAttention(dim, heads, backend=backend, chunk_size=chunk_size)
                                    for _ in range(depth))
        self.head = nn.Linear(dim, num_classes)

    def tokens(self, images):
        x = self.patch_embed(images).flatten(2).transpose(1, 2)
        return torch.cat([self.cls_token.expand(len(x), -1, -1), x], dim=1) + self.pos_embed

    def forward(self, images):
        x = self.tokens(images)
        for norm, attn in zip(self.norms, self.blocks, strict=True):
            x = x + attn(norm(x))
        return self.head(x[:, 0] if self.global_pool == "token" else x[:, 1:].mean(1))


def math_weights(model: TinyViT, images):
    """The reference: each layer's weights from need_weights=True on the math backend."""
    x, maps = model.tokens(images), []
    for norm, attn in zip(model.norms, model.blocks, strict=True):
        backend, attn.backend = attn.backend, "math"
        out, w = attn(norm(x), need_weights=True)
        attn.backend = backend
        maps.append(w)
        x = x + out
    return maps


@pytest.mark.parametrize("backend", ["sdpa", "math", "chunked", "auto"])
def test_record_attention_equals_math_weights_under_every_backend(backend):
    model = TinyViT(backend=backend, chunk_size=16).eval()
    images = torch.randn(2, 3, 32, 32)
    with torch.no_grad():
        expected = math_weights(model, images)
        with zoo.record_attention(model) as rec:
            logits = model(images)
        plain = model(images)
    assert len(rec.maps) == 2 and rec.cbam == []
    for got, want in zip(rec.maps, expected, strict=True):
        assert got.shape == (2, 3, 65, 65) and got.device.type == "cpu"
        torch.testing.assert_close(got, want, atol=1e-6, rtol=1e-5)
    torch.testing.assert_close(logits, plain, atol=1e-5, rtol=1e-5)  # recording does not change the output
    assert all(m.weights_hook is None and m.backend == backend for m in model.blocks)


def test_record_attention_restores_hooks_on_error_and_keeps_existing_hooks():
    model = TinyViT().eval()
    seen = []
    user_hook = seen.append
    model.blocks[0].weights_hook = user_hook
    with pytest.raises(RuntimeError, match="boom"), zoo.record_attention(model) as rec:
        model(torch.randn(1, 3, 32, 32))
        raise RuntimeError("boom")
    assert len(rec.maps) == 2 and seen == []  # the user's hook was replaced while recording ...
    assert model.blocks[0].weights_hook is user_hook and model.blocks[1].weights_hook is None  # ... and back
    model(torch.randn(1, 3, 32, 32))
    assert len(seen) == 1


def test_record_attention_keeps_graph_free_tensors_on_device_when_asked():
    model = TinyViT().eval()
    with zoo.record_attention(model, to_cpu=False) as rec:
        model(torch.randn(1, 3, 32, 32))  # with grad enabled
    assert not rec.maps[0].requires_grad


# Two layers, two heads, three tokens; every row sums to 1.
LAYERS = [
    [[[1.0, 0.0, 0.0], [0.5, 0.5, 0.0], [0.2, 0.3, 0.5]],
     [[0.0, 1.0, 0.0], [0.5, 0.5, 0.0], [0.4, 0.1, 0.5]]],
    [[[0.6, 0.2, 0.2], [0.0, 0.0, 1.0], [0.25, 0.25, 0.5]],
     [[0.2, 0.2, 0.6], [0.0, 1.0, 0.0], [0.75, 0.25, 0.0]]],
]


def hand_rollout(fuse, discard_ratio=0.0, prefix=1):
    """Rollout with plain per-element Python arithmetic, following the paper's recipe."""
    n = 3
    rollout = [[float(i == j) for j in range(n)] for i in range(n)]
    for heads in LAYERS:
        a = [[fuse([h[i][j] for h in heads]) for j in range(n)] for i in range(n)]
        candidates = sorted((a[i][j], i, j) for i in range(n) for j in range(prefix, n))
        for _, i, j in candidates[:int(discard_ratio * len(candidates))]:
            a[i][j] = 0.0
        a = [[0.5 * a[i][j] + 0.5 * (i == j) for j in range(n)] for i in range(n)]
        a = [[v / sum(row) for v in row] for row in a]
        rollout = [[sum(a[i][k] * rollout[k][j] for k in range(n)) for j in range(n)] for i in range(n)]
    return rollout


def as_maps():
    return [torch.tensor(layer)[None] for layer in LAYERS]  # (1, 2, 3, 3) each


def test_rollout_mean_matches_numbers_worked_by_hand():
    expected = [[0.58, 0.27, 0.15], [0.225, 0.5875, 0.1875], [0.3125, 0.21875, 0.46875]]
    got = zoo.attention_rollout(as_maps(), head_fusion="mean")
    torch.testing.assert_close(got[0], torch.tensor(expected))
    torch.testing.assert_close(got[0], torch.tensor(hand_rollout(lambda v: sum(v) / len(v))))


@pytest.mark.parametrize("fusion,fuse", [("max", max), ("min", min)])
def test_rollout_max_min_fusion(fusion, fuse):
    got = zoo.attention_rollout(as_maps(), head_fusion=fusion)
    torch.testing.assert_close(got[0], torch.tensor(hand_rollout(fuse)))


@pytest.mark.parametrize("prefix", [0, 1])
def test_rollout_discard_ratio_keeps_prefix_column(prefix):
    mean = lambda v: sum(v) / len(v)
    got = zoo.attention_rollout(as_maps(), discard_ratio=0.5, num_prefix_tokens=prefix)
    torch.testing.assert_close(got[0], torch.tensor(hand_rollout(mean, 0.5, prefix)))
    # layer 1's fused (2, 0) weight is 0.3: among the 4 lowest of all 9, but never dropped as a prefix column
    other = zoo.attention_rollout(as_maps(), discard_ratio=0.5, num_prefix_tokens=1 - prefix)
    assert not torch.allclose(got, other)


def test_rollout_rejects_bad_arguments():
    maps = as_maps()
    for kwargs, match in [(dict(head_fusion="median"), r"head_fusion must be one of .*got 'median'"),
                          (dict(discard_ratio=1.0), r"discard_ratio must be in \[0, 1\), got 1.0"),
                          (dict(discard_ratio=-0.1), r"discard_ratio must be in \[0, 1\), got -0.1"),
                          (dict(num_prefix_tokens=3), r"num_prefix_tokens must be in \[0, N=3\), got 3")]:
        with pytest.raises(ValueError, match=match):
            zoo.attention_rollout(maps, **kwargs)
    for bad, match in [([], "non-empty list of .* got list of length 0"),
                       (maps[0], "non-empty list of .* got Tensor"),
                       ([torch.rand(1, 2, 3, 4)], r"maps\[0\] must be \(B, H, N, N\) .* got \(1, 2, 3, 4\)"),
                       ([maps[0], torch.rand(1, 2, 4, 4)], r"share B and N; .* maps\[1\] is \(1, 2, 4, 4\)")]:
        with pytest.raises(ValueError, match=match):
            zoo.attention_rollout(bad)


def test_rollout_heatmap_token_row_and_patch_mean():
    rollout = torch.arange(25.0).reshape(1, 5, 5)  # 1 prefix token + a 2x2 grid
    torch.testing.assert_close(rollout_heatmap(rollout, (2, 2), 1, "token"),
                               torch.tensor([[[1.0, 2.0], [3.0, 4.0]]]))
    # mean over rows 1..4 of columns 1..4: column j holds 5 * mean(1..4) + j = 12.5 + j
    torch.testing.assert_close(rollout_heatmap(rollout, (2, 2), 1, "avg"),
                               torch.tensor([[[13.5, 14.5], [15.5, 16.5]]]))
    with pytest.raises(ValueError, match=r"num_prefix_tokens \+ gh \* gw = 0 \+ 2\*2, got \(1, 5, 5\)"):
        rollout_heatmap(rollout, (2, 2), 0, "token")
    with pytest.raises(ValueError, match=r"= 1 \+ 3\*3, got \(1, 5, 5\)"):
        rollout_heatmap(rollout, (3, 3), 1, "token")
    with pytest.raises(ValueError, match="pooling='token' needs a class token"):
        rollout_heatmap(torch.rand(1, 4, 4), (2, 2), 0, "token")
    with pytest.raises(ValueError, match=r"pooling must be one of .*got 'max'"):
        rollout_heatmap(rollout, (2, 2), 1, "max")


class OnePatchModel(nn.Module):
    """Class 1's logit is the mean of the patch at grid cell (2, 5); class 0's is 0. Positive images are
    class 1 until that patch is blanked."""

    def __init__(self):
        super().__init__()
        self.scale = nn.Parameter(torch.ones(()))

    def forward(self, images):
        evidence = images[:, :, 8:12, 20:24].mean(dim=(1, 2, 3)) * self.scale
        return torch.stack([torch.zeros_like(evidence), evidence], dim=1)


def test_deletion_ranks_the_right_explanation_above_random():
    model = OnePatchModel()
    images, labels = torch.rand(64, 3, 32, 32) + 0.1, torch.ones(64, dtype=torch.long)
    right = torch.zeros(64, 8, 8)
    right[:, 2, 5] = 1.0
    fractions = [i / 10 for i in range(10)]
    curve = deletion_curve(model, images, labels, right, fractions)
    assert curve == [1.0] + [0.0] * 9
    random = deletion_curve(model, images, labels, torch.rand(64, 8, 8), fractions)
    # a random order has blanked the patch with probability ~fraction: accuracy falls roughly linearly
    assert random[0] == 1.0 and random[-1] < 0.35 and random[3] > 0.4
    assert curve_auc(fractions, curve) == pytest.approx(0.05)  # one trapezoid from 1 to 0 over 0.1
    assert curve_auc(fractions, curve) < curve_auc(fractions, random)
    # a coarser heatmap is pooled onto the 8x8 grid: the 4x4 cell (1, 2) covers grid cells (2..3, 4..5)
    coarse = torch.zeros(64, 4, 4)
    coarse[:, 1, 2] = 1.0
    assert deletion_curve(model, images, labels, coarse, [0.0, 4 / 64]) == [1.0, 0.0]


def test_deletion_test_methods_per_model_kind():
    images, labels = torch.randn(6, 3, 32, 32), torch.randint(0, 10, (6,))
    result = deletion_test(TinyViT().eval(), images, labels, fractions=[0.0, 0.5], batch_size=4)
    assert set(result["curves"]) == {"rollout", "attention", "random"} and result["explanation"] == "rollout"
    assert result["num_images"] == 6 and result["fractions"] == [0.0, 0.5]
    assert all(0.0 <= a <= 1.0 for c in result["curves"].values() for a in c)
    cnn = nn.Sequential(nn.Conv2d(3, 4, 3), nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(4, 10))
    result = deletion_test(cnn, images, labels, fractions=[0.0, 0.5])
    assert set(result["curves"]) == {"random"} and result["explanation"] is None


def test_explain_avg_pooled_model_uses_patch_rows():
    model = TinyViT(global_pool="avg").eval()
    images = torch.randn(2, 3, 32, 32)
    out = explain(model, images)
    with torch.no_grad():
        maps = math_weights(model, images)
    rollout = zoo.attention_rollout(maps)
    torch.testing.assert_close(out.rollout, rollout[:, 1:, 1:].mean(1).reshape(2, 8, 8))
    torch.testing.assert_close(out.attention, maps[-1].mean(1)[:, 1:, 1:].mean(1).reshape(2, 8, 8))
    assert out.cbam is None and out.heatmap is out.rollout


def test_record_attention_spatial_gates():
    """Spatial gates are recorded after the sigmoid, in forward order (CBAM's SpatialAttention contract)."""

    class Gate(nn.Module):
        def __init__(self):
            super().__init__()
            self.conv = nn.Conv2d(2, 1, 7, padding=3, bias=False)
            self.gate_hook = None

        def forward(self, x):
            gate = torch.sigmoid(self.conv(torch.cat([x.mean(1, keepdim=True), x.amax(1, keepdim=True)], 1)))
            if self.gate_hook is not None:
                self.gate_hook(gate)
            return x * gate

    model = nn.Sequential(Gate(), nn.Conv2d(3, 3, 3, stride=2, padding=1), Gate())
    x = torch.randn(2, 3, 16, 16)
    with zoo.record_attention(model) as rec:
        model(x)
    assert [tuple(g.shape) for g in rec.cbam] == [(2, 1, 16, 16), (2, 1, 8, 8)]
    pooled = torch.cat([x.mean(1, keepdim=True), x.amax(1, keepdim=True)], 1)
    torch.testing.assert_close(rec.cbam[0], torch.sigmoid(F.conv2d(pooled, model[0].conv.weight, padding=3)))
    assert all(g.gate_hook is None for g in (model[0], model[2]))


def test_record_attention_real_cbam_gates_match_the_direct_formula():
    gate_module = zoo.layers.cbam.SpatialAttention(kernel_size=7)
    model = nn.Sequential(zoo.layers.cbam.CBAM(16, reduction=4), nn.Conv2d(16, 16, 3), gate_module)
    x = torch.randn(2, 16, 12, 12)
    with torch.no_grad(), zoo.record_attention(model) as rec:
        model(x)
    with torch.no_grad():
        inner = model[1](model[0](x))
    assert [tuple(g.shape) for g in rec.cbam] == [(2, 1, 12, 12), (2, 1, 10, 10)]
    assert all(((g >= 0) & (g <= 1)).all() for g in rec.cbam)
    pooled = torch.stack([inner.mean(1), inner.max(1).values], 1)
    expected = 1 / (1 + torch.exp(-F.conv2d(pooled, gate_module.conv.weight, padding=3)))
    torch.testing.assert_close(rec.cbam[1], expected)
    assert gate_module.gate_hook is None


@pytest.mark.parametrize("name", zoo.list_models())
def test_explain_every_registered_model(name):
    model = zoo.create_model(name).eval()
    attn = [m for m in model.modules() if isinstance(m, zoo.MultiHeadAttention)]
    gates = [m for m in model.modules() if isinstance(m, zoo.layers.cbam.SpatialAttention)]
    out = explain(model, torch.randn(2, 3, 32, 32))
    assert len(out.recording.maps) == len(attn) and len(out.recording.cbam) == len(gates)
    assert (out.rollout is not None) == bool(attn) and (out.cbam is not None) == bool(gates)
    if attn:
        assert out.rollout.shape == (2, *model.grid_size)
        assert out.heatmap is out.rollout  # the hybrid too: rollout first, its gates are for the figures
    elif gates:
        assert out.heatmap is out.cbam and ((out.cbam >= 0) & (out.cbam <= 1)).all()
    else:
        assert out.heatmap is None
