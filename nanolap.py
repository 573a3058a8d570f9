"""
nanolap: transformers whose layers mix attention heads and Laplacian heads.

Zhang & Papyan, "Laplacian Heads Improve Transformers by Smoothing Token Representations",
arXiv 2602.09297. A layer with attention heads A and Laplacian heads L updates tokens X (T x d) as

    X <- X + sum_{i in A} P_i V_i Wo_i  +  sum_{i in L} (I - P_i) V_i Wo_i
    P_i = softmax(Q_i K_i^T / sqrt(d_h))  (row-stochastic),   V_i = X Wv_i

I - P is the random-walk graph Laplacian of the attention graph. Because rows of P sum to 1,
(I - P) 1 = 0: a Laplacian head ignores what all tokens share and row t of its output is
sum_j P_tj (v_t - v_j), a function of token differences only.

Why it is (almost) free: (I - P) V = V - P V. One fused scaled_dot_product_attention call computes
P V for every head (FlashAttention on GPU, no T x T matrix ever exists), and the Laplacian heads
subtract that result from their own values. No extra parameters, one subtraction of extra FLOPs.

Convention (the first author's code): the trailing `n_lap` heads of a layer are Laplacian.
`n_lap` is one count for every layer or a list with one count per layer.

Contents, top to bottom: Config and presets; mixed-head attention (fused and explicit paths);
blocks; the shared trunk; ViT; GPT (nanochat architecture); DINO head; checkpoint loading;
helpers shared by the training scripts; `python nanolap.py` self-check and benchmark.
"""

import ast
import json
import math
import os
import random
import re
import sys
import time
from dataclasses import asdict, dataclass, fields
from typing import Union

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

# -----------------------------------------------------------------------------
# config

class UsageError(ValueError):
    """A mistake in the user's input; scripts print it without a traceback (see run_main)."""

