"""The model is right: Laplacian heads compute (I - P) V, n_lap = 0 is a standard transformer, and the
helpers around the model keep their promises."""

import os
import sys

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import nanolap  # noqa: E402
from nanolap import Config, MixedHeadAttention, build_model, make_config  # noqa: E402


def randomise(model, std=0.2, seed=0):
    """GPTs start with zero output projections (every head a no-op): give every weight a value."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(torch.randn(p.shape, generator=g) * std)
    return model


def reference_attention(attn, x, rope=None):
    """(I - P) V for Laplacian heads and P V for attention heads, written out from the module's weights."""
    B, T, C = x.shape
    H, D = attn.n_head, attn.head_dim
    W, b = attn.qkv.weight, attn.qkv.bias
    qkv = x @ W.T + (b if b is not None else 0)
    q, k, v = qkv.split(C, dim=-1)
    heads = []
    for h in range(H):
        qh, kh, vh = (t[..., h * D:(h + 1) * D] for t in (q, k, v))
        qh, kh = attn.q_norm(qh), attn.k_norm(kh)
        if rope is not None:
            qh, kh = nanolap.apply_rope(qh[:, :, None], *rope)[:, :, 0], nanolap.apply_rope(kh[:, :, None], *rope)[:, :, 0]
        scores = qh @ kh.transpose(1, 2) / D ** 0.5
        if attn.causal:
            scores = scores + torch.full((T, T), float("-inf")).triu(1)
        P = scores.softmax(-1)
        op = torch.eye(T) - P if h >= H - attn.n_lap else P
        heads.append(op @ vh)
    y = torch.cat(heads, dim=-1)
    return y @ attn.proj.weight.T + (attn.proj.bias if attn.proj.bias is not None else 0)


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("n_lap", [0, 1, 3, 4])
def test_fused_equals_explicit_reference(causal, n_lap):
    torch.manual_seed(0)
    preset = "gpt-tiny" if causal else "vit-tiny"
    cfg = make_config(preset, n_lap=n_lap, n_layer=1, **({"vocab_size": 10} if causal else {}))
    attn = randomise(MixedHeadAttention(cfg, n_lap), std=0.3).eval()
    x = torch.randn(2, 17, cfg.n_embd)
    expected = reference_attention(attn, x)
    torch.testing.assert_close(attn(x), expected, atol=2e-5, rtol=1e-4)
    torch.testing.assert_close(attn(x, explicit=True), expected, atol=2e-5, rtol=1e-4)


def test_fused_equals_reference_with_rope():
    torch.manual_seed(0)
    model = randomise(build_model(make_config("gpt-tiny", n_lap=2, vocab_size=10)), std=0.3)
    attn, T = model.blocks[0].attn, 12
    rope = (model.cos[:, :T], model.sin[:, :T])
    x = torch.randn(2, T, model.config.n_embd)
    torch.testing.assert_close(attn(x, rope), reference_attention(attn, x, rope), atol=2e-5, rtol=1e-4)


@pytest.mark.parametrize("kind", ["vit", "gpt"])
def test_whole_model_fused_equals_explicit_mixed_schedule(kind):
    torch.manual_seed(0)
    cfg = make_config(f"{kind}-tiny", n_lap=[4, 0, 2, 1], **({"vocab_size": 50} if kind == "gpt" else {}))
    model = randomise(build_model(cfg), std=0.1).eval()
    x = torch.randint(0, 50, (2, 40)) if kind == "gpt" else torch.randn(2, 1, 28, 28)
    with torch.no_grad():
        torch.testing.assert_close(model(x), model(x, explicit=True), atol=1e-4, rtol=1e-4)
    assert [b.attn.n_lap for b in model.blocks] == [4, 0, 2, 1]


def test_no_laplacian_heads_is_standard_multihead_attention():
    torch.manual_seed(0)
    cfg = make_config("vit-tiny", n_lap=0, qk_norm=False)
    attn = MixedHeadAttention(cfg, 0).eval()
    mha = nn.MultiheadAttention(cfg.n_embd, cfg.n_head, batch_first=True).eval()
    with torch.no_grad():
        mha.in_proj_weight.copy_(attn.qkv.weight)
        mha.in_proj_bias.copy_(attn.qkv.bias.uniform_(-1, 1))
        mha.out_proj.weight.copy_(attn.proj.weight)
        mha.out_proj.bias.copy_(attn.proj.bias.uniform_(-1, 1))
    x = torch.randn(3, 20, cfg.n_embd)
    expected = mha(x, x, x, need_weights=False)[0]
    torch.testing.assert_close(attn(x), expected, atol=1e-5, rtol=1e-4)
    # and causally, against MHA with a boolean mask
    attn.causal = True
    expected = mha(x, x, x, attn_mask=torch.ones(20, 20, dtype=torch.bool).triu(1), need_weights=False)[0]
    torch.testing.assert_close(attn(x), expected, atol=1e-5, rtol=1e-4)


