"""Exercise 1: what a Laplacian head ignores. Reference solution."""

import torch


def laplacian(P):
    """The random-walk Laplacian I - P of attention maps P (..., T, T), for every map of the batch at once."""
    return torch.eye(P.shape[-1], dtype=P.dtype) - P  # the identity broadcasts over the leading dimensions
