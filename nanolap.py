"""nanolap: transformers whose layers mix attention heads and Laplacian heads.

Zhang & Papyan, "Laplacian Heads Improve Transformers by Smoothing Token Representations", arXiv 2602.09297. A layer
with attention heads A and Laplacian heads L updates tokens X (T x d) as

    X <- X + sum_{i in A} P_i V_i Wo_i  +  sum_{i in L} (I - P_i) V_i Wo_i
    P_i = softmax(Q_i K_i^T / sqrt(d_h))  (row-stochastic),   V_i = X Wv_i

I - P is the random-walk graph Laplacian of the attention graph. Because rows of P sum to 1, (I - P) 1 = 0:
a Laplacian head ignores what all tokens share; row t of its output is sum_j P_tj (v_t - v_j): token differences only.

Why it is (almost) free: (I - P) V = V - P V. One fused scaled_dot_product_attention call computes P V for every head
(FlashAttention on GPU, no T x T matrix ever exists), and the Laplacian heads subtract it from their own values.
No extra parameters, one subtraction of extra FLOPs.

Convention (the first author's code): the trailing `n_lap` heads of a layer, an int or one per layer, are Laplacian.
"""

import math
# the run plumbing (the second half of this file) uses these
import ast
import atexit
import difflib
import json
import os
import platform
import random
import re
import shlex
import socket
import subprocess
import sys
import tempfile
import threading
import time
from contextlib import contextmanager, nullcontext, suppress
from dataclasses import asdict, dataclass, fields

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

# ---- mixed-head attention: the idea -----------------------------------------
class RMSNorm(nn.Module):  # parameter-free (nanochat)
    def forward(self, x):
        return F.rms_norm(x, (x.size(-1),))

def make_norm(config, dim):
    return nn.LayerNorm(dim, eps=1e-6, bias=config.bias) if config.norm == "layernorm" else RMSNorm()  # eps: timm, DINO

def apply_rope(x, cos, sin):  # x: (B, T, H, D), cos/sin: (1, T, 1, D/2)
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat([x1 * cos + x2 * sin, x2 * cos - x1 * sin], dim=-1)

class MixedHeadAttention(nn.Module):
    """n_head heads; the trailing n_lap of them output (I - P) V instead of P V.
    graph='uniform' replaces every head's P by the plain average over the sequence (causal: over positions <= t),
    the mean-mixing baseline: no queries or keys, and (I - P) V is each value minus the sequence's (running) mean."""
    def __init__(self, config, n_lap):
        super().__init__()
        self.n_head = config.n_head
        self.n_lap = n_lap
        self.causal = config.causal
        self.dropout = config.dropout
        self.uniform = config.graph == "uniform"
        self.head_dim = config.n_embd // config.n_head
        n_qkv = 1 if self.uniform else 3  # the uniform graph needs values only
        self.qkv = nn.Linear(config.n_embd, n_qkv * config.n_embd, bias=config.bias)
        self.proj = nn.Linear(config.n_embd, config.n_embd, bias=config.bias)
        use_qk_norm = config.qk_norm and not self.uniform
        self.q_norm = make_norm(config, self.head_dim) if use_qk_norm else nn.Identity()
        self.k_norm = make_norm(config, self.head_dim) if use_qk_norm else nn.Identity()
        self.resid_drop = nn.Dropout(config.dropout)

    def forward(self, x, rope=None, explicit=False, return_attn=False):
        """(B, T, C) -> (B, T, C); return_attn: also P (B, H, T, T), through the explicit path."""
        B, T, C = x.shape
        y, P = self.heads(x, rope, explicit or return_attn)  # (B, T, H, D)
        y = self.resid_drop(self.proj(y.reshape(B, T, C)))
        return (y, P) if return_attn else y

    def heads(self, x, rope=None, explicit=False):
        """Every head's output before the output projection, (B, T, H, D), and P (B, H, T, T) (explicit path; else None)."""
        B, T, C = x.shape
        H, D = self.n_head, self.head_dim
        A = H - self.n_lap  # A attention heads, then the Laplacian ones
        if self.uniform:
            v = self.qkv(x).view(B, T, H, D)
        else:
            q, k, v = self.qkv(x).view(B, T, 3, H, D).unbind(2)  # each (B, T, H, D)
            q, k = self.q_norm(q), self.k_norm(k)
            if rope is not None:
                q, k = apply_rope(q, *rope), apply_rope(k, *rope)
            q, k = q.transpose(1, 2), k.transpose(1, 2)  # (B, H, T, D)
        vh = v.transpose(1, 2)  # (B, H, T, D)
        drop = self.dropout if self.training else 0.0
        if not explicit:  # fast path: P V for every head in one fused call, then V - P V for the Laplacian heads
            if self.uniform:  # P V is the (running) mean of the values
                y = uniform_mean(v, self.causal)  # (B, T, H, D)
            else:
                y = F.scaled_dot_product_attention(q, k, vh, dropout_p=drop, is_causal=self.causal)  # (B, H, T, D)
                y = y.transpose(1, 2)  # (B, T, H, D)
            if self.n_lap:
                y = torch.cat([y[:, :, :A], v[:, :, A:] - y[:, :, A:]], dim=2)  # (B, T, H, D): P V, then V - P V
            return y, None
        # explicit path: materialise P, build P or I - P per head, multiply
        if self.uniform:
            P = uniform_graph(T, self.causal, x.device, x.dtype).expand(B, H, T, T)  # (B, H, T, T)
        else:
            att = (q @ k.transpose(-2, -1)) * D ** -0.5  # (B, H, T, T)
            if self.causal:  # no token sees the future
                att = att.masked_fill(torch.ones(T, T, dtype=torch.bool, device=x.device).triu(1), float("-inf"))
            P = F.dropout(att.softmax(dim=-1), drop, self.training)
        is_lap = (torch.arange(H, device=x.device) >= A).view(1, H, 1, 1)
        eye = torch.eye(T, device=x.device, dtype=P.dtype)
        y = (torch.where(is_lap, eye - P, P) @ vh).transpose(1, 2)  # (B, T, H, D)
        return y, P

def uniform_mean(v, causal):
    """P V for the uniform graph, v (B, T, H, D): the mean over the sequence, or causally the mean of positions <= t."""
    if not causal:
        return v.mean(dim=1, keepdim=True).expand_as(v)
    count = torch.arange(1, v.shape[1] + 1, device=v.device, dtype=v.dtype).view(1, -1, 1, 1)
    return v.cumsum(dim=1) / count

def uniform_graph(T, causal, device, dtype):
    """The uniform graph's P (T, T): 1/T everywhere, or causally 1/t on and below the diagonal of row t."""
    P = torch.ones(T, T, device=device, dtype=dtype)
    if causal:
        P = P.tril()
    return P / P.sum(dim=-1, keepdim=True)

