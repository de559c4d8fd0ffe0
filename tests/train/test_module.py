"""ImageClassifier: loss, schedule, weight-decay groups, metrics, NaN stop; runs.py: atomic checkpoint IO and
load_run errors. Uses an in-memory stand-in DataModule (random tensors) so no images are decoded here."""

from __future__ import annotations

import math

import lightning.pytorch as pl
import pytest
import torch
import torch.nn.functional as F
from lightning.pytorch.callbacks import ModelCheckpoint
from torch.utils.data import DataLoader, TensorDataset

import zoo
from zoo.models.checkpoints import load_run
from zoo.train.callbacks import EMAWeightAveraging, LossProgressBar
from zoo.train.module import ImageClassifier, NonFiniteLossError, WarmupCosine
from zoo.train.optim import MuonAdamW
from zoo.train.runs import AtomicCheckpointIO

TINY = {"embed_dim": 32, "depth": 1, "num_heads": 2, "img_size": 16}


def tiny_module(**kwargs) -> ImageClassifier:
    return ImageClassifier("vit_nano", TINY, num_classes=10, **kwargs)


class Batches(pl.LightningDataModule):
    """Random images (float) with fixed labels; ``nan_batch`` gets a NaN image."""

    def __init__(self, n: int = 64, batch_size: int = 8, nan_batch: int | None = None):
        super().__init__()
        g = torch.Generator().manual_seed(0)
        self.images = torch.randn(n, 3, 16, 16, generator=g)
        self.labels = torch.randint(0, 10, (n,), generator=g)
        if nan_batch is not None:
            self.images[nan_batch * batch_size] = float("nan")
        self.batch_size = batch_size

    def _loader(self):
        return DataLoader(TensorDataset(self.images, self.labels), batch_size=self.batch_size)

    train_dataloader = val_dataloader = test_dataloader = _loader


def trainer(tmp_path, **kwargs) -> pl.Trainer:
    return pl.Trainer(accelerator="cpu", devices=1, logger=False, enable_progress_bar=False,
                      enable_model_summary=False, default_root_dir=tmp_path, plugins=[AtomicCheckpointIO()],
                      num_sanity_val_steps=0, **kwargs)


def test_warmup_cosine_matches_the_formula():
    schedule = WarmupCosine(10, 110, min_ratio=0.1)
    assert schedule(0) == pytest.approx(1 / 11) and schedule(9) == pytest.approx(10 / 11)
    for step in (10, 35, 60, 109):
        t = (step - 10) / 100
        assert schedule(step) == pytest.approx(0.1 + 0.9 * (1 + math.cos(math.pi * t)) / 2)
    assert schedule(500) == pytest.approx(0.1)


def test_loss_with_int_and_probability_targets():
    module = tiny_module(label_smoothing=0.1)
    images, labels = torch.randn(4, 3, 16, 16), torch.tensor([1, 2, 3, 4])
    logits = module(images)
    smooth = F.one_hot(labels, 10).float() * 0.9 + 0.1 / 10
    expected = -(smooth * logits.log_softmax(-1)).sum(-1).mean()      # hand-written smoothed CE
    module.log = module.log_dict = lambda *a, **k: None
    assert module._shared_step((images, labels), "val").item() == pytest.approx(expected.item(), rel=1e-5)
    probs = torch.softmax(torch.randn(4, 10), -1)
    soft = probs * 0.9 + 0.1 / 10
    expected = -(soft * logits.log_softmax(-1)).sum(-1).mean()
    assert module._shared_step((images, probs), "val").item() == pytest.approx(expected.item(), rel=1e-5)


def test_no_weight_decay_on_norms_biases_pos_embed_cls_token(tmp_path):
    module = tiny_module(weight_decay=0.05)
    module.trainer = trainer(tmp_path, max_steps=10)
    module.trainer.fit_loop.epoch_loop.max_steps = 10
    groups = module.configure_optimizers()["optimizer"].param_groups
    names = {id(p): n for n, p in module.model.named_parameters()}
    no_decay = {names[id(p)] for g in groups if g["weight_decay"] == 0 for p in g["params"]}
    decay = {names[id(p)] for g in groups if g["weight_decay"] == 0.05 for p in g["params"]}
    assert {"pos_embed", "cls_token"} <= no_decay
    assert all(n.endswith("bias") or "norm" in n or n in ("pos_embed", "cls_token") for n in no_decay)
    assert "blocks.0.attn.qkv.weight" in decay and "head.weight" in decay
    assert decay | no_decay == set(names.values())


def test_validation_metrics_match_a_hand_count(tmp_path):
    module, data = tiny_module(), Batches(n=40)
    result = trainer(tmp_path).validate(module, datamodule=data, verbose=False)[0]
    with torch.no_grad():
        logits = module(data.images)
    top5 = logits.topk(5, dim=-1).indices
    assert result["val/top1"] == pytest.approx((logits.argmax(-1) == data.labels).float().mean().item())
    assert result["val/top5"] == pytest.approx((top5 == data.labels[:, None]).any(-1).float().mean().item())


