"""Explaining compiled models: the explanation methods hook into modules (forward hooks, recorded attention
weights kept in the autograd graph), which a compiled graph does not honour — the tensors a hook sees inside it
are copies the outputs do not depend on, so gradients never reach them. ``eager`` runs a model compiled by
``torch.compile(model)`` or regionally (``Module.compile()``, ``zoo.models.regions``) eagerly for the duration
of a block. Parameters are shared, so the maps are those of the eager model."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

from torch import nn


@contextmanager
def eager(model: nn.Module) -> Iterator[nn.Module]:
    """Yield the eager form of ``model``: the module ``torch.compile`` wrapped (``_orig_mod``), with every
    ``Module.compile()``-d submodule switched back to its plain call until the block ends (also on error)."""
    model = getattr(model, "_orig_mod", model)
    # Module.compile() keeps the compiled call in _compiled_call_impl; None is the eager call
    compiled = [(m, m._compiled_call_impl) for m in model.modules() if getattr(m, "_compiled_call_impl", None)]
    try:
        for m, _ in compiled:
            m._compiled_call_impl = None
        yield model
    finally:
        for m, call in compiled:
            m._compiled_call_impl = call
