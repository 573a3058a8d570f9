"""What the training scripts need beyond torch's own optimizers, as nanochat keeps it beside its model: Muon, the GPT's
optimizer for the matrices of its blocks, and the optimizer step that unscales float16 gradients, clips them and steps
every optimizer of a run.
"""

import math

import torch
import torch.distributed as dist


def orthogonalize(G, steps=5, eps=1e-7, dtype=torch.float32):
    """Newton-Schulz iteration towards the nearest semi-orthogonal matrix U V^T of G = U S V^T, for each matrix of a
    stack G (..., rows, cols), with the quintic coefficients of Keller Jordan's Muon (also torch.optim.Muon's): fast,
    and the singular values end spread around 1, which does not hurt training. dtype: bfloat16 where the GPU has
    bfloat16 tensor cores, else float32 (float16's small range risks overflow in the iteration's products)."""
    a = 3.4445  # the quintic's coefficients, one polynomial
    b = -4.7750
    c = 2.0315
    X = G.to(dtype)
    if X.size(-2) > X.size(-1):
        X = X.mT
    X = X / X.norm(dim=(-2, -1), keepdim=True).clamp(min=eps)  # spectral norm <= Frobenius norm <= 1
    for _ in range(steps):
        A = X @ X.mT
        X = a * X + (b * A + c * A @ A) @ X
    return (X.mT if G.size(-2) > G.size(-1) else X).to(G.dtype)


class Muon(torch.optim.Optimizer):
    """MomentUm Orthogonalized by Newton-Schulz (Jordan et al. 2024), for 2-D weight matrices: SGD with Nesterov
    momentum whose update is orthogonalised, scaled by sqrt(max(1, rows / cols)). The same update as torch.optim.Muon,
    which however always orthogonalises in bfloat16. A group with blocks=n holds matrices of n stacked blocks of equal
    height, blocks=[rows, ...] of blocks of these heights (the fused qkv: q, k, v; k and v are shorter with grouped-query
    attention), each updated as a matrix of its own."""

    def __init__(self, params, lr=0.02, momentum=0.95, weight_decay=0.0, ns_steps=5, blocks=1, ns_dtype=torch.float32):
        super().__init__(params, dict(lr=lr, momentum=momentum, weight_decay=weight_decay, ns_steps=ns_steps, blocks=blocks))
        self.ns_dtype = ns_dtype  # the Newton-Schulz iteration's dtype (orthogonalize)

    @torch.no_grad()
    def step(self):
        """One step. In a process group the processes share the Newton-Schulz work, as nanochat's DistMuon does:
        every process updates every momentum buffer (cheap), process r orthogonalises and applies every world-th
        matrix's update and sends the new matrix to the others, so each holds the whole state and the numbers are
        those of one process."""
        world = dist.get_world_size() if dist.is_initialized() else 1
        rank = dist.get_rank() if world > 1 else 0
        params = [(group, p) for group in self.param_groups for p in group["params"] if p.grad is not None]
        for i, (group, p) in enumerate(params):
            buf = self.state[p].setdefault("momentum_buffer", torch.zeros_like(p))
            buf.lerp_(p.grad, 1 - group["momentum"])
            if i % world != rank:
                continue
            g = p.grad.lerp(buf, group["momentum"])  # Nesterov
            rows = group["blocks"] if isinstance(group["blocks"], list) else p.size(0) // group["blocks"]
            p.mul_(1 - group["lr"] * group["weight_decay"])
            for block, update in zip(p.split(rows), g.split(rows)):  # views of p: each block moves on its own
                scale = max(1.0, update.size(0) / update.size(1)) ** 0.5
                block.add_(orthogonalize(update, group["ns_steps"], dtype=self.ns_dtype), alpha=-group["lr"] * scale)
        if world > 1:
            handles = [dist.broadcast(p, src=i % world, async_op=True) for i, (_, p) in enumerate(params)]
            for handle in handles:
                handle.wait()


def optimizer_step(optimizers, scaler, params, grad_clip, step):
    """Clip the gradients of params and step every optimizer. With float16 the loss was scaled (a GradScaler): every
    optimizer's gradients are unscaled first (the clip needs their true norm), each optimizer then steps unless its
    gradients overflowed, and the scale is updated once. Without float16 the scaler does nothing, and a non-finite
    gradient norm (every process sees the same) stops the run before the step."""
    for optimizer in optimizers:
        scaler.unscale_(optimizer)
    grad_norm = float(torch.nn.utils.clip_grad_norm_(params, grad_clip or math.inf))
    if not math.isfinite(grad_norm) and not scaler.is_enabled():
        raise FloatingPointError(f"non-finite gradient norm at step {step}: stopped before the optimizer step. "
                                 f"Try a lower learning rate.")
    for optimizer in optimizers:
        scaler.step(optimizer)  # float16: skipped (and the scale lowered) when its gradients overflowed
    scaler.update()
