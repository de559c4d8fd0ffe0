"""timm's model contract (the conventions its own tests/test_models.py checks on every timm model), one test per
convention over every zoo model, at 32x32 with batches of 1-2.

Two contracts, chosen by the pretrained cfg: CNNs (``pool_size`` set: the ResNets) give (B, C, h, w) features of
that size and features_only maps; token models (``pool_size`` None: ViT, hybrid; timm's "non-std" models) give
(B, N, C) tokens and get their features_only maps from ``forward_intermediates`` (timm's FeatureGetterNet).
Then torch.fx (plain ``symbolic_trace`` and torchvision's ``create_feature_extractor`` with timm's leaf lists,
as timm's FX tests build it) must reproduce eager outputs bit for bit with every parameter, and torch.export
within 1e-5. TorchScript is not a goal (docs/models.md)."""

from __future__ import annotations

import pytest
import timm
import torch
from conftest import slow_except
from timm.models import get_notrace_functions, get_notrace_modules
from torchvision.models.feature_extraction import create_feature_extractor, get_graph_node_names

import zoo

MODELS = zoo.list_models()
SIZE = 32
# tracing and exporting take a second or more a model: the default suite does it for one of each family (ViT, local
# ViT, hybrid with CBAM, ResNet) and every model under -m slow
TRACED = slow_except(MODELS, ("vit_nano", "vit_local_tiny", "hybrid_tiny", "resnet18"))


def is_token_model(name: str) -> bool:
    return timm.get_pretrained_cfg_value(f"zoo_{name}", "pool_size") is None


def images(batch: int = 1) -> torch.Tensor:
    return torch.randn(batch, 3, SIZE, SIZE, generator=torch.Generator().manual_seed(0))


def num_params(model: torch.nn.Module) -> int:
    return sum(p.numel() for p in model.parameters())


def fx_model(model: torch.nn.Module) -> torch.nn.Module:
    """torchvision's feature extractor returning the model's output node, traced with timm's leaf modules and
    functions, in train and eval mode alike (as timm's ``_create_fx_model``)."""
    tracer_kwargs = dict(leaf_modules=get_notrace_modules(), autowrap_functions=get_notrace_functions(),
                         param_shapes_constant=True)
    train_nodes, eval_nodes = get_graph_node_names(model, tracer_kwargs=tracer_kwargs)
    return create_feature_extractor(model, train_return_nodes=train_nodes[-1:], eval_return_nodes=eval_nodes[-1:],
                                    tracer_kwargs=tracer_kwargs)


