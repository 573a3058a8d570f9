"""dev/gpu_bench.py before a GPU is at hand: its recipes pass only options their scripts have, and its generated data
are learnable. Its recipes run compiled on the CPU in test_compiled.py (slow tier)."""

import json
import os
import re
import sys
from collections import Counter

import numpy as np
import torch

from conftest import ROOT

sys.path.insert(0, os.path.join(ROOT, "dev"))
import gpu_bench  # noqa: E402


def script_options(script):
    """The options a script declares (configurator.declared_options: `name = value  # comment` at the top level)."""
    return set(re.findall(r"^([a-z]\w*) = .*?  # ", open(os.path.join(ROOT, script)).read(), re.M))


def test_every_option_the_recipes_pass_is_one_of_their_script():
    """What a GPU would meet first: an option a script does not have (or a config file that is not there) ends the
    run at once. Config files' keys included; a T4 (14.5 GiB free, compute capability 7.5) gets float16."""
    runs = gpu_bench.recipe_runs("cuda", gpu_bench.half_dtype((7, 5)), 14.5, "out", 100)
    for script, (options, _) in runs.items():
        declared = script_options(script)
        for arg in options:
            if arg.startswith("--"):
                assert arg[2:].split("=")[0] in declared, (script, arg)
            else:
                keys = re.findall(r"^(\w+) = ", open(os.path.join(ROOT, arg)).read(), re.M)
                assert keys and set(keys) <= declared, (script, arg)
        assert "--dtype=float16" in options
    assert "--batch_size=4" in runs["train_gpt.py"][0]  # 1.2 GiB a sequence of 1024 tokens


def test_the_generated_tokens_are_a_learnable_gpt2_sized_set(tmp_path):
    """7 of 8 next tokens follow from the one before: among tokens seen at least 5 times, the usual next token is the
    next one 89% of the time (in a random stream of this vocabulary 15%)."""
    gpu_bench.write_tokens(str(tmp_path), n_train=2**18, n_val=2**12)
    meta = json.load(open(tmp_path / "meta.json"))
    train = np.fromfile(tmp_path / "train.bin", dtype=np.uint16)
    assert len(train) == 2**18 and train.max() < meta["vocab_size"] - 1 == 50256 and len(meta["token_bytes"]) == 50257
    assert os.path.getsize(tmp_path / "val.bin") == 2 * 2**12
    successors = {}
    for a, b in zip(train[:-1].tolist(), train[1:].tolist()):
        successors.setdefault(a, Counter())[b] += 1
    often = [c for c in successors.values() if c.total() >= 5]
    assert sum(max(c.values()) for c in often) / sum(c.total() for c in often) > 0.8


def test_colour_images_are_a_learnable_colour_set():
    data = gpu_bench.colour_images(200, 50)
    x, y = data["train"]
    assert x.shape == (200, 3, 32, 32) and x.dtype == torch.uint8 and data["val"][0].shape == (50, 3, 32, 32)
    assert len(data["mean"]) == 3 and data["num_classes"] == 10 and set(y.tolist()) == set(range(10))
    means = torch.stack([x[y == k].float().mean(0) for k in range(10)])  # (10, 3, 32, 32): one mean image per class
    assert torch.cdist(means.flatten(1), means.flatten(1)).add(torch.eye(10) * 1e9).min() > 100  # classes differ