# ---- blocks -----------------------------------------------------------------
class MLP(nn.Module):
    def __init__(self, config):
        super().__init__()
        hidden = int(config.mlp_ratio * config.n_embd)
        self.fc = nn.Linear(config.n_embd, hidden, bias=config.bias)
        self.proj = nn.Linear(hidden, config.n_embd, bias=config.bias)
        self.relu2 = config.mlp == "relu2"
        self.drop = nn.Dropout(config.dropout)

    def forward(self, x):
        x = self.fc(x)
        return self.drop(self.proj(F.relu(x).square() if self.relu2 else F.gelu(x)))

class LayerScale(nn.Module):
    def __init__(self, dim, init):
        super().__init__()
        self.gamma = nn.Parameter(torch.full((dim,), float(init)))

    def forward(self, x):
        return x * self.gamma

def drop_path(x, p, training):
    """Stochastic depth: drop a whole residual branch per sample, rescale the kept ones."""
    if p == 0.0 or not training:
        return x
    return x * x.new_empty((x.shape[0],) + (1,) * (x.ndim - 1)).bernoulli_(1 - p) / (1 - p)  # a (B, 1, ..) keep mask

class Block(nn.Module):
    def __init__(self, config, n_lap, drop_path_rate):
        super().__init__()
        self.norm1 = make_norm(config, config.n_embd)
        self.attn = MixedHeadAttention(config, n_lap)
        self.ls1 = LayerScale(config.n_embd, config.layerscale) if config.layerscale else nn.Identity()
        self.norm2 = make_norm(config, config.n_embd)
        self.mlp = MLP(config)
        self.ls2 = LayerScale(config.n_embd, config.layerscale) if config.layerscale else nn.Identity()
        self.drop_path = drop_path_rate

    def forward(self, x, rope=None, explicit=False):
        x = x + drop_path(self.ls1(self.attn(self.norm1(x), rope, explicit)), self.drop_path, self.training)
        return x + drop_path(self.ls2(self.mlp(self.norm2(x))), self.drop_path, self.training)

# ---- config and presets -----------------------------------------------------
class UsageError(ValueError):
    """A mistake in the user's input: scripts print it as one line, without a traceback."""

