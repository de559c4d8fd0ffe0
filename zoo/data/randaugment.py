"""RandAugment (Cubuk et al. 2019, https://arxiv.org/abs/1909.13719) per image on a uint8 batch, without host sync.

torchvision's ``v2.RandAugment`` draws one op pair for a whole batch and reads its random numbers on the host;
``RandAugment`` here draws ``num_ops`` ops (uniformly, with replacement) and a sign per op for every image, on the
images' device with torch ops. It keeps torchvision's 14 ops and their magnitudes (``magnitude`` indexes
``num_magnitude_bins`` bins; the signed ops negate it with probability 1/2), nearest interpolation and fill 0
for the geometric ops. On a GPU each round computes every op on the whole batch and keeps, per image, the one it
drew (``torch.where``): no boolean-mask indexing, no ``.item()``, no tensor built from Python data per call. On a
CPU, where reading the draws costs nothing, each op runs on the images that drew it: the same images, a fifth of
the time (8.6 against 43 ms for 256 CIFAR images on a 2-core AMD EPYC, Zen 4; torchvision's one op pair for the
whole batch takes 1.9 ms).

The op functions take uint8 (B, C, H, W) images (C = 3 for Color and Contrast) and ``magnitude`` (B,) float64
(float32 on MPS): per image the value torchvision's RandAugment would pass for that op (signed, in its units:
pixels, degrees, bits, a factor offset). They follow
torchvision's kernels step by step: the same float32 ops, torchvision's inverse affine matrix and sampling
grid, and its fused multiply-add in the blends reproduced in float64 (exact); on MPS, which has no float64, the
float32 arithmetic can differ from torchvision in the last bit."""

from __future__ import annotations

import functools
from typing import ClassVar

import torch
import torch.nn.functional as F

BOUND = 255.0  # the largest uint8 value


def _wide(device: torch.device) -> torch.dtype:
    """The dtype for torchvision's Python-double arithmetic on ``device``."""
    return torch.float32 if device.type == "mps" else torch.float64


def _per_image(values: torch.Tensor) -> torch.Tensor:
    """(B,) -> (B, 1, 1, 1), to broadcast over (B, C, H, W)."""
    return values[:, None, None, None]


# geometric ops: each builds torchvision's inverse affine matrix (output pixel -> input pixel, both measured from
# the image centre) per image; ``affine`` samples with it as torchvision's ``affine`` / ``rotate`` do.

def _theta(rows: list[list[torch.Tensor | float]], like: torch.Tensor) -> torch.Tensor:
    """(B, 2, 3) matrices from a 2 x 3 layout of (B,) tensors and numbers."""
    return torch.stack([torch.stack([v if isinstance(v, torch.Tensor) else torch.full_like(like, v) for v in row],
                                    dim=-1) for row in rows], dim=1)


def shear_x_theta(magnitude: torch.Tensor, height: int, width: int) -> torch.Tensor:
    """torchvision's ShearX: ``affine(shear=[degrees(atan(m)), 0], center=[0, 0])`` (the top-left corner)."""
    t = torch.tan(torch.atan(magnitude))  # torchvision shears by the angle atan(m), i.e. by tan(atan(m)) ~ m
    return _theta([[1.0, t, t * (0.5 * height)], [0.0, 1.0, 0.0]], t)


def shear_y_theta(magnitude: torch.Tensor, height: int, width: int) -> torch.Tensor:
    """torchvision's ShearY: ``affine(shear=[0, degrees(atan(m))], center=[0, 0])``."""
    t = torch.tan(torch.atan(magnitude))
    return _theta([[1.0, 0.0, 0.0], [t, 1.0, t * (0.5 * width)]], t)


def translate_x_theta(magnitude: torch.Tensor, height: int, width: int) -> torch.Tensor:
    """torchvision's TranslateX: ``affine(translate=[int(m), 0])``, m in pixels."""
    return _theta([[1.0, 0.0, -torch.trunc(magnitude)], [0.0, 1.0, 0.0]], magnitude)


def translate_y_theta(magnitude: torch.Tensor, height: int, width: int) -> torch.Tensor:
    """torchvision's TranslateY: ``affine(translate=[0, int(m)])``."""
    return _theta([[1.0, 0.0, 0.0], [0.0, 1.0, -torch.trunc(magnitude)]], magnitude)


