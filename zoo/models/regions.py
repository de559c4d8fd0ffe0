"""Regional compilation (torch's recipe "Reducing torch.compile cold start compilation time with regional
compilation"): ``torch.compile`` each repeated block of a model in place instead of the whole model. The blocks
of one class share their compiled code, so the compile costs seconds, and inductor fuses the element-wise chains
that dominate these blocks on a CPU (CBAM's pooling, gates and products; LayerNorm, GELU and the residual adds
of a transformer block) while the convolutions between them stay eager. BENCHMARKS.md's throughput tables
measure it ("regions").

The parameter names do not change (``Module.compile`` compiles the call, not a wrapper), so checkpoints and
state_dicts are those of the eager model; ``copy.deepcopy`` gives an eager copy."""

from __future__ import annotations

from torch import nn

from ..layers.cbam import CBAM
from .vit import Block

REGIONS = (CBAM, Block)  # the zoo's repeated blocks: CBAM after a conv stage, the transformer block


def compile_regions(model: nn.Module, regions: tuple[type[nn.Module], ...] = REGIONS) -> list[str]:
    """``Module.compile()`` every submodule of ``model`` that is an instance of ``regions`` (outermost ones only)
    and return their names in forward order; a model without any is left as it is (an empty list)."""
    if isinstance(model, regions):
        model.compile()
        return [""]
    compiled = []
    for name, module in model.named_modules():
        if isinstance(module, regions) and not any(name.startswith(done + ".") for done in compiled):
            module.compile()
            compiled.append(name)
    return compiled
