"""timm's feature API for the zoo's token models (``vit``, ``hybrid``): ``forward_intermediates`` and
``prune_intermediate_layers`` with the signatures and semantics of timm's ``VisionTransformer`` (indices chosen
by timm's ``feature_take_indices``: None -> all, int n -> the last n, a list -> those, negative from the end),
and ``set_grad_checkpointing``. With ``feature_cfg=dict(out_indices=..., feature_cls="getter")`` in the
registry, ``features_only=True`` wraps a model in timm's ``FeatureGetterNet``, which calls these.

A model's features are the outputs of its ``feature_stages()``, in order: optional convolutional stages (the
hybrid's conv groups, (B, C, H, W)) and then its transformer ``blocks`` (tokens (B, prefix + gh * gw, C)).
Intermediates come as (B, C, h, w) with ``output_fmt="NCHW"`` (prefix tokens dropped, patch tokens read
row-major over the grid) or as tokens (B, h * w, C) with ``"NLC"``. ``feature_info`` has one dict
(``module``, ``num_chs``, ``reduction``) per stage.
"""

from __future__ import annotations

import torch
import torch.fx
from einops import rearrange
from timm.models._features import feature_take_indices
from torch import nn
from torch.utils.checkpoint import checkpoint

torch.fx.wrap("rearrange")  # einops cannot take an fx Proxy: the call becomes one node of the graph

__all__ = ["TOKEN_FEATURES", "TokenFeatures"]

TOKEN_FEATURES = dict(out_indices=3, feature_cls="getter")  # features_only: the last 3 stages, as timm's ViT


class TokenFeatures:
    """Mixin for a model with transformer ``blocks`` (an nn.Sequential), a final ``norm``,
    ``num_prefix_tokens``, ``grid_size`` (gh, gw), ``grad_checkpointing``, ``reset_classifier`` and
    ``forward_tokens(x)``, which takes the last conv stage's output (or the image, without conv stages) to the
    tokens entering the blocks. A model with conv stages also overrides ``conv_stages`` (the modules),
    ``forward_pre_stages`` (image -> input of the first) and ``keep_conv_stages`` (drop all but the first n)."""

    @property
    def conv_stages(self) -> list[nn.Module]:
        return []

    def forward_pre_stages(self, x: torch.Tensor) -> torch.Tensor:
        return x

    def keep_conv_stages(self, n: int) -> None:
        pass

    def set_grad_checkpointing(self, enable: bool = True) -> None:
        """Recompute each transformer block in backward (torch.utils.checkpoint); outputs are unchanged."""
        self.grad_checkpointing = enable

    def _tokens_as(self, x: torch.Tensor, output_fmt: str) -> torch.Tensor:
        """Block output (B, prefix + gh * gw, C) -> (B, C, gh, gw) ("NCHW") or (B, gh * gw, C) ("NLC")."""
        x = x[:, self.num_prefix_tokens:]
        return rearrange(x, "b (h w) c -> b c h w", h=self.grid_size[0]) if output_fmt == "NCHW" else x

    def forward_intermediates(self, x: torch.Tensor, indices: int | list[int] | None = None, norm: bool = False,
                              stop_early: bool = False, output_fmt: str = "NCHW",
                              intermediates_only: bool = False):
        """Image (B, in_chans, H, W) -> (final tokens as ``forward_features`` gives them, [intermediates]), or
        the intermediates alone with ``intermediates_only``. ``norm`` passes block outputs through the final
        norm; ``stop_early`` skips the stages after the last one taken."""
        if output_fmt not in ("NCHW", "NLC"):
            raise ValueError(f"output_fmt must be 'NCHW' or 'NLC', got {output_fmt!r}")
        num_conv = len(self.conv_stages)
        take_indices, max_index = feature_take_indices(num_conv + len(self.blocks), indices)
        last = max_index if stop_early else num_conv + len(self.blocks) - 1
        intermediates = []
        x = self.forward_pre_stages(x)
        for i, stage in enumerate(self.conv_stages[:last + 1]):
            x = stage(x)
            if i in take_indices:
                intermediates.append(x if output_fmt == "NCHW" else rearrange(x, "b c h w -> b (h w) c"))
        x = self.forward_tokens(x)
        for i, block in enumerate(self.blocks[:max(last + 1 - num_conv, 0)], start=num_conv):
            x = checkpoint(block, x, use_reentrant=False) if self.grad_checkpointing else block(x)
            if i in take_indices:
                intermediates.append(self._tokens_as(self.norm(x) if norm else x, output_fmt))
        if intermediates_only:
            return intermediates
        return self.norm(x), intermediates

    def prune_intermediate_layers(self, indices: int | list[int] = 1, prune_norm: bool = False,
                                  prune_head: bool = True) -> list[int]:
        """Drop the stages after the last of ``indices`` (and the final norm with ``prune_norm``, the head
        with ``prune_head``); returns the absolute indices to pass to ``forward_intermediates``."""
        num_conv = len(self.conv_stages)
        take_indices, max_index = feature_take_indices(num_conv + len(self.blocks), indices)
        self.keep_conv_stages(min(max_index + 1, num_conv))
        self.blocks = self.blocks[:max(max_index + 1 - num_conv, 0)]
        if prune_norm:
            self.norm = nn.Identity()
        if prune_head:
            if hasattr(self, "fc_norm"):
                self.fc_norm = nn.Identity()
            self.reset_classifier(0)
        return take_indices
