"""The steps the loop and the LightningModule share (``zoo.train.step``), the schedule, parameter groups and EMA
(``zoo.train.optim``), ``ImageClassifier`` fitted by a plain ``lightning.Trainer``, atomic checkpoint writes and
``load_run``'s errors, whitening filters and ``--init-from``. In-memory random tensors: no images are decoded here."""

from __future__ import annotations

import math
from types import SimpleNamespace

import lightning.pytorch as pl
import pytest
import torch
import torch.nn.functional as F
from lightning.pytorch.callbacks import ModelCheckpoint
from torch.utils.data import DataLoader, TensorDataset

import zoo
from zoo.train import ImageClassifier
from zoo.train.optim import EMA, MuonAdamW, WarmupCosine, param_groups
from zoo.train.runs import save_checkpoint
from zoo.train.step import eval_loss, train_loss

TINY = {"embed_dim": 32, "depth": 1, "num_heads": 2, "img_size": 16}


def tiny_module(**kwargs) -> ImageClassifier:
    return ImageClassifier("vit_nano", TINY, num_classes=10, **kwargs)


def tiny_model():
    return zoo.create_model("vit_nano", num_classes=10, **TINY)


class Batches(pl.LightningDataModule):
    """Random images (float) with fixed labels."""

    def __init__(self, n: int = 64, batch_size: int = 8):
        super().__init__()
        g = torch.Generator().manual_seed(0)
        self.images = torch.randn(n, 3, 16, 16, generator=g)
        self.labels = torch.randint(0, 10, (n,), generator=g)
        self.batch_size = batch_size

    def _loader(self):
        return DataLoader(TensorDataset(self.images, self.labels), batch_size=self.batch_size)

    train_dataloader = val_dataloader = test_dataloader = _loader


def trainer(tmp_path, **kwargs) -> pl.Trainer:
    return pl.Trainer(accelerator="cpu", devices=1, logger=False, enable_progress_bar=False,
                      enable_model_summary=False, default_root_dir=tmp_path, num_sanity_val_steps=0, **kwargs)


def test_warmup_cosine_matches_the_formula():
    schedule = WarmupCosine(10, 110, min_ratio=0.1)
    assert schedule(0) == pytest.approx(1 / 11) and schedule(9) == pytest.approx(10 / 11)
    for step in (10, 35, 60, 109):
        t = (step - 10) / 100
        assert schedule(step) == pytest.approx(0.1 + 0.9 * (1 + math.cos(math.pi * t)) / 2)
    assert schedule(500) == pytest.approx(0.1)


def test_the_losses_with_int_and_probability_targets_are_the_smoothed_cross_entropy():
    model = tiny_model()
    images, labels = torch.randn(4, 3, 16, 16), torch.tensor([1, 2, 3, 4])
    logits = model(images)
    smooth = F.one_hot(labels, 10).float() * 0.9 + 0.1 / 10
    expected = -(smooth * logits.log_softmax(-1)).sum(-1).mean()      # hand-written smoothed CE
    assert train_loss(model, images, labels, 0.1)[0].item() == pytest.approx(expected.item(), rel=1e-5)
    assert eval_loss(model, images, labels, 0.1, tta=0)[0].item() == pytest.approx(expected.item(), rel=1e-5)
    probs = torch.softmax(torch.randn(4, 10), -1)
    soft = probs * 0.9 + 0.1 / 10
    expected = -(soft * logits.log_softmax(-1)).sum(-1).mean()
    assert train_loss(model, images, probs, 0.1)[0].item() == pytest.approx(expected.item(), rel=1e-5)


def test_no_weight_decay_on_norms_biases_pos_embed_cls_token():
    model = tiny_model()
    groups = param_groups(model, 1e-3, 0.05)
    names = {id(p): n for n, p in model.named_parameters()}
    no_decay = {names[id(p)] for g in groups if g["weight_decay"] == 0 for p in g["params"]}
    decay = {names[id(p)] for g in groups if g["weight_decay"] == 0.05 for p in g["params"]}
    assert {"pos_embed", "cls_token"} <= no_decay
    assert all(n.endswith("bias") or "norm" in n or n in ("pos_embed", "cls_token") for n in no_decay)
    assert "blocks.0.attn.qkv.weight" in decay and "head.weight" in decay
    assert decay | no_decay == set(names.values())


