"""The per-image RandAugment against torchvision's v2 functional ops, applied image by image as the reference.

Colour ops must match exactly on uint8. Geometric ops may differ in a few pixels (``GEOMETRIC_TOLERANCE``):
nearest sampling reads the neighbour on the other side of a half-pixel when the matrix's sin / cos / tan,
computed here with torch's float64 ops and in torchvision with Python's ``math``, differ in the last bit on some
platform (on this CPU they match exactly). No host sync: every aten op is recorded and none may read a device
value on the host, index with a boolean mask or build a tensor from Python data."""

from __future__ import annotations

import math

import pytest
import torch
from torchvision.transforms import v2
from torchvision.transforms.v2 import functional as TF

from zoo.bench.dispatch import OpRecorder
from zoo.data.augment import BatchAugment
from zoo.data.randaugment import OPS, RandAugment

NEAREST = TF.InterpolationMode.NEAREST
GEOMETRIC = ("ShearX", "ShearY", "TranslateX", "TranslateY", "Rotate")
GEOMETRIC_TOLERANCE = 0.01  # the largest fraction of an image's pixels allowed to differ from torchvision
BINS = 31


def reference(name: str, image: torch.Tensor, magnitude: float) -> torch.Tensor:
    """torchvision's op ``name`` on one (C, H, W) uint8 image, called as v2.RandAugment calls it."""
    shear = math.degrees(math.atan(magnitude))
    ops = {
        "Identity": lambda: image,
        "ShearX": lambda: TF.affine(image, angle=0.0, translate=[0, 0], scale=1.0, shear=[shear, 0.0],
                                    interpolation=NEAREST, center=[0, 0]),
        "ShearY": lambda: TF.affine(image, angle=0.0, translate=[0, 0], scale=1.0, shear=[0.0, shear],
                                    interpolation=NEAREST, center=[0, 0]),
        "TranslateX": lambda: TF.affine(image, angle=0.0, translate=[int(magnitude), 0], scale=1.0,
                                        shear=[0.0, 0.0], interpolation=NEAREST),
        "TranslateY": lambda: TF.affine(image, angle=0.0, translate=[0, int(magnitude)], scale=1.0,
                                        shear=[0.0, 0.0], interpolation=NEAREST),
        "Rotate": lambda: TF.rotate(image, angle=magnitude, interpolation=NEAREST),
        "Brightness": lambda: TF.adjust_brightness(image, 1.0 + magnitude),
        "Color": lambda: TF.adjust_saturation(image, 1.0 + magnitude),
        "Contrast": lambda: TF.adjust_contrast(image, 1.0 + magnitude),
        "Sharpness": lambda: TF.adjust_sharpness(image, 1.0 + magnitude),
        "Posterize": lambda: TF.posterize(image, int(magnitude)),
        "Solarize": lambda: TF.solarize(image, 255 * magnitude),
        "AutoContrast": lambda: TF.autocontrast(image),
        "Equalize": lambda: TF.equalize(image),
    }
    return ops[name]()


def torchvision_magnitudes(name: str, height: int, width: int) -> tuple[torch.Tensor | None, bool]:
    """v2.RandAugment's own magnitude bins for op ``name`` and whether it is signed."""
    bins, signed = v2.RandAugment._AUGMENTATION_SPACE[name]
    return bins(BINS, height, width), signed


def images_batch(b: int = 96, size: int = 32, seed: int = 0) -> torch.Tensor:
    """uint8 images: noise, low-contrast noise (equalize / autocontrast stretch it), smooth gradients, a constant
    channel (autocontrast keeps it) and single-value images (equalize keeps them)."""
    g = torch.Generator().manual_seed(seed)
    images = torch.randint(0, 256, (b, 3, size, size), dtype=torch.uint8, generator=g)
    q = b // 6
    images[q:2 * q] = images[q:2 * q] // 8 + 100
    ramp = torch.arange(size)[None, :] * 5 + torch.arange(size)[:, None] * 3
    images[2 * q:3 * q] = (ramp + torch.randint(0, 50, (q, 3, 1, 1), generator=g)).clamp(0, 255).to(torch.uint8)
    images[3 * q:4 * q, 1] = 77
    images[4 * q:4 * q + 4] = 200
    return images


def assert_matches(name: str, out: torch.Tensor, expected: torch.Tensor) -> None:
    """Exact for the colour ops; for the geometric ones at most ``GEOMETRIC_TOLERANCE`` of each image's pixels."""
    if name not in GEOMETRIC:
        assert torch.equal(out, expected), f"{name}: {(out != expected).sum().item()} values differ"
        return
    differ = (out != expected).any(1).flatten(1).float().mean(1)
    assert differ.max() <= GEOMETRIC_TOLERANCE, f"{name}: up to {differ.max():.3%} of an image's pixels differ"


