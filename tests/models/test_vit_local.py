"""vit_local_tiny: local (neighbourhood) attention over the patch grid. Each patch token of one block sees only
the patches within ``local_window`` grid rows and columns (checked by changing far patches), the model equals
the same weights run on a dense boolean mask, and the banded path gives the same logits and gradients as the
dense one at a grid large enough to band."""

from __future__ import annotations

import pytest
import torch

import zoo


def test_a_block_sees_only_its_neighbourhood():
    model = zoo.create_model("vit_local_tiny", depth=1, img_size=48, local_window=2).eval()  # 12 x 12 grid
    x = torch.randn(1, 3, 48, 48)
    changed = x.clone()
    changed[..., 24:, 24:] = torch.randn(1, 3, 24, 24)  # patches in grid rows and columns 6..11
    with torch.no_grad():
        out, out_changed = model.forward_features(x), model.forward_features(changed)
    grid = lambda t: t[0].reshape(12, 12, -1)
    torch.testing.assert_close(grid(out_changed)[:4], grid(out)[:4])  # rows 0-3: 6 - 3 > 2, out of reach
    torch.testing.assert_close(grid(out_changed)[:, :4], grid(out)[:, :4])
    assert not torch.allclose(grid(out_changed)[5, 5], grid(out)[5, 5])  # (5, 5) sees (6, 6)


def test_local_attention_equals_the_dense_mask_and_the_banded_path():
    """The same weights with local attention through auto (dense masked SDPA at this size), the banded path
    and math given the spec's dense mask: equal logits and gradients (atol 1e-5)."""
    torch.manual_seed(0)
    model = zoo.create_model("vit_local_tiny", depth=2, embed_dim=32, num_heads=2, img_size=64)  # 256 tokens
    spec = model.blocks[0].attn_call["mask"]
    assert spec == zoo.masks.spec(window=3, grid=(16, 16))
    x = torch.randn(2, 3, 64, 64)
    results = {}
    for name in ("auto", "chunked", "dense_math"):
        for block in model.blocks:
            block.attn.backend = "math" if name == "dense_math" else name
            block.attn_call = {"mask": spec.dense(256) if name == "dense_math" else spec}
        model.zero_grad()
        out = model(x)
        out.square().sum().backward()
        results[name] = (out.detach(), {k: p.grad.clone() for k, p in model.named_parameters()})
    ref_out, ref_grads = results["dense_math"]
    for name in ("auto", "chunked"):
        out, grads = results[name]
        torch.testing.assert_close(out, ref_out, atol=1e-5, rtol=1e-5)
        for key, g in ref_grads.items():
            torch.testing.assert_close(grads[key], g, atol=1e-5, rtol=1e-4, msg=f"{name} grad {key}")


def test_local_window_needs_mean_pooling():
    with pytest.raises(ValueError, match=r"local_window needs global_pool='avg'.*'token'"):
        zoo.create_model("vit_local_tiny", global_pool="token")