def rotate_theta(magnitude: torch.Tensor, height: int, width: int) -> torch.Tensor:
    """torchvision's Rotate: ``rotate(angle=m)`` in degrees, counter-clockwise, about the centre."""
    radians = torch.deg2rad(-torch.remainder(magnitude, 360.0))  # rotate takes angle % 360 and negates it
    cos, sin = torch.cos(radians), torch.sin(radians)
    return _theta([[cos, sin, 0.0], [-sin, cos, 0.0]], cos)


def affine(images: torch.Tensor, theta: torch.Tensor) -> torch.Tensor:
    """uint8 (B, C, H, W) images resampled (nearest, fill 0) through (B, 2, 3) inverse matrices in pixels about
    the centre, with torchvision's grid: output pixel centres times theta, over (W / 2, H / 2)."""
    b, _, h, w = images.shape
    x = torch.linspace((1.0 - w) * 0.5, (w - 1.0) * 0.5, steps=w, device=images.device)
    y = torch.linspace((1.0 - h) * 0.5, (h - 1.0) * 0.5, steps=h, device=images.device)
    base = torch.stack([x.expand(h, w), y[:, None].expand(h, w), torch.ones(h, w, device=images.device)], dim=-1)
    scaled = theta.float().transpose(1, 2).clone()  # (B, 3, 2)
    scaled[..., 0] /= 0.5 * w
    scaled[..., 1] /= 0.5 * h
    grid = base.view(1, h * w, 3).expand(b, h * w, 3).bmm(scaled).view(b, h, w, 2)
    out = F.grid_sample(images.float(), grid, mode="nearest", padding_mode="zeros", align_corners=False)
    return out.round_().to(torch.uint8)


def _geometric(theta_fn):
    def op(images: torch.Tensor, magnitude: torch.Tensor) -> torch.Tensor:
        return affine(images, theta_fn(magnitude, *images.shape[-2:]))
    op.__doc__ = f"uint8 (B, C, H, W) images through ``{theta_fn.__name__}`` per image."
    return op


shear_x = _geometric(shear_x_theta)
shear_y = _geometric(shear_y_theta)
translate_x = _geometric(translate_x_theta)
translate_y = _geometric(translate_y_theta)
rotate = _geometric(rotate_theta)


# colour ops

def _blend(images: torch.Tensor, other: torch.Tensor, ratio: torch.Tensor) -> torch.Tensor:
    """torchvision's ``_blend``: ``images * r + other * (1 - r)`` clamped to uint8, ``ratio`` (B,) in the wide
    dtype. torchvision's ``add_(other, alpha=1 - r)`` is a fused multiply-add; float64 holds its exact sum."""
    wide = ratio.dtype
    scaled = images.float() * _per_image(ratio.float())
    alpha = _per_image((1.0 - ratio).float())
    out = scaled.to(wide) + alpha.to(wide) * other.to(wide)
    return out.float().clamp_(0, BOUND).to(torch.uint8)


def _grayscale(images: torch.Tensor) -> torch.Tensor:
    """torchvision's uint8 grayscale as float32, floored: (B, 1, H, W)."""
    r, g, b = images.unbind(dim=-3)
    return r.mul(0.2989).add_(g, alpha=0.587).add_(b, alpha=0.114).unsqueeze(-3).floor_()


def brightness(images: torch.Tensor, magnitude: torch.Tensor) -> torch.Tensor:
    """torchvision's Brightness: ``adjust_brightness(factor=1 + m)``."""
    factor = _per_image((1.0 + magnitude).float())
    return (images.float() * factor).clamp_(0, BOUND).to(torch.uint8)


def color(images: torch.Tensor, magnitude: torch.Tensor) -> torch.Tensor:
    """torchvision's Color: ``adjust_saturation(factor=1 + m)``, a blend with the grayscale image."""
    return _blend(images, _grayscale(images), 1.0 + magnitude)


def contrast(images: torch.Tensor, magnitude: torch.Tensor) -> torch.Tensor:
    """torchvision's Contrast: ``adjust_contrast(factor=1 + m)``, a blend with the grayscale mean."""
    mean = _grayscale(images).mean(dim=(-3, -2, -1), keepdim=True)
    return _blend(images, mean, 1.0 + magnitude)


