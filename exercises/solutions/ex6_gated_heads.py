"""Exercise 6: a learnable head type. Reference solution.

Every head gets a gate g = sigmoid(gate_logit) in [0, 1] and outputs (1 - g) P V + g (V - P V) = P V + g (V - 2 P V):
g = 0 is an attention head, g = 1 a Laplacian head. nanolap.py stays untouched: gated_model() swaps the attention
module of every block of a built model for this subclass.
"""

import torch
import torch.nn as nn
import torch.nn.functional as F

import nanolap


class GatedHeadAttention(nanolap.MixedHeadAttention):
    """MixedHeadAttention whose head types are learned: one gate per head, sigmoid(0) = 1/2 at the start."""
    def __init__(self, config):
        super().__init__(config, n_lap=0)
        self.gate_logit = nn.Parameter(torch.zeros(config.n_head))

    def gates(self):
        return torch.sigmoid(self.gate_logit)  # (H,)

    def forward(self, x, rope=None, explicit=False, return_attn=False, cache=None):
        """Head h outputs (1 - g_h) P V + g_h (V - P V), then the projection (explicit, return_attn and
        cache: unused; a GPT of these heads generates with use_cache=False)."""
        B, T, C = x.shape
        H, D = self.n_head, self.head_dim
        q, k, v = self.qkv(x).view(B, T, 3, H, D).unbind(2)  # each (B, T, H, D)
        q, k = self.q_norm(q), self.k_norm(k)
        if rope is not None:
            q, k = nanolap.apply_rope(q, *rope), nanolap.apply_rope(k, *rope)
        pv = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
                                            is_causal=self.causal).transpose(1, 2)  # (B, T, H, D): P V per head
        g = self.gates().view(1, 1, H, 1)
        y = pv + g * (v - 2 * pv)  # (B, T, H, D): (1 - g) P V + g (V - P V)
        return self.resid_drop(self.proj(y.reshape(B, T, C)))


def gated_model(config):
    """nanolap.build_model(config) with every block's attention replaced by a GatedHeadAttention holding the same
    initial weights (config.n_lap is ignored: the gates decide). No need to change this."""
    model = nanolap.build_model(config)
    for block in model.blocks:
        gated = GatedHeadAttention(config)
        gated.load_state_dict(block.attn.state_dict(), strict=False)  # strict=False: the new gate_logit keeps its 0
        block.attn = gated
    return model