@dataclass
class Config:
    model: str = "vit"  # 'vit' (image classifier / DINO backbone) or 'gpt' (causal LM)
    n_layer: int = 6
    n_head: int = 4
    n_embd: int = 128
    n_lap: Union[int, list] = 0  # Laplacian heads per layer (the trailing ones): int or per-layer list
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
    # GPT
    vocab_size: int = 0
    block_size: int = 256
    # ViT
    img_size: int = 28
    patch_size: int = 4
    in_chans: int = 1
    num_classes: int = 10  # 0 = features only (DINO backbone)
    pooling: str = "cls"  # 'cls' token or 'mean' of patch tokens

    def __post_init__(self):
        def fail(field, why):
            raise ValueError(f"Config.{field}={getattr(self, field)!r}: {why}")
        if isinstance(self.n_lap, tuple):
            self.n_lap = list(self.n_lap)
        choices = dict(model=("vit", "gpt"), norm=("layernorm", "rmsnorm"), mlp=("gelu", "relu2"),
                       pos=("learned", "rope"), pooling=("cls", "mean"))
        is_int = lambda v: isinstance(v, int) and not isinstance(v, bool)
        for f in fields(self):
            v, default = getattr(self, f.name), f.default
            if f.name in choices and v not in choices[f.name]:
                fail(f.name, f"allowed values are {choices[f.name]}")
            elif f.name == "n_lap":
                if not all(is_int(k) and k >= 0 for k in (v if isinstance(v, list) else [v])):
                    fail(f.name, "must be a non-negative int or a list of them, one per layer")
            elif isinstance(default, bool) and not isinstance(v, bool):
                fail(f.name, "must be True or False")
            elif is_int(default) and not (is_int(v) and v >= 0):
                fail(f.name, "must be a non-negative int")
            elif isinstance(default, float) and not ((is_int(v) or isinstance(v, float)) and v >= 0):
                fail(f.name, "must be a non-negative number")
        for field in ("n_layer", "n_head", "n_embd", "patch_size", "in_chans", "block_size"):
            if getattr(self, field) < 1:
                fail(field, "must be at least 1")
        if self.n_embd % self.n_head:
            fail("n_embd", f"not divisible by n_head={self.n_head}; choose a multiple of n_head")
        if len(self.lap_schedule()) != self.n_layer:
            fail("n_lap", f"the per-layer list has {len(self.n_lap)} entries but n_layer={self.n_layer}")
        if max(self.lap_schedule()) > self.n_head:
            fail("n_lap", f"at most n_head={self.n_head} Laplacian heads per layer")
        if self.pos == "rope" and (self.n_embd // self.n_head) % 2:
            fail("n_embd", f"RoPE needs an even head size, got n_embd/n_head={self.n_embd // self.n_head}")
        for field in ("drop_path", "dropout"):
            if getattr(self, field) >= 1:
                fail(field, "must lie in [0, 1)")
        if self.model == "gpt" and self.vocab_size < 1:
            fail("vocab_size", "a GPT needs vocab_size >= 1")
        if self.model == "gpt" and not self.causal:
            fail("causal", "a GPT must be causal (causal=True)")
        if self.model == "vit" and self.img_size % self.patch_size:
            fail("img_size", f"not divisible by patch_size={self.patch_size}")
        if self.model == "vit" and self.pos != "learned":
            fail("pos", "the ViT uses a learned position embedding (pos='learned')")

    def lap_schedule(self):
        """Number of Laplacian heads in each layer."""
        return list(self.n_lap) if isinstance(self.n_lap, list) else [self.n_lap] * self.n_layer

# The paper's models and small sizes that train on a laptop CPU. Any field can be overridden.
_VIT = dict(model="vit", qk_norm=True, norm="layernorm", mlp="gelu", bias=True, pos="learned")
_GPT = dict(model="gpt", causal=True, qk_norm=True, norm="rmsnorm", mlp="relu2", bias=False,
            pos="rope", softcap=15.0)
PRESETS = {
    "vit-b": dict(_VIT, n_layer=12, n_embd=768, n_head=12, img_size=224, patch_size=16, in_chans=3,
                  num_classes=1000, layerscale=1e-6),  # DeiT-III ViT-B/16
    "vit-s": dict(_VIT, n_layer=12, n_embd=384, n_head=6, img_size=224, patch_size=16, in_chans=3,
                  num_classes=0),  # DINO ViT-S/16 backbone
    "vit-small": dict(_VIT, n_layer=6, n_embd=192, n_head=6, img_size=32, patch_size=4, in_chans=3),
    "vit-tiny": dict(_VIT, n_layer=4, n_embd=96, n_head=4, img_size=28, patch_size=4, in_chans=1),
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

# -----------------------------------------------------------------------------
# attention

class RMSNorm(nn.Module):
    """Parameter-free RMSNorm (nanochat)."""

    def forward(self, x):
        return F.rms_norm(x, (x.size(-1),))

def make_norm(config, dim):
    return nn.LayerNorm(dim, bias=config.bias) if config.norm == "layernorm" else RMSNorm()

def apply_rope(x, cos, sin):  # x: (B, T, H, D), cos/sin: (1, T, 1, D/2)
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat([x1 * cos + x2 * sin, x2 * cos - x1 * sin], dim=-1)

class MixedHeadAttention(nn.Module):
    """n_head heads; the trailing n_lap of them output (I - P) V instead of P V."""

    def __init__(self, config, n_lap):
        super().__init__()
        self.n_head, self.n_lap, self.causal = config.n_head, n_lap, config.causal
        self.head_dim = config.n_embd // config.n_head
        self.dropout = config.dropout
        self.qkv = nn.Linear(config.n_embd, 3 * config.n_embd, bias=config.bias)
        self.proj = nn.Linear(config.n_embd, config.n_embd, bias=config.bias)
        self.q_norm = make_norm(config, self.head_dim) if config.qk_norm else nn.Identity()
        self.k_norm = make_norm(config, self.head_dim) if config.qk_norm else nn.Identity()
        self.resid_drop = nn.Dropout(config.dropout)

    def forward(self, x, rope=None, explicit=False, return_attn=False):
        B, T, C = x.shape
        H, D, A = self.n_head, self.head_dim, self.n_head - self.n_lap  # A attention heads, then Laplacian
        q, k, v = self.qkv(x).view(B, T, 3, H, D).unbind(2)  # each (B, T, H, D)
        q, k = self.q_norm(q), self.k_norm(k)
        if rope is not None:
            q, k = apply_rope(q, *rope), apply_rope(k, *rope)
        q, k, vh = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)  # (B, H, T, D)
        drop = self.dropout if self.training else 0.0
        P = None
        if not explicit:
            # fast path: P V for every head in one fused call, then V - P V for the Laplacian heads
            y = F.scaled_dot_product_attention(q, k, vh, dropout_p=drop, is_causal=self.causal)  # (B, H, T, D)
            y = y.transpose(1, 2)  # (B, T, H, D)
            if self.n_lap:
                y = torch.cat([y[:, :, :A], v[:, :, A:] - y[:, :, A:]], dim=2)
        else:
            # explicit path: materialise P, build P or I - P per head, multiply
            att = (q @ k.transpose(-2, -1)) * D ** -0.5  # (B, H, T, T)
            if self.causal:
                future = torch.ones(T, T, dtype=torch.bool, device=x.device).triu(1)
                att = att.masked_fill(future, float("-inf"))
            P = F.dropout(att.softmax(dim=-1), drop, self.training)
            is_lap = (torch.arange(H, device=x.device) >= A).view(1, H, 1, 1)
            eye = torch.eye(T, device=x.device, dtype=P.dtype)
            y = (torch.where(is_lap, eye - P, P) @ vh).transpose(1, 2)  # (B, T, H, D)
        y = self.resid_drop(self.proj(y.reshape(B, T, C)))
        return (y, P) if return_attn else y

# -----------------------------------------------------------------------------
# block

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
        x = F.relu(x).square() if self.relu2 else F.gelu(x)
        return self.drop(self.proj(x))

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
    keep = x.new_empty((x.shape[0],) + (1,) * (x.ndim - 1)).bernoulli_(1 - p)
    return x * keep / (1 - p)

class Block(nn.Module):
    def __init__(self, config, n_lap, drop_path_rate):
        super().__init__()
        ls = (lambda: LayerScale(config.n_embd, config.layerscale)) if config.layerscale else nn.Identity
        self.norm1, self.attn, self.ls1 = make_norm(config, config.n_embd), MixedHeadAttention(config, n_lap), ls()
        self.norm2, self.mlp, self.ls2 = make_norm(config, config.n_embd), MLP(config), ls()
        self.drop_path = drop_path_rate

    def forward(self, x, rope=None, explicit=False):
        x = x + drop_path(self.ls1(self.attn(self.norm1(x), rope, explicit)), self.drop_path, self.training)
        x = x + drop_path(self.ls2(self.mlp(self.norm2(x))), self.drop_path, self.training)
        return x

# -----------------------------------------------------------------------------
# trunk shared by the ViT and the GPT

class Trunk(nn.Module):
    """Blocks + final norm, analysis access, and the one place where weights are initialised."""

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
        x = self.norm(x)
        return hidden + [x] if all_layers else x

    @torch.no_grad()
    def attention_maps(self, x, rope, layer):
        """P (B, H, T, T) of block `layer` through the explicit path; x are the embedded tokens."""
        for block in self.blocks[:layer]:
            x = block(x, rope)
        block = self.blocks[layer]
        return block.attn(block.norm1(x), rope, explicit=True, return_attn=True)[1]

    def num_params(self, exclude_embedding=False):
        """Parameter count; exclude_embedding drops the GPT's token table (a lookup, not a matmul)."""
        n = sum(p.numel() for p in self.parameters())
        return n - self.wte.weight.numel() if exclude_embedding and hasattr(self, "wte") else n

    def flops_per_token(self, T):
        """Training FLOPs per token: 6N for the matmuls plus 12*L*H*Q*T for attention (nanochat).
        The Laplacian subtraction is O(T*d) per layer and counts as 0."""
        c = self.config
        return 6 * self.num_params(exclude_embedding=True) + 12 * c.n_layer * c.n_head * (c.n_embd // c.n_head) * T

    def init_weights(self):
        """All initialisation lives here.
        ViT (DeiT/timm): Linear weights and cls/pos embeddings ~ truncated normal(0.02), biases 0;
            norms, LayerScale and the patch-embedding convolution keep PyTorch's defaults.
        GPT (nanochat): Linear weights ~ N(0, 1/fan_in * min(1, fan_out/fan_in)), embedding ~ N(0, 1),
            and the attention/MLP output projections and lm_head are zero, so every block, Laplacian
            or not, is an exact no-op at step 0."""
        gpt = self.config.model == "gpt"
        for m in self.modules():
            if isinstance(m, nn.Linear):
                if gpt:
                    fan_out, fan_in = m.weight.shape
                    nn.init.normal_(m.weight, std=fan_in ** -0.5 * min(1.0, math.sqrt(fan_out / fan_in)))
                else:
                    nn.init.trunc_normal_(m.weight, std=0.02)
                if m.bias is not None:
                    nn.init.zeros_(m.bias)
            elif isinstance(m, nn.Embedding):
                nn.init.normal_(m.weight, std=1.0)
        if gpt:
            for block in self.blocks:
                nn.init.zeros_(block.attn.proj.weight)
                nn.init.zeros_(block.mlp.proj.weight)
            nn.init.zeros_(self.lm_head.weight)
        else:
            nn.init.trunc_normal_(self.pos_embed, std=0.02)
            nn.init.trunc_normal_(self.cls_token, std=0.02)

# -----------------------------------------------------------------------------
# ViT

class ViT(Trunk):
    """Patch embedding, CLS token, learned position embedding on the patches (DeiT-III), head.
    Accepts images of another size than img_size (DINO local crops): positions are interpolated."""

    def __init__(self, config):
        super().__init__(config)
        assert config.model == "vit"
        c, self.grid = config, config.img_size // config.patch_size
        self.patch_embed = nn.Conv2d(c.in_chans, c.n_embd, c.patch_size, c.patch_size)
        self.cls_token = nn.Parameter(torch.zeros(1, 1, c.n_embd))
        self.pos_embed = nn.Parameter(torch.zeros(1, self.grid * self.grid, c.n_embd))
        self.head = nn.Linear(c.n_embd, c.num_classes) if c.num_classes else nn.Identity()
        self.init_weights()

    def embed(self, img):  # img (B, C, H, W) -> tokens (B, 1 + N, d), the CLS token first
        x = self.patch_embed(img)  # (B, d, h, w)
        h, w = x.shape[-2:]
        pos = self.pos_embed
        if (h, w) != (self.grid, self.grid):
            pos = pos.reshape(1, self.grid, self.grid, -1).permute(0, 3, 1, 2)
            pos = F.interpolate(pos, size=(h, w), mode="bicubic", align_corners=False)
            pos = pos.permute(0, 2, 3, 1).reshape(1, h * w, -1)
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

# -----------------------------------------------------------------------------
# GPT

class GPT(Trunk):
    """nanochat's GPT: token embedding then RMSNorm, RoPE, QK-norm, ReLU^2 MLP, no biases,
    untied lm_head, logits soft-capped as softcap * tanh(x / softcap)."""

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

    def _embed(self, idx):
        T = idx.shape[1]
        if T > self.config.block_size:
            raise ValueError(f"sequence of length {T} is longer than block_size={self.config.block_size}")
        x = F.rms_norm(self.wte(idx), (self.config.n_embd,))
        return x, (self.cos[:, :T].to(x.dtype), self.sin[:, :T].to(x.dtype))

    def forward_features(self, idx, explicit=False, all_layers=False):
        x, rope = self._embed(idx)
        return self.run_blocks(x, rope, explicit, all_layers)

    def forward(self, idx, targets=None, explicit=False):
        logits = self.lm_head(self.forward_features(idx, explicit)).float()  # (B, T, vocab)
        if self.config.softcap:
            logits = self.config.softcap * torch.tanh(logits / self.config.softcap)
        if targets is None:
            return logits
        return logits, F.cross_entropy(logits.view(-1, logits.size(-1)), targets.reshape(-1), ignore_index=-1)

    def get_attention(self, idx, layer):
        return self.attention_maps(*self._embed(idx), layer)

    @torch.no_grad()
    def generate(self, idx, max_new_tokens, temperature=1.0, top_k=None, generator=None):
        """Sample continuations of idx (B, T); the context is cropped to the last block_size tokens."""
        for _ in range(max_new_tokens):
            logits = self(idx[:, -self.config.block_size:])[:, -1, :]
            if temperature == 0:
                nxt = logits.argmax(dim=-1, keepdim=True)
            else:
                logits = logits / temperature
                if top_k:
                    kth = torch.topk(logits, min(top_k, logits.size(-1))).values[:, [-1]]
                    logits = logits.masked_fill(logits < kth, float("-inf"))
                nxt = torch.multinomial(logits.softmax(dim=-1), 1, generator=generator)
            idx = torch.cat([idx, nxt], dim=1)
        return idx

# -----------------------------------------------------------------------------
# DINO head

class DINOHead(nn.Module):
    """facebookresearch/dino: MLP -> L2-normalised bottleneck -> weight-normalised linear layer.
    The last layer's weight is g * v / |v| per output row; norm_last_layer freezes g at 1."""

    def __init__(self, in_dim, out_dim=4096, hidden_dim=2048, bottleneck_dim=256, n_layers=3, norm_last_layer=True):
        super().__init__()
        dims = [in_dim] + [hidden_dim] * (n_layers - 1) + [bottleneck_dim]
        linears = [nn.Linear(a, b) for a, b in zip(dims[:-1], dims[1:])]
        for m in linears:
            nn.init.trunc_normal_(m.weight, std=0.02)
            nn.init.zeros_(m.bias)
        self.mlp = nn.Sequential(*[m for lin in linears for m in (lin, nn.GELU())][:-1])  # no GELU at the end
        self.weight_v = nn.Parameter(torch.empty(out_dim, bottleneck_dim))
        nn.init.trunc_normal_(self.weight_v, std=0.02)
        self.weight_g = nn.Parameter(torch.ones(out_dim, 1), requires_grad=not norm_last_layer)

    def forward(self, x):
        x = F.normalize(self.mlp(x), dim=-1)
        return F.linear(x, self.weight_g * F.normalize(self.weight_v, dim=-1))

    def last_layer_params(self):
        return [self.weight_v, self.weight_g]

# -----------------------------------------------------------------------------
# building and loading models

def build_model(config):
    return ViT(config) if config.model == "vit" else GPT(config)

def clean_state_dict(state_dict):
    """Strip the prefixes that torch.compile (_orig_mod.) and DDP (module.) add to parameter names."""
    return {re.sub(r"(^|(?<=\.))(_orig_mod|module)\.", "", k): v for k, v in state_dict.items()}

def load_checkpoint(path, map_location="cpu"):
    """torch.load with weights_only=True: a checkpoint can hold tensors and plain data, never code."""
    if not os.path.isfile(path):
        raise FileNotFoundError(f"no checkpoint at {path}")
    return torch.load(path, map_location=map_location, weights_only=True)

def load_model(path_or_ckpt, key="model", map_location="cpu"):
    """Rebuild a model from a nanolap checkpoint (a path or an already loaded dict)."""
    ckpt = load_checkpoint(path_or_ckpt, map_location) if isinstance(path_or_ckpt, str) else path_or_ckpt
    model = build_model(Config(**ckpt["model_config"]))
    model.load_state_dict(clean_state_dict(ckpt[key]))
    return model

def save_checkpoint(obj, path):
    """Atomic: write a temporary file, fsync, rename. An interrupted save leaves the old file intact."""
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    tmp = f"{path}.tmp{os.getpid()}"
    try:
        with open(tmp, "wb") as f:
            torch.save(obj, f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    finally:
        if os.path.exists(tmp):
            os.remove(tmp)

# -----------------------------------------------------------------------------
# helpers shared by train_vit.py, train_gpt.py, train_dino.py and analyze.py

def _literal(text):
    try:
        return ast.literal_eval(text)
    except (ValueError, SyntaxError):
        return text  # a bare word is a string: --dataset=cifar10

def _check_type(key, value, default):
    if default is None or value is None:
        return value
    if isinstance(default, bool) or not isinstance(default, (int, float)):
        ok = isinstance(value, type(default))
    elif isinstance(default, int):
        ok = (isinstance(value, int) and not isinstance(value, bool)) or (
            key == "n_lap" and isinstance(value, (list, tuple)))  # n_lap may be a per-layer list
    else:
        ok = isinstance(value, (int, float)) and not isinstance(value, bool)
        value = float(value) if ok else value
    if not ok:
        raise UsageError(f"--{key}={value!r} has type {type(value).__name__}, "
                         f"expected {type(default).__name__} like the default {default!r}")
    return list(value) if isinstance(value, tuple) else value

def parse_args(defaults, argv=None):
    """Resolve a config dict from defaults, then config files (plain `key = literal` lines), then
    --key=value overrides, in command-line order. Values are Python literals; no code is executed."""
    config = dict(defaults)
    for arg in sys.argv[1:] if argv is None else argv:
        if arg in ("-h", "--help"):
            print((sys.modules["__main__"].__doc__ or "").strip() + "\n\noptions (--key=value; the defaults):")
            print("\n".join(f"  --{k}={v!r}" for k, v in defaults.items()))
            sys.exit(0)
        if arg.startswith("--"):
            key, has_value, text = arg[2:].partition("=")
            if key not in config:
                raise UsageError(f"unknown option --{key}; valid options: {', '.join(sorted(config))}")
            if not has_value:  # --flag is short for --flag=True
                if not isinstance(config[key], bool):
                    raise UsageError(f"--{key} needs a value: --{key}=...")
                text = "True"
            config[key] = _check_type(key, _literal(text), defaults[key])
        else:
            if not os.path.isfile(arg):
                raise UsageError(f"{arg!r} is neither a --key=value option nor a config file")
            try:
                tree = ast.parse(open(arg).read(), arg)
            except SyntaxError as e:
                raise UsageError(f"config file {arg}: line {e.lineno}: {e.msg}")
            for node in tree.body:
                ok = isinstance(node, ast.Assign) and len(node.targets) == 1 and isinstance(node.targets[0], ast.Name)
                if not ok:
                    raise UsageError(f"config file {arg}: line {node.lineno}: only `key = value` lines are allowed")
                key = node.targets[0].id
                if key not in config:
                    raise UsageError(f"config file {arg}: line {node.lineno}: unknown key {key!r}")
                try:
                    value = ast.literal_eval(node.value)
                except ValueError:
                    raise UsageError(f"config file {arg}: line {node.lineno}: {key} must be a literal value")
                config[key] = _check_type(key, value, defaults[key])
    return config

def run_main(main):
    """Call main(); a UsageError, ValueError from Config, or missing file is printed without a traceback."""
    try:
        main()
    except (UsageError, FileNotFoundError, FloatingPointError) as e:
        sys.exit(f"error: {e}")
    except KeyboardInterrupt:
        sys.exit("interrupted; the last checkpoint is intact (resume with --resume)")

def setup_distributed():
    """torchrun sets RANK, LOCAL_RANK and WORLD_SIZE; without them this is a single process.
    Returns (rank, local_rank, world_size, device)."""
    if "RANK" not in os.environ:
        device = "cuda" if torch.cuda.is_available() else "mps" if torch.backends.mps.is_available() else "cpu"
        return 0, 0, 1, device
    rank, local_rank, world = int(os.environ["RANK"]), int(os.environ["LOCAL_RANK"]), int(os.environ["WORLD_SIZE"])
    if torch.cuda.is_available():
        torch.cuda.set_device(local_rank)
        device = f"cuda:{local_rank}"
    else:
        device = "cpu"
    dist.init_process_group("nccl" if device.startswith("cuda") else "gloo")
    return rank, local_rank, world, device

def teardown_distributed():
    if dist.is_initialized():
        dist.destroy_process_group()

def all_reduce_mean(x, device="cpu"):
    """Mean of a number or tensor over processes (identity without a process group)."""
    t = torch.as_tensor(x, dtype=torch.float64, device=device)
    if dist.is_initialized():
        dist.all_reduce(t)
        t /= dist.get_world_size()
    return t.item() if t.ndim == 0 else t

def rng_state():
    state = {"python": random.getstate(), "torch": torch.get_rng_state()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state

def set_rng_state(state):
    random.setstate(state["python"])
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])

def peak_flops(device):
    """bf16 dense peak of the accelerator, for MFU; None where unknown (CPU)."""
    if not str(device).startswith("cuda"):
        return None
    name = torch.cuda.get_device_name(device)
    peaks = dict(H200=989e12, H100=989e12, A100=312e12, L40=181e12, A10=125e12, V100=125e12, T4=65e12)
    return next((flops for key, flops in peaks.items() if key in name), None)

def append_jsonl(path, record):
    """One JSON line per evaluation in out_dir/log.jsonl."""
    with open(path, "a") as f:
        f.write(json.dumps(record) + "\n")

def check_finite(loss, step):
    """Stop before the optimiser step when the loss is NaN or inf; the last checkpoint stays intact."""
    if not math.isfinite(float(loss)):
        raise FloatingPointError(f"non-finite loss {float(loss)} at step {step}: stopping before the optimiser "
                                 f"step; the last checkpoint is intact. Try a lower learning rate or --grad_clip.")

def format_time(seconds):
    seconds = int(seconds)
    return f"{seconds // 3600}h{seconds // 60 % 60:02d}m" if seconds >= 3600 else f"{seconds // 60}m{seconds % 60:02d}s"

# -----------------------------------------------------------------------------
# python nanolap.py: self-check and micro-benchmark on the device present

def _time_step(model, idx, repeats):
    t0 = time.perf_counter()
    for _ in range(repeats):
        logits, loss = model(idx, idx)
        loss.backward()
    if idx.is_cuda:
        torch.cuda.synchronize()
    return (time.perf_counter() - t0) / repeats

def _overhead(models, idx, rounds, repeats):
    """Median ratio of step times (n_lap = n_head) / (n_lap = 0), the two measured in alternation."""
    for m in models:
        _time_step(m, idx, 1)  # warm-up (and compilation)
    ratios, times = [], []
    for r in range(rounds):
        t = [0.0, 0.0]
        for i in (0, 1) if r % 2 == 0 else (1, 0):  # alternate who goes first: no order bias
            t[i] = _time_step(models[i], idx, repeats)
        ratios.append(t[1] / t[0])
        times.append(t)
    med = lambda xs: sorted(xs)[len(xs) // 2]
    return med(ratios), med([t[0] for t in times]), med([t[1] for t in times])

def _selfcheck():
    device = "cuda" if torch.cuda.is_available() else "cpu"
    torch.manual_seed(0)
    print(f"nanolap self-check on {device} (torch {torch.__version__}, {torch.get_num_threads()} threads)")
    # 1. the fused path equals the explicit (I - P) V path, for a mixed per-layer schedule
    max_err = 0.0
    for model in ("vit", "gpt"):
        cfg = make_config(f"{model}-tiny", n_lap=[0, 1, 3, 4], **({"vocab_size": 100} if model == "gpt" else {}))
        m = build_model(cfg).to(device).eval()
        for p in m.parameters() if model == "gpt" else []:  # zero-init projections: every head a no-op
            nn.init.normal_(p, std=0.1)
        x = torch.randint(0, 100, (2, 64), device=device) if model == "gpt" else torch.randn(2, 1, 28, 28, device=device)
        with torch.no_grad():
            max_err = max(max_err, (m(x) - m(x, explicit=True)).abs().max().item())
    print(f"fused vs explicit (I - P) V, mixed schedule [0, 1, 3, 4]: max abs error {max_err:.2e}")
    # 2. the cost of Laplacian heads: forward+backward of one GPT with n_lap = 0 and n_lap = n_head
    T, B = 256, 4
    cfg = dict(n_layer=4, n_embd=256, n_head=8, vocab_size=512, block_size=1024)
    models = [build_model(make_config("gpt-tiny", **cfg, n_lap=k)).to(device) for k in (0, 8)]
    models[1].load_state_dict(models[0].state_dict())
    idx = torch.randint(0, 512, (B, T), device=device)
    rows = [("eager", *_overhead(models, idx, rounds=9, repeats=3)),
            ("compiled", *_overhead([torch.compile(m, fullgraph=True) for m in models], idx, rounds=9, repeats=3))]
    # 3. the explicit path materialises B*H*T*T probabilities: its price at T = 1024
    idx = torch.randint(0, 512, (2, 1024), device=device)
    explicit_model = lambda i, t: models[1](i, t, explicit=True)
    fused, explicit = [(_time_step(m, idx, 1), _time_step(m, idx, 2))[1] for m in (models[1], explicit_model)]
    print(f"\nGPT {cfg['n_layer']}L d{cfg['n_embd']} {cfg['n_head']}h, B={B} T={T}, forward+backward, "
          f"median of 9 interleaved rounds:")
    print(f"{'mode':<10}{'n_lap=0 ms':>12}{'n_lap=8 ms':>12}{'ratio':>8}")
    for mode, ratio, a, b in rows:
        print(f"{mode:<10}{a * 1e3:>12.1f}{b * 1e3:>12.1f}{ratio:>8.3f}")
    print(f"explicit path at T=1024 (B=2): {explicit / fused:.2f}x the fused path")
    print(f"RESULT max_err={max_err:.3g} lap_overhead={rows[0][1]:.3f} "
          f"lap_overhead_compiled={rows[1][1]:.3f} explicit_slowdown={explicit / fused:.2f}")

if __name__ == "__main__":
    _selfcheck()
