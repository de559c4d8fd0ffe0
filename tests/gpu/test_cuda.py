"""What only a CUDA GPU can show (``pytest -m cuda``; skipped without one; ``python -m benchmarks.gpu_check`` runs
them): every attention backend forward and backward in bf16 / fp16 autocast against fp32 on the GPU, flex's compiled
backward among them, CBAM and the hybrid under autocast against fp32, and training steps that never make the host
wait (``torch.cuda.set_sync_debug_mode("error")`` turns every synchronising call into an error)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import zoo
from zoo.train.optim import build_optimizer, param_groups

pytestmark = [pytest.mark.cuda, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]
CUDA = torch.device("cuda")


def _relative(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.float() - b.float()).norm() / b.float().norm().clamp(min=1e-12))


@pytest.mark.parametrize("backend", ["sdpa", "math", "chunked", "linear", "flex"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("causal", [False, True])
def test_backend_under_autocast_matches_fp32(backend, dtype, causal):
    if backend == "linear" and causal:
        pytest.skip("linear attention takes no mask")
    torch.manual_seed(0)
    attn = zoo.MultiHeadAttention(64, num_heads=4, backend=backend).to(CUDA)
    x = torch.randn(2, 1024, 64, device=CUDA, requires_grad=True)
    mask = zoo.masks.spec(causal=True) if causal else None
    reference = attn(x, mask=mask)
    reference.square().mean().backward()
    grads = [x.grad.clone(), *(p.grad.clone() for p in attn.parameters())]
    x.grad = None
    attn.zero_grad()
    with torch.autocast("cuda", dtype):
        out = attn(x, mask=mask)
    assert torch.isfinite(out).all()
    # fp16 gradients need the loss scaled, as 16-mixed training's GradScaler does (its initial scale): this
    # loss's gradients (~1e-7) lie below fp16's normal range and would lose their digits
    scale = 2.0**16 if dtype == torch.float16 else 1.0
    (out.float().square().mean() * scale).backward()
    assert _relative(out, reference) < 2e-2
    for got, want in zip([x.grad, *(p.grad for p in attn.parameters())], grads, strict=True):
        assert torch.isfinite(got).all() and _relative(got / scale, want) < 5e-2


@pytest.mark.parametrize("name", ["hybrid_tiny", "resnet18_cbam", "vit_tiny"])
def test_models_under_bf16_autocast_match_fp32(name):
    torch.manual_seed(0)
    model = zoo.create_model(name).to(CUDA).eval()
    x = torch.randn(16, 3, 32, 32, device=CUDA)
    with torch.no_grad():
        reference = model(x)
        with torch.autocast("cuda", torch.bfloat16):
            out = model(x)
    assert _relative(out, reference) < 5e-2


@pytest.mark.parametrize("optimizer", ["adamw", "muon_conv"])
def test_training_steps_never_wait_for_the_gpu(optimizer):
    torch.manual_seed(0)
    model = zoo.create_model("hybrid_tiny").to(CUDA, memory_format=torch.channels_last)
    head = {id(p) for p in model.get_classifier().parameters()}
    opt = build_optimizer(optimizer, param_groups(model, 2e-3, 0.05), 2e-3, momentum=0.95, fused=True,
                          muon_exclude=head, muon_dtype="bfloat16")
    x = torch.randn(64, 3, 32, 32, device=CUDA).contiguous(memory_format=torch.channels_last)
    y = torch.randint(0, 10, (64,), device=CUDA)

    def step():
        opt.zero_grad(set_to_none=True)
        with torch.autocast("cuda", torch.bfloat16):
            loss = F.cross_entropy(model(x).float(), y, label_smoothing=0.2)
        loss.backward()
        opt.step()

    step()  # warm-up: lazy state, cuBLAS handles
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        for _ in range(3):
            step()
    finally:
        torch.cuda.set_sync_debug_mode("default")
    bad = [name for name, p in model.named_parameters() if not torch.isfinite(p).all()]
    assert not bad, f"non-finite weights after 4 steps: {bad[:5]}"


def test_a_cuda_graphed_training_step_trains_as_the_eager_one():
    """``compile: step`` on CUDA replays the forward and backward as CUDA graphs. Four steps in the loop's order
    (forward, gradients set to None, backward, a fused SGD step; warm-up, recording, then replays into the same
    memory, the last step's gradients still held during the next forward): each step's loss and gradients match
    the eager model's in fp32 at the same weights, and a step's loss is not overwritten by later replays."""
    from zoo.train.step import compiled_train_loss, train_loss

    models = []
    for _ in range(2):
        torch.manual_seed(0)
        models.append(zoo.create_model("hybrid_tiny", num_classes=10).to(CUDA, memory_format=torch.channels_last))
    steps = (train_loss, compiled_train_loss("cuda"))
    optimizers = [torch.optim.SGD(m.parameters(), lr=0.05, momentum=0.9, fused=True) for m in models]
    g = torch.Generator(device=CUDA).manual_seed(0)
    batches = [(torch.randn(32, 3, 32, 32, device=CUDA, generator=g), torch.randint(0, 10, (32,), device=CUDA,
                                                                                      generator=g)) for _ in range(4)]
    kept = []
    for batch in batches:
        losses = []
        for model, step, optimizer in zip(models, steps, optimizers, strict=True):
            losses.append(step(model, *batch, 0.0, torch.channels_last)[0])
            optimizer.zero_grad(set_to_none=True)
            losses[-1].backward()
        eager, graphed = ([p.grad for p in m.parameters()] for m in models)
        assert all(_relative(b, a) < 1e-2 for a, b in zip(eager, graphed, strict=True))  # fp32 (TF32 may be on)
        assert _relative(losses[1], losses[0]) < 1e-3
        for optimizer in optimizers:
            optimizer.step()
        # the graphed weights set to the eager ones in place (its graphs read them there): float differences in
        # the two gradients would otherwise grow step by step
        with torch.no_grad():
            torch._foreach_copy_(list(models[1].parameters()), list(models[0].parameters()))
        kept.append(losses[1])
    assert all(torch.isfinite(k) for k in kept) and len({float(k) for k in kept}) == len(kept)