def test_nan_loss_stops_naming_the_step_and_keeps_the_last_good_checkpoint(tmp_path):
    ckpt = ModelCheckpoint(tmp_path / "ckpt", "last", save_top_k=0, save_last=True, every_n_train_steps=2,
                           enable_version_counter=False)
    run = trainer(tmp_path, max_epochs=1, callbacks=[ckpt], limit_val_batches=0)
    with pytest.raises(NonFiniteLossError, match="optimizer step 5"):
        run.fit(tiny_module(), datamodule=Batches(nan_batch=5))
    model, meta = load_run(tmp_path / "ckpt" / "last.ckpt")
    assert meta["global_step"] == 4          # written after step 4; the step-6 checkpoint never happened
    assert all(torch.isfinite(p).all() for p in model.parameters())


def test_nan_check_does_not_sync_between_checks(tmp_path):
    module = tiny_module(nan_check_every=100)   # the flag is only read every 100 steps and at checkpoints
    run = trainer(tmp_path, max_steps=3, limit_val_batches=0, enable_checkpointing=False)
    run.fit(module, datamodule=Batches(nan_batch=1))
    assert int(module.first_bad_step) == 1
    with pytest.raises(NonFiniteLossError, match="step 1"):
        module.on_save_checkpoint({})


class _Snapshots(pl.Callback):
    """The model's parameters after every optimizer step."""

    def __init__(self):
        self.steps = []

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        self.steps.append([p.detach().clone() for p in pl_module.model.parameters()])


def test_ema_callback_leaves_the_hand_written_average_in_the_model(tmp_path):
    """EMA after each of 6 steps: a copy first, then keep min(0.9, (1 + n) / (10 + n)) after n updates;
    Lightning puts the average into the module when training ends."""
    snapshots, module = _Snapshots(), tiny_module()
    run = trainer(tmp_path, max_steps=6, limit_val_batches=0, enable_checkpointing=False,
                  callbacks=[snapshots, EMAWeightAveraging(0.9)])
    run.fit(module, datamodule=Batches())
    expected = snapshots.steps[0]
    for n, params in enumerate(snapshots.steps[1:], start=1):
        kept = min(0.9, (1 + n) / (10 + n))
        expected = [kept * e + (1 - kept) * p for e, p in zip(expected, params, strict=True)]
    assert len(snapshots.steps) == 6
    assert not torch.allclose(expected[0], snapshots.steps[-1][0])  # the average is not the last weights
    for average, hand in zip(module.model.parameters(), expected, strict=True):
        torch.testing.assert_close(average, hand)


def test_progress_bar_shows_the_training_loss_that_is_off_lightnings_progress_bar_dict(tmp_path):
    bar, shown = LossProgressBar(), []

    class Read(pl.Callback):
        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
            shown.append((bar.get_metrics(trainer, pl_module), float(outputs["loss"])))

    run = pl.Trainer(accelerator="cpu", devices=1, logger=False, enable_model_summary=False, max_steps=2,
                     limit_val_batches=0, enable_checkpointing=False, callbacks=[bar, Read()],
                     default_root_dir=tmp_path)
    run.fit(tiny_module(), datamodule=Batches())
    assert [metrics["train/loss"] for metrics, _ in shown] == [f"{loss:.3g}" for _, loss in shown]
    assert "train/loss_step" not in run.progress_bar_metrics  # Lightning itself holds no loss to convert


def test_atomic_checkpoint_io_keeps_the_old_file_when_a_write_fails(tmp_path):
    path = tmp_path / "last.ckpt"
    io = AtomicCheckpointIO()
    io.save_checkpoint({"step": 1}, path)

    class Boom:
        def __reduce__(self):
            raise RuntimeError("disk full")

    with pytest.raises(RuntimeError, match="disk full"):
        io.save_checkpoint({"step": 2, "x": Boom()}, path)
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


def test_fit_whitening_sets_the_filters_from_images_and_they_are_saved():
    module = ImageClassifier("hybrid_tiny", {}, num_classes=10)
    (layer,) = module.whitening_layers
    before = layer.weight.clone()
    module.fit_whitening(torch.randn(64, 3, 32, 32) * torch.tensor([1.0, 2.0, 0.5]).view(1, 3, 1, 1))
    assert not torch.equal(layer.weight, before)
    assert torch.equal(module.state_dict()["model.stem.0.weight"], layer.weight)
    assert ImageClassifier("vit_nano", TINY, num_classes=10).whitening_layers == []


