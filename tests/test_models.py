"""The models around the idea (nanolap.py): the presets at the paper's sizes, each model's own init_weights, clear
errors for bad configs, the ViT's features and attention maps at other image sizes, the GPT's causal generation,
the DINO head, bf16 autocast and a compiled model's checkpoint."""

import math
import re
from dataclasses import asdict

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import common
import nanolap
from conftest import randomise
from nanolap import Config, build_model, make_config


def test_paper_presets_have_the_paper_sizes():
    assert nanolap.PRESETS["vit-b"]["n_embd"] == 768 and nanolap.PRESETS["vit-s"]["n_head"] == 6
    with torch.device("meta"):
        d20 = build_model(make_config("gpt-d20"))
    assert 540e6 < d20.num_params() < 580e6  # nanochat d20: ~561M


def test_vit_s_preset_is_the_deit3_small_of_the_paper_dino_runs():
    cfg = make_config("vit-s")  # the first author's deit3_small_*L_patch16_224: QK-norm, LayerScale 1e-6
    assert (cfg.n_layer, cfg.n_embd, cfg.n_head, cfg.patch_size, cfg.qk_norm, cfg.layerscale) == (12, 384, 6, 16, True, 1e-6)
    model = build_model(make_config("vit-s", n_layer=1))
    assert all(torch.equal(ls.gamma, torch.full((384,), 1e-6)) for ls in (model.blocks[0].ls1, model.blocks[0].ls2))
    assert model.pos_embed.shape == (1, 14 * 14, 384)  # positions for the patches only, not for the CLS token


def test_vit_init_follows_timm():
    torch.manual_seed(0)
    model = build_model(make_config("vit-small", n_lap=2))
    norms = [m for m in model.modules() if isinstance(m, nn.LayerNorm)]
    assert len(norms) == 6 * 4 + 1 and all(m.eps == 1e-6 for m in norms)  # norm1, norm2, q_norm, k_norm; the last
    assert model.cls_token.std() < 1e-5 and 0.017 < model.pos_embed.std() < 0.023  # N(0, 1e-6), trunc normal(0.02)
    torch.manual_seed(0)
    again = build_model(make_config("vit-small", n_lap=2))  # one seed, one model
    assert all(torch.equal(a, b) for a, b in zip(model.state_dict().values(), again.state_dict().values()))



@pytest.mark.parametrize("preset, overrides", [("vit-cpu", dict(layerscale=1e-6)), ("gpt-tiny", {})])
def test_each_model_initialises_its_own_weights_as_its_docstring_says(preset, overrides):
    """init_weights is the model's own (no base class reaches into a subclass) and its docstring names every
    parameter (by its path inside a block, or the model's own attribute)."""
    model = build_model(make_config(preset, n_lap=2, **overrides))
    assert "init_weights" not in vars(nanolap.Trunk) and "init_weights" in vars(type(model))
    doc = type(model).init_weights.__doc__
    paths = {re.sub(r"^blocks\.\d+\.|\.(weight|bias|gamma)$", "", name) for name, _ in model.named_parameters()}
    undocumented = [p for p in sorted(paths) if not re.search(rf"(?<![\w.]){re.escape(p)}(?!\w)", doc)]
    assert not undocumented, f"init_weights' docstring does not say how {undocumented} start"


def trunc_normal_draws_normal():
    """Whether torch's nn.init.trunc_normal_ draws with normal_ and rejects outliers (torch 2.14) rather than mapping
    uniform draws through the inverse CDF (torch 2.11 and earlier): one seed gives other weights under each."""
    torch.manual_seed(0)
    drawn = nn.init.trunc_normal_(torch.empty(8), std=0.02)
    torch.manual_seed(0)
    return torch.equal(drawn, torch.empty(8).normal_(0, 0.02))


