"""What the training scripts need beyond torch's own optimizers, as nanochat keeps it beside its model: Muon, the GPT's
optimizer for the matrices of its blocks, and the optimizer step of every script, which unscales float16 gradients,
clips them and steps every optimizer of a run.
"""

import math

import torch
import torch.distributed as dist


def orthogonalize(G, steps=5, eps=1e-7, dtype=torch.float32):
    """Newton-Schulz iteration towards the nearest semi-orthogonal matrix U V^T of G = U S V^T, for each matrix of a
    stack G (..., rows, cols), with the quintic coefficients of Keller Jordan's Muon (also torch.optim.Muon's): fast,
    and the singular values end spread around 1, which does not hurt training. dtype: the run's, float32 or the half
    precision of its autocast (bfloat16, or float16 on a GPU without bfloat16 tensor cores). float16's range is
    enough: the Frobenius normalisation leaves every singular value at most 1, the quintic keeps them below 1.21, and
    so every entry of every product stays far below float16's largest number, 65504. G is normalised in its own dtype
    before it is rounded, so that a small update does not lose its digits among float16's smallest numbers."""
    a = 3.4445  # the quintic's coefficients, one polynomial
    b = -4.7750
    c = 2.0315
    X = G.mT if G.size(-2) > G.size(-1) else G
    X = (X / X.norm(dim=(-2, -1), keepdim=True).clamp(min=eps)).to(dtype)  # spectral norm <= Frobenius norm <= 1
    for _ in range(steps):
        A = X @ X.mT
        X = a * X + (b * A + c * A @ A) @ X
    return (X.mT if G.size(-2) > G.size(-1) else X).to(G.dtype)


class Muon(torch.optim.Optimizer):
    """MomentUm Orthogonalized by Newton-Schulz (Jordan et al. 2024), for 2-D weight matrices: SGD with Nesterov
    momentum whose update is orthogonalised, scaled by sqrt(max(1, rows / cols)). The same update as torch.optim.Muon,
    which however always orthogonalises in bfloat16. A group with blocks=n holds matrices of n stacked blocks of equal
    height, blocks=[rows, ...] of blocks of these heights (the fused qkv: q, k, v; k and v are shorter with grouped-query
    attention), each updated as a matrix of its own. compile=True (the GPT's --compile_model on a GPU) compiles the
    Newton-Schulz iteration: one graph per stack shape."""

    def __init__(self, params, lr=0.02, momentum=0.95, weight_decay=0.0, ns_steps=5, blocks=1, ns_dtype=torch.float32,
                 compile=False):
        super().__init__(params, dict(lr=lr, momentum=momentum, weight_decay=weight_decay, ns_steps=ns_steps, blocks=blocks))
        self.ns_dtype = ns_dtype  # the Newton-Schulz iteration's dtype (orthogonalize)
        self.orthogonalize = torch.compile(orthogonalize, dynamic=False) if compile else orthogonalize
        for group in self.param_groups:
            for p in group["params"]:
                self.state[p]["momentum_buffer"] = torch.zeros_like(p)  # once, not at every step

    @torch.no_grad()
    def step(self):
        """One step. The matrices of a group that have one shape are orthogonalised as one stack, in one call, as
        nanochat stacks them: a d12 GPT makes 4 calls a step instead of 72. In a process group the processes share
        that work, as nanochat's DistMuon does: every process updates every momentum buffer (cheap), process r
        orthogonalises and applies every world-th parameter's update and sends the new parameter to the others, so
        each holds the whole state and the numbers are those of one process. Under float16, optimizer_step sets
        found_inf as GradScaler sets it for torch's fused optimizers: 1.0, on the device, where a gradient of the step
        overflowed; the step then leaves every weight and momentum buffer as it was, and the host reads nothing."""
        skip = getattr(self, "found_inf", None)
        keep = 1.0 if skip is None else 1 - skip  # 0.0 where the step is skipped
        world = dist.get_world_size() if dist.is_initialized() else 1
        rank = dist.get_rank() if world > 1 else 0
        params = [(group, p) for group in self.param_groups for p in group["params"] if p.grad is not None]
        for group in self.param_groups:
            ps = [p for p in group["params"] if p.grad is not None]
            bufs = [self.state[p]["momentum_buffer"] for p in ps]
            if skip is not None:  # a skipped step's gradient is its momentum buffer: the lerps below leave it as it is
                for p, buf in zip(ps, bufs):
                    p.grad = torch.where(skip.bool(), buf, p.grad)
            if ps:
                torch._foreach_lerp_(bufs, [p.grad for p in ps], 1 - group["momentum"])
        mine = {}  # group -> (group, the parameters this process updates)
        for i, (group, p) in enumerate(params):
            if i % world == rank:
                mine.setdefault(id(group), (group, []))[1].append(p)
        stacks = {}  # (group, block shape) -> (group, [(block of a parameter, its update)])
        for group, ps in mine.values():
            bufs = [self.state[p]["momentum_buffer"] for p in ps]
            updates = torch._foreach_lerp([p.grad for p in ps], bufs, group["momentum"])  # Nesterov
            if group["weight_decay"]:
                torch._foreach_mul_(ps, 1 - group["lr"] * group["weight_decay"] * keep)
            for p, g in zip(ps, updates):
                rows = group["blocks"] if isinstance(group["blocks"], list) else p.size(0) // group["blocks"]
                for block, update in zip(p.split(rows), g.split(rows)):  # views of p: each block moves on its own
                    stacks.setdefault((id(group), update.shape), (group, []))[1].append((block, update))
        for group, matrices in stacks.values():
            blocks, updates = zip(*matrices)
            rows, cols = updates[0].shape
            scale = max(1.0, rows / cols) ** 0.5
            orthogonal = self.orthogonalize(torch.stack(updates), group["ns_steps"], dtype=self.ns_dtype)
            if skip is not None:
                orthogonal = orthogonal * keep
            torch._foreach_add_(list(blocks), list(orthogonal.unbind(0)), alpha=-group["lr"] * scale)
        if world > 1:
            handles = [dist.broadcast(p, src=i % world, async_op=True) for i, (_, p) in enumerate(params)]
            for handle in handles:
                handle.wait()