@pytest.mark.parametrize("fit_whitening", [True, False])
def test_a_new_run_fits_the_whitening_filters_unless_the_recipe_says_not_to(fit_whitening, tmp_path):
    from types import SimpleNamespace

    from zoo.layers.whitening import PatchWhitening
    from zoo.train.fit import RunPlan, build_module
    from zoo.train.recipe import Recipe

    images = torch.randint(0, 256, (40, 3, 32, 32), dtype=torch.uint8)
    normalize = lambda x: (x.float() / 255 - 0.5) / 0.25  # noqa: E731
    train = torch.utils.data.TensorDataset(images, torch.zeros(40, dtype=torch.long))  # [:n] -> (images, labels)
    dm = SimpleNamespace(num_classes=10, normalize=normalize, train_dataset=train)
    recipe = Recipe.from_dict({"model": "hybrid_tiny", "fit_whitening": fit_whitening})
    (layer,) = build_module(RunPlan(recipe, "cpu", "32", tmp_path, None), dm).whitening_layers
    expected = PatchWhitening(3, kernel_size=2, num_filters=12)  # the fixed random filters of a new layer
    if fit_whitening:
        expected.fit(normalize(images))
    torch.testing.assert_close(layer.weight, expected.weight)


@pytest.mark.parametrize("name", ["muon", "muon_conv"])
def test_lightning_fits_with_muon_and_its_checkpoint_restores_both_halves(tmp_path, name):
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


def test_a_compiled_training_step_trains_as_the_eager_one(tmp_path):
    """``compile: step`` (forward, loss and backward compiled as one graph) takes Lightning's steps to the eager
    run's weights: three AdamW steps from the same start on mixup's probability targets (the next test compiles
    integer targets)."""
    from torch._dynamo.utils import counters

    class Soft(Batches):
        def _loader(self):
            soft = torch.softmax(torch.randn(len(self.labels), 10, generator=torch.Generator().manual_seed(1)), -1)
            return DataLoader(TensorDataset(self.images, soft), batch_size=self.batch_size)

        train_dataloader = _loader

    runs = {}
    for compile in (False, "step"):
        torch.manual_seed(0)
        module = tiny_module(compile=compile, label_smoothing=0.1)
        frames = counters["stats"]["unique_graphs"]
        trainer(tmp_path / str(compile), max_steps=3, limit_val_batches=0, enable_checkpointing=False).fit(
            module, datamodule=Soft(n=24))
        if compile:
            assert counters["stats"]["unique_graphs"] > frames  # dynamo compiled a graph: not silently eager
        runs[compile] = [p.detach() for p in module.model.parameters()]
    for eager, compiled in zip(runs[False], runs["step"], strict=True):  # atol: a tenth of one AdamW step at lr
        # 1e-3 (Adam's normalisation turns float rounding in a near-zero gradient into a visible part of a step)
        torch.testing.assert_close(compiled, eager, rtol=1e-4, atol=1e-4)


def test_the_cuda_graph_wrapper_of_the_compiled_step_runs_on_the_cpu():
    """The CUDA form of ``compiled_train_loss`` (reduce-overhead mode, a step mark, copied outputs) on CPU tensors,
    where torch skips the graphs: the loss, logits and gradients of train_loss itself."""
    from zoo.train.module import compiled_train_loss, train_loss

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


def test_the_cuda_graphed_step_refuses_gradient_accumulation():
    """Torch's CUDA graphs would overwrite the accumulated gradients (its own error comes from deep in a replay):
    refused in one line when the fit starts, on CUDA only (compiled without graphs elsewhere, it accumulates)."""
    from types import SimpleNamespace

    module = tiny_module(compile="step")
    module._trainer = SimpleNamespace(accumulate_grad_batches=2)
    module.on_fit_start()  # on the CPU
    module._device = torch.device("cuda", 0)  # what Lightning's move to a GPU sets
    with pytest.raises(ValueError, match="accumulate_grad_batches=1"):
        module.on_fit_start()
    module._trainer.accumulate_grad_batches = 1
    module.on_fit_start()


def test_under_several_processes_each_rank_draws_its_own_dropout_and_the_generators_stay_in_step():
    """Every rank's generators agree (one seed; the augmentation relies on it). The training forward's dropout and
    drop path are drawn apart per rank inside a fork, and every rank leaves it with the generators still equal;
    one process draws exactly as the plain forward does."""
    from types import SimpleNamespace

    module = ImageClassifier("vit_nano", {**TINY, "depth": 2, "drop_path_rate": 0.5}, num_classes=10).train()
    module.log = lambda *args, **kwargs: None
    images, labels = torch.randn(8, 3, 16, 16), torch.arange(8)

    def step(world: int, rank: int = 0):
        module._trainer = SimpleNamespace(world_size=world, global_rank=rank)
        torch.manual_seed(0)
        loss = module._shared_step((images, labels), "train")
        return loss.detach(), torch.get_rng_state()

    torch.manual_seed(0)
    plain = F.cross_entropy(module(images).float(), labels)
    alone, _ = step(1)
    torch.testing.assert_close(alone, plain.detach(), rtol=0, atol=0)
    (first, after_first), (second, after_second) = step(2, 0), step(2, 1)
    assert not torch.equal(first, second) and torch.equal(after_first, after_second)
    assert torch.equal(step(2, 1)[0], second)  # the rank's draw is a function of the shared state and the rank