@dataclass
class Config:
    model: str = "vit"  # 'vit' (image classifier / DINO backbone) or 'gpt' (causal LM)
    n_layer: int = 6
    n_head: int = 4
    n_embd: int = 128
    n_lap: int | list = 0  # Laplacian heads per layer (the trailing ones): int or per-layer list
    causal: bool = False  # GPT: True
    qk_norm: bool = True  # normalise queries and keys per head (ViT: LayerNorm, GPT: RMSNorm)
    norm: str = "layernorm"  # 'layernorm' (ViT) or 'rmsnorm' (parameter-free, GPT)
    mlp: str = "gelu"  # 'gelu' (ViT) or 'relu2' (GPT)
    mlp_ratio: float = 4.0
    bias: bool = True  # biases in Linear layers and LayerNorms
    layerscale: float = 0.0  # LayerScale init value (DeiT-III: 1e-6); 0 = off
    drop_path: float = 0.0  # stochastic depth rate, rising linearly to this value in the last block
    dropout: float = 0.0  # attention-probability and residual dropout
    softcap: float = 0.0  # GPT logits: softcap * tanh(logits / softcap); 0 = off (nanochat: 15)
    pos: str = "learned"  # 'learned' position embedding (ViT) or 'rope' (GPT)
    rope_base: float = 10000.0
    vocab_size: int = 0  # GPT
    block_size: int = 256  # GPT: the longest sequence
    img_size: int = 28  # ViT
    patch_size: int = 4
    in_chans: int = 1
    num_classes: int = 10  # 0 = features only (DINO backbone)
    pooling: str = "cls"  # 'cls' token or 'mean' of patch tokens
    graph: str = "attention"  # every head's P: 'attention' (softmax) or 'uniform' (the sequence mean; the baseline)

    def __post_init__(self):
        self.n_lap = list(self.n_lap) if isinstance(self.n_lap, tuple) else self.n_lap
        choices = dict(model=("vit", "gpt"), norm=("layernorm", "rmsnorm"), mlp=("gelu", "relu2"),
                       pos=("learned", "rope"), pooling=("cls", "mean"), graph=("attention", "uniform"))
        for f in fields(self):  # the types first: the checks below rely on them
            v, default = getattr(self, f.name), f.default
            self._check(f.name, f.name not in choices or v in choices[f.name], f"allowed values are {choices.get(f.name)}")
            laps = v if isinstance(v, list) else [v]
            self._check(f.name, f.name != "n_lap" or all(self._is_int(k) and k >= 0 for k in laps),
                        "must be a non-negative int or a list of them, one per layer")
            self._check(f.name, f.name == "n_lap" or not isinstance(default, bool) or isinstance(v, bool), "must be True or False")
            self._check(f.name, f.name == "n_lap" or not self._is_int(default) or (self._is_int(v) and v >= 0), "must be a non-negative int")
            self._check(f.name, not isinstance(default, float) or ((self._is_int(v) or isinstance(v, float)) and v >= 0),
                        "must be a non-negative number")
        for field in ("n_layer", "n_head", "n_embd", "patch_size", "in_chans", "block_size"):
            self._check(field, getattr(self, field) >= 1, "must be at least 1")
        self._check("n_embd", self.n_embd % self.n_head == 0, f"not divisible by n_head={self.n_head}; choose a multiple of n_head")
        self._check("n_lap", len(self.lap_schedule()) == self.n_layer,
                    f"the per-layer list has {len(self.lap_schedule())} entries but n_layer={self.n_layer}")
        self._check("n_lap", max(self.lap_schedule()) <= self.n_head, f"at most n_head={self.n_head} Laplacian heads per layer")
        self._check("n_embd", self.pos != "rope" or (self.n_embd // self.n_head) % 2 == 0, "RoPE needs an even head size")
        self._check("drop_path", self.drop_path < 1, "must lie in [0, 1)")
        self._check("dropout", self.dropout < 1, "must lie in [0, 1)")
        self._check("vocab_size", self.model != "gpt" or self.vocab_size >= 1, "a GPT needs vocab_size >= 1")
        self._check("causal", self.model != "gpt" or self.causal, "a GPT must be causal (causal=True)")
        self._check("img_size", self.model != "vit" or self.img_size % self.patch_size == 0,
                    f"not divisible by patch_size={self.patch_size}")
        self._check("pos", self.model != "vit" or self.pos == "learned", "the ViT uses a learned position embedding")
        self._check("graph", self.graph == "attention" or self.dropout == 0,
                    "the uniform graph has no attention probabilities to drop; set dropout=0")

    @staticmethod
    def _is_int(v):
        return isinstance(v, int) and not isinstance(v, bool)

    def _check(self, field, ok, why):
        if not ok:
            raise ValueError(f"Config.{field}={getattr(self, field)!r}: {why}")

    def lap_schedule(self):
        """Number of Laplacian heads in each layer."""
        return list(self.n_lap) if isinstance(self.n_lap, list) else [self.n_lap] * self.n_layer

_VIT = dict(model="vit", qk_norm=True, norm="layernorm", mlp="gelu", bias=True, pos="learned")
_GPT = dict(model="gpt", causal=True, qk_norm=True, norm="rmsnorm", mlp="relu2", bias=False, pos="rope", softcap=15.0)
_IMAGENET = dict(_VIT, n_layer=12, img_size=224, patch_size=16, in_chans=3)  # ViT-*/16
PRESETS = {  # the paper's models and small sizes that train on a laptop CPU; any field can be overridden
    "vit-b": dict(_IMAGENET, n_embd=768, n_head=12, num_classes=1000, layerscale=1e-6),  # DeiT-III ViT-B/16
    "vit-s": dict(_IMAGENET, n_embd=384, n_head=6, num_classes=0, layerscale=1e-6),  # the author fork's DeiT-III small (DINO runs)
    "vit-small": dict(_VIT, n_layer=6, n_embd=192, n_head=6, img_size=32, patch_size=4, in_chans=3),
    "vit-tiny": dict(_VIT, n_layer=4, n_embd=96, n_head=4, img_size=28, patch_size=4, in_chans=1),
    # the CPU model: 7x7 patches give 17 tokens instead of 50, and d 64 trains 1.8x faster than 96
    "vit-cpu": dict(_VIT, n_layer=4, n_embd=64, n_head=4, img_size=28, patch_size=7, in_chans=1),
    "gpt-d20": dict(_GPT, n_layer=20, n_embd=1280, n_head=10, vocab_size=65536, block_size=2048),  # nanochat d20
    "gpt-small": dict(_GPT, n_layer=6, n_embd=384, n_head=6, vocab_size=50304, block_size=256),
    "gpt-tiny": dict(_GPT, n_layer=4, n_embd=128, n_head=4, vocab_size=65, block_size=128),
}

def make_config(preset, **overrides):
    """Config from a named preset plus field overrides (None values are ignored). Raises UsageError."""
    if preset not in PRESETS:
        raise UsageError(f"unknown model preset {preset!r}; choose one of {sorted(PRESETS)}")
    try:
        return Config(**{**PRESETS[preset], **{k: v for k, v in overrides.items() if v is not None}})
    except ValueError as e:
        raise UsageError(str(e)) from None

def config_from_options(options, kind, **fixed):
    """Model Config of a script's options: preset, then options named like Config fields (None = keep), then `fixed`."""
    names = [name for name, p in PRESETS.items() if p["model"] == kind]
    if options["preset"] not in names:
        raise UsageError(f"--preset={options['preset']!r}: choose one of {names}")
    overrides = {f.name: options[f.name] for f in fields(Config) if f.name in options}
    return make_config(options["preset"], **{**overrides, **fixed})

# ---- trunk shared by the ViT and the GPT ------------------------------------
class Trunk(nn.Module):
    """Blocks + final norm and analysis access; each model initialises its own weights (init_weights)."""
    def __init__(self, config):
        super().__init__()
        self.config = config
        dpr = [config.drop_path * i / max(config.n_layer - 1, 1) for i in range(config.n_layer)]
        self.blocks = nn.ModuleList(Block(config, k, p) for k, p in zip(config.lap_schedule(), dpr))
        self.norm = make_norm(config, config.n_embd)

    def run_blocks(self, x, rope=None, explicit=False, all_layers=False):
        """Final-normed tokens, or with all_layers the list [after block 1, ..., after block L, final norm]."""
        hidden = []
        for block in self.blocks:
            x = block(x, rope, explicit)
            if all_layers:
                hidden.append(x)
        return hidden + [self.norm(x)] if all_layers else self.norm(x)

    @torch.no_grad()
    def attention_maps(self, x, rope, layer):
        """P (B, H, T, T) of block `layer` through the explicit path; x are the embedded tokens."""
        for block in self.blocks[:layer]:
            x = block(x, rope)
        block = self.blocks[layer]
        return block.attn(block.norm1(x), rope, explicit=True, return_attn=True)[1]

    def num_params(self, exclude_embedding=False):
        """Parameter count (the GPT can leave out its token table; the ViT has none to leave out)."""
        return sum(p.numel() for p in self.parameters())

    def flops_per_token(self, T):
        """Training FLOPs per token (nanochat): 6N (matmuls) + 12*L*H*Q*T (attention, H*Q = d); V - P V counts as 0,
        and so does the uniform graph's mean."""
        attention = 0 if self.config.graph == "uniform" else 12 * self.config.n_layer * self.config.n_embd * T
        return 6 * self.num_params(exclude_embedding=True) + attention

# ---- ViT --------------------------------------------------------------------
class ViT(Trunk):
    """DeiT-III: patch embedding, CLS token, learned positions, head; crops of other sizes (DINO) interpolate them."""
    def __init__(self, config):
        super().__init__(config)
        assert config.model == "vit"
        c, self.grid = config, config.img_size // config.patch_size
        self.patch_embed = nn.Conv2d(c.in_chans, c.n_embd, c.patch_size, c.patch_size)
        self.cls_token = nn.Parameter(torch.zeros(1, 1, c.n_embd))
        self.pos_embed = nn.Parameter(torch.zeros(1, self.grid * self.grid, c.n_embd))
        self.head = nn.Linear(c.n_embd, c.num_classes) if c.num_classes else nn.Identity()
        self.init_weights()

    @torch.no_grad()
    def init_weights(self):
        """timm's ViT init; the random draws follow the modules' order, then pos_embed, then cls_token (a seed gives
        one model):
        attn.qkv, attn.proj, mlp.fc, mlp.proj, head (every nn.Linear): weight ~ trunc normal(std 0.02), bias 0
        pos_embed ~ trunc normal(std 0.02); cls_token ~ N(0, 1e-6)
        patch_embed (a Conv2d): PyTorch's default, uniform with a fan-in bound, as timm leaves it
        norm1, norm2, attn.q_norm, attn.k_norm, norm (LayerNorms): weight 1, bias 0 (PyTorch's)
        ls1, ls2 (LayerScale, when config.layerscale > 0): gamma = config.layerscale"""
        for m in self.modules():
            if isinstance(m, nn.Linear):
                nn.init.trunc_normal_(m.weight, std=0.02)
                if m.bias is not None:
                    nn.init.zeros_(m.bias)
        nn.init.trunc_normal_(self.pos_embed, std=0.02)
        nn.init.normal_(self.cls_token, std=1e-6)

    def embed(self, img):  # img (B, C, H, W) -> tokens (B, 1 + N, d), the CLS token first
        x = self.patch_embed(img)  # (B, d, h, w)
        pos, (h, w) = self.pos_embed, x.shape[-2:]
        if (h, w) != (self.grid, self.grid):
            pos = pos.reshape(1, self.grid, self.grid, -1).permute(0, 3, 1, 2)
            pos = F.interpolate(pos, size=(h, w), mode="bicubic").permute(0, 2, 3, 1).reshape(1, h * w, -1)
        x = x.flatten(2).transpose(1, 2) + pos  # (B, N, d)
        return torch.cat([self.cls_token.expand(x.shape[0], -1, -1), x], dim=1)

    def forward_features(self, img, explicit=False, all_layers=False):
        return self.run_blocks(self.embed(img), explicit=explicit, all_layers=all_layers)

    def pool(self, tokens):  # (B, 1 + N, d) -> (B, d)
        return tokens[:, 0] if self.config.pooling == "cls" else tokens[:, 1:].mean(dim=1)

    def forward(self, img, explicit=False):
        return self.head(self.pool(self.forward_features(img, explicit)))

    def get_attention(self, img, layer):
        return self.attention_maps(self.embed(img), None, layer)

# ---- GPT --------------------------------------------------------------------
class GPT(Trunk):
    """nanochat's GPT: token embedding then RMSNorm, RoPE, QK-norm, ReLU^2 MLP, no biases, untied lm_head, softcap."""
    def __init__(self, config):
        super().__init__(config)
        assert config.model == "gpt"
        self.wte = nn.Embedding(config.vocab_size, config.n_embd)
        self.lm_head = nn.Linear(config.n_embd, config.vocab_size, bias=False)
        D = config.n_embd // config.n_head
        inv_freq = config.rope_base ** (-torch.arange(0, D, 2, dtype=torch.float32) / D)
        angles = torch.outer(torch.arange(config.block_size, dtype=torch.float32), inv_freq)
        self.register_buffer("cos", angles.cos()[None, :, None, :], persistent=False)  # (1, T, 1, D/2)
        self.register_buffer("sin", angles.sin()[None, :, None, :], persistent=False)
        self.init_weights()

    @torch.no_grad()
    def init_weights(self):
        """nanochat's GPT init; the random draws follow the modules' order, so that a seed gives one model:
        attn.qkv, mlp.fc: weight ~ N(0, std 1/sqrt(fan_in) * min(1, sqrt(fan_out / fan_in))), bias (bias=True) 0
        wte ~ N(0, 1)
        attn.proj, mlp.proj, lm_head: weight 0 (after a draw like attn.qkv's), so that every block, Laplacian or not,
            is an exact no-op at step 0
        (the norms, RMSNorm or with norm='layernorm' LayerNorms, keep PyTorch's init: weight 1, bias 0)"""
        for m in self.modules():
            if isinstance(m, nn.Linear):
                fan_out, fan_in = m.weight.shape
                nn.init.normal_(m.weight, std=fan_in ** -0.5 * min(1.0, math.sqrt(fan_out / fan_in)))
                if m.bias is not None:
                    nn.init.zeros_(m.bias)
            elif isinstance(m, nn.Embedding):
                nn.init.normal_(m.weight, std=1.0)
        for block in self.blocks:
            nn.init.zeros_(block.attn.proj.weight)
            nn.init.zeros_(block.mlp.proj.weight)
        nn.init.zeros_(self.lm_head.weight)

    def num_params(self, exclude_embedding=False):
        """Parameter count; exclude_embedding leaves out the token table (a lookup, not a matmul)."""
        n = super().num_params()
        return n - self.wte.weight.numel() if exclude_embedding else n

    def embed(self, idx):  # idx (B, T) -> tokens (B, T, d) and the rotary (cos, sin) of T positions
        T = idx.shape[1]
        if T > self.config.block_size:
            raise ValueError(f"sequence of length {T} is longer than block_size={self.config.block_size}")
        x = F.rms_norm(self.wte(idx), (self.config.n_embd,))
        return x, (self.cos[:, :T].to(x.dtype), self.sin[:, :T].to(x.dtype))

    def forward_features(self, idx, explicit=False, all_layers=False):
        return self.run_blocks(*self.embed(idx), explicit, all_layers)

    def forward(self, idx, targets=None, explicit=False):
        logits = self.lm_head(self.forward_features(idx, explicit)).float()  # (B, T, vocab)
        if self.config.softcap:
            logits = self.config.softcap * torch.tanh(logits / self.config.softcap)
        return logits if targets is None else (logits, F.cross_entropy(logits.flatten(0, 1), targets.flatten(), ignore_index=-1))

    def get_attention(self, idx, layer):
        return self.attention_maps(*self.embed(idx), layer)

    @torch.no_grad()
    def generate(self, idx, max_new_tokens, temperature=1.0, top_k=None, generator=None):
        """Sample continuations of idx (B, T) (temperature 0 = greedy); the context is cropped to block_size."""
        for _ in range(max_new_tokens):
            logits = self(idx[:, -self.config.block_size:])[:, -1, :] / max(temperature, 1e-9)
            if top_k:
                logits = logits.masked_fill(logits < torch.topk(logits, min(top_k, logits.size(-1))).values[:, [-1]], -math.inf)
            nxt = logits.argmax(-1, keepdim=True) if temperature == 0 else torch.multinomial(logits.softmax(-1), 1, generator=generator)
            idx = torch.cat([idx, nxt], dim=1)
        return idx

# ---- DINO head --------------------------------------------------------------
class DINOHead(nn.Module):
    """DINO's head: MLP -> L2-normalised bottleneck -> linear g * v / |v| per row (norm_last_layer freezes g at 1)."""
    def __init__(self, in_dim, out_dim=4096, hidden_dim=2048, bottleneck_dim=256, n_layers=3, norm_last_layer=True):
        super().__init__()
        dims = [in_dim] + [hidden_dim] * (n_layers - 1) + [bottleneck_dim]
        linears = [nn.Linear(a, b) for a, b in zip(dims[:-1], dims[1:])]
        for m in linears:
            nn.init.trunc_normal_(m.weight, std=0.02)
            nn.init.zeros_(m.bias)
        self.mlp = nn.Sequential(*[m for lin in linears for m in (lin, nn.GELU())][:-1])  # no GELU at the end
        self.weight_v = nn.Parameter(nn.init.kaiming_uniform_(torch.empty(out_dim, bottleneck_dim), a=math.sqrt(5)))  # nn.Linear's, as DINO
        self.weight_g = nn.Parameter(torch.ones(out_dim, 1), requires_grad=not norm_last_layer)

    def forward(self, x):
        return F.linear(F.normalize(self.mlp(x), dim=-1), self.weight_g * F.normalize(self.weight_v, dim=-1))

    def last_layer_params(self):
        return [self.weight_v, self.weight_g]

def build_model(config):
    return ViT(config) if config.model == "vit" else GPT(config)

# ---- run plumbing shared by the scripts -------------------------------------
# A script declares its options as commented lower-case globals and calls configure(globals()); values are never code.
def _typed(key, value, default):
    if isinstance(value, str) and not isinstance(default, str) or default is None:
        with suppress(ValueError, SyntaxError):  # a bare word stays a string: --dataset=cifar10
            value = ast.literal_eval(value)
    if default is None or value is None:
        return value
    value = float(value) if isinstance(default, float) and type(value) is int else value  # --lr=1 is 1.0
    n_lap_list = key == "n_lap" and isinstance(value, (list, tuple))
    if not (n_lap_list or type(value) is type(default) or isinstance(value, type(default)) and not isinstance(value, bool)):
        raise UsageError(f"--{key}={value!r} has type {type(value).__name__}, expected {type(default).__name__} like the default {default!r}")
    return list(value) if isinstance(value, tuple) else value

def parse_args(defaults, argv=None):
    """defaults, then config files and --key=value options in command-line order -> a new dict."""
    config = dict(defaults)
    for arg in sys.argv[1:] if argv is None else argv:
        key, has_value, text = arg[2:].partition("=")
        if arg.startswith("--") and key not in config:
            raise UsageError(f"unknown option --{key};{_closest(key, config, '--')} --help lists every option")
        if arg.startswith("--") and not has_value and not isinstance(config[key], bool):
            raise UsageError(f"--{key} needs a value: --{key}=...")
        if arg.startswith("--"):
            config[key] = _typed(key, text if has_value else "True", defaults[key])  # --flag is --flag=True
            continue
        if not os.path.isfile(arg):
            raise UsageError(f"{arg!r} is neither a --key=value option nor a config file")
        try:
            tree = ast.parse(open(arg).read(), arg)
        except SyntaxError as e:
            raise UsageError(f"config file {arg}: line {e.lineno}: {e.msg}")
        for node in tree.body:
            where = f"config file {arg}: line {node.lineno}"
            if not (isinstance(node, ast.Assign) and len(node.targets) == 1 and isinstance(node.targets[0], ast.Name)):
                raise UsageError(f"{where}: only `key = value` lines are allowed")
            if node.targets[0].id not in config:
                raise UsageError(f"{where}: unknown key {node.targets[0].id!r};"
                                 f"{_closest(node.targets[0].id, config)} --help lists every option")
            try:
                value = ast.literal_eval(node.value)
            except ValueError:
                raise UsageError(f"{where}: {node.targets[0].id} must be a literal value")
            config[node.targets[0].id] = _typed(node.targets[0].id, value, defaults[node.targets[0].id])
    return config

def _closest(name, names, prefix=""):
    """' did you mean --a or --b?' for the nearest valid names (difflib), '' when none is near."""
    close = difflib.get_close_matches(name, list(names), n=3, cutoff=0.6)
    return f" did you mean {' or '.join(prefix + c for c in close)}?" if close else ""

def configure(namespace, argv=None, schedule=()):
    """Resolve a script's options (see declared_options) into it; --help lists them with their comments.
    --resume: the options saved in out_dir/ckpt.pt are the base and the command line goes on top, but neither the model,
    the data (Config fields, preset, dataset, seed) nor the `schedule` length (a longer one would raise the learning
    rate of a cooled-down run again) may change. Returns (config, checkpoint or None)."""
    install_error_handler()
    argv = sys.argv[1:] if argv is None else argv
    comments = declared_options(namespace)
    options = {k: namespace[k] for k in comments}
    if {"-h", "--help"} & set(argv):
        print(namespace["__doc__"].strip() + "\n\noptions (--key=value, or key = value lines in a config file):")
        print("\n".join(f"  --{k}={v!r}  # {comments[k]}" for k, v in options.items()))
        sys.exit(0)
    config, ckpt = parse_args(options, argv), None
    _defaults.update(options)  # finished_run() names the options a run was given: those that differ from these
    if config.get("resume"):
        ckpt = load_checkpoint(os.path.join(config["out_dir"], "ckpt.pt"), "--resume: ")
        saved = {k: v for k, v in ckpt.get("config", {}).items() if k in options}
        config = parse_args({**options, **saved, "resume": True, "out_dir": config["out_dir"]}, argv)
        fixed = [f.name for f in fields(Config)] + ["preset", "dataset", "seed", *schedule]
        changed = [f"--{k}={config[k]!r} (checkpoint: {saved[k]!r})" for k in fixed if k in saved and config[k] != saved[k]]
        if changed:
            raise UsageError(f"--resume continues a run exactly: it cannot change the model, data or schedule ({', '.join(changed)}). "
                             f"To train longer, run the longer schedule in a new --out_dir (--stop_at_step stops early)")
    namespace.update(config)
    return config, ckpt

_defaults = {}  # the running script's option defaults, kept by configure() for finished_run()

def check_options(config, at_least=None, above_zero=(), fractions=(), choices=None):
    """A script's rules for its options, declared once and worded alike: at_least {minimum: [keys]},
    above_zero [keys] (> 0), fractions [keys] (in [0, 1]), choices {key: allowed values}. Raises UsageError."""
    def require(key, ok, why):
        if not ok:
            raise UsageError(f"--{key}={config[key]!r}: {why}")
    for minimum, keys in (at_least or {}).items():
        for key in keys:
            require(key, config[key] >= minimum, f"must be at least {minimum}")
    for key in above_zero:
        require(key, config[key] > 0, "must be greater than 0")
    for key in fractions:
        require(key, 0 <= config[key] <= 1, "must lie in [0, 1]")
    for key, allowed in (choices or {}).items():
        require(key, config[key] in allowed, f"choose one of {', '.join(map(str, allowed))}")

def check_resume(ckpt, kind, model_config):
    """--resume continues one run: the checkpoint must hold a `kind` run of the same model. Raises UsageError."""
    if ckpt.get("kind") != kind:
        raise UsageError(f"--resume: the checkpoint holds a {ckpt.get('kind')} run, not a {kind} one; use a new --out_dir")
    if ckpt["model_config"] != asdict(model_config):
        raise UsageError("--resume: the checkpoint holds a different model; do not change model options on resume, "
                         "or use a new --out_dir")

def declared_options(namespace):
    """{option: its comment}, in the script's order: the top-level `name = value  # comment` lines of the script's file
    whose name is lower-case and whose value is a literal (None, bool, int, float, str, list). Any other global, a
    constant, an import or a line without a comment, never becomes an option by accident."""
    lines = re.findall(r"^([a-z]\w*) = .*?  # (.*)$", open(namespace["__file__"]).read(), re.M)
    literal = (type(None), bool, int, float, str, list)
    return {k: why for k, why in lines if k.islower() and isinstance(namespace.get(k, ()), literal)}

def install_error_handler():
    """Input mistakes, a non-finite loss and Ctrl-C end in one stderr line (no traceback) from the first process."""
    def handler(kind, error, tb):
        rank = int(os.environ.get("RANK", 0))
        if issubclass(kind, KeyboardInterrupt):
            message = "interrupted; the last checkpoint is intact (continue with --resume)"
        elif issubclass(kind, (UsageError, OSError, FloatingPointError)):  # OSError: a missing file, a full disk, ...
            message = f"error: {error}"
        elif not (rank > 0 and issubclass(kind, RuntimeError)):  # not a lost peer (rank 0 says why)
            return sys.__excepthook__(kind, error, tb)
        if rank == 0:
            print(message, file=sys.__stderr__, flush=True)  # torch's process group wraps sys.stderr
        remove_empty_out_dirs()
        os._exit(1)  # skip the process group's destructor, which can abort once a peer is gone
    sys.excepthook = handler

# ---- devices and processes
def resolve_device(device):
    """'auto' = cuda, else mps, else cpu; 'cpu', 'cuda', 'cuda:N' and 'mps' are checked to exist."""
    kind, has = device.split(":")[0], dict(cpu=True, cuda=torch.cuda.is_available(), mps=torch.backends.mps.is_available())
    if device == "auto":
        return "cuda" if has["cuda"] else "mps" if has["mps"] else "cpu"
    if not has.get(kind, False):
        raise UsageError(f"--device={device}: this machine has no {kind.upper()} device; use --device=cpu (or auto)"
                         if kind in has else f"--device={device!r}: choose auto, cpu, cuda, cuda:N or mps")
    return device

def launch_cpu_processes(nprocs, device):
    """DDP on a CPU without torchrun: with nprocs > 1 on the CPU, run this command in nprocs single-threaded processes
    that form a gloo group (torchrun's variables, set here), and exit with their status; else (or in them) return."""
    if nprocs < 1:
        raise UsageError(f"--cpu_procs={nprocs}: must be at least 1")
    if "NANOLAP_LAUNCHER" in os.environ:  # one of the processes: stop when the launcher is gone
        threading.Thread(target=_exit_with_launcher, args=(int(os.environ["NANOLAP_LAUNCHER"]),), daemon=True).start()
    if nprocs == 1 or "RANK" in os.environ or resolve_device(device) != "cpu":
        return
    with socket.create_server(("127.0.0.1", 0)) as s:  # a free port for the process group
        port = s.getsockname()[1]
    env = dict(os.environ, WORLD_SIZE=str(nprocs), LOCAL_WORLD_SIZE=str(nprocs), MASTER_ADDR="127.0.0.1",
               MASTER_PORT=str(port), NANOLAP_LAUNCHER=str(os.getpid()), OMP_NUM_THREADS="1", OMP_WAIT_POLICY="PASSIVE")
    procs = [subprocess.Popen([sys.executable, *sys.argv], env=dict(env, RANK=str(r), LOCAL_RANK=str(r))) for r in range(nprocs)]
    with suppress(KeyboardInterrupt):  # they got the same Ctrl-C and stop cleanly
        while all(p.poll() in (None, 0) for p in procs) and any(p.poll() is None for p in procs):
            time.sleep(0.1)
    with suppress(subprocess.TimeoutExpired):  # one failed: the first process speaks for all, give it time to say why
        procs[0].wait(timeout=10)
    for p in procs:  # the others would wait for the failed one forever
        p.terminate() if p.poll() is None else None
        p.wait()
    sys.exit(next((abs(p.returncode) for p in procs if p.returncode), 0))

def _exit_with_launcher(launcher):
    while os.getppid() == launcher:
        time.sleep(1)
    os._exit(1)

def setup_distributed(device="auto"):
    """Under torchrun: GPU LOCAL_RANK (nccl) or CPU (gloo) per process; returns (rank, local_rank, world, device)."""
    device = resolve_device(device)
    if "RANK" not in os.environ:
        return 0, 0, 1, device
    rank = int(os.environ["RANK"])
    local_rank = int(os.environ["LOCAL_RANK"])
    world = int(os.environ["WORLD_SIZE"])
    if device.startswith("cuda"):
        device = f"cuda:{local_rank}"
        torch.cuda.set_device(device)
    dist.init_process_group("nccl" if device.startswith("cuda") else "gloo")
    return rank, local_rank, world, device

def start_processes(out_dir, resume, cpu_procs, device):
    """A training run's start, alike in every script: the first process prepares out_dir (a bad one fails once,
    before any other process starts), a CPU run launches its cpu_procs processes, each joins the process group,
    and on CUDA float32 matmuls run in TF32 (bfloat16 autocast covers most of them anyway).
    Returns (rank, local_rank, world, device)."""
    if os.environ.get("RANK", "0") == "0":
        prepare_out_dir(out_dir, resume)
    launch_cpu_processes(cpu_procs, device)
    rank, local_rank, world, device = setup_distributed(device)
    if device.startswith("cuda"):
        torch.backends.cuda.matmul.allow_tf32 = True
        torch.backends.cudnn.allow_tf32 = True
    return rank, local_rank, world, device

def teardown_distributed():
    """The end of a process of a group: after the last collective, leave without the interpreter's finalisation.
    gloo's worker threads outlive destroy_process_group (even without the DDP model), and one that drops a Python
    object while the interpreter finalises is killed in C++: SIGABRT, 'terminate called without an active exception'."""
    if not dist.is_initialized():
        return
    dist.barrier()  # nobody tears the group down while a peer still talks to it
    dist.destroy_process_group()
    atexit._run_exitfuncs()  # what a normal exit would still do (remove_empty_out_dirs), with the interpreter alive
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)

def print0(*args):
    """print on the first process only, as one write, so that lines of processes never interleave."""
    if not dist.is_initialized() or dist.get_rank() == 0:
        print(" ".join(map(str, args)) + "\n", end="", flush=True)

def all_reduce_mean(x, device="cpu"):
    """Mean of a number or tensor over processes (identity without a process group)."""
    t = torch.as_tensor(x, dtype=torch.float64, device=device)
    if dist.is_initialized():
        dist.all_reduce(t)
        t /= dist.get_world_size()
    return t.item() if t.ndim == 0 else t

def autocast(device, dtype):
    """(context, dtype) of --dtype: 'auto' = bfloat16 autocast on CUDA, float32 elsewhere."""
    if dtype not in ("auto", "float32", "bfloat16", "float16"):
        raise UsageError(f"--dtype={dtype!r}: choose auto, float32, bfloat16 or float16")
    kind = str(device).split(":")[0]
    amp = getattr(torch, ("bfloat16" if kind == "cuda" else "float32") if dtype == "auto" else dtype)
    return (nullcontext() if amp == torch.float32 else torch.autocast(kind, dtype=amp)), amp

# Dense tensor-core peaks (no 2:4 sparsity) in bfloat16 with float32 accumulation, FLOP/s, from NVIDIA's product
# datasheets (data-centre cards: the sparse figures halved) and the GA102 (Ampere) and AD102 (Ada) GeForce whitepapers
# ("FP16 Tensor TFLOPS with FP32 Accumulate"). T4 and V100 have no bfloat16 tensor cores: their float16 peaks.
# Keys are whole names (torch.cuda.get_device_name() without "NVIDIA", "Tesla", "GeForce"): an H100 PCIe is no
# H100 SXM, an A10G no A10, an L40 no L40S, and a MIG slice or a laptop RTX 4090 is a smaller chip: no MFU for those.
GPU_PEAK_FLOPS = {
    r"H100( SXM5?)?( \d+GB)?( HBM3)?": 989e12, r"H100 PCIe": 756e12, r"H100 NVL": 835e12,  # SXM: "H100 80GB HBM3"
    r"H200": 989e12, r"H200 NVL": 835e12, r"GH200 \d+GB": 989e12,
    r"A100(-SXM4-\d+GB|-PCIE-\d+GB| \d+GB PCIe)?": 312e12, r"A10": 125e12, r"L4": 121e12, r"L40S": 362e12,
    r"L40": 181e12, r"T4": 65e12, r"V100-SXM2-\d+GB": 125e12, r"V100-PCIE-\d+GB": 112e12, r"RTX A6000": 154.8e12,
    r"RTX 4090": 165.2e12, r"RTX 4080": 97.5e12, r"RTX 3090 Ti": 80e12, r"RTX 3090": 71e12, r"RTX 3080": 59.5e12,
}

def peak_flops(device, name=None):
    """Dense bf16 peak FLOP/s of a CUDA device (or of a GPU called `name`), for MFU; None for a CPU or an unknown GPU."""
    if name is None and not str(device).startswith("cuda"):
        return None
    name = re.sub(r"^(NVIDIA |Tesla |GeForce )+", "", name or torch.cuda.get_device_name(device))
    return next((flops for key, flops in GPU_PEAK_FLOPS.items() if re.fullmatch(key, name)), None)

def machine_name(device):
    """What a run trains on, as one word for its RESULT line and log (floats differ between machines: compare runs
    of one machine): the GPU's name, or the CPU's model name and the vector instructions torch's kernels use."""
    if str(device).startswith("cuda"):
        name = torch.cuda.get_device_name(device)
    else:
        name = f"{cpu_model_name()} {torch.backends.cpu.get_cpu_capability()}"
    return re.sub(r"\s+", "_", name.strip())

def cpu_model_name():
    """The CPU's model name: /proc/cpuinfo on Linux, sysctl on a Mac, else what the platform module says."""
    with suppress(OSError):
        found = re.search(r"^model name\s*:\s*(.+)$", open("/proc/cpuinfo").read(), re.M)
        if found:
            return found.group(1)
    with suppress(OSError, subprocess.SubprocessError):
        return subprocess.run(["sysctl", "-n", "machdep.cpu.brand_string"], capture_output=True, text=True,
                              timeout=5, check=True).stdout.strip()
    return platform.processor() or platform.machine() or "unknown CPU"

def print_param_checksum(params, rank, world):
    """Every process of a DDP run reports its weights: the ranks must agree exactly (the tests compare them)."""
    print(f"rank {rank}/{world} param_checksum={sum(p.double().sum().item() for p in params):.10e}\n", end="", flush=True)

# ---- seeds: everything random in a step is a function of (seed, step, ...), so a resume is exact
def step_seed(*parts):
    """A seed from ints, e.g. (seed, step, rank): Python hashes int tuples alike in every process and run."""
    return hash(tuple(parts)) & 0x7FFF_FFFF_FFFF_FFFF

def rng_state():
    cuda = {"cuda": torch.cuda.get_rng_state_all()} if torch.cuda.is_available() else {}
    return {"python": random.getstate(), "torch": torch.get_rng_state(), **cuda}

def set_rng_state(state):
    random.setstate(state["python"])
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])