@pytest.mark.parametrize("name", list(OPS))
def test_each_op_per_image_equals_torchvision_on_that_image(name):
    """Every image of the batch at its own magnitude bin and sign equals torchvision's op on that image alone."""
    images = images_batch()
    b, _, h, w = images.shape
    bins, signed = torchvision_magnitudes(name, h, w)
    g = torch.Generator().manual_seed(1)
    if bins is None:
        magnitudes = [0.0] * b
    else:
        index = torch.randint(0, BINS, (b,), generator=g)
        index[:2] = torch.tensor([0, BINS - 1])  # the ends of the range
        sign = torch.where(torch.rand(b, generator=g) < 0.5, -1.0, 1.0) if signed else torch.ones(b)
        magnitudes = [float(bins[i]) * float(s) for i, s in zip(index, sign, strict=True)]
    out = OPS[name][0](images, torch.tensor(magnitudes, dtype=torch.float64))
    assert out.dtype == torch.uint8 and out.shape == images.shape
    expected = torch.stack([reference(name, image, m) for image, m in zip(images, magnitudes, strict=True)])
    assert_matches(name, out, expected)


def test_the_op_table_is_torchvisions():
    """The same 14 ops, in the same order, so a uniform draw picks each with probability 1/14."""
    assert list(OPS) == list(v2.RandAugment._AUGMENTATION_SPACE)


@pytest.mark.parametrize("num_ops, magnitude", [(2, 9), (3, 30), (1, 0)])
def test_randaugment_equals_torchvision_ops_in_the_drawn_order(num_ops, magnitude):
    """The whole transform: each image through torchvision's ops in the order and with the signs it drew
    (``draw`` under the same seed), at torchvision's magnitude for the bin."""
    images = images_batch(b=48, seed=2)
    augment = RandAugment(num_ops, magnitude)
    out = augment(images, generator=torch.Generator().manual_seed(3))
    ops, signs = augment.draw(len(images), images.device, torch.Generator().manual_seed(3))
    names = list(OPS)
    for i, image in enumerate(images):
        applied = []
        for op, sign in zip(ops[:, i].tolist(), signs[:, i].tolist(), strict=True):
            name = names[op]
            bins, signed = torchvision_magnitudes(name, *image.shape[-2:])
            value = 0.0 if bins is None else float(bins[magnitude]) * (sign if signed else 1.0)
            image = reference(name, image, value)
            applied.append(name)
        if all(name not in GEOMETRIC for name in applied):
            assert torch.equal(out[i], image), f"image {i} through {applied}"
        else:  # a geometric op moves the pixels the ops after it see; allow its tolerance per geometric op
            differ = (out[i] != image).any(0).float().mean()
            assert differ <= GEOMETRIC_TOLERANCE * len(applied), f"image {i} through {applied}: {differ:.3%}"


def test_images_of_one_batch_draw_their_own_ops():
    """The per-image property torchvision's batched call lacks: one batch holds many different op draws, and
    the images it changes differently are not the result of one op applied to all."""
    augment = RandAugment(2, 9)
    ops, _ = augment.draw(64, torch.device("cpu"), torch.Generator().manual_seed(0))
    assert len({tuple(pair) for pair in ops.T.tolist()}) > 30  # 196 possible ordered pairs, 64 images
    images = images_batch(b=64)
    out = RandAugment(1, 9)(images, generator=torch.Generator().manual_seed(0))
    changed = (out != images).flatten(1).any(1)
    assert 0 < changed.sum() < len(images)  # some drew Identity (or an op that left them), most changed


def test_op_frequencies_are_uniform():
    """Over 2 x 14000 draws each op's count is within 4 binomial standard deviations of 2000 (p = 1/14), and
    the signs are negative half the time."""
    augment = RandAugment(2, 9)
    ops, signs = augment.draw(14000, torch.device("cpu"), torch.Generator().manual_seed(5))
    n, p = ops.numel(), 1 / len(OPS)
    counts = torch.bincount(ops.flatten(), minlength=len(OPS)).float()
    assert (counts - n * p).abs().max() <= 4 * math.sqrt(n * p * (1 - p))
    negative = (signs < 0).float().sum()
    assert abs(negative - n / 2) <= 4 * math.sqrt(n / 4)


def test_seeded_generator_is_deterministic_and_types_are_kept():
    images = images_batch(b=16)
    augment = RandAugment(2, 9)
    first = augment(images, generator=torch.Generator().manual_seed(7))
    assert torch.equal(first, augment(images, generator=torch.Generator().manual_seed(7)))
    assert not torch.equal(first, augment(images, generator=torch.Generator().manual_seed(8)))
    assert first.dtype == torch.uint8 and first.shape == images.shape and first.device == images.device
    assert torch.equal(RandAugment(0, 9)(images), images)


