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
from dataclasses import dataclass, replace

import torch
import torch.nn as nn
import torch.nn.functional as F


# ---- mixed-head attention: the idea -----------------------------------------
class MixedHeadAttention(nn.Module):
    """n_head heads: the first n_att output P V (attention heads), the trailing n_lap (I - P) V (Laplacian heads)."""

    def __init__(self, config, n_lap):
        super().__init__()
        self.n_head = config.n_head
        self.n_kv_head = config.n_kv_head or config.n_head  # key and value heads; fewer: grouped-query attention
        self.n_lap = n_lap
        self.n_att = config.n_head - n_lap
        self.causal = config.causal
        self.dropout = config.dropout
        self.head_dim = config.n_embd // config.n_head
        self.qkv_rows = self.qkv_heights()  # the heights of q, k and v in qkv
        self.qkv = nn.Linear(config.n_embd, sum(self.qkv_rows), bias=config.bias)
        self.proj = nn.Linear(config.n_embd, config.n_embd, bias=config.bias)
        self.q_norm = make_norm(config, self.head_dim) if config.qk_norm else nn.Identity()
        self.k_norm = make_norm(config, self.head_dim) if config.qk_norm else nn.Identity()
        self.resid_drop = nn.Dropout(config.dropout)

    def heads(self, x, rope=None, cache=None):
        """Every head's output before the output projection (B, T, H, D): P V, then V - P V for the trailing n_lap."""
        q, k, v = self.project(x, rope)  # q (B, H, T, D); k and v (B, K, T, D) of this call's T tokens
        keys, values = (k, v) if cache is None else extend_cache(cache, k, v)  # (B, K, S, D): S - T cached, then T
        keys, values = kv_for_kernel(q, keys, values)  # grouped-query attention as SDPA's kernel reads it
        drop = self.dropout if self.training else 0.0  # drops entries of P: (I - P) 1 = 0 holds on average only
        causal = self.causal and q.shape[2] > 1  # a new cached token sees every cached one
        grouped = keys.shape[1] < self.n_head  # fewer key and value heads than query heads
        # P V for every head in one fused call (FlashAttention on a GPU: P is never built)
        y = F.scaled_dot_product_attention(q, keys, values, dropout_p=drop, is_causal=causal, enable_gqa=grouped)
        y = y.transpose(1, 2)  # (B, T, H, D)
        if self.n_lap:  # V - P V for the trailing n_lap heads, V the values of this call's tokens
            v = expand_kv(v, self.n_head).transpose(1, 2)  # (B, T, H, D): each query head's values
            y = torch.cat([y[:, :, :self.n_att], v[:, :, self.n_att:] - y[:, :, self.n_att:]], dim=2)  # (B, T, H, D)
        return y

    def forward(self, x, rope=None, explicit=False, return_attn=False, cache=None):
        """(B, T, C) -> (B, T, C). explicit: through the path that materialises P; return_attn: that path, and P."""
        if explicit or return_attn:
            y, P = self.explicit_heads(x, rope)  # (B, T, H, D), (B, H, T, T)
        else:
            y = self.heads(x, rope, cache)  # (B, T, H, D)
        y = self.resid_drop(self.proj(y.flatten(2)))  # (B, T, C)
        return (y, P) if return_attn else y

    def qkv_heights(self):
        kv_dim = self.n_kv_head * self.head_dim
        return [self.n_head * self.head_dim, kv_dim, kv_dim]

    def project(self, x, rope=None):
        """Queries (B, H, T, D), keys and values (B, K, T, D); queries and keys normalised and rotated."""
        B, T, C = x.shape
        q, k, v = self.qkv(x).split(self.qkv_rows, dim=-1)
        q = self.q_norm(q.view(B, T, -1, self.head_dim))  # (B, T, H, D)
        k = self.k_norm(k.view(B, T, -1, self.head_dim))  # (B, T, K, D)
        v = v.view(B, T, self.n_kv_head, self.head_dim)  # (B, T, K, D)
        if rope is not None:
            q, k = apply_rope(q, *rope), apply_rope(k, *rope)
        return q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)

    def explicit_heads(self, x, rope=None):
        """The same heads (B, T, H, D) with every P (B, H, T, T) materialised, for teaching, analysis and the tests."""
        q, k, v = self.project(x, rope)  # q (B, H, T, D); k and v (B, K, T, D)
        k, v = expand_kv(k, self.n_head), expand_kv(v, self.n_head)  # (B, H, T, D): each query head's keys and values
        scores = (q @ k.transpose(-2, -1)) * self.head_dim ** -0.5  # (B, H, T, T)
        T = scores.shape[-1]
        if self.causal:  # no token sees the future
            scores = scores.masked_fill(torch.ones(T, T, dtype=torch.bool, device=scores.device).triu(1), float("-inf"))
        P = F.dropout(scores.softmax(dim=-1), self.dropout, self.training)
        is_lap = (torch.arange(self.n_head, device=P.device) >= self.n_att).view(1, self.n_head, 1, 1)
        eye = torch.eye(T, device=P.device, dtype=P.dtype)
        y = torch.where(is_lap, eye - P, P) @ v  # (B, H, T, D): (I - P) V for the Laplacian heads, P V for the others
        return y.transpose(1, 2), P

