"""What a piece of code asks torch to compute, op by op: ``OpRecorder``, a ``TorchDispatchMode`` that logs
every aten op with the dtypes and devices of its tensors. It sees below autograd and autocast, so it proves
properties of a training step on any machine: which dtype each matmul / convolution / attention kernel ran in
(no bf16 op in an fp32 run), and which ops force the host to wait for the device (``.item()``, ``float(t)``,
``bool(t)``, ``nonzero``: a sync on a GPU even where the CPU cannot show the wait)."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

# the ops that do a step's arithmetic (linear decomposes to addmm / mm, einsum and batched matmul to bmm)
COMPUTE_OPS = frozenset({
    "mm", "addmm", "bmm", "baddbmm", "addbmm", "matmul", "mv", "addmv", "dot", "linear", "_addmm_activation",
    "convolution", "convolution_backward", "_convolution", "mkldnn_convolution",
    "_scaled_dot_product_flash_attention_for_cpu", "_scaled_dot_product_flash_attention_for_cpu_backward",
    "_scaled_dot_product_flash_attention", "_scaled_dot_product_flash_attention_backward",
    "_scaled_dot_product_efficient_attention", "_scaled_dot_product_efficient_attention_backward",
    "_scaled_dot_product_cudnn_attention", "_scaled_dot_product_cudnn_attention_backward",
    "_flash_attention_forward", "_flash_attention_backward", "_efficient_attention_forward",
})
# ops whose result the host must read (a scalar's value, a data-dependent output size): each one waits for the
# device to finish everything queued before it
SYNC_OPS = frozenset({"_local_scalar_dense", "is_nonzero", "nonzero", "masked_select", "unique", "_unique",
                      "_unique2", "unique_consecutive", "unique_dim", "repeat_interleave", "item"})


@dataclass(frozen=True)
class OpCall:
    """One aten op: its name without namespace and overload (``addmm``), the dtypes and devices of its tensor
    arguments and results, in order."""

    name: str
    dtypes: tuple[torch.dtype, ...]
    devices: tuple[str, ...]

    @property
    def copies_to_host(self) -> bool:
        """A copy from an accelerator into host memory (``.cpu()``, ``.tolist()``, ``.to("cpu")``)."""
        return self.name in ("_to_copy", "copy_") and "cpu" in self.devices and any(
            d != "cpu" for d in self.devices)


class OpRecorder(TorchDispatchMode):
    """``with OpRecorder() as ops: step()`` logs every aten op ``step`` runs in this thread (autograd's backward
    included) as an ``OpCall`` in ``ops.calls``; ``compute`` and ``syncs`` are the subsets that do a step's
    arithmetic and that force a host sync (see ``SYNC_OPS``, plus device-to-host copies)."""

    def __init__(self):
        super().__init__()
        self.calls: list[OpCall] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        tensors = [t for t in tree_flatten((args, kwargs, out))[0] if isinstance(t, torch.Tensor)]
        name = func._schema.name.split("::")[-1]
        self.calls.append(OpCall(name, tuple(t.dtype for t in tensors), tuple(t.device.type for t in tensors)))
        return out

    @property
    def compute(self) -> list[OpCall]:
        """The matmul / convolution / attention calls."""
        return [c for c in self.calls if c.name in COMPUTE_OPS]

    @property
    def syncs(self) -> list[OpCall]:
        """The calls that make the host wait for the device."""
        return [c for c in self.calls if c.name in SYNC_OPS or c.copies_to_host]

    def compute_in(self, dtype: torch.dtype) -> list[OpCall]:
        """The compute calls with a floating tensor of ``dtype`` among their arguments or results."""
        return [c for c in self.compute if dtype in c.dtypes]