def test_laplacian_head_ignores_a_shared_value_component():
    torch.manual_seed(0)
    cfg = make_config("vit-tiny", n_lap=4)
    attn = randomise(MixedHeadAttention(cfg, 4), std=0.3).eval()
    x = torch.randn(2, 10, cfg.n_embd)
    before = attn(x)
    with torch.no_grad():  # add the same vector to every token's value (through the value bias)
        attn.qkv.bias[2 * cfg.n_embd:] += torch.randn(cfg.n_embd) * 5
    torch.testing.assert_close(attn(x), before, atol=1e-4, rtol=1e-4)
    # an attention head passes the shared component straight through: its output does change
    cfg0 = make_config("vit-tiny", n_lap=0)
    attn0 = randomise(MixedHeadAttention(cfg0, 0), std=0.3).eval()
    before = attn0(x)
    with torch.no_grad():
        attn0.qkv.bias[2 * cfg.n_embd:] += torch.randn(cfg.n_embd) * 5
    assert (attn0(x) - before).abs().max() > 0.1


def test_causal_first_position_is_zero_and_future_never_leaks():
    torch.manual_seed(0)
    cfg = make_config("gpt-tiny", n_lap=4, vocab_size=10)  # no biases
    attn = randomise(MixedHeadAttention(cfg, 4), std=0.3).eval()
    x = torch.randn(2, 16, cfg.n_embd)
    y = attn(x)
    assert torch.equal(y[:, 0], torch.zeros_like(y[:, 0]))  # (I - P) V at t = 0 is v_0 - v_0, exactly
    x2 = x.clone()
    x2[:, 9:] = torch.randn(2, 7, cfg.n_embd)
    torch.testing.assert_close(attn(x2)[:, :9], y[:, :9], atol=0, rtol=0)
    model = randomise(build_model(make_config("gpt-tiny", n_lap=[0, 2, 4, 1], vocab_size=10)), std=0.1).eval()
    idx = torch.randint(0, 10, (1, 30))
    idx2 = idx.clone()
    idx2[:, 20:] = (idx2[:, 20:] + 1) % 10
    torch.testing.assert_close(model(idx)[:, :20], model(idx2)[:, :20], atol=1e-6, rtol=0)


def test_zero_initialised_projections_make_every_block_a_no_op():
    model = build_model(make_config("gpt-tiny", n_lap=[0, 2, 4, 1], vocab_size=10))
    idx = torch.randint(0, 10, (2, 8))
    hidden = model.forward_features(idx, all_layers=True)
    x0 = F.rms_norm(model.wte(idx), (model.config.n_embd,))
    assert len(hidden) == model.config.n_layer + 1
    for h in hidden[:-1]:
        assert torch.equal(h, x0)


@pytest.mark.parametrize("preset", ["vit-tiny", "vit-b", "gpt-tiny", "gpt-d20"])
def test_parameters_and_flops_do_not_depend_on_n_lap(preset):
    with torch.device("meta"):  # no memory for the big ones
        counts = set()
        flops = set()
        H = nanolap.PRESETS[preset]["n_head"]
        for n_lap in (0, 1, H, [H] + [0] * (nanolap.PRESETS[preset]["n_layer"] - 1)):
            model = build_model(make_config(preset, n_lap=n_lap))
            counts.add(model.num_params())
            flops.add(model.flops_per_token(64))
    assert len(counts) == 1 and len(flops) == 1


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
    (dict(qk_norm="yes"), "True or False"),
])
def test_invalid_vit_configs_raise_clear_errors(overrides, message):
    with pytest.raises(ValueError, match=None) as err:
        make_config("vit-tiny", **overrides)
    assert message in str(err.value)


