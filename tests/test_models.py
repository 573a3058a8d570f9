"""The models around the idea (nanolap.py): the presets at the paper's sizes, each model's own init_weights, clear
errors for bad configs, the ViT's features and attention maps at other image sizes, the GPT's causal generation,
the DINO head, bf16 autocast and a compiled model's checkpoint."""

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
