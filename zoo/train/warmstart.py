"""Starting a new run from other weights (``--init-from``): which tensors were loaded, which were skipped because
their shape differs, which the model has and the file lacks, and what fraction of the model's parameter elements
that covers. A load that finds under ``MIN_FRACTION`` of them is refused unless asked for (``--init-partial``):
a model that silently starts mostly from scratch is a wrong result nobody sees."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from torch import nn

from ..models.checkpoints import checkpoint_weights, matching_weights

MIN_FRACTION = 0.5  # of the model's parameter elements an --init-from must find, unless --init-partial


@dataclass(frozen=True)
class InitReport:
    """What ``init_from`` found: tensor names loaded, skipped (same name, other shape), missing from the file;
    ``fraction``: the model's parameter elements loaded over all its parameter elements."""

    path: str
    loaded: list[str]
    skipped_for_shape: list[str]
    missing: list[str]
    fraction: float

    def summary(self) -> str:
        def names(keys: list[str]) -> str:
            return f" ({', '.join(keys[:4])}{', ...' if len(keys) > 4 else ''})" if keys else ""

        return (f"--init-from {self.path}: loaded {len(self.loaded)} tensors ({self.fraction:.1%} of the model's "
                f"parameter elements), skipped {len(self.skipped_for_shape)} for shape"
                f"{names(self.skipped_for_shape)}, {len(self.missing)} missing{names(self.missing)}")


def match_init(model: nn.Module, path: str | Path, *, allow_partial: bool = False) -> tuple[InitReport, dict]:
    """What ``init_from`` would load into ``model`` from ``path``, and its report, loading nothing: under
    ``MIN_FRACTION`` of the parameter elements found -> ValueError unless ``allow_partial``; nothing at all found
    -> ValueError always."""
    source = checkpoint_weights(path)
    target = model.state_dict()
    loaded = matching_weights(model, source)
    params = dict(model.named_parameters())
    total = sum(p.numel() for p in params.values())
    found = sum(params[k].numel() for k in loaded if k in params)
    report = InitReport(str(path), sorted(loaded), sorted(k for k in source if k in target and k not in loaded),
                        sorted(k for k in target if k not in source), found / max(total, 1))
    if not loaded:
        raise ValueError(f"{report.summary()}: no weight matches the model by name and shape")
    if report.fraction < MIN_FRACTION and not allow_partial:
        raise ValueError(f"{report.summary()}: under {MIN_FRACTION:.0%} of the model was found (another model's "
                         "weights?); pass --init-partial (recipe key init_partial) to load them anyway")
    return report, loaded


def init_from(model: nn.Module, path: str | Path, *, allow_partial: bool = False) -> InitReport:
    """Copy the matching weights of a zoo checkpoint or a timm / plain state_dict file into ``model`` and say
    what was loaded; refused as ``match_init`` refuses (nothing is loaded then)."""
    report, loaded = match_init(model, path, allow_partial=allow_partial)
    model.load_state_dict(loaded, strict=False)
    return report