# ---- schedules
def cosine_schedule(step, total, start, end, warmup=0, warmup_start=0.0, warmup_from=0):
    """A linear warm-up from warmup_start to start over the first `warmup` steps, then a half cosine from start to end
    at step `total` (and end after it); start == end: a warm-up, then constant. Warm-up step s is (s + warmup_from) /
    warmup of the way: warmup_from 0 begins at warmup_start (DINO), 1 ends on start at step warmup - 1 (nanoGPT)."""
    if step < warmup:
        return warmup_start + (start - warmup_start) * (step + warmup_from) / warmup
    progress = min((step - warmup) / max(total - warmup, 1), 1.0)
    return end + 0.5 * (start - end) * (1 + math.cos(math.pi * progress))

# ---- checkpoints and the output folder
def clean_state_dict(state_dict):
    """Strip the prefixes that torch.compile (_orig_mod.) and DDP (module.) add to parameter names."""
    return {re.sub(r"(^|(?<=\.))(_orig_mod|module)\.", "", k): v for k, v in state_dict.items()}

@contextmanager
def atomic_write(path):
    """`with atomic_write(path) as f:` writes a binary temporary file, fsyncs it and renames it to path: a killed
    write leaves the old file (or none), the next write removes its leftovers; an error inside the block writes nothing."""
    folder = os.path.dirname(os.path.abspath(path))
    os.makedirs(folder, exist_ok=True)
    for name in [n for n in os.listdir(folder) if n.startswith(os.path.basename(path) + ".tmp")]:
        os.remove(os.path.join(folder, name))
    tmp = f"{path}.tmp{os.getpid()}"
    try:
        with open(tmp, "wb") as f:
            yield f
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    finally:
        if os.path.exists(tmp):
            os.remove(tmp)