def optimizer_step(optimizers, scaler, params, grad_clip=0.0, clip_grad=0.0):
    """The one optimizer step of every script: clip the gradients of params (those of every optimizer), step every
    optimizer and return the global gradient norm, unread: reading a number waits for the GPU, so the scripts add it up
    on the device and check it at their progress lines and before each checkpoint (common.check_finite). Two clipping
    rules, each under its anchor's name: grad_clip, the global norm (nanoGPT, nanochat); clip_grad, each parameter's
    own norm (DINO); 0 = off. With float16 the loss was scaled (a GradScaler): every optimizer's gradients are unscaled
    first (the clip needs their true norm), and an overflow in any of them skips every optimizer, decided on the
    device; the scale is then updated once. Such an overflow is the scaler's to handle, and the norm returned is 0.
    The scripts zero the gradients right after it."""
    for optimizer in optimizers:
        scaler.unscale_(optimizer)
    params = [p for p in params if p.grad is not None]
    grad_norm = torch.nn.utils.clip_grad_norm_(params, grad_clip or math.inf)
    if clip_grad:
        clip_each_gradient(params, clip_grad)
    if not scaler.is_enabled():
        for optimizer in optimizers:
            optimizer.step()
        return grad_norm
    # one decision for all: GradScaler.step decides per optimizer, so where only one overflowed the other would step
    # on gradients the clip's inf norm had zeroed (momentum alone), or made NaN with grad_clip=0. Fused AdamW and Muon
    # read found_inf on the device, as GradScaler.step hands it to fused AdamW, so no step waits for the GPU
    found_inf = (~grad_norm.isfinite()).float()
    for optimizer in optimizers:
        optimizer.found_inf = found_inf
        optimizer.step()
        del optimizer.found_inf
    scaler.update()  # a lower scale after an overflow
    return torch.zeros_like(grad_norm)


def clip_each_gradient(params, clip):
    """DINO's clip_grad: every parameter's gradient to norm `clip` separately (not one global norm),
    g *= min(1, clip / (|g| + 1e-6)). All norms and factors at once (foreach ops), never read on the host."""
    grads = [p.grad for p in params if p.grad is not None]
    if grads:  # the model lives on one device in one dtype, so one stack holds every norm
        factors = torch.clamp(clip / (torch.stack(torch._foreach_norm(grads)) + 1e-6), max=1.0)
        torch._foreach_mul_(grads, list(factors.unbind()))


def load_optimizer_states(optimizers, states):
    """A checkpoint's optimizer states, one per optimizer in order: the moments and step counts from the checkpoint,
    the hyperparameters (betas, weight decay, peak rates) from this run's options, identical unless changed on --resume."""
    for optimizer, state in zip(optimizers, states, strict=True):
        hyper = [{k: v for k, v in group.items() if k != "params"} for group in optimizer.param_groups]
        optimizer.load_state_dict(state)
        for group, h in zip(optimizer.param_groups, hyper):
            group.update(h)