# How far the sums of the initial weights may move on another CPU. The weights are float32 draws, and another CPU's
# random-number kernels (torch's scalar ones, or those of another vector width) may round each weight apart by an ulp
# or a few. With every weight k ulps off, the sum moves by at most k * eps * sum |w| and the sum of squares by at most
# 2 * k * eps * sum w^2 (eps: float32's 2^-23, an ulp of 1). We allow k = 16. Measured against the recorded sums (an
# AMD EPYC's AVX512 kernels): torch's scalar kernels (ATEN_CPU_CAPABILITY=default, what a CPU without AVX2 runs) move
# the sum by 0.15 (ViT) and 0.18 (GPT) of eps * sum |w|, the squares by 0.009 of 2 eps sum w^2 or less. A real change
# moves them far more: every init std 1% larger moves the sum by 72 (GPT) to 166 (ViT) of those units and the squares
# by 8300 to 84000, a std 0.1% larger the squares by 830; one tensor drawn at another position of the random stream
# moves the sum by 1400 or more.
INIT_ULPS = 16
FLOAT32_EPS = torch.finfo(torch.float32).eps
INIT_SUMS = [  # preset, overrides, {trunc_normal_draws_normal(): (sum, sum of squares)}
    ("vit-cpu", dict(layerscale=1e-6), {True: (689.8936297486409, 804.8857045457419),
                                        False: (701.7742873626524, 804.8934572958057)}),
    ("gpt-tiny", {}, {True: (33.339676446469696, 12187.229609323887), False: (33.339676446469696, 12187.229609323887)}),
]


def init_drift(weights, total, squares):
    """How far the weights' sum and sum of squares (in float64) lie from total and squares, each as a fraction of
    what INIT_ULPS float32 ulps per weight allow: both at most 1 when they agree."""
    weights = [w.double() for w in weights]
    magnitude = sum(w.abs().sum().item() for w in weights)
    sum_drift = abs(sum(w.sum().item() for w in weights) - total) / (INIT_ULPS * FLOAT32_EPS * magnitude)
    squares_tolerance = 2 * INIT_ULPS * FLOAT32_EPS * squares
    squares_drift = abs(sum(w.square().sum().item() for w in weights) - squares) / squares_tolerance
    return sum_drift, squares_drift


def with_std_scaled(init, factor):
    """The initialiser init (nn.init.normal_ or trunc_normal_) with every std multiplied by factor."""
    def scaled(tensor, mean=0.0, std=1.0, *args, **kwargs):
        return init(tensor, mean, factor * std, *args, **kwargs)
    return scaled


def seed_0_weights(preset, overrides):
    torch.manual_seed(0)
    return list(build_model(make_config(preset, n_lap=2, **overrides)).state_dict().values())


@pytest.mark.parametrize("preset, overrides, sums", INIT_SUMS)
def test_a_seed_gives_the_same_initial_weights_as_before(preset, overrides, sums):
    """The sums of the initial weights at seed 0, recorded from the code before the init moved into each model
    (torch 2.14.1 and 2.11.0 on a CPU, one pair for each trunc_normal_ algorithm; the GPT draws no truncated
    normal), within INIT_ULPS of float32 rounding (they came from another CPU): a reordered draw or a changed init
    changes them."""
    total, squares = sums[trunc_normal_draws_normal()]
    sum_drift, squares_drift = init_drift(seed_0_weights(preset, overrides), total, squares)
    assert sum_drift <= 1 and squares_drift <= 1, (sum_drift, squares_drift)