def sharpness(images: torch.Tensor, magnitude: torch.Tensor) -> torch.Tensor:
    """torchvision's Sharpness: ``adjust_sharpness(factor=1 + m)``: the interior blended with a 3 x 3 smoothing
    (1/13 around, 5/13 in the middle, rounded); the border pixels kept."""
    c, h, w = images.shape[-3:]
    if h <= 2 or w <= 2:
        return images
    kernel = torch.full((c, 1, 3, 3), 1.0 / 13.0, device=images.device)
    kernel[:, :, 1, 1].fill_(5.0 / 13.0)  # fill_, not item assignment: that builds a tensor from the number
    out = images.float()
    blurred = F.conv2d(out, kernel, groups=c).round_()
    inner = out[..., 1:-1, 1:-1]
    wide = magnitude.dtype
    alpha = _per_image((-magnitude).float()).to(wide)  # 1 - factor
    out[..., 1:-1, 1:-1] = (inner.to(wide) + alpha * (blurred - inner).to(wide)).float()  # fused, as in color
    return out.clamp_(0, BOUND).to(torch.uint8)


def posterize(images: torch.Tensor, magnitude: torch.Tensor) -> torch.Tensor:
    """torchvision's Posterize: keep the ``int(m)`` (0-8) high bits of every value."""
    bits = magnitude.long().clamp(0, 8)
    mask = ((torch.ones_like(bits) << bits) - 1) << (8 - bits)
    return images & _per_image(mask.to(torch.uint8))


def solarize(images: torch.Tensor, magnitude: torch.Tensor) -> torch.Tensor:
    """torchvision's Solarize: invert the values >= 255 * m (m in [0, 1])."""
    threshold = _per_image((BOUND * magnitude).float())
    return torch.where(images.float() >= threshold, 255 - images, images)


def autocontrast(images: torch.Tensor, magnitude: torch.Tensor | None = None) -> torch.Tensor:
    """torchvision's AutoContrast: stretch each channel to [0, 255] (a constant channel is kept)."""
    values = images.float()
    low = values.amin(dim=(-2, -1), keepdim=True)
    high = values.amax(dim=(-2, -1), keepdim=True)
    flat = high == low
    inv_scale = torch.where(flat, 1.0, (high - low).mul_(1.0 / BOUND))
    low = torch.where(flat, 0.0, low)
    return values.sub_(low).div_(inv_scale).clamp_(0, BOUND).to(torch.uint8)