def save_checkpoint(obj, path):
    with atomic_write(path) as f:
        torch.save(obj, f)

def load_checkpoint(path, context="", map_location="cpu"):
    """torch.load with weights_only=True (tensors and plain data, never code), failing in one line."""
    if not os.path.isfile(path):
        raise FileNotFoundError(f"{context}no checkpoint at {path}")
    try:
        ckpt = torch.load(path, map_location=map_location, weights_only=True)
    except Exception as e:
        if "Unsupported global" in str(e):
            raise UsageError(f"{context}{path} holds Python objects, which could run code: it is not loaded") from None
        reason = [line.strip() for line in str(e).split("WeightsUnpickler error:")[-1].splitlines() if line.strip()]
        raise UsageError(f"{context}{path} cannot be read ({(reason or [type(e).__name__])[0].split('. ')[0][:100]}): the file "
                         f"is damaged or truncated (an interrupted copy?)" + ("; restore it, or start afresh without --resume"
                         if context.startswith("--resume") else "; restore it")) from None
    if not isinstance(ckpt, dict):
        raise UsageError(f"{context}{path} is not a nanolap checkpoint (a dict of tensors and plain data)")
    return ckpt

def load_model(path_or_ckpt, key="model", map_location="cpu"):
    """Rebuild a model from a nanolap checkpoint (a path or an already loaded dict)."""
    ckpt = load_checkpoint(path_or_ckpt, "", map_location) if isinstance(path_or_ckpt, str) else path_or_ckpt
    model = build_model(Config(**ckpt["model_config"]))
    model.load_state_dict(clean_state_dict(ckpt[key]))
    return model