@pytest.mark.parametrize("preset, overrides, sums", INIT_SUMS)
def test_the_initial_weight_sums_tolerate_rounding_but_not_a_changed_init(preset, overrides, sums, monkeypatch):
    """The comparison above passes the seed-0 weights with every weight moved 4 float32 ulps (up, down, away from
    zero, toward zero: another CPU's rounding), and fails two real changes: every init std 1% larger, and one more
    draw from the random stream before the model's."""
    total, squares = sums[trunc_normal_draws_normal()]
    weights = seed_0_weights(preset, overrides)
    directions = {"up": lambda w: torch.full_like(w, math.inf), "down": lambda w: torch.full_like(w, -math.inf),
                  "away from zero": lambda w: torch.copysign(torch.full_like(w, math.inf), w),
                  "toward zero": torch.zeros_like}
    for name, target in directions.items():
        moved = []
        for w in weights:
            for _ in range(4):
                w = torch.nextafter(w, target(w))
            moved.append(w)
        assert max(init_drift(moved, total, squares)) <= 1, name
    monkeypatch.setattr(nn.init, "trunc_normal_", with_std_scaled(nn.init.trunc_normal_, 1.01))
    monkeypatch.setattr(nn.init, "normal_", with_std_scaled(nn.init.normal_, 1.01))
    assert max(init_drift(seed_0_weights(preset, overrides), total, squares)) > 1, "every std 1% larger"
    monkeypatch.undo()
    torch.manual_seed(0)
    torch.randn(1)  # a draw before the model's: every later draw shifts
    shifted = build_model(make_config(preset, n_lap=2, **overrides)).state_dict().values()
    assert max(init_drift(shifted, total, squares)) > 1, "one more draw first"


@pytest.mark.parametrize("overrides, message", [
    (dict(n_lap=5), "at most n_head"),
    (dict(n_lap=-1), "non-negative"),
    (dict(n_lap=[1, 2]), "has 2 entries but n_layer=4"),
    (dict(n_lap=[1, 2, 3, 9]), "at most n_head"),
    (dict(n_lap=1.5), "non-negative int or a list"),
    (dict(n_embd=100, n_head=3), "not divisible by n_head"),
    (dict(mlp="swish"), "allowed values"),
    (dict(norm="batchnorm"), "allowed values"),
    (dict(pooling="max"), "allowed values"),
    (dict(n_layer=0), "at least 1"),
    (dict(dropout=1.0), "[0, 1)"),
    (dict(img_size=30), "not divisible by patch_size"),
])
def test_invalid_vit_configs_raise_clear_errors(overrides, message):
    with pytest.raises(ValueError, match=None) as err:
        make_config("vit-tiny", **overrides)
    assert message in str(err.value)


@pytest.mark.parametrize("overrides, message", [
    (dict(n_embd=132, n_head=4), "even head size"),  # head size 33
    (dict(vocab_size=0), "vocab_size"),
    (dict(n_kv_head=3), "Config.n_kv_head=3: must divide n_head=4"),
    (dict(n_kv_head=0), "Config.n_kv_head=0: must lie in [1, n_head=4]"),
    (dict(n_kv_head=-2), "must lie in [1, n_head=4]"),
    (dict(n_kv_head=8), "must lie in [1, n_head=4]"),
])
def test_invalid_gpt_configs_raise_clear_errors(overrides, message):
    with pytest.raises(ValueError) as err:
        make_config("gpt-tiny", **overrides)
    assert message in str(err.value)


def test_config_raises_value_error_directly_and_unknown_preset():
    with pytest.raises(ValueError, match="n_lap"):
        Config(n_lap=7)
    with pytest.raises(ValueError, match="unknown model preset"):
        make_config("vit-huge")


def test_gpt_rejects_sequences_longer_than_block_size():
    model = build_model(make_config("gpt-tiny", block_size=8))
    with pytest.raises(ValueError, match="longer than block_size=8"):
        model(torch.zeros(1, 9, dtype=torch.long))


def test_vit_features_pooling_attention_and_other_image_sizes():
    torch.manual_seed(0)
    model = build_model(make_config("vit-tiny", n_lap=2, pooling="mean")).eval()
    img = torch.randn(3, 1, 28, 28)
    hidden = model.forward_features(img, all_layers=True)
    assert len(hidden) == 5 and hidden[-1].shape == (3, 50, 96)
    torch.testing.assert_close(model(img), model.head(hidden[-1][:, 1:].mean(1)))
    P = model.get_attention(img, layer=2)
    assert P.shape == (3, 4, 50, 50)
    torch.testing.assert_close(P.sum(-1), torch.ones(3, 4, 50))
    assert model(torch.randn(2, 1, 16, 16)).shape == (2, 10)  # local crops: positions are interpolated
    features = build_model(make_config("vit-tiny", num_classes=0))
    assert features(img).shape == (3, 96)