def test_the_ema_is_the_hand_written_average_and_swaps_in_and_out():
    """EMA after each of 6 steps: a copy first, then keep min(0.9, (1 + n) / (10 + n)) after n updates; inside
    ``swapped_in`` the model holds the average, after it the trained weights again."""
    model = tiny_model()
    ema, optimizer = EMA(model, 0.9), torch.optim.SGD(model.parameters(), lr=0.1)
    steps = []
    for _ in range(6):
        optimizer.zero_grad()
        F.cross_entropy(model(torch.randn(4, 3, 16, 16)), torch.arange(4)).backward()
        optimizer.step()
        ema.update()
        steps.append([p.detach().clone() for p in model.parameters()])
    expected = steps[0]
    for n, params in enumerate(steps[1:], start=1):
        kept = min(0.9, (1 + n) / (10 + n))
        expected = [kept * e + (1 - kept) * p for e, p in zip(expected, params, strict=True)]
    assert not torch.allclose(expected[0], steps[-1][0])  # the average is not the last weights
    with ema.swapped_in():
        for average, hand in zip(model.parameters(), expected, strict=True):
            torch.testing.assert_close(average, hand)
    for trained, last in zip(model.parameters(), steps[-1], strict=True):
        torch.testing.assert_close(trained, last, rtol=0, atol=0)


def test_a_checkpoint_write_that_fails_keeps_the_old_file(tmp_path):
    path = tmp_path / "last.ckpt"
    save_checkpoint(path, {"step": 1})

    class Boom:
        def __reduce__(self):
            raise RuntimeError("disk full")

    with pytest.raises(RuntimeError, match="disk full"):
        save_checkpoint(path, {"step": 2, "x": Boom()})
    assert torch.load(path, weights_only=True) == {"step": 1}
    assert [p.name for p in tmp_path.iterdir()] == ["last.ckpt"]   # no temp file left


def test_load_run_rejects_missing_truncated_and_foreign_files(tmp_path):
    run = trainer(tmp_path, max_steps=2, limit_val_batches=0, enable_checkpointing=False)
    run.fit(tiny_module(), datamodule=Batches())
    good = tmp_path / "good.ckpt"
    run.save_checkpoint(good)
    model, meta = zoo.load_run(good)
    assert not model.training and meta["model_name"] == "vit_nano" and meta["global_step"] == 2
    x = torch.randn(2, 3, 16, 16)
    torch.testing.assert_close(model(x), run.lightning_module.model.eval()(x))
    truncated = tmp_path / "truncated.ckpt"
    truncated.write_bytes(good.read_bytes()[:1000])
    foreign = tmp_path / "foreign.ckpt"
    torch.save({"weights": torch.zeros(3)}, foreign)
    for path, message in [(tmp_path / "missing.ckpt", "no checkpoint"), (truncated, "truncated"),
                          (foreign, "not a zoo"), (tmp_path, "no checkpoints/best.ckpt")]:
        with pytest.raises(ValueError, match=message) as err:
            zoo.load_run(path)
        assert "\n" not in str(err.value)