RUN_FILES = ("ckpt.pt", "log.jsonl", "result.txt")  # what a training run writes into its out_dir
ANALYSIS_FILES = ("analysis", "analysis.json", "analysis_all.json", "summary.md")  # what analyze.py writes there

def describes_a_run(out_dir, name):
    """Whether out_dir/name describes the run trained there: its files, or analyze.py's outputs (figures, a folder
    holding an analysis.json, as --out=out_dir/NAME writes) made from its checkpoint."""
    path = os.path.join(out_dir, name)
    return (name in RUN_FILES or name in ANALYSIS_FILES or name.endswith(".png")
            or os.path.isdir(path) and not name.startswith("previous-") and os.path.isfile(os.path.join(path, "analysis.json")))

_made_out_dirs = []  # out_dirs this process created: removed again if the run ends before writing into them

def remove_empty_out_dirs():
    for folder in _made_out_dirs:
        with suppress(OSError):  # not empty (the run wrote something) or gone: leave it
            os.rmdir(folder)

def prepare_out_dir(out_dir, resume):
    """Make out_dir and prove it writable; a fresh run moves everything that describes an earlier run (its files and
    its analysis) together to out_dir/previous-<time>/. A folder made here goes again if the run fails before using it."""
    made = not os.path.isdir(out_dir)
    try:
        os.makedirs(out_dir, exist_ok=True)
        open(os.path.join(out_dir, ".write-test"), "w").close()
        os.remove(os.path.join(out_dir, ".write-test"))
    except OSError as e:
        raise UsageError(f"--out_dir={out_dir} cannot be written ({e.strerror or e}); choose another --out_dir") from None
    if made and not _made_out_dirs:
        atexit.register(remove_empty_out_dirs)  # the error handler calls it too: os._exit skips atexit
    if made:
        _made_out_dirs.append(out_dir)
    old = sorted(n for n in os.listdir(out_dir) if describes_a_run(out_dir, n))
    if old and not resume:
        aside = tempfile.mkdtemp(prefix=time.strftime("previous-%Y%m%d-%H%M%S-"), dir=out_dir)  # a new, unique folder
        for name in old:
            os.replace(os.path.join(out_dir, name), os.path.join(aside, name))
        print(f"note: {out_dir} held an earlier run: its {', '.join(old)} moved to {aside}", flush=True)