def test_gpt_attention_is_causal_and_generation_respects_block_size():
    model = randomise(build_model(make_config("gpt-tiny", n_lap=1, vocab_size=10, block_size=8)), std=0.1)
    P = model.get_attention(torch.randint(0, 10, (1, 8)), layer=1)
    assert torch.all(P.triu(1) == 0)
    out = model.generate(torch.zeros(2, 3, dtype=torch.long), 12, temperature=0.8, top_k=3,
                         generator=torch.Generator().manual_seed(0))
    assert out.shape == (2, 15) and out.max() < 10
    greedy = model.generate(torch.zeros(1, 3, dtype=torch.long), 4, temperature=0)
    assert torch.equal(greedy[:, :4], torch.cat([torch.zeros(1, 3, dtype=torch.long),
                                                 model(torch.zeros(1, 3, dtype=torch.long))[:, -1:].argmax(-1)], 1))


def test_dino_head_weight_norm_and_frozen_norm():
    head = nanolap.DINOHead(96, out_dim=64, hidden_dim=32, bottleneck_dim=16)
    out = head(torch.randn(5, 96))
    assert out.shape == (5, 64)
    w = head.weight_g * F.normalize(head.weight_v, dim=-1)
    torch.testing.assert_close(w.norm(dim=-1), torch.ones(64))
    assert not head.weight_g.requires_grad and head.weight_v.requires_grad
    assert nanolap.DINOHead(96, 64, 32, 16, norm_last_layer=False).weight_g.requires_grad


def test_dino_head_last_layer_starts_with_nn_linear_init():
    """DINO keeps nn.Linear's init for the last layer: U(-1/sqrt(256), 1/sqrt(256)), rows of norm ~ 1/sqrt(3) = 0.58
    (trunc normal(0.02) would give 0.02 * sqrt(256) = 0.32)."""
    torch.manual_seed(0)
    v = nanolap.DINOHead(32, out_dim=512, hidden_dim=32, bottleneck_dim=256).weight_v
    assert abs(v.norm(dim=-1).mean().item() - 3 ** -0.5) < 0.02 and v.abs().max() <= 256 ** -0.5


def test_bf16_autocast_runs_on_cpu():
    model = randomise(build_model(make_config("gpt-tiny", n_lap=2, vocab_size=20)), std=0.1)
    idx = torch.randint(0, 20, (2, 16))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        logits, loss = model(idx, idx)
    loss.backward()
    assert torch.isfinite(loss) and logits.dtype == torch.float32
    assert model.blocks[0].attn.qkv.weight.grad is not None


@pytest.mark.slow
def test_a_compiled_models_checkpoint_loads_into_an_eager_one(tmp_path):
    """A compiled model's state dict carries `_orig_mod.`; load_model strips it. (Compiled against eager outputs:
    tests/test_compiled.py.)"""
    torch.manual_seed(0)
    model = randomise(build_model(make_config("gpt-tiny", n_lap=[0, 4, 2, 1], vocab_size=30)), std=0.1).eval()
    compiled = torch.compile(model, fullgraph=True)
    idx = torch.randint(0, 30, (2, 24))
    path = str(tmp_path / "ckpt.pt")
    common.save_checkpoint({"model": compiled.state_dict(), "model_config": asdict(model.config)}, path)
    assert any(k.startswith("_orig_mod.") for k in torch.load(path, weights_only=True)["model"])
    loaded = common.load_model(common.load_checkpoint(path)).eval()
    assert loaded.config == model.config
    with torch.no_grad():
        torch.testing.assert_close(loaded(idx), model(idx), atol=0, rtol=0)