def test_init_from_a_timm_vit_state_dict_at_another_img_size(tmp_path):
    """--init-from: a timm ViT trained at 64 px starts a 32 px zoo ViT; every weight is copied and the
    position embedding is resampled exactly as timm resamples it for its own models."""
    import timm
    from timm.layers import resample_abs_pos_embed

    from zoo.models.checkpoints import load_pretrained

    source = timm.create_model("vit_tiny_patch16_224", pretrained=False, img_size=64, patch_size=4, depth=2,
                               num_classes=10)
    torch.save(source.state_dict(), tmp_path / "timm_vit.pth")
    model = zoo.create_model("vit_tiny", depth=2)
    loaded = load_pretrained(model, tmp_path / "timm_vit.pth")
    assert set(loaded) == set(source.state_dict())
    expected_pos = resample_abs_pos_embed(source.pos_embed.detach(), [8, 8], [16, 16], num_prefix_tokens=1)
    torch.testing.assert_close(model.pos_embed.detach(), expected_pos)
    torch.testing.assert_close(model.blocks[1].attn.qkv.weight, source.blocks[1].attn.qkv.weight)
    with pytest.raises(ValueError, match="no weight matches"):
        load_pretrained(zoo.create_model("resnet18"), tmp_path / "timm_vit.pth")


def test_init_from_a_vit_of_another_width_skips_its_position_embedding(tmp_path):
    """A pos_embed of another embedding width cannot be resampled into the model: it is skipped with the other
    mismatched tensors (--init-partial then loads the rest), not loaded into a size-mismatch error."""
    from zoo.models.checkpoints import load_pretrained

    narrow, wide = zoo.create_model("vit_nano", depth=1), zoo.create_model("vit_tiny", depth=1)
    assert narrow.pos_embed.shape[-1] != wide.pos_embed.shape[-1]
    torch.save(narrow.state_dict(), tmp_path / "narrow.pth")
    same_width = {k for k, v in narrow.state_dict().items() if v.shape == wide.state_dict()[k].shape}
    assert set(load_pretrained(wide, tmp_path / "narrow.pth")) == same_width and "pos_embed" not in same_width


@pytest.mark.parametrize("fit_whitening", [True, False])
def test_a_new_run_fits_the_whitening_filters_unless_the_recipe_says_not_to(fit_whitening, tmp_path):
    from zoo.layers.whitening import PatchWhitening
    from zoo.train.loop import RunPlan, build_net
    from zoo.train.recipe import Recipe

    images = torch.randint(0, 256, (40, 3, 32, 32), dtype=torch.uint8)
    normalize = lambda x: (x.float() / 255 - 0.5) / 0.25  # noqa: E731
    train = torch.utils.data.TensorDataset(images, torch.zeros(40, dtype=torch.long))  # [:n] -> (images, labels)
    data = SimpleNamespace(num_classes=10, normalize=normalize, train_dataset=train)
    recipe = Recipe.from_dict({"model": "hybrid_tiny", "fit_whitening": fit_whitening})
    torch.manual_seed(0)
    (layer,) = [m for m in build_net(RunPlan(recipe, "cpu", "32", tmp_path, None), data).modules()
                if isinstance(m, PatchWhitening)]
    torch.manual_seed(0)
    expected = zoo.create_model("hybrid_tiny").stem[0]  # the random filters of a new model, drawn alike
    if fit_whitening:
        expected.fit(normalize(images))
    torch.testing.assert_close(layer.weight, expected.weight)
    assert isinstance(expected, PatchWhitening)


def test_validation_metrics_of_a_plain_trainer_match_a_hand_count(tmp_path):
    module, data = tiny_module(), Batches(n=40)
    result = trainer(tmp_path).validate(module, datamodule=data, verbose=False)[0]
    with torch.no_grad():
        logits = module(data.images)
    top5 = logits.topk(5, dim=-1).indices
    assert result["val/top1"] == pytest.approx((logits.argmax(-1) == data.labels).float().mean().item())
    assert result["val/top5"] == pytest.approx((top5 == data.labels[:, None]).any(-1).float().mean().item())


