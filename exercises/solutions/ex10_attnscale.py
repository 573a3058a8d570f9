"""Exercise 10: a high-pass relative side by side. Reference solution.

AttnScale (Wang, Zheng, Chen and Wang, "Anti-Oversmoothing in Deep Vision Transformers via the Fourier Domain
Analysis", ICLR 2022, arXiv 2203.05962) splits each head's P into a low-pass part, U = 11^T / T (every row the plain
mean of the sequence), and a high-pass part, P - U, and learns a gain 1 + lambda on the high-pass part, one lambda per
head: P_lambda = U + (1 + lambda)(P - U), so that P_lambda V = (1 + lambda) P V - lambda mean(V).

nanolap.py stays untouched: attnscale_model() swaps the attention module of every block of a built ViT for this
subclass.
"""

import torch
import torch.nn as nn
import torch.nn.functional as F

import nanolap


class AttnScaleAttention(nanolap.MixedHeadAttention):
    """MixedHeadAttention with AttnScale's heads: one lambda per head, 0 at the start (every head an attention head), as
    in AttnScale's code. For a ViT only: U averages the whole sequence, which a causal model must not see."""
    def __init__(self, config):
        super().__init__(config, n_lap=0)
        if config.causal:
            raise ValueError("AttnScale's U averages the whole sequence, future tokens too: use it in a ViT")
        self.lam = nn.Parameter(torch.zeros(config.n_head))

    def forward(self, x, rope=None, explicit=False, return_attn=False, cache=None):
        """Head h outputs (1 + lambda_h) P V - lambda_h mean(V), then the projection (a ViT: rope is None; explicit,
        return_attn and cache: unused)."""
        B, T, C = x.shape
        H, D = self.n_head, self.head_dim
        q, k, v = self.qkv(x).view(B, T, 3, H, D).unbind(2)  # each (B, T, H, D)
        q, k = self.q_norm(q), self.k_norm(k)
        pv = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2),
                                            v.transpose(1, 2)).transpose(1, 2)  # (B, T, H, D): P V per head
        mean = v.mean(dim=1, keepdim=True)  # (B, 1, H, D): U V, the same row for every token
        lam = self.lam.view(1, 1, H, 1)
        y = (1 + lam) * pv - lam * mean  # (B, T, H, D): U V + (1 + lambda)(P V - U V)
        return self.resid_drop(self.proj(y.reshape(B, T, C)))


def attnscale_model(config):
    """nanolap.build_model(config) with every block's attention replaced by an AttnScaleAttention holding the same
    initial weights (config.n_lap is ignored). No need to change this."""
    model = nanolap.build_model(config)
    for block in model.blocks:
        relative = AttnScaleAttention(config)
        relative.load_state_dict(block.attn.state_dict(), strict=False)  # strict=False: the new lam keeps its 0
        block.attn = relative
    return model