def expand_kv(t, n_head):
    """Grouped-query attention: each of t's K key or value heads (B, K, T, D) serves n_head / K query heads in a row."""
    K = t.shape[1]
    return t if K == n_head else t.repeat_interleave(n_head // K, dim=1)

def extend_cache(cache, k, v):
    """Generation: one layer's cached keys and values (B, K, t, D), then this call's. A Laplacian head caches no more
    than an attention head: row t of V - P V is v_t - sum_s P_ts v_s, and v_t is the new token's own value."""
    if cache:
        k = torch.cat([cache["k"], k], dim=2)
        v = torch.cat([cache["v"], v], dim=2)
    cache.update(k=k, v=v)
    return k, v

def kv_for_kernel(q, k, v):
    """Keys and values as SDPA's kernel reads them. A CPU and FlashAttention (16-bit, capability >= 8.0) read grouped
    ones (B, K, S, D) themselves; SDPA's other CUDA kernels (a T4, float32) would fall back to the math kernel, memory
    growing with T^2 (pytorch #139586), so there every query head gets its own copy (B, H, S, D)."""
    if sdpa_reads_groups(q):
        return k, v
    return expand_kv(k, q.shape[1]), expand_kv(v, q.shape[1])

def sdpa_reads_groups(q):
    return not q.is_cuda or q.dtype != torch.float32 and torch.cuda.get_device_capability(q.device) >= (8, 0)

class UniformGraphAttention(MixedHeadAttention):
    """The mean-mixing baseline (graph='uniform'): every score 0, so P is the plain average over the sequence (causally:
    over the positions <= t) and P V the (running) mean; no queries or keys, so no QK-norm either."""

    def __init__(self, config, n_lap):
        super().__init__(replace(config, qk_norm=False), n_lap)

    def qkv_heights(self):
        return [self.n_kv_head * self.head_dim]  # values only

    def project(self, x, rope=None):
        B, T, C = x.shape
        v = self.qkv(x).view(B, T, self.n_kv_head, self.head_dim)  # (B, T, K, D): values only
        scores = x.new_zeros(B, self.n_head, T, 1)  # (B, H, T, 1): zero queries and keys, so every score is 0
        return scores, scores[:, :self.n_kv_head], v.transpose(1, 2)

class UniformLaplacianAttention(MixedHeadAttention):
    """The mixed graph control (graph='lap_uniform'): the attention heads keep their softmax graph, the Laplacian heads
    alone mix by the uniform graph, V - mean(V) (causally: minus the running mean). Only the attention heads have
    queries and keys; the Laplacian heads' are zero, so each of their scores is 0 and their P the plain average."""

    def qkv_heights(self):
        return [self.n_att * self.head_dim, self.n_att * self.head_dim, self.n_head * self.head_dim]

    def project(self, x, rope=None):
        q, k, v = super().project(x, rope)  # q and k (B, n_att, T, D), v (B, H, T, D)
        zeros = q.new_zeros(q.shape[0], self.n_lap, q.shape[2], self.head_dim)  # the Laplacian heads' queries and keys
        return torch.cat([q, zeros], dim=1), torch.cat([k, zeros], dim=1), v  # (B, H, T, D) each

ATTENTION = dict(attention=MixedHeadAttention, uniform=UniformGraphAttention, lap_uniform=UniformLaplacianAttention)

# ---- norms and rotary embeddings ------------------------------------------
def make_norm(config, dim):  # LayerNorm's eps: timm's and DINO's; RMSNorm without a gain, as nanochat's
    if config.norm == "layernorm":
        return nn.LayerNorm(dim, eps=1e-6, bias=config.bias)
    return nn.RMSNorm(dim, elementwise_affine=False)

def apply_rope(x, cos, sin):  # x: (B, T, H, D), cos/sin: (1, T, 1, D/2)
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat([x1 * cos + x2 * sin, x2 * cos - x1 * sin], dim=-1)

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

def drop_path(x, p, training):  # stochastic depth: drop a whole residual branch per sample, rescale the kept ones
    if p == 0.0 or not training:
        return x
    return x * x.new_empty((x.shape[0],) + (1,) * (x.ndim - 1)).bernoulli_(1 - p) / (1 - p)  # a (B, 1, ..) keep mask

class Block(nn.Module):
    def __init__(self, config, n_lap, drop_path_rate):
        super().__init__()
        self.norm1 = make_norm(config, config.n_embd)
        self.attn = ATTENTION[config.graph](config, n_lap)
        self.ls1 = LayerScale(config.n_embd, config.layerscale) if config.layerscale else nn.Identity()
        self.norm2 = make_norm(config, config.n_embd)
        self.mlp = MLP(config)
        self.ls2 = LayerScale(config.n_embd, config.layerscale) if config.layerscale else nn.Identity()
        self.drop_path = drop_path_rate

    def forward(self, x, rope=None, explicit=False, cache=None):
        h = self.attn(self.norm1(x), rope, explicit, cache=cache)
        x = x + drop_path(self.ls1(h), self.drop_path, self.training)
        return x + drop_path(self.ls2(self.mlp(self.norm2(x))), self.drop_path, self.training)

# ---- config and presets -----------------------------------------------------
CHOICES = dict(model=("vit", "gpt"), norm=("layernorm", "rmsnorm"), mlp=("gelu", "relu2"), pos=("learned", "rope"),
               pooling=("cls", "mean"), graph=tuple(ATTENTION))  # Config's fields with named values

@dataclass
class Config:
    model: str = "vit"  # 'vit' (image classifier / DINO backbone) or 'gpt' (causal LM)
    n_layer: int = 6
    n_head: int = 4
    n_kv_head: int | None = None  # key and value heads (grouped-query attention), a divisor of n_head; None = n_head
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
    graph: str = "attention"  # P: 'attention' (softmax), 'uniform' (every head: the sequence mean) or 'lap_uniform' (the
    # Laplacian heads alone on the sequence mean, the attention heads on softmax)

    def __post_init__(self):
        """The rules between fields, one per check, raising ValueError (the scripts check types against the defaults)."""
        for name, allowed in CHOICES.items():
            self._check(name, getattr(self, name) in allowed, f"allowed values are {allowed}")
        for name in ("n_layer", "n_head", "n_embd", "patch_size", "in_chans", "block_size"):
            self._check(name, getattr(self, name) >= 1, "must be at least 1")
        self._check("n_embd", self.n_embd % self.n_head == 0, f"not divisible by n_head={self.n_head}; choose a multiple of n_head")
        counts = self.n_lap_per_layer()
        self._check("n_lap", all(isinstance(k, int) and not isinstance(k, bool) and k >= 0 for k in counts),
                    "must be a non-negative int or a list of them, one per layer")
        self._check("n_lap", len(counts) == self.n_layer, f"the per-layer list has {len(counts)} entries but n_layer={self.n_layer}")
        self._check("n_lap", max(counts) <= self.n_head, f"at most n_head={self.n_head} Laplacian heads per layer")
        if self.n_kv_head is not None:
            self._check("n_kv_head", 1 <= self.n_kv_head <= self.n_head, f"must lie in [1, n_head={self.n_head}] (or be None)")
            self._check("n_kv_head", self.n_head % self.n_kv_head == 0, f"must divide n_head={self.n_head}")
            self._check("n_kv_head", self.graph != "lap_uniform" or self.n_kv_head == self.n_head,
                        "graph='lap_uniform' has no grouped-query attention; leave n_kv_head None")
        self._check("drop_path", 0 <= self.drop_path < 1, "must lie in [0, 1)")
        self._check("dropout", 0 <= self.dropout < 1, "must lie in [0, 1)")
        if self.pos == "rope":
            self._check("n_embd", (self.n_embd // self.n_head) % 2 == 0, "RoPE needs an even head size")
        if self.model == "gpt":
            self._check("vocab_size", self.vocab_size >= 1, "a GPT needs vocab_size >= 1")
        if self.model == "vit":
            self._check("img_size", self.img_size % self.patch_size == 0, f"not divisible by patch_size={self.patch_size}")

    def _check(self, field, ok, why):
        if not ok:
            raise ValueError(f"Config.{field}={getattr(self, field)!r}: {why}")

    def n_lap_per_layer(self):
        """Number of Laplacian heads in each layer."""
        return list(self.n_lap) if isinstance(self.n_lap, (list, tuple)) else [self.n_lap] * self.n_layer

_VIT = dict(model="vit", qk_norm=True, norm="layernorm", mlp="gelu", bias=True, pos="learned")
_GPT = dict(model="gpt", causal=True, qk_norm=True, norm="rmsnorm", mlp="relu2", bias=False, pos="rope", softcap=15.0)
_IMAGENET = dict(_VIT, n_layer=12, img_size=224, patch_size=16, in_chans=3)  # ViT-*/16
PRESETS = {  # the paper's models and small sizes that train on a laptop CPU; any field can be overridden
    "vit-b": dict(_IMAGENET, n_embd=768, n_head=12, num_classes=1000, layerscale=1e-6),  # DeiT-III ViT-B/16
    "vit-s": dict(_IMAGENET, n_embd=384, n_head=6, num_classes=0, layerscale=1e-6),  # DeiT-III ViT-S/16, the paper's DINO backbone
    "vit-small": dict(_VIT, n_layer=6, n_embd=192, n_head=6, img_size=32, patch_size=4, in_chans=3),
    "vit-tiny": dict(_VIT, n_layer=4, n_embd=96, n_head=4, img_size=28, patch_size=4, in_chans=1),
    # the CPU model: 7x7 patches give 17 tokens instead of 50, and d 64 is cheaper per step than 96
    "vit-cpu": dict(_VIT, n_layer=4, n_embd=64, n_head=4, img_size=28, patch_size=7, in_chans=1),
    "gpt-d20": dict(_GPT, n_layer=20, n_embd=1280, n_head=10, vocab_size=65536, block_size=2048),  # nanochat d20
    "gpt-small": dict(_GPT, n_layer=6, n_embd=384, n_head=6, vocab_size=50304, block_size=256),
    "gpt-tiny": dict(_GPT, n_layer=4, n_embd=128, n_head=4, vocab_size=65, block_size=128),
}

def make_config(preset, **overrides):
    """Config from a named preset plus field overrides (None values are ignored). Raises ValueError."""
    if preset not in PRESETS:
        raise ValueError(f"unknown model preset {preset!r}; choose one of {sorted(PRESETS)}")
    return Config(**{**PRESETS[preset], **{k: v for k, v in overrides.items() if v is not None}})

# ---- trunk shared by the ViT and the GPT ------------------------------------
class Trunk(nn.Module):
    """Blocks + final norm and analysis access; each model initialises its own weights (init_weights)."""
    def __init__(self, config):
        super().__init__()
        self.config = config
        drop_path_rates = [config.drop_path * i / max(config.n_layer - 1, 1) for i in range(config.n_layer)]
        layers = zip(config.n_lap_per_layer(), drop_path_rates)
        self.blocks = nn.ModuleList(Block(config, n_lap, drop_path_rate) for n_lap, drop_path_rate in layers)
        self.norm = make_norm(config, config.n_embd)

    def run_blocks(self, x, rope=None, explicit=False, all_layers=False, cache=None):
        """Final-normed tokens, or with all_layers the list [after block 1, ..., after block L, final norm]."""
        hidden = []
        for i, block in enumerate(self.blocks):
            x = block(x, rope, explicit, None if cache is None else cache.layers[i])
            if all_layers:
                hidden.append(x)
        return hidden + [self.norm(x)] if all_layers else self.norm(x)

    @torch.no_grad()
    def attention_maps(self, x, rope, layer):
        """P (B, H, T, T) of block `layer` through the explicit path; x are the embedded tokens."""
        for block in self.blocks[:layer]:
            x = block(x, rope)
        block = self.blocks[layer]
        return block.attn(block.norm1(x), rope, return_attn=True)[1]

    def num_params(self, exclude_embedding=False):
        """Parameter count; exclude_embedding leaves out token tables, lookups rather than matmuls (the GPT's wte)."""
        tables = sum(m.weight.numel() for m in self.modules() if isinstance(m, nn.Embedding)) if exclude_embedding else 0
        return sum(p.numel() for p in self.parameters()) - tables

    def flops_per_token(self, T):
        """Training FLOPs per token (nanochat): 6N (matmuls) + 12 L d T (attention; a causal half counted too: 9% of gpt-d20's
        total at T 2048); V - P V counts 0; the uniform graph's constant scores: Q K^T forward (width 1), P V and dV."""
        L = self.config.n_layer
        d = self.config.n_embd
        if self.config.graph == "uniform":
            return 6 * self.num_params(exclude_embedding=True) + L * T * (4 * d + 2 * self.config.n_head)
        return 6 * self.num_params(exclude_embedding=True) + 12 * L * d * T

# ---- ViT --------------------------------------------------------------------
class ViT(Trunk):
    """DeiT-III: patch embedding, CLS token, learned positions, head; crops of other sizes (DINO) interpolate them."""
    def __init__(self, config):
        super().__init__(config)
        self.grid = config.img_size // config.patch_size
        self.patch_embed = nn.Conv2d(config.in_chans, config.n_embd, config.patch_size, config.patch_size)
        self.cls_token = nn.Parameter(torch.zeros(1, 1, config.n_embd))
        self.pos_embed = nn.Parameter(torch.zeros(1, self.grid * self.grid, config.n_embd))
        self.head = nn.Linear(config.n_embd, config.num_classes) if config.num_classes else nn.Identity()
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
        pos = self.pos_embed
        h, w = x.shape[-2:]
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
        self.wte = nn.Embedding(config.vocab_size, config.n_embd)
        self.lm_head = nn.Linear(config.n_embd, config.vocab_size, bias=False)
        head_dim = config.n_embd // config.n_head
        inv_freq = config.rope_base ** (-torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim)
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

    def embed(self, idx, start=0):  # idx (B, T) -> tokens (B, T, d) and the rotary (cos, sin) of positions start..start+T-1
        end = start + idx.shape[1]
        if end > self.config.block_size:
            raise ValueError(f"sequence of length {end} is longer than block_size={self.config.block_size}")
        x = F.rms_norm(self.wte(idx), (self.config.n_embd,))
        return x, (self.cos[:, start:end].to(x.dtype), self.sin[:, start:end].to(x.dtype))

    def forward_features(self, idx, explicit=False, all_layers=False, cache=None):
        if cache is not None and (explicit or len(cache) and idx.shape[1] > 1):
            raise ValueError("a KVCache takes the fused path, one prompt first and then one token per call")
        x, rope = self.embed(idx, 0 if cache is None else len(cache))  # a cached call's tokens follow the cached ones
        return self.run_blocks(x, rope, explicit, all_layers, cache)

    def forward(self, idx, targets=None, explicit=False, cache=None):
        logits = self.lm_head(self.forward_features(idx, explicit, cache=cache)).float()  # (B, T, vocab)
        if self.config.softcap:
            logits = self.config.softcap * torch.tanh(logits / self.config.softcap)
        return logits if targets is None else (logits, F.cross_entropy(logits.flatten(0, 1), targets.flatten(), ignore_index=-1))

    def get_attention(self, idx, layer):
        return self.attention_maps(*self.embed(idx), layer)

    @torch.no_grad()
    def generate(self, idx, max_new_tokens, temperature=1.0, top_k=None, generator=None, use_cache=True):
        """Sample continuations of idx (B, T) (temperature 0 = greedy). use_cache: a KVCache of the prompt, then one token
        per call; a full cache restarts from the last half window (a sliding one would void every cached key)."""
        block_size = self.config.block_size
        cache = None
        for _ in range(max_new_tokens):
            if not use_cache:
                logits = self(idx[:, -block_size:])
            elif cache is None or len(cache) == block_size:  # prefill: the prompt, or the last half window
                window = block_size if cache is None else max(block_size // 2, 1)
                cache = KVCache(self.config.n_layer)
                logits = self(idx[:, -window:], cache=cache)
            else:
                logits = self(idx[:, -1:], cache=cache)  # the new token alone, at position len(cache)
            logits = logits[:, -1, :] / max(temperature, 1e-9)
            if top_k:
                logits = logits.masked_fill(logits < torch.topk(logits, min(top_k, logits.size(-1))).values[:, [-1]], -math.inf)
            next_token = (logits.argmax(-1, keepdim=True) if temperature == 0  # greedy, else sampled
                          else torch.multinomial(logits.softmax(-1), 1, generator=generator))
            idx = torch.cat([idx, next_token], dim=1)
        return idx

class KVCache:
    """Generation's memory: each layer's keys and values (B, n_kv_head, t, D), RoPE applied (see extend_cache)."""
    def __init__(self, n_layer):
        self.layers = [{} for _ in range(n_layer)]  # one dict per layer, filled by MixedHeadAttention.heads

    def __len__(self):  # positions cached: the next token's position
        return self.layers[0]["v"].shape[2] if self.layers[0] else 0

# ---- DINO head --------------------------------------------------------------
class DINOHead(nn.Module):
    """DINO's head: MLP -> L2-normalised bottleneck -> linear g * v / |v| per row (norm_last_layer freezes g at 1)."""
    def __init__(self, in_dim, out_dim=4096, hidden_dim=2048, bottleneck_dim=256, n_layers=3, norm_last_layer=True):
        super().__init__()
        dims = [in_dim] + [hidden_dim] * (n_layers - 1) + [bottleneck_dim]
        linears = [nn.Linear(d_in, d_out) for d_in, d_out in zip(dims[:-1], dims[1:])]
        for m in linears:
            nn.init.trunc_normal_(m.weight, std=0.02)
            nn.init.zeros_(m.bias)
        self.mlp = nn.Sequential(*[m for lin in linears for m in (lin, nn.GELU())][:-1])  # no GELU at the end
        self.weight_v = nn.Parameter(nn.init.kaiming_uniform_(torch.empty(out_dim, bottleneck_dim), a=math.sqrt(5)))  # nn.Linear's, as DINO
        self.weight_g = nn.Parameter(torch.ones(out_dim, 1), requires_grad=not norm_last_layer)

    def forward(self, x):
        return F.linear(F.normalize(self.mlp(x), dim=-1), self.weight_g * F.normalize(self.weight_v, dim=-1))

def build_model(config):
    return ViT(config) if config.model == "vit" else GPT(config)