def finished_run(config, step, total, option, longer):
    """--resume of a run at the end of its schedule: nothing to train, its files stay byte for byte. Says how to train
    longer: a new run whose schedule `option` is `longer` (continuing would raise a cooled-down learning rate again),
    with the options this run was given (those that differ from the script's defaults). Exits with status 0."""
    out_dir = config["out_dir"]
    given = {k: v for k, v in config.items() if k not in ("resume", "out_dir", option) and v != _defaults.get(k)}
    new = {"out_dir": os.path.normpath(out_dir) + "-long", option: longer, **given}
    command = " ".join(["python", sys.argv[0]] + [shlex.quote(f"--{k}={_option_text(v)}") for k, v in new.items()])
    if int(os.environ.get("RANK", 0)) == 0:  # under torchrun every process gets here, before any process group
        print(f"{out_dir} holds a finished run (step {step} of {total}): --resume has nothing to train and leaves its "
              f"files as they are. To train longer, start a new --out_dir with a longer --{option}: {command}", flush=True)
    teardown_distributed()
    sys.exit(0)

def _option_text(value):
    """How value is written after --key= so that parse_args reads it back."""
    if isinstance(value, list):
        return json.dumps(value, separators=(",", ":"))
    return value if isinstance(value, str) else repr(value)

