"""Exercise 6 (2 hours): a learnable head type. The task is in exercises/README.md.

Every head gets a gate g = sigmoid(gate_logit) in [0, 1] and outputs (1 - g) P V + g (V - P V) = P V + g (V - 2 P V):
g = 0 is an attention head, g = 1 a Laplacian head. nanolap.py stays untouched: gated_model() swaps the attention
module of every block of a built model for this subclass.

Write GatedHeadAttention.forward, then run:  python exercises/check.py 6
"""

import torch
import torch.nn as nn
import torch.nn.functional as F  # noqa: F401 (for your code)

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
        cache: unused; a GPT of these heads generates with use_cache=False).

        Replace this body: it ignores the gates and makes every head an attention head, so the gates never learn
        and the check fails."""
        return super().forward(x, rope)


def gated_model(config):
    """nanolap.build_model(config) with every block's attention replaced by a GatedHeadAttention holding the same
    initial weights (config.n_lap is ignored: the gates decide). No need to change this."""
    model = nanolap.build_model(config)
    for block in model.blocks:
        gated = GatedHeadAttention(config)
        gated.load_state_dict(block.attn.state_dict(), strict=False)  # strict=False: the new gate_logit keeps its 0
        block.attn = gated
    return model