@pytest.mark.parametrize("overrides, message", [
    (dict(n_embd=132, n_head=4), "even head size"),  # head size 33
    (dict(vocab_size=0), "vocab_size"),
    (dict(causal=False), "must be causal"),
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


def test_compiled_equals_eager_and_checkpoint_round_trip(tmp_path):
    torch.manual_seed(0)
    model = randomise(build_model(make_config("gpt-tiny", n_lap=[0, 4, 2, 1], vocab_size=30)), std=0.1).eval()
    compiled = torch.compile(model, fullgraph=True)
    idx = torch.randint(0, 30, (2, 24))
    with torch.no_grad():
        torch.testing.assert_close(compiled(idx), model(idx), atol=1e-4, rtol=1e-4)
    # a compiled model's state dict carries `_orig_mod.`; load_model strips it
    path = str(tmp_path / "ckpt.pt")
    nanolap.save_checkpoint({"model": compiled.state_dict(), "model_config": nanolap.asdict(model.config)}, path)
    assert any(k.startswith("_orig_mod.") for k in torch.load(path, weights_only=True)["model"])
    loaded = nanolap.load_model(path).eval()
    assert loaded.config == model.config
    with torch.no_grad():
        torch.testing.assert_close(loaded(idx), model(idx), atol=0, rtol=0)


def test_checkpoint_is_atomic_and_never_executes_code(tmp_path, monkeypatch):
    path = str(tmp_path / "ckpt.pt")
    nanolap.save_checkpoint({"step": 1}, path)

    def crash(*args, **kwargs):
        raise RuntimeError("disk full")
    monkeypatch.setattr(torch, "save", crash)
    with pytest.raises(RuntimeError):
        nanolap.save_checkpoint({"step": 2}, path)
    monkeypatch.undo()
    assert nanolap.load_checkpoint(path)["step"] == 1  # the old checkpoint survived
    torch.save({"evil": Config()}, str(tmp_path / "evil.pt"))  # a pickled object, not plain data
    with pytest.raises(nanolap.UsageError, match="holds Python objects.*not loaded"):
        nanolap.load_checkpoint(str(tmp_path / "evil.pt"))
    with pytest.raises(FileNotFoundError, match="no checkpoint"):
        nanolap.load_checkpoint(str(tmp_path / "missing.pt"))


def test_clean_state_dict_strips_compile_and_ddp_prefixes():
    sd = {"module._orig_mod.blocks.0.x": 1, "_orig_mod.wte.weight": 2, "head.weight": 3}
    assert nanolap.clean_state_dict(sd) == {"blocks.0.x": 1, "wte.weight": 2, "head.weight": 3}


def test_rng_state_round_trip_through_a_checkpoint(tmp_path):
    import random
    state = nanolap.rng_state()
    a = (random.random(), torch.rand(3))
    nanolap.save_checkpoint({"rng": state}, str(tmp_path / "r.pt"))
    nanolap.set_rng_state(nanolap.load_checkpoint(str(tmp_path / "r.pt"))["rng"])
    b = (random.random(), torch.rand(3))
    assert a[0] == b[0] and torch.equal(a[1], b[1])


def test_parse_args_overrides_config_files_and_errors(tmp_path):
    defaults = dict(lr=1e-3, batch_size=64, dataset="fashion_mnist", compile=False, n_lap=0, preset=None)
    cfg = nanolap.parse_args(defaults, ["--lr=3e-4", "--batch_size=32", "--dataset=cifar10", "--compile",
                                        "--n_lap=[0,1,2]", "--preset='vit-b'"])
    assert cfg == dict(lr=3e-4, batch_size=32, dataset="cifar10", compile=True, n_lap=[0, 1, 2], preset="vit-b")
    assert nanolap.parse_args(defaults, ["--lr=1"])["lr"] == 1.0  # an int where a float is expected is fine
    f = tmp_path / "cfg.py"
    f.write_text("# a comment\nlr = 0.01\nn_lap = 3\n")
    assert nanolap.parse_args(defaults, [str(f), "--lr=0.5"])["lr"] == 0.5
    for argv, message in [(["--learning_rate=1"], "unknown option --learning_rate"),
                          (["--batch_size=3.5"], "expected int"),
                          (["--batch_size=big"], "expected int"),
                          (["--compile=1"], "expected bool"),
                          (["--lr"], "needs a value"),
                          (["nonexistent.py"], "neither"),
                          (["--n_lap=1.5"], "expected int")]:
        with pytest.raises(nanolap.UsageError, match=message):
            nanolap.parse_args(defaults, argv)
    f.write_text("import os\n")
    with pytest.raises(nanolap.UsageError, match="only `key = value`"):
        nanolap.parse_args(defaults, [str(f)])
    f.write_text("lr = __import__('os').getcwd()\n")
    with pytest.raises(nanolap.UsageError, match="literal"):
        nanolap.parse_args(defaults, [str(f)])


def test_check_finite_stops_on_nan():
    nanolap.check_finite(torch.tensor(1.0), 3)
    with pytest.raises(FloatingPointError, match="non-finite loss nan at step 7"):
        nanolap.check_finite(torch.tensor(float("nan")), 7)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_fused_equals_explicit_in_bf16_and_flash_is_eligible():
    torch.manual_seed(0)
    cfg = make_config("gpt-tiny", n_lap=[0, 4, 2, 1], vocab_size=50, block_size=256)
    model = randomise(build_model(cfg), std=0.1).cuda().eval()
    idx = torch.randint(0, 50, (2, 256), device="cuda")
    with torch.no_grad():
        torch.testing.assert_close(model(idx), model(idx, explicit=True), atol=1e-3, rtol=1e-3)
        with torch.autocast("cuda", dtype=torch.bfloat16):
            from torch.nn.attention import SDPBackend, sdpa_kernel
            with sdpa_kernel(SDPBackend.FLASH_ATTENTION):  # raises if flash could not be used
                fast = model(idx)
            slow = model(idx, explicit=True)
        assert (fast - slow).abs().max() < 0.1


# ---- the run plumbing that every script shares


def fake_script(tmp_path, text):
    """A script's namespace as configure() sees it: its globals, its file and its docstring."""
    path = tmp_path / "script.py"
    path.write_text(text)
    namespace = {"__file__": str(path), "__doc__": "A test script.", "torch": torch}
    exec(compile(text, str(path), "exec"), namespace)
    return namespace


SCRIPT = '''
out_dir = "out"  # where ckpt.pt goes
resume = False  # continue out_dir/ckpt.pt
lr = 0.001  # the peak learning rate
n_lap = 2  # Laplacian heads per layer
preset = "vit-cpu"  # a ViT preset
n_embd = None  # None = the preset's width
MAX = 3
_private = 1
'''


def test_configure_reads_the_options_from_the_globals_and_writes_them_back(tmp_path, capsys):
    ns = fake_script(tmp_path, SCRIPT)
    config, ckpt = nanolap.configure(ns, ["--lr=0.01", "--n_lap=[0,1,2,4]"])
    assert ckpt is None and sorted(config) == ["lr", "n_embd", "n_lap", "out_dir", "preset", "resume"]
    assert ns["lr"] == 0.01 and ns["n_lap"] == [0, 1, 2, 4] and ns["MAX"] == 3
    with pytest.raises(SystemExit) as exit_:
        nanolap.configure(fake_script(tmp_path, SCRIPT), ["--help"])
    out = capsys.readouterr().out
    assert exit_.value.code == 0 and out.startswith("A test script.")
    assert "--lr=0.001  # the peak learning rate" in out and "--n_embd=None  # None = the preset's width" in out
    assert "MAX" not in out and "_private" not in out


def test_config_from_options_derives_the_model_config_from_its_fields(tmp_path):
    ns = fake_script(tmp_path, SCRIPT)
    config, _ = nanolap.configure(ns, ["--n_embd=32"])
    cfg = nanolap.config_from_options(config, "vit", num_classes=3)
    assert (cfg.n_embd, cfg.n_lap, cfg.patch_size, cfg.num_classes) == (32, 2, 7, 3)  # option, option, preset, data
    with pytest.raises(nanolap.UsageError, match="--preset='gpt-tiny': choose one of"):
        nanolap.config_from_options(dict(config, preset="gpt-tiny"), "vit")


def test_resume_takes_the_checkpoint_options_and_refuses_model_changes(tmp_path):
    out = tmp_path / "run"
    cfg = dict(out_dir=str(out), resume=False, lr=0.5, n_lap=3, preset="vit-cpu", n_embd=None)
    nanolap.save_checkpoint({"config": cfg, "model_config": {}}, str(out / "ckpt.pt"))
    config, ckpt = nanolap.configure(fake_script(tmp_path, SCRIPT), ["--resume", f"--out_dir={out}"])
    assert ckpt is not None and config["lr"] == 0.5 and config["n_lap"] == 3 and config["resume"]
    config, _ = nanolap.configure(fake_script(tmp_path, SCRIPT), ["--resume", f"--out_dir={out}", "--lr=0.1"])
    assert config["lr"] == 0.1  # a training option may change ...
    with pytest.raises(nanolap.UsageError, match=r"cannot change the model, data or schedule \(--n_lap=4 \(checkpoint: 3\)"):
        nanolap.configure(fake_script(tmp_path, SCRIPT), ["--resume", f"--out_dir={out}", "--n_lap=4"])  # ... the model not
    with pytest.raises(nanolap.UsageError, match=r"or schedule \(--lr=0.1 \(checkpoint: 0.5\)\)\. To train longer"):
        nanolap.configure(fake_script(tmp_path, SCRIPT), ["--resume", f"--out_dir={out}", "--lr=0.1"], schedule=("lr",))
    with pytest.raises(FileNotFoundError, match="--resume: no checkpoint at"):
        nanolap.configure(fake_script(tmp_path, SCRIPT), ["--resume", f"--out_dir={tmp_path / 'none'}"])


@pytest.mark.parametrize("content, message", [
    (b"", "cannot be read"),
    (b"\x00\x01garbage" * 100, "cannot be read"),
    ("truncated", "cannot be read"),
])
def test_damaged_checkpoints_fail_in_one_line_without_unsafe_advice(tmp_path, content, message):
    path = tmp_path / "ckpt.pt"
    if content == "truncated":
        nanolap.save_checkpoint({"model": torch.randn(1000)}, str(path))
        content = path.read_bytes()[:2000]
    path.write_bytes(content)
    with pytest.raises(nanolap.UsageError) as err:
        nanolap.load_checkpoint(str(path), "--resume: ")
    text = str(err.value)
    assert message in text and str(path) in text and "\n" not in text
    assert "weights_only=False" not in text and "damaged or truncated" in text


def test_save_checkpoint_removes_temp_files_of_killed_saves(tmp_path):
    (tmp_path / "ckpt.pt.tmp12345").write_bytes(b"")  # what a save killed mid-write leaves
    nanolap.save_checkpoint({"step": 3}, str(tmp_path / "ckpt.pt"))
    assert sorted(os.listdir(tmp_path)) == ["ckpt.pt"]


def test_prepare_out_dir_moves_an_earlier_run_aside_and_checks_writing(tmp_path, capsys):
    out = tmp_path / "run"
    out.mkdir()
    (out / "ckpt.pt").write_text("old")
    (out / "log.jsonl").write_text("{}\n")
    nanolap.prepare_out_dir(str(out), resume=True)  # a resume keeps them
    assert (out / "ckpt.pt").exists()
    nanolap.prepare_out_dir(str(out), resume=False)  # a fresh run moves them aside, and says where
    aside = [d for d in os.listdir(out) if d.startswith("previous-")]
    assert len(aside) == 1 and sorted(os.listdir(out / aside[0])) == ["ckpt.pt", "log.jsonl"]
    assert not (out / "ckpt.pt").exists() and aside[0] in capsys.readouterr().out
    blocker = tmp_path / "file"
    blocker.write_text("")
    with pytest.raises(nanolap.UsageError, match="--out_dir=.* cannot be written"):
        nanolap.prepare_out_dir(str(blocker / "sub"), resume=False)


def test_devices_and_dtypes_are_checked():
    assert nanolap.resolve_device("cpu") == "cpu"
    with pytest.raises(nanolap.UsageError, match="choose auto, cpu"):
        nanolap.resolve_device("gpu")
    if not torch.cuda.is_available():
        with pytest.raises(nanolap.UsageError, match="--device=cuda: this machine has no CUDA device"):
            nanolap.resolve_device("cuda")
    context, dtype = nanolap.autocast("cpu", "auto")
    assert dtype == torch.float32
    with pytest.raises(nanolap.UsageError, match="--dtype='fp8'"):
        nanolap.autocast("cpu", "fp8")


def test_result_line_and_step_seed(tmp_path, capsys):
    nanolap.write_result(str(tmp_path), val_acc=0.81234, n_lap=[0, 4], params=12, seconds="3.5")
    line = "RESULT val_acc=0.8123 n_lap=[0,4] params=12 seconds=3.5"
    assert capsys.readouterr().out.strip() == line and (tmp_path / "result.txt").read_text().strip() == line
    assert nanolap.step_seed(0, 1, 2) == nanolap.step_seed(0, 1, 2) != nanolap.step_seed(0, 2, 1)
