"""Exercise 10 (90 minutes): a high-pass relative side by side. The task is in exercises/README.md.

AttnScale (Wang, Zheng, Chen and Wang, "Anti-Oversmoothing in Deep Vision Transformers via the Fourier Domain
Analysis", ICLR 2022, arXiv 2203.05962) splits each head's P into a low-pass part, U = 11^T / T (every row the plain
mean of the sequence), and a high-pass part, P - U, and learns a gain 1 + lambda on the high-pass part, one lambda per
head: P_lambda = U + (1 + lambda)(P - U), so that P_lambda V = (1 + lambda) P V - lambda mean(V).

nanolap.py stays untouched: attnscale_model() swaps the attention module of every block of a built ViT for this
subclass.

Write AttnScaleAttention.forward, then run:  python exercises/check.py 10
"""

import torch
import torch.nn as nn
import torch.nn.functional as F  # noqa: F401 (for your code)

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
        return_attn and cache: unused).

        Replace this body: it ignores lambda, so every head stays an attention head whatever lambda is and the check
        fails. Compute P V with one F.scaled_dot_product_attention call, as nanolap.py does."""
        return super().forward(x, rope)


def attnscale_model(config):
    """nanolap.build_model(config) with every block's attention replaced by an AttnScaleAttention holding the same
    initial weights (config.n_lap is ignored). No need to change this."""
    model = nanolap.build_model(config)
    for block in model.blocks:
        relative = AttnScaleAttention(config)
        relative.load_state_dict(block.attn.state_dict(), strict=False)  # strict=False: the new lam keeps its 0
        block.attn = relative
    return model