@pytest.mark.parametrize("name", ["muon", "muon_conv"])
def test_a_plain_trainer_fits_with_muon_and_its_checkpoint_restores_both_halves(tmp_path, name):
    save = ModelCheckpoint(tmp_path, "last", save_top_k=0, save_last=True, enable_version_counter=False)
    module = tiny_module(optimizer=name, lr=2e-3, momentum=0.95, channels_last=True)
    trainer(tmp_path, max_steps=8, callbacks=[save], limit_val_batches=0).fit(module, datamodule=Batches(n=32))
    optimizer = module.trainer.optimizers[0]
    assert isinstance(optimizer, MuonAdamW)
    names = {id(p): n for n, p in module.model.named_parameters()}
    on_muon = {names[id(p)] for g in optimizer.muon.param_groups for p in g["params"]}
    assert "blocks.0.attn.qkv.weight" in on_muon and "head.weight" not in on_muon
    assert ("patch_embed.proj.weight" in on_muon) == (name == "muon_conv")  # the one conv filter
    assert all("momentum_buffer" in optimizer.state[p] for g in optimizer.muon.param_groups for p in g["params"])
    assert all("exp_avg" in optimizer.state[p] for g in optimizer.adamw.param_groups for p in g["params"])

    resumed = tiny_module(optimizer=name, lr=2e-3, momentum=0.95, channels_last=True)
    run = trainer(tmp_path / "resumed", max_steps=8, limit_val_batches=0)
    run.fit(resumed, datamodule=Batches(n=32), ckpt_path=tmp_path / "last.ckpt")  # already at step 8: restores only
    again = run.optimizers[0]
    for p, q in zip(module.model.parameters(), resumed.model.parameters(), strict=True):
        for key, value in optimizer.state[p].items():
            torch.testing.assert_close(again.state[q][key], value, rtol=0, atol=0)


def test_the_cuda_graph_wrapper_of_the_compiled_step_runs_on_the_cpu():
    """The CUDA form of ``compiled_train_loss`` (reduce-overhead mode, a step mark, copied outputs) on CPU tensors,
    where torch skips the graphs: the loss, logits and gradients of train_loss itself."""
    from zoo.train.step import compiled_train_loss

    torch.manual_seed(0)
    model = zoo.create_model("vit_nano", num_classes=10, **TINY)
    images, targets = torch.randn(6, 3, 16, 16), torch.tensor([0, 1, 2, 3, 4, 5])
    results = []
    for fn in (train_loss, compiled_train_loss("cuda")):
        model.zero_grad(set_to_none=True)
        loss, logits = fn(model, images, targets, 0.1, torch.contiguous_format)
        loss.backward()
        results.append((loss, logits, [p.grad for p in model.parameters()]))
    (loss, logits, grads), (loss2, logits2, grads2) = results
    assert not logits2.requires_grad
    torch.testing.assert_close(loss2, loss)
    torch.testing.assert_close(logits2, logits.detach())
    torch.testing.assert_close(grads2, grads, rtol=1e-4, atol=1e-6)


def test_under_several_processes_each_rank_draws_its_own_dropout_and_the_generators_stay_in_step():
    """Every rank's generators agree (one seed; the augmentation relies on it). The training forward's dropout and
    drop path are drawn apart per rank inside a fork, and every rank leaves it with the generators still equal;
    one process draws exactly as the plain forward does."""
    from zoo.train.loop import rank_own_draws

    model = zoo.create_model("vit_nano", num_classes=10, **{**TINY, "depth": 2, "drop_path_rate": 0.5}).train()
    images, labels = torch.randn(8, 3, 16, 16), torch.arange(8)

    def step(world: int, rank: int = 0):
        fabric = SimpleNamespace(world_size=world, global_rank=rank, device=torch.device("cpu"))
        run = SimpleNamespace(fabric=fabric, plan=SimpleNamespace(recipe=SimpleNamespace(compile=False)))
        torch.manual_seed(0)
        with rank_own_draws(run):
            loss = train_loss(model, images, labels, 0.0)[0]
        return loss.detach(), torch.get_rng_state()

    torch.manual_seed(0)
    plain = F.cross_entropy(model(images).float(), labels)
    alone, _ = step(1)
    torch.testing.assert_close(alone, plain.detach(), rtol=0, atol=0)
    (first, after_first), (second, after_second) = step(2, 0), step(2, 1)
    assert not torch.equal(first, second) and torch.equal(after_first, after_second)
    assert torch.equal(step(2, 1)[0], second)  # the rank's draw is a function of the shared state and the rank
