"""The README's one-GPU lines fit a 16 GB card as written. Each line's options resolve through its own script's options
(and config file); its tokens per image are those of the recipe the H200 measured; its global batch and learning rate
follow its script's rule; and its peak memory, predicted from the H200's measured peaks in results/gpu_h200/ (a fixed
part computed from the parameters, the rest per image or token), is what its comment says and at least 20% under a
T4's 15 GiB (its 80 GB form: under 80% of 80 GiB). results/gpu_h200/README.md, "Other cards", spells the arithmetic."""

import importlib.util
import os
import re
import shlex

import pytest
import torch

import configurator
from conftest import ROOT
from data import text
from nanolap import DINOHead, build_model, make_config

GIB = 2**30
USABLE = 0.8  # a prediction may take this share of a card: the CUDA context and the allocator's spare blocks need room
T4_GIB = 15.0  # a T4's memory as nvidia-smi reports it (15,360 MiB)
BIG_GIB = 80.0
SHAKESPEARE_VOCAB = 84  # prepare.py's character vocabulary (gpt-small-lap3.log: "vocab 84")


def readme_lines():
    """{script kind: (options, predicted GiB in its comment, its comment's 80 GB options)} of the README's GPU lines."""
    readme = open(os.path.join(ROOT, "README.md")).read()
    gpus = readme[readme.index("## GPUs"):readme.index("## Reading the code")]
    lines = {}
    line = re.compile(r"^python train_(\w+)\.py (.*?)\s+# ([\d.]+) GiB.*?(?:; 80 GB card: (.*))?$", re.M)
    for script, options, gib, big in line.findall(gpus):
        lines[script] = (shlex.split(options), float(gib), shlex.split(big))
    return lines