@pytest.mark.parametrize("kwargs, message", [
    ({"num_ops": -1}, "num_ops must be an int >= 0, got -1"),
    ({"magnitude": 31}, r"magnitude must be an int in \[0, 30\], got 31"),
    ({"magnitude": 2.5}, r"magnitude must be an int in \[0, 30\], got 2.5"),
])
def test_bad_settings_name_the_fix(kwargs, message):
    with pytest.raises(ValueError, match=message):
        RandAugment(**kwargs)
    with pytest.raises(ValueError, match=message):
        BatchAugment({"randaugment": kwargs}, num_classes=10)


def test_bad_images_name_the_fix():
    with pytest.raises(ValueError, match=r"takes uint8 \(B, 3, H, W\) images, got torch.float32"):
        RandAugment()(torch.zeros(2, 3, 8, 8))
    with pytest.raises(ValueError, match=r"takes uint8 \(B, 3, H, W\) images, got torch.uint8 \(2, 1, 8, 8\)"):
        RandAugment()(torch.zeros(2, 1, 8, 8, dtype=torch.uint8))


def test_no_host_sync(monkeypatch):
    """Every aten op of a call, recorded: no read of a device value on the host (``.item()``, ``nonzero`` ...),
    no device-to-host copy, no boolean-mask indexing (its kernel calls nonzero), no tensor built from Python
    data (``torch.tensor(...)``: a blocking upload on a GPU). Stricter than the training-step recorder of
    test_step_sync.py, which excuses reads of values computed from host data alone (here every tensor is on
    the batch's device, the random draws included)."""
    images = images_batch(b=32)
    monkeypatch.setattr(RandAugment, "grouped_on_cpu", False)  # the path every other device takes
    RandAugment(3, 9)(images)  # reads the magnitude table (CPU numbers, no device involved) once per image size
    with OpRecorder() as ops:
        RandAugment(3, 9)(images)
    names = {c.name for c in ops.calls}
    assert ops.syncs == []
    assert not names & {"lift_fresh", "lift_fresh_copy"}
    assert not [c for c in ops.calls if c.name.startswith("index") and torch.bool in c.dtypes]
    assert {"grid_sampler_2d", "scatter_add_", "convolution"} <= names  # the ops were recorded


def test_batch_augment_applies_it_per_image():
    """BatchAugment's RandAugment is this one: the recipe key keeps its meaning (true: num_ops 2, magnitude 9)."""
    augment = BatchAugment({"randaugment": True, "crop_padding": 0, "hflip": False}, num_classes=10)
    assert isinstance(augment.randaugment, RandAugment)
    assert (augment.randaugment.num_ops, augment.randaugment.magnitude) == (2, 9)
    assert BatchAugment({"randaugment": None}, num_classes=10).randaugment is None
    images = images_batch(b=8)
    torch.manual_seed(0)
    out, _ = augment(images, torch.zeros(8, dtype=torch.long), lambda x: x.float())
    torch.manual_seed(0)
    assert torch.equal(out, RandAugment(2, 9)(images).float())


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_on_cuda_no_sync_and_the_cpu_result():
    """On a GPU: CUDA's sync debug mode raises on any synchronising call, and each colour op equals the CPU
    result exactly (geometric ops within the tolerance)."""
    images = images_batch()
    cuda = images.cuda()
    RandAugment(2, 9)(cuda)  # warm up (lazy initialisation may sync once)
    torch.cuda.set_sync_debug_mode("error")
    try:
        out = RandAugment(2, 9)(cuda, generator=torch.Generator("cuda").manual_seed(0))
    finally:
        torch.cuda.set_sync_debug_mode(0)
    assert out.device == cuda.device and out.dtype == torch.uint8
    magnitudes = torch.linspace(-0.3, 0.3, len(images), dtype=torch.float64)
    for name, (fn, _, _) in OPS.items():
        scale = {"TranslateX": 40.0, "TranslateY": 40.0, "Rotate": 100.0, "Posterize": 20.0}.get(name, 1.0)
        m = magnitudes.abs() * scale if name in ("Posterize", "Solarize") else magnitudes * scale
        assert_matches(name, fn(cuda, m.cuda()).cpu(), fn(images, m))


@pytest.mark.parametrize("num_ops, magnitude", [(3, 9), (2, 30)])
def test_the_cpu_path_equals_the_device_path(num_ops, magnitude):
    """On a CPU each op runs on the images that drew it (``apply_grouped``); on a device every op runs on the whole
    batch and ``where`` picks (``apply_everywhere``): the same images, to the bit, for the same draws."""
    images = images_batch(b=96, seed=4)
    augment = RandAugment(num_ops, magnitude)
    ops, signs = augment.draw(len(images), images.device, torch.Generator().manual_seed(6))
    grouped = everywhere = images
    for op, sign in zip(ops, signs, strict=True):
        grouped, everywhere = augment.apply_grouped(grouped, op, sign), augment.apply_everywhere(everywhere, op, sign)
    assert len(set(ops.flatten().tolist())) == len(OPS)  # every op drawn somewhere
    assert torch.equal(grouped, everywhere)