def equalize(images: torch.Tensor, magnitude: torch.Tensor | None = None) -> torch.Tensor:
    """torchvision's (PIL's) Equalize per image and channel: a 256-bin histogram, the lookup table
    ``(cumulative[k - 1] + step // 2) // step`` with ``step`` = the pixels not of the largest value // 255,
    applied with ``gather``; channels with ``step == 0`` kept."""
    flat = images.flatten(-2).long()  # (B, C, HW)
    hist = torch.zeros(*flat.shape[:-1], 256, dtype=torch.int32, device=images.device)
    hist.scatter_add_(-1, flat, torch.ones_like(flat, dtype=torch.int32))
    cumulative = hist.cumsum(-1)
    top = cumulative.argmax(-1, keepdim=True)  # the largest value present: the first bin holding every pixel
    step = (flat.shape[-1] - hist.gather(-1, top)).div(255, rounding_mode="floor")
    lut = (cumulative[..., :-1] + step // 2).div(step.clamp(min=1), rounding_mode="floor").clamp_(0, 255)
    lut = F.pad(lut, (1, 0)).to(torch.uint8)  # lut[0] = 0
    equalized = lut.gather(-1, flat).view_as(images)
    return torch.where(step[..., None] != 0, equalized, images)


def identity(images: torch.Tensor, magnitude: torch.Tensor | None = None) -> torch.Tensor:
    """torchvision's Identity."""
    return images


# torchvision's op order, magnitudes per bin (num_bins, height, width -> (num_bins,) or None) and whether signed
OPS = {
    "Identity": (identity, None, False),
    "ShearX": (shear_x, lambda n, h, w: torch.linspace(0.0, 0.3, n), True),
    "ShearY": (shear_y, lambda n, h, w: torch.linspace(0.0, 0.3, n), True),
    "TranslateX": (translate_x, lambda n, h, w: torch.linspace(0.0, 150.0 / 331.0 * w, n), True),
    "TranslateY": (translate_y, lambda n, h, w: torch.linspace(0.0, 150.0 / 331.0 * h, n), True),
    "Rotate": (rotate, lambda n, h, w: torch.linspace(0.0, 30.0, n), True),
    "Brightness": (brightness, lambda n, h, w: torch.linspace(0.0, 0.9, n), True),
    "Color": (color, lambda n, h, w: torch.linspace(0.0, 0.9, n), True),
    "Contrast": (contrast, lambda n, h, w: torch.linspace(0.0, 0.9, n), True),
    "Sharpness": (sharpness, lambda n, h, w: torch.linspace(0.0, 0.9, n), True),
    "Posterize": (posterize, lambda n, h, w: (8 - (torch.arange(n) / ((n - 1) / 4))).round().int(), False),
    "Solarize": (solarize, lambda n, h, w: torch.linspace(1.0, 0.0, n), False),
    "AutoContrast": (autocontrast, None, False),
    "Equalize": (equalize, None, False),
}
GEOMETRIC = {"ShearX": shear_x_theta, "ShearY": shear_y_theta, "TranslateX": translate_x_theta,
             "TranslateY": translate_y_theta, "Rotate": rotate_theta}
BLENDS = ("Brightness", "Color", "Contrast")


@functools.cache
def op_magnitudes(magnitude: int, num_bins: int, height: int, width: int) -> tuple[float, ...]:
    """Each op's unsigned magnitude at bin ``magnitude``, as torchvision reads it (0.0 for the ops without one):
    host numbers from CPU tensors, read once per image size."""
    return tuple(0.0 if bins is None else float(bins(num_bins, height, width)[magnitude])
                 for _, bins, _ in OPS.values())


class RandAugment:
    """Per-image RandAugment of uint8 (B, 3, H, W) batches, on their device.

    Args:
        num_ops: ops applied in turn to every image, each drawn per image uniformly from ``OPS``.
        magnitude: the bin of every op's magnitude, in [0, num_magnitude_bins).
        num_magnitude_bins: how many bins span each op's range.
    """

    grouped_on_cpu: ClassVar[bool] = True  # False: the device path on a CPU too (the no-sync tests)

    def __init__(self, num_ops: int = 2, magnitude: int = 9, num_magnitude_bins: int = 31):
        if not isinstance(num_ops, int) or isinstance(num_ops, bool) or num_ops < 0:
            raise ValueError(f"randaugment num_ops must be an int >= 0, got {num_ops!r}")
        if not isinstance(num_magnitude_bins, int) or num_magnitude_bins < 2:
            raise ValueError(f"randaugment num_magnitude_bins must be an int >= 2, got {num_magnitude_bins!r}")
        if not isinstance(magnitude, int) or isinstance(magnitude, bool) or not 0 <= magnitude < num_magnitude_bins:
            raise ValueError(f"randaugment magnitude must be an int in [0, {num_magnitude_bins - 1}], "
                             f"got {magnitude!r}")
        self.num_ops, self.magnitude, self.num_magnitude_bins = num_ops, magnitude, num_magnitude_bins

    def draw(self, batch: int, device: torch.device, generator: torch.Generator | None = None
             ) -> tuple[torch.Tensor, torch.Tensor]:
        """Each image's ops and signs: (num_ops, B) int64 indices into ``OPS`` and (num_ops, B) +-1.0 (-1 with
        probability 1/2, used by the signed ops only)."""
        ops = torch.randint(len(OPS), (self.num_ops, batch), device=device, generator=generator)
        negate = torch.rand(self.num_ops, batch, device=device, generator=generator) <= 0.5
        return ops, torch.where(negate, -1.0, 1.0)

    def __call__(self, images: torch.Tensor, generator: torch.Generator | None = None,
                 draws: tuple[torch.Tensor, torch.Tensor] | None = None) -> torch.Tensor:
        """uint8 (B, 3, H, W) -> uint8 (B, 3, H, W): each image through its own ``num_ops`` drawn ops (``draws``:
        ``draw``'s result for these images, made by the caller)."""
        if images.dtype != torch.uint8 or images.ndim != 4 or images.shape[1] != 3:
            raise ValueError(f"RandAugment takes uint8 (B, 3, H, W) images, got {images.dtype} "
                             f"{tuple(images.shape)}")
        ops, signs = draws if draws is not None else self.draw(images.shape[0], images.device, generator)
        for op, sign in zip(ops, signs, strict=True):
            images = self.apply(images, op, sign)
        return images

    def apply(self, images: torch.Tensor, op: torch.Tensor, sign: torch.Tensor) -> torch.Tensor:
        """One round: image i through op ``OPS[op[i]]`` at this magnitude, negated where ``sign[i]`` < 0 for the
        signed ops. On a CPU, where reading the draws on the host costs nothing, each op runs on the images that
        drew it (``apply_grouped``); elsewhere every op runs on the whole batch (``apply_everywhere``)."""
        if images.device.type == "cpu" and self.grouped_on_cpu:
            return self.apply_grouped(images, op, sign)
        return self.apply_everywhere(images, op, sign)

    def apply_grouped(self, images: torch.Tensor, op: torch.Tensor, sign: torch.Tensor) -> torch.Tensor:
        """``apply`` with each op's function on the rows that drew it (indices read on the host): a fourteenth
        of the work of ``apply_everywhere``, the same images."""
        values = op_magnitudes(self.magnitude, self.num_magnitude_bins, *images.shape[-2:])
        sign = sign.to(_wide(images.device))
        out = images.clone()
        for index, (name, (function, _, signed)) in enumerate(OPS.items()):
            rows = (op == index).nonzero().flatten()
            if name == "Identity" or rows.numel() == 0:
                continue
            magnitude = sign[rows] * values[index] if signed else torch.full_like(sign[rows], values[index])
            out[rows] = function(images[rows], magnitude)
        return out

    def apply_everywhere(self, images: torch.Tensor, op: torch.Tensor, sign: torch.Tensor) -> torch.Tensor:
        """``apply`` without a host sync: every op runs on the whole batch (cheap at CIFAR sizes), each image at its
        own op's magnitude, and ``where`` keeps each image's result. Sharing: the geometric ops are one
        resampling with each image's matrix; Brightness, Color and Contrast one blend (Brightness: with 0, which
        leaves torchvision's ``image * factor``)."""
        h, w = images.shape[-2:]
        values = op_magnitudes(self.magnitude, self.num_magnitude_bins, h, w)
        names = list(OPS)
        is_op = {name: op == index for index, name in enumerate(names)}
        sign = sign.to(_wide(images.device))
        magnitude = torch.zeros_like(sign)
        for name, value in zip(names, values, strict=True):
            if value != 0.0:
                magnitude = torch.where(is_op[name], value * sign if OPS[name][2] else value, magnitude)
        theta = rotate_theta(magnitude, h, w)
        for name in ("ShearX", "ShearY", "TranslateX", "TranslateY"):
            theta = torch.where(is_op[name][:, None, None], GEOMETRIC[name](magnitude, h, w), theta)
        gray = _grayscale(images)
        other = torch.where(_per_image(is_op["Color"]), gray, torch.where(
            _per_image(is_op["Contrast"]), gray.mean(dim=(-3, -2, -1), keepdim=True), 0.0))
        results = {"geometric": affine(images, theta), "blend": _blend(images, other, 1.0 + magnitude)}
        results.update((name, OPS[name][0](images, magnitude))
                       for name in ("Sharpness", "Posterize", "Solarize", "AutoContrast", "Equalize"))
        chosen = {"geometric": functools.reduce(torch.logical_or, (is_op[name] for name in GEOMETRIC)),
                  "blend": functools.reduce(torch.logical_or, (is_op[name] for name in BLENDS))}
        out = images
        for key, result in results.items():
            out = torch.where(_per_image(chosen.get(key, is_op.get(key))), result, out)
        return out

    def __repr__(self) -> str:
        return (f"RandAugment(num_ops={self.num_ops}, magnitude={self.magnitude}, "
                f"num_magnitude_bins={self.num_magnitude_bins})")