# ---- logging and the RESULT line
def append_jsonl(path, record):
    with open(path, "a") as f:
        f.write(json.dumps(record) + "\n")

def write_result(out_dir, **values):
    """Print the run's last line `RESULT key=value ...` (floats: 4 decimals, lists: no spaces), kept in result.txt.
    Training scripts write the shared keys n_lap params seed dataset steps seconds first, then their own metrics."""
    line = "RESULT " + " ".join(f"{k}={_result_value(v)}" for k, v in values.items())
    print(line + "\n", end="", flush=True)
    with open(os.path.join(out_dir, "result.txt"), "w") as f:
        f.write(line + "\n")

def _result_value(v):
    if isinstance(v, float):
        return f"{v:.4f}"
    if isinstance(v, list):
        return json.dumps(v, separators=(",", ":"))
    return str(v)

RESULT_RENAMED = {"time_s": "seconds", "step": "steps"}  # keys of older RESULT lines and their names now

def read_result(run_dir):
    """The key=value pairs (strings) of the RESULT line in run_dir/result.txt, older keys renamed; {} without one."""
    path = os.path.join(run_dir, "result.txt")
    if not os.path.isfile(path):
        return {}
    pairs = [word.split("=", 1) for word in open(path).read().split() if "=" in word]
    return {RESULT_RENAMED.get(k, k): v for k, v in pairs}

def check_finite(loss, step):
    """Stop before the optimiser step when the loss is NaN or inf; the last checkpoint stays intact."""
    if not math.isfinite(float(loss)):
        raise FloatingPointError(f"non-finite loss {float(loss)} at step {step}: stopping before the optimiser "
                                 f"step; the last checkpoint is intact. Try a lower learning rate or --grad_clip.")

def format_time(seconds):
    s = int(seconds)
    return f"{s // 3600}h{s // 60 % 60:02d}m" if s >= 3600 else f"{s // 60}m{s % 60:02d}s"
