"""Exercise 1 (10 minutes): what a Laplacian head ignores. The task is in exercises/README.md.

Write laplacian(P), then run:  python exercises/check.py 1
"""

import torch  # noqa: F401 (for your code)


def laplacian(P):
    """The random-walk Laplacian I - P of attention maps P (..., T, T), for every map of the batch at once.

    Replace this body: it returns P itself, the operator of an attention head, so the check fails."""
    return P
