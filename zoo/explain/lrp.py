"""AttnLRP (Achtibat et al., "AttnLRP: Attention-Aware Layer-Wise Relevance Propagation for Transformers",
ICML 2024, https://arxiv.org/abs/2402.05602) in the gradient x input form of its reference implementation
(``lxt.efficient``): while ``lrp_rules`` is active every module computes the same values, with a backward that
makes ``input * grad`` the relevance of the rules below.

- LayerNorm: the standard deviation detached (the identity rule on the normalisation, eq. 9).
- GELU, SiLU: the identity rule, backward ``grad * f(x) / x``.
- Attention, ``attention="cp"`` (lxt's default for ViTs: AttnLRP outside the attention, CP-LRP inside, Ali et
  al. 2022, https://arxiv.org/abs/2202.07304): no relevance through the attention weights (q and k detached), the
  values carry all of it. ``attention="attnlrp"``: the paper's rules inside too, the softmax through its gradient
  x input (the linearised rule, eq. 13) and the uniform rule on both products q k^T and A v (relevance halved at
  each: q, k gradients x 1/4, v x 1/2, as ``lxt.efficient.patches.wrap_attention_forward``).
- CBAM channel and spatial gates (the hybrid): the gate detached, as CP-LRP treats attention weights.
- Linear, conv (the hybrid's stem included), BatchNorm in eval mode, pooling, ReLU: plain gradient x input,
  i.e. the epsilon rule with epsilon -> 0 everywhere (no z+ rule).

With ``attention="cp"`` the model is linear in its input and its additive terms (biases, position embeddings,
class tokens, BatchNorm shifts) once the detached factors are fixed, so input relevance + the relevance those
terms absorb = the logit exactly; ``attention="attnlrp"`` is not exactly conservative (the softmax rule). Attention
is handled for the zoo's ``MultiHeadAttention``, timm's ``Attention`` and torch's ``nn.MultiheadAttention``."""

from __future__ import annotations

from collections.abc import Callable
from contextlib import contextmanager

import torch
from timm.layers import Attention as TimmAttention
from torch import nn

from ..layers.attention import MultiHeadAttention
from ..layers.cbam import ChannelAttention, SpatialAttention

ATTENTION_RULES = ("cp", "attnlrp")
IDENTITY_RULE = (nn.GELU, nn.SiLU)


class _IdentityRule(torch.autograd.Function):
    """y = fn(x); backward: grad * fn(x) / (x + 1e-10) (lxt's identity_rule_implicit), the ratio computed in
    float32 (in fp16, x + 1e-10 rounds to x and 0 / 0 is NaN)."""

    @staticmethod
    def forward(ctx, fn, x):
        y = fn(x)
        ctx.save_for_backward((y.float() / (x.float() + 1e-10)).to(y.dtype))
        return y

    @staticmethod
    def backward(ctx, grad):
        (ratio,) = ctx.saved_tensors
        return None, grad * ratio


class _ScaleGrad(torch.autograd.Function):
    """Identity forward; backward multiplies the gradient by ``factor`` (the uniform rule's split)."""

    @staticmethod
    def forward(ctx, x, factor):
        ctx.factor = factor
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        return grad * ctx.factor, None


def _layer_norm(module: nn.LayerNorm) -> Callable[[torch.Tensor], torch.Tensor]:
    dims = tuple(range(-len(module.normalized_shape), 0))

    def forward(x):  # the statistics in float32, as LayerNorm computes them under autocast (fp16 overflows)
        xf = x.float()
        mean = xf.mean(dim=dims, keepdim=True)
        std = (xf.var(dim=dims, keepdim=True, unbiased=False) + module.eps).sqrt()
        y = ((xf - mean) / std.detach()).to(x.dtype)
        if module.weight is not None:
            y = y * module.weight
        return y + module.bias if module.bias is not None else y
    return forward


def _identity_rule(module: nn.Module) -> Callable[[torch.Tensor], torch.Tensor]:
    original = type(module).forward.__get__(module)
    return lambda x: _IdentityRule.apply(original, x)


def _channel_gate(module: ChannelAttention) -> Callable[[torch.Tensor], torch.Tensor]:
    def forward(x):
        with torch.no_grad():
            avg = module.fc2(module.act(module.fc1(x.mean(dim=(2, 3), keepdim=True))))
            peak = module.fc2(module.act(module.fc1(x.amax(dim=(2, 3), keepdim=True))))
        return x * torch.sigmoid(avg + peak)
    return forward