def resolved(kind, options, monkeypatch):
    """The options a script resolves from `options`: its own defaults, then config files and --key=value, as it does."""
    spec = importlib.util.spec_from_file_location(f"train_{kind}_options", os.path.join(ROOT, f"train_{kind}.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)  # its functions and options, not its run
    namespace = vars(module)
    monkeypatch.chdir(ROOT)  # config files are named from the repository root
    return configurator.parse_args({k: namespace[k] for k in configurator.declared_options(namespace)}, options)


def measured_peaks():
    """{model: (batch, peak GiB)} of the H200's scripts rows (results/gpu_h200/gpu_check_all.txt)."""
    rows = open(os.path.join(ROOT, "results", "gpu_h200", "gpu_check_all.txt")).read()
    found = re.findall(r"^scripts +(\w+)\S* .*?B=(\d+) .*?peak GiB.*?  +\d+ \| ([\d.]+) \|", rows, re.M)
    return {model: (int(batch), float(peak)) for model, batch, peak in found}


def count(*modules):
    return sum(p.numel() for m in modules for p in m.parameters())


def adamw_gib(*modules):
    """Weights, gradients and AdamW's two moments, float32: 16 bytes a parameter."""
    return 16 * count(*modules) / GIB


def muon_gib(gpt):
    """Weights and gradients (8 bytes), Muon's momentum on the block matrices (4), AdamW's moments on the embedding
    and the head (8), float32."""
    tables = count(gpt.wte, gpt.lm_head)
    return (8 * count(gpt) + 4 * (count(gpt) - tables) + 8 * tables) / GIB


def dino_gib(backbone, head):
    """The student's weights, gradients and AdamW moments (16 bytes), the teacher's weights (4)."""
    return 20 * count(backbone, head) / GIB


def vit_prediction(config, batch):
    """Peak GiB of the ViT line at `batch` images a micro-step, from the H200's ViT-S/16 at 224 px (the tokens alike)."""
    with torch.device("meta"):
        measured = build_model(make_config("vit-s", n_lap=6, num_classes=10, in_chans=3, img_size=224, patch_size=16,
                                           pooling="cls"))
        line = build_model(configurator.config_from_options(config, "vit", img_size=28, in_chans=1, num_classes=10))
    assert (28 // line.config.patch_size) ** 2 == (224 // 16) ** 2 == 196 and line.config.pooling == "cls"
    assert (line.config.n_layer, line.config.n_embd, line.config.n_head) == (12, 384, 6)  # ViT-S, as measured
    measured_batch, peak = measured_peaks()["vit"]
    per_image = (peak - adamw_gib(measured)) / measured_batch
    return adamw_gib(line) + batch * per_image


def dino_prediction(config, batch):
    """Peak GiB of the DINO line at `batch` images, from the H200's DINO ViT-S/16: 2 x 224 px and 8 x 96 px crops."""
    with torch.device("meta"):
        measured = (build_model(make_config("vit-s", n_lap=3, num_classes=0, in_chans=3, img_size=224)),
                    DINOHead(384, 65536, 2048, 256))
        line = (build_model(configurator.config_from_options(config, "vit", img_size=config["global_size"], in_chans=1,
                                                             num_classes=0)),
                DINOHead(384, config["out_dim"], config["head_hidden"], config["head_bottleneck"]))
    patch = line[0].config.patch_size
    assert (config["global_size"] // patch) ** 2 == (224 // 16) ** 2 == 196
    assert (config["local_size"] // patch) ** 2 == (96 // 16) ** 2 == 36 and config["local_crops"] == 8
    assert config["out_dim"] <= 65536 and config["head_hidden"] <= 2048  # a head no larger than the measured one
    measured_batch, peak = measured_peaks()["dino"]
    per_image = (peak - dino_gib(*measured)) / measured_batch
    return dino_gib(*line) + batch * per_image


def gpt_prediction(config):
    """Peak GiB of the GPT line, estimated: no memory of it was measured, so the H200's d12 memory per token, scaled
    by depth x width (an upper bound: d12's includes float32 logits over 50,304 tokens, this line's vocabulary is 84)."""
    with torch.device("meta"):
        measured = build_model(make_config("gpt-d20", n_layer=12, n_embd=768, n_head=6, n_lap=3, vocab_size=50304,
                                           block_size=1024))
        line = build_model(configurator.config_from_options(config, "gpt",
                                                            vocab_size=text.model_vocab_size(SHAKESPEARE_VOCAB)))
    measured_batch, peak = measured_peaks()["gpt"]
    per_token = (peak - muon_gib(measured)) / (measured_batch * 1024)
    scale = line.config.n_layer * line.config.n_embd / (12 * 768)
    return muon_gib(line) + config["batch_size"] * config["block_size"] * per_token * scale


def test_the_measured_peaks_are_read_from_the_h200s_rows():
    assert measured_peaks() == {"gpt": (32, 32.21), "vit": (512, 21.24), "dino": (128, 23.4)}


def test_the_vit_line_keeps_its_recipes_batch_and_lr_and_fits_a_t4(monkeypatch):
    options, said, big = readme_lines()["vit"]
    config = resolved("vit", options, monkeypatch)
    recipe = resolved("vit", ["config/vit_cifar10.py"], monkeypatch)
    # train_vit.py takes lr as given: the global batch batch_size x grad_accum must stay the recipe's
    assert config["batch_size"] * config["grad_accum"] == recipe["batch_size"] * recipe["grad_accum"] == 512
    assert config["lr"] == recipe["lr"] == 2e-3
    predicted = vit_prediction(config, config["batch_size"])
    assert predicted <= USABLE * T4_GIB and said == round(predicted, 1)
    large = resolved("vit", options + big, monkeypatch)
    assert large["batch_size"] * large["grad_accum"] == 512
    assert vit_prediction(large, large["batch_size"]) <= USABLE * BIG_GIB


def test_the_dino_line_fits_a_t4_and_its_80_gb_form_is_the_batch_it_had(monkeypatch):
    options, said, big = readme_lines()["dino"]
    config = resolved("dino", options, monkeypatch)
    predicted = dino_prediction(config, config["batch_size"])
    assert predicted <= USABLE * T4_GIB and said == round(predicted, 1)
    assert config["lr"] == 0.0005 * 64 / 256 and config["batch_size"] == 64  # DINO's rate per 256 images, at the batch
    large = resolved("dino", options + big, monkeypatch)
    assert large["batch_size"] == 256 and large["lr"] == 0.0005 and dino_prediction(large, 256) <= USABLE * BIG_GIB
    assert dino_prediction(large, 256) > USABLE * T4_GIB  # what the line asked for before: no T4 holds it


def test_the_gpt_line_is_an_estimate_that_fits_a_t4(monkeypatch):
    options, said, big = readme_lines()["gpt"]
    config = resolved("gpt", options, monkeypatch)
    assert config["batch_size"] * config["block_size"] == 16384 and config["total_batch_size"] == 0  # as the H200 ran
    predicted = gpt_prediction(config)
    assert predicted <= USABLE * T4_GIB and said == round(predicted, 1) and not big
    readme = open(os.path.join(ROOT, "README.md")).read()
    assert re.search(r"--out_dir=out/gpt-small-lap3 +# [\d.]+ GiB \(estimated\)$", readme, re.M)


@pytest.mark.parametrize("kind", ["vit", "gpt", "dino"])
def test_each_line_names_its_dtype_as_auto(kind, monkeypatch):
    """No line asks for bfloat16, which a T4 would emulate (common.amp_dtype now falls back, but says so)."""
    options, _, big = readme_lines()[kind]
    assert resolved(kind, options + big, monkeypatch)["dtype"] == "auto"