def check_maps(maps, channels, reductions, batch: int) -> None:
    """Feature maps (B, C, h, w) against feature_info: C == num_chs and h == w == SIZE / reduction."""
    assert len(maps) == len(channels) == len(reductions) >= 3
    for fmap, chs, reduction in zip(maps, channels, reductions, strict=True):
        assert fmap.shape == (batch, chs, SIZE // reduction, SIZE // reduction)
        assert not fmap.isnan().any()


@pytest.mark.parametrize("name", MODELS)
def test_forward_and_grad_checkpointing_give_the_same_output_and_gradients(name):
    model = zoo.create_model(name).eval()
    x = images()
    out = model(x)
    assert out.shape == (1, 10) and not out.isnan().any()
    out.sum().backward()
    grads = {n: p.grad for n, p in model.named_parameters()}
    model.zero_grad(set_to_none=True)
    model.set_grad_checkpointing()
    checkpointed = model(x)
    torch.testing.assert_close(checkpointed, out, rtol=1e-4, atol=1e-5)
    checkpointed.sum().backward()
    for n, p in model.named_parameters():
        torch.testing.assert_close(p.grad, grads[n], rtol=1e-4, atol=1e-6, msg=n)


@pytest.mark.parametrize("name", MODELS)
def test_backward_with_42_classes_reaches_every_parameter(name):
    model = zoo.create_model(name, num_classes=42).train()
    out = model(images(2))
    assert out.shape == (2, 42)
    out.mean().backward()
    assert [n for n, p in model.named_parameters() if p.grad is None] == []


@pytest.mark.parametrize("name", MODELS)
def test_default_cfg_and_heads(name):
    model = zoo.create_model(name).eval()
    cfg, state = model.pretrained_cfg, model.state_dict()
    assert model.num_classes == 10 and model.num_features > 0 and model.head_hidden_size > 0
    assert f"{cfg['first_conv']}.weight" in state and f"{cfg['classifier']}.weight" in state
    x = images()
    with torch.no_grad():
        features = model.forward_features(x)
        pre_logits = model.forward_head(features, pre_logits=True)
        assert pre_logits.shape == (1, model.head_hidden_size)
        if is_token_model(name):
            assert features.dim() == 3 and features.shape[-1] == model.num_features
        else:
            assert features.shape == (1, model.num_features, *cfg["pool_size"])
        model.reset_classifier(0)
        assert model.num_classes == 0 and model(x).shape == pre_logits.shape
        assert zoo.create_model(name, num_classes=0).eval()(x).shape == (1, model.num_features)
        if not is_token_model(name):  # no pooling either: the unpooled map of pool_size
            model.reset_classifier(0, "")
            assert model(x).shape == features.shape
            assert zoo.create_model(name, num_classes=0, global_pool="").eval()(x).shape == features.shape


@pytest.mark.parametrize("name", MODELS)
def test_features_only_maps_match_feature_info(name):
    features = timm.create_model(f"zoo_{name}", features_only=True).eval()
    with torch.no_grad():
        maps = features(images())
    check_maps(maps, features.feature_info.channels(), features.feature_info.reduction(), batch=1)


@pytest.mark.parametrize("name", [n for n in MODELS if is_token_model(n)])
def test_token_models_take_timm_out_indices(name):
    features = timm.create_model(f"zoo_{name}", features_only=True, out_indices=(-1, -2)).eval()
    model = zoo.create_model(name).eval()
    assert features.feature_info.module_name() == [model.feature_info[i]["module"] for i in (-1, -2)]
    with torch.no_grad():
        maps = features(images())
    assert [tuple(m.shape) for m in maps] == [(1, model.num_features, *model.grid_size)] * 2


@pytest.mark.parametrize("name", MODELS)
def test_forward_intermediates_and_getter_features(name):
    model = zoo.create_model(name).eval()
    info = timm.models.FeatureInfo(model.feature_info, list(range(len(model.feature_info))))
    x = images()
    with torch.no_grad():
        final, maps = model.forward_intermediates(x)
        torch.testing.assert_close(final, model.forward_features(x), rtol=0, atol=0)
        check_maps(maps, info.channels(), info.reduction(), batch=1)
        getter = timm.create_model(f"zoo_{name}", features_only=True, feature_cls="getter").eval()
        check_maps(getter(x), getter.feature_info.channels(), getter.feature_info.reduction(), batch=1)
    model.set_grad_checkpointing()
    checkpointed, _ = model.forward_intermediates(x)
    torch.testing.assert_close(checkpointed, final, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("name", [n for n in MODELS if is_token_model(n)])
def test_token_intermediates_formats_indices_and_pruning(name):
    model = zoo.create_model(name).eval()
    x = images()
    with torch.no_grad():
        final, normed = model.forward_intermediates(x, norm=True)
        assert torch.equal(normed[-1].flatten(2).mT, final[:, model.num_prefix_tokens:])  # the last, normed
        maps = model.forward_intermediates(x, indices=[0, -1], intermediates_only=True)
        tokens = model.forward_intermediates(x, indices=[0, -1], output_fmt="NLC", intermediates_only=True)
        assert all(torch.equal(m.flatten(2).mT, t) for m, t in zip(maps, tokens, strict=True))
        early = model.forward_intermediates(x, indices=[1], stop_early=True, intermediates_only=True)
        assert len(early) == 1 and torch.equal(early[0], model.forward_intermediates(x, indices=[1])[1][0])
        kept = model.prune_intermediate_layers(indices=(-2,), prune_norm=True)
        assert kept == [len(model.feature_info) - 2] and model.num_classes == 0
        pruned = model.forward_intermediates(x, indices=kept, intermediates_only=True)
    full = zoo.create_model(name).eval()
    full.load_state_dict(model.state_dict(), strict=False)
    with torch.no_grad():
        torch.testing.assert_close(pruned[0], full.forward_intermediates(x, indices=[-2], intermediates_only=True)[0])
    with pytest.raises(ValueError, match="output_fmt"):
        model.forward_intermediates(x, output_fmt="NHWC")


@pytest.mark.parametrize("name", TRACED)
def test_fx_trace_equals_eager_bit_for_bit(name):
    model = zoo.create_model(name).eval()
    x = images()
    traced = torch.fx.symbolic_trace(model)
    extractor = fx_model(model).eval()
    with torch.no_grad():
        out = model(x)
        assert torch.equal(traced(x), out)
        assert torch.equal(next(iter(extractor(x).values())), out)
    assert num_params(traced) == num_params(extractor) == num_params(model)


@pytest.mark.parametrize("name", TRACED)
def test_fx_backward_reaches_every_parameter(name):
    model = zoo.create_model(name, num_classes=42).train()
    count = num_params(model)
    extractor = fx_model(model).train()
    out = next(iter(extractor(images(2)).values()))
    assert out.shape == (2, 42)
    out.mean().backward()
    assert [n for n, p in extractor.named_parameters() if p.grad is None] == []
    assert num_params(extractor) == count


def test_traced_resnet18_cbam_keeps_the_cbam_parameters():
    model = zoo.create_model("resnet18_cbam", num_classes=42)
    assert num_params(model) == num_params(torch.fx.symbolic_trace(model)) == num_params(fx_model(model))
    assert num_params(model) == 11_278_202


@pytest.mark.parametrize("name", TRACED)  # about a second each at this size
def test_torch_export_matches_eager(name):
    model = zoo.create_model(name).eval()
    x = images(2)
    exported = torch.export.export(model, (x,)).module()
    with torch.no_grad():
        torch.testing.assert_close(exported(x), model(x), rtol=0, atol=1e-5)
    assert num_params(exported) == num_params(model)


def old_resnet18_cbam_state(model: torch.nn.Module) -> dict:
    """``model``'s state_dict under the names of the hook-based add_cbam: ``...bn2.*`` and ``...cbam.*``."""
    return {k.replace(".bn2.norm.", ".bn2.").replace(".bn2.cbam.", ".cbam."): v for k, v in model.state_dict().items()}


def randomised_resnet18_cbam() -> torch.nn.Module:
    model = zoo.create_model("resnet18_cbam")
    for m in model.modules():  # timm zero-initialises bn2's weight; random norms make CBAM's effect visible
        if isinstance(m, torch.nn.BatchNorm2d):
            torch.nn.init.uniform_(m.weight, 0.5, 1.5)
            m.running_mean.normal_(std=0.1)
    return model.eval()


def test_resnet18_cbam_state_dict_with_the_old_names_loads_and_gives_the_same_output():
    model = randomised_resnet18_cbam()
    old = old_resnet18_cbam_state(model)
    assert "layer1.0.cbam.channel.fc1.weight" in old and "layer1.0.bn2.running_mean" in old
    fresh = zoo.create_model("resnet18_cbam").eval()
    fresh.load_state_dict(old, strict=True)
    x = images(2)
    with torch.no_grad():
        assert torch.equal(fresh(x), model(x))


def test_init_from_a_checkpoint_with_the_old_cbam_names_copies_every_weight(tmp_path):
    from zoo.models.checkpoints import load_pretrained

    model = randomised_resnet18_cbam()
    torch.save(old_resnet18_cbam_state(model), tmp_path / "old.pth")
    fresh = zoo.create_model("resnet18_cbam").eval()
    assert load_pretrained(fresh, tmp_path / "old.pth") == sorted(model.state_dict())
    x = images(2)
    with torch.no_grad():
        assert torch.equal(fresh(x), model(x))