def _spatial_gate(module: SpatialAttention) -> Callable[[torch.Tensor], torch.Tensor]:
    original = type(module).forward.__get__(module)

    def forward(x):
        hook, found = module.gate_hook, []
        module.gate_hook = lambda gate: (found.append(gate), hook is not None and hook(gate))
        try:
            with torch.no_grad():
                original(x)
        finally:
            module.gate_hook = hook
        return x * found[0]
    return forward


def _qk_rule(attention: str) -> Callable[[torch.Tensor], torch.Tensor]:
    return (lambda t: t.detach()) if attention == "cp" else (lambda t: _ScaleGrad.apply(t, 0.5))


def _zoo_attend(module: MultiHeadAttention, attention: str):
    original, qk = module._attend, _qk_rule(attention)

    def attend(backend, q, k, v, masking, need_weights):
        out, weights = original(backend, qk(q), qk(k), v, masking, need_weights)
        return (out if attention == "cp" else _ScaleGrad.apply(out, 0.5)), weights
    return attend


def _timm_hooks(module: TimmAttention, attention: str) -> list:
    qk = _qk_rule(attention)
    handles = [m.register_forward_hook(lambda mod, args, out: qk(out)) for m in (module.q_norm, module.k_norm)]
    if attention == "attnlrp":
        handles.append(module.proj.register_forward_pre_hook(lambda mod, args: (_ScaleGrad.apply(args[0], 0.5),)))
    return handles


def _torch_mha_hooks(module: nn.MultiheadAttention, attention: str) -> list:
    qk = _qk_rule(attention)

    def before(mod, args, kwargs):
        if len(args) >= 2:
            return (qk(args[0]), qk(args[1]), *args[2:]), kwargs
        return args, {**kwargs, "query": qk(kwargs["query"]), "key": qk(kwargs["key"])}

    handles = [module.register_forward_pre_hook(before, with_kwargs=True)]
    if attention == "attnlrp":
        handles.append(module.register_forward_hook(lambda mod, args, out: (_ScaleGrad.apply(out[0], 0.5),
                                                                            *out[1:])))
    return handles


@contextmanager
def lrp_rules(model: nn.Module, attention: str = "cp"):
    """Inside the block, ``model``'s forward computes the same values with AttnLRP's backward (module
    docstring); modules are restored on exit, also on error. ``attention``: "cp" or "attnlrp"."""
    if attention not in ATTENTION_RULES:
        raise ValueError(f"attention must be one of {ATTENTION_RULES}, got {attention!r}")
    patched, handles = [], []
    try:
        for m in model.modules():
            forward = None
            if isinstance(m, nn.LayerNorm):
                forward = _layer_norm(m)
            elif isinstance(m, IDENTITY_RULE):
                forward = _identity_rule(m)
            elif isinstance(m, ChannelAttention):
                forward = _channel_gate(m)
            elif isinstance(m, SpatialAttention):
                forward = _spatial_gate(m)
            elif isinstance(m, MultiHeadAttention):
                m._attend = _zoo_attend(m, attention)
                patched.append((m, "_attend"))
            elif isinstance(m, TimmAttention):
                handles += _timm_hooks(m, attention)
            elif isinstance(m, nn.MultiheadAttention):
                handles += _torch_mha_hooks(m, attention)
            if forward is not None:
                m.forward = forward
                patched.append((m, "forward"))
        yield model
    finally:
        for handle in handles:
            handle.remove()
        for m, name in patched:
            delattr(m, name)  # the instance attribute goes, the class's method shows again


def attnlrp(model: nn.Module, images: torch.Tensor, score: Callable[[torch.Tensor], torch.Tensor], *,
            attention: str = "cp") -> torch.Tensor:
    """AttnLRP relevance (B, H, W) of ``score(logits)`` (a scalar, the sum over images of what is explained)
    for ``model`` (eval mode) on normalised ``images`` (B, C, H, W): input x gradient under ``lrp_rules``,
    summed over the channels. No parameter's ``.grad`` is touched."""
    x = images.detach().requires_grad_(True)
    with torch.enable_grad(), lrp_rules(model, attention):
        (grad,) = torch.autograd.grad(score(model(x)), x)
    return (x.detach() * grad).sum(dim=1)
