"""analyze.py: the classifier analyses and ETF panels, the figures, the readings of the model's parameters (the
ANOVA views, the heads' weights), and end-to-end runs on tiny checkpoints of each kind (vit, gpt, dino; in-memory data
and ImageNet-style folders) plus a comparison over several runs; geometry.py's metrics are tests/test_geometry.py's.
The run section is executed in this process (runpy) as `python analyze.py ...` would run it; the slow tier runs it
as a subprocess for the one-line error messages."""

import gzip
import json
import os
import re
import runpy
import shutil
import subprocess
import sys
from dataclasses import asdict

import numpy as np
import pytest
import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
import analyze  # noqa: E402
import figures  # noqa: E402
import geometry  # noqa: E402
import report  # noqa: E402
from common import UsageError, save_checkpoint  # noqa: E402
from conftest import randomise, result  # noqa: E402
from data import folders, images, text  # noqa: E402
from nanolap import build_model, make_config  # noqa: E402
from test_geometry import diffusion_block, simplex_etf  # noqa: E402

FRACS = ("within_seq_frac", "within_class_frac", "between_class_frac")
SCRIPT = os.path.join(ROOT, "analyze.py")


def run_analyze(*argv):
    """`python analyze.py ARGV` in this process: the module's run section under __main__ (exceptions propagate)."""
    old = sys.argv
    sys.argv = [SCRIPT, *map(str, argv)]
    try:
        runpy.run_path(SCRIPT, run_name="__main__")
    finally:
        sys.argv = old


# -----------------------------------------------------------------------------
# the classifier analyses, the ETF panels, the figures and the model's parameters


def test_etf_token_panel_puts_collapsed_tokens_on_the_vertices(tmp_path, figure_texts):
    """Tokens that sit at their class's classifier direction (plus a shift shared by all, and per-token parts outside
    the classifier's span) land on their class's vertex of the ETF triangle, in a panel of their own, vertex_dist 0;
    features unrelated to the classifier do not."""
    from types import SimpleNamespace
    W = simplex_etf(4, 12, scale=2.0, seed=3)  # a 4-class classifier; the projection uses 3 of its rows
    classes, y = [0, 2, 3], torch.tensor([0, 1, 2, 3] * 6)
    g = torch.Generator().manual_seed(4)
    noise = torch.randn(24, 5, 12, generator=g, dtype=torch.float64)
    noise = noise - noise @ torch.linalg.pinv(W) @ W  # orthogonal to every classifier row
    tokens = 3.0 * W[y, None] + torch.randn(12, generator=g, dtype=torch.float64) + noise  # (24, 5, 12)
    extra = dict(pooled=torch.randn(24, 12, generator=g, dtype=torch.float64), seq_means=tokens.mean(1), tokens=tokens)
    model = SimpleNamespace(head=SimpleNamespace(weight=W, bias=None), config=SimpleNamespace(pooling="cls"))
    res = {"settings": {"tokens": "patch tokens only"}}
    assert analyze.classifier_analyses(model, extra, y, None, classes, res, "t", str(tmp_path)) == ["etf.png"]
    assert [title.replace("\n", " ") for title in figure_texts["etf.png"]["titles"]] == ["pooled = CLS token", "seq_means = mean of the patch tokens only",
                                                 "tokens = 5 per image (patch tokens only)"]
    etf = res["etf"]["tokens"]
    assert etf["vertex_dist"] == pytest.approx(0, abs=1e-9) and res["etf"]["seq_means"]["vertex_dist"] < 1e-9
    radius = torch.tensor(etf["class_means_2d"], dtype=torch.float64).norm(dim=1)
    assert torch.allclose(torch.tensor(etf["class_means_2d"], dtype=torch.float64), geometry.TRIANGLE.T * radius[0])
    m = torch.isin(y, torch.tensor(classes))
    xy = geometry.etf_projection(W[classes], tokens[m].flatten(0, 1), tokens[m].mean((0, 1)))  # every single token
    vertex = geometry.TRIANGLE.T[[classes.index(c) for c in y[m].repeat_interleave(5).tolist()]]
    assert torch.allclose(xy / radius[0], vertex, atol=1e-9)
    assert res["etf"]["pooled"]["vertex_dist"] > 0.3  # random features: scattered, not on the vertices


def test_etf_panel_in_the_plane_of_class_means_puts_collapsed_features_on_the_vertices():
    """DINO's ETF panel has no classifier: the plane is that of its three class means. Features at the means of an
    equiangular, equinorm triangle (plus parts outside that plane) land on the vertices; spread features do not."""
    means = simplex_etf(3, 9, scale=2.0, seed=5) + torch.randn(9, dtype=torch.float64)  # a shifted simplex ETF
    y = torch.tensor([4, 7, 9] * 5)
    g = torch.Generator().manual_seed(6)
    noise = torch.randn(15, 9, generator=g, dtype=torch.float64)
    centred = means - means.mean(0)
    noise = noise - noise @ torch.linalg.pinv(centred) @ centred  # orthogonal to the plane of the means
    x = means[[[4, 7, 9].index(c) for c in y.tolist()]] + noise  # every feature at its class mean
    xy, panel, triangle = analyze.etf_panel(means, x, y, [4, 7, 9])
    assert panel["vertex_dist"] == pytest.approx(0, abs=1e-9)
    assert torch.allclose(torch.tensor(panel["class_means_2d"], dtype=torch.float64), triangle, atol=1e-9)
    assert xy.shape == (15, 2) and torch.allclose(triangle.norm(dim=1), triangle.norm(dim=1)[0].expand(3))
    spread = analyze.etf_panel(means, x + torch.randn(15, 9, generator=g, dtype=torch.float64), y, [4, 7, 9])[1]
    assert spread["vertex_dist"] > 0.1


def test_pca_helpers():
    g = torch.Generator().manual_seed(10)
    rgb = figures.pca_rgb(torch.randn(16, 8, generator=g), (4, 4))
    assert rgb.shape == (4, 4, 3) and rgb.min() >= 0 and rgb.max() <= 1
    assert torch.allclose(rgb.amax((0, 1)), torch.ones(3, dtype=torch.float64))
    assert figures.pca_rgb(torch.randn(4, 2, generator=g), (2, 2)).shape == (2, 2, 3)  # fewer than 3 components
    x = torch.randn(50, 2, generator=g) @ torch.randn(2, 6, generator=g)  # rank 2
    xy, ratio = figures.pca_2d(x)
    assert xy.shape == (50, 2) and sum(ratio) == pytest.approx(1.0)


def test_head_weights_of_an_exact_diffusion_step_are_negative_definite():
    tau = 0.3
    block, _, _ = diffusion_block(tau)
    w = analyze.head_weights(block)[0]  # M_h = -tau I: negative definite
    assert w["trace_ratio"] == pytest.approx(-1.0) and w["eig_min"] == pytest.approx(-tau) == w["eig_max"]


def test_the_heads_figure_puts_first_order_beside_first_order(tmp_path, monkeypatch, figure_texts):
    """heads.png: the sublayer bars are first order, as the heads' rho (a block's heads add up to its attention bar),
    and the caption says so; the exact changes (here of the other sign) stay out of the figure."""
    layers = [{"block": b + 1, "laplacian": [False, True], "rho": [-0.1 * (b + 1), 0.05],
               **{part: {"rho": -0.2 * (b + 1) + k / 10, "exact": 0.5} for k, part in enumerate(("attention", "mlp",
                                                                                                 "block_total"))}}
              for b in range(2)]
    heights = {}
    save = figures.save_figure

    def spy(fig, path):
        bars = next(ax for ax in fig.axes if ax.get_title().startswith("sublayers"))
        heights.update({t.get_text(): [round(p.get_height(), 9) for p in c] for t, c in zip(bars.get_legend().get_texts(),
                                                                                        bars.containers)})
        return save(fig, path)
    monkeypatch.setattr(figures, "save_figure", spy)
    figures.fig_heads({"layers": layers}, "t", str(tmp_path / "heads.png"))
    assert heights == {"attention": [-0.2, -0.4], "mlp": [-0.1, -0.3], "block": [0.0, -0.2]}
    assert "first order throughout" in figure_texts["heads.png"]["suptitle"]
    assert figure_texts["heads.png"]["labels"][1][1].startswith("first-order change")


def test_head_weights_read_each_query_heads_group_under_grouped_query_attention():
    """With n_kv_head = 2 of 4 heads, query heads 0, 1 read value head 0 and heads 2, 3 value head 1: head_weights
    equals that of a model without grouping whose four value heads are those copies."""
    grouped = randomise(build_model(make_config("vit-tiny", n_kv_head=2)), gain=1.0).blocks[0]
    full = randomise(build_model(make_config("vit-tiny")), gain=1.0).blocks[0]
    C, D = 96, 24
    with torch.no_grad():
        full.norm1.weight.copy_(grouped.norm1.weight)
        full.attn.proj.weight.copy_(grouped.attn.proj.weight)
        full.attn.qkv.weight[2 * C:] = grouped.attn.qkv.weight[-2 * D:].view(2, D, C).repeat_interleave(2, dim=0).reshape(C, C)
    assert analyze.head_weights(grouped) == analyze.head_weights(full)


def test_anova_views_split_the_final_norm_tokens_into_the_classifier_subspaces():
    model = build_model(make_config("vit-tiny", n_lap=2)).eval()
    randomise(model, gain=1.0)
    x, y = torch.randn(30, 17, 96, generator=torch.Generator().manual_seed(4)), torch.arange(30) % 10
    views = analyze.AnovaViews(model, 10)
    views.update(x[:12], y[:12])
    views.update(x[12:], y[12:])
    r = views.result()
    full = geometry.anova(model.norm(x).detach(), y)
    for part in ("within_seq_var", "within_class_var", "between_class_var", "total_var"):  # orthogonal subspaces add
        assert r["classifier_rows"][part] + r["classifier_complement"][part] == pytest.approx(full[part], rel=1e-9)
    rows = views.bases["classifier_rows"]  # (d, r): the classifier reads these coordinates and nothing else
    W = model.head.weight.detach().double()
    assert rows.shape == (96, 10) and torch.allclose(W @ rows @ rows.T, W, atol=1e-9)
    plain = geometry.anova(torch.nn.functional.layer_norm(x, (96,), eps=1e-6), y)
    assert r["norm_without_affine"]["within_seq_frac"] == pytest.approx(plain["within_seq_frac"], rel=1e-9)


# -----------------------------------------------------------------------------
# end to end on tiny checkpoints (the contract the training scripts write)


def write_idx(path, arr):
    """An IDX (MNIST-format) gzip file: magic 0x0000 0x08 ndim, big-endian sizes, uint8 data."""
    arr = np.asarray(arr, dtype=np.uint8)
    header = bytes([0, 0, 8, arr.ndim]) + b"".join(int(s).to_bytes(4, "big") for s in arr.shape)
    with gzip.open(path, "wb") as f:
        f.write(header + arr.tobytes())


@pytest.fixture(scope="module")
def fashion_dir(tmp_path_factory):
    """A tiny Fashion-MNIST in the real file format, read through data.images.load_images."""
    root = tmp_path_factory.mktemp("data")
    d = root / "fashion_mnist"
    d.mkdir()
    rng = np.random.default_rng(0)
    for split, n in (("train", 40), ("t10k", 60)):
        y = np.arange(n) % 10
        x = rng.integers(0, 60, (n, 28, 28)) + (y[:, None, None] * 20)  # class shows in the brightness
        write_idx(d / f"{split}-images-idx3-ubyte.gz", x)
        write_idx(d / f"{split}-labels-idx1-ubyte.gz", y)
    return str(root)


def train_pixels(data_dir):
    with gzip.open(os.path.join(data_dir, "fashion_mnist", "train-images-idx3-ubyte.gz")) as f:
        return np.frombuffer(f.read()[16:], dtype=np.uint8)


def make_run(path, kind, n_lap=0, seed=0, metric=None, in_chans=1, extra=None, pooling="cls", **cfg):
    """A run folder as the training scripts leave it: ckpt.pt (kind, model_config, model, config, step and, for extra
    keys such as a ViT's classes/mean/std, `extra`) and log.jsonl with the headline metric."""
    torch.manual_seed(seed)
    if kind == "gpt":
        config = make_config("gpt-tiny", n_layer=2, n_embd=32, n_head=4, vocab_size=50, block_size=32, n_lap=n_lap)
    else:
        config = make_config("vit-tiny", n_layer=2, n_embd=32, n_head=4, n_lap=n_lap, img_size=28, patch_size=7,
                             in_chans=in_chans, num_classes=10 if kind == "vit" else 0, pooling=pooling)
    model = build_model(config)
    if kind == "gpt":  # zero-initialised projections make every block a no-op: give them weights
        for p in model.parameters():
            torch.nn.init.normal_(p, std=0.2)
    save_checkpoint(dict(kind=kind, model_config=asdict(config), model=model.state_dict(), step=10,
                         config=dict(cfg, seed=seed, n_lap=n_lap), **(extra or {})), os.path.join(path, "ckpt.pt"))
    name = geometry.FINAL_METRIC[kind][0]
    with open(os.path.join(path, "log.jsonl"), "w") as f:
        f.write(json.dumps({"step": 0, name: 0.1}) + "\n")
        f.write(json.dumps({"step": 10, name: metric if metric is not None else 0.5 + 0.01 * seed}) + "\n")
        f.write('{"step": 11, "' + name + '": 0.9')  # a line cut short by an interrupted run is skipped
    return str(path)


def check_outputs(out, pngs):
    files = set(os.listdir(out))
    for f in pngs + ["analysis.json", "summary.md", "result.txt"]:
        assert f in files, f"{f} missing from {sorted(files)}"
        assert os.path.getsize(os.path.join(out, f)) > 500 or not f.endswith(".png")
    with open(os.path.join(out, "analysis.json")) as f:
        res = json.load(f)  # strict JSON: no NaN
    assert sorted(res["figures"]) == sorted(pngs)
    if "kind" in res:  # one run: its per-head numbers, every block and head
        layers = res["heads"]["layers"]
        assert [len(layer["rho"]) for layer in layers] == [res["n_head"]] * len(res["layerwise"]["layer"][:-1])
        assert "Per-head analysis" in open(os.path.join(out, "summary.md")).read()
    return res


def report_metrics(tmp_path, res, result):
    """The metrics the report reads of a real analysis.json res and a RESULT line's values."""
    d = tmp_path / "results" / res["kind"] / "k0-s0"
    d.mkdir(parents=True)
    (d / "analysis.json").write_text(json.dumps(res))
    (d / "result.txt").write_text(f"RESULT {result} n_lap=0\n")
    return report.collect_runs(str(tmp_path / "results"))[res["kind"]][0]["metrics"]


VIT_FIGURES = ["collapse.png", "anova.png", "spectrum.png", "heads.png", "pca.png", "etf.png", "curves.png"]


def test_end_to_end_vit(tmp_path, fashion_dir, capsys, figure_texts):
    stats = dict(classes=[f"c{i}" for i in range(10)], mean=[0.25], std=[0.5])  # train_vit.py stores these
    run = make_run(tmp_path / "vit", "vit", n_lap=2, dataset="fashion_mnist", data_dir=fashion_dir, extra=stats)
    run_analyze(run, "--max_samples=30", "--batch_size=16", "--pca_images=4", "--etf_classes=[1,4,7]")
    res = check_outputs(os.path.join(run, "analysis"), VIT_FIGURES)
    s = res["settings"]
    assert s["normalisation"] == {"mean": [0.25], "std": [0.5]}  # the checkpoint's statistics win
    assert s["n_samples"] == 30 and s["layer"] == -1 and s["tokens"] == "patch tokens only" and s["pca_images"] == 4
    assert res["kind"] == "vit" and res["n_lap"] == 2 and res["step"] == 10
    assert res["final_metric"] == {"name": "val_acc", "value": 0.5, "step": 10}
    assert sum(res["anova"][k] for k in FRACS) == pytest.approx(1.0)
    lw = res["layerwise"]
    assert len(lw["within_seq_frac"]) == len(lw["cosine"]) == len(lw["anova"]) == 3  # 2 blocks + final norm
    assert res["anova"] == lw["anova"][-1] and lw["within_seq_frac"][-1] == res["anova"]["within_seq_frac"]
    for feats in ("pooled", "seq_means"):
        nc = res["nc"][feats]
        assert nc["n_samples"] == 30 and nc["n_classes"] == 10
        assert all(nc[k] is not None and nc[k] >= 0 for k in ("nc1", "nc2_equinorm", "nc3", "nc4"))
    assert res["etf"]["classes"] == [1, 4, 7] and len(res["etf"]["pooled"]["class_means_2d"]) == 3
    assert all(res["etf"][k]["vertex_dist"] >= 0 for k in ("pooled", "seq_means", "tokens"))
    assert len(res["spectrum"]["lambda_mean"]) == 16  # min(T = 16 patches, d = 32)
    assert all(1 <= res["spectrum"][f"k_{a}"] <= 15 for a in geometry.ALPHAS)  # centred rank <= T - 1
    out = capsys.readouterr().out
    r = result(out)
    assert r["kind"] == "vit" and r["n_lap"] == "2" and "30 sequences" in out
    assert out.split("\n")[-3].startswith("curves.png: "), out  # under the progress lines, before the RESULT line
    assert r["within_seq_frac"] == f"{res['anova']['within_seq_frac']:.4f}" and r["nc1"] == f"{res['nc']['pooled']['nc1']:.4g}"
    assert r["k_0.99"] == f"{res['spectrum']['k_0.99']:.2f}" and r["out"] == os.path.join(run, "analysis")
    assert open(os.path.join(run, "analysis", "result.txt")).read().startswith("RESULT kind=vit n_lap=2 ")
    summary = open(os.path.join(run, "analysis", "summary.md")).read()
    assert "| nc1 (pooled) |" in summary and "| nc1 (seq_means) |" in summary  # CLS pooling: two sets of features
    assert "| features (pooled) | pooled = CLS token, final norm |" in summary
    assert [title.replace("\n", " ") for title in figure_texts["etf.png"]["titles"]] == ["pooled = CLS token", "seq_means = mean of the patch tokens only",
                                                 f"tokens = {analyze.ETF_TOKENS} per image (patch tokens only)"]
    assert "band: mean $\\pm$ std over sequences\n(lower edge clamped above 0: log scale)" in figure_texts["spectrum.png"]["legend"]
    assert any(t.startswith("$k_{0.99}$ = ") and t.endswith(": the fewest directions that hold 99% of\na sequence's "
                                                             "variance (mean over sequences)")
               for t in figure_texts["spectrum.png"]["legend"]), figure_texts["spectrum.png"]["legend"]
    etf = figure_texts["etf.png"]
    assert etf["labels"][0] == ("first axis of that plane", "second axis") and "Neural Collapse (each class" in etf["suptitle"]
    assert all(title.split("\n")[0].endswith(" =") for title in etf["titles"])  # the name, then what it is
    for name in VIT_FIGURES:  # every figure says what to look for, and every plot labels both axes
        assert "look for: " in figure_texts[name]["suptitle"], (name, figure_texts[name]["suptitle"])
        assert all(x and y for x, y in figure_texts[name]["labels"]), (name, figure_texts[name]["labels"])
    m = report_metrics(tmp_path, res, "val_acc=0.9 val_loss=0.3")  # what the report reads of this analysis.json
    assert m == {"val_acc": 0.9, "val_loss": 0.3, "within_seq (patch)": res["anova"]["within_seq_frac"],
                 "between_class (patch)": res["anova"]["between_class_frac"], "within_seq (all)": None,
                 "between_class (all)": None, "within_seq after last block": lw["within_seq_frac"][1],
                 "nc1": res["nc"]["pooled"]["nc1"], "k_0.99": res["spectrum"]["k_0.99"],
                 "within_seq_var (last block)": lw["anova"][1]["within_seq_var"],
                 "between_seq_var (last block)": lw["anova"][1]["total_var"] - lw["anova"][1]["within_seq_var"],
                 "within_seq (norm without affine)": res["anova_views"]["norm_without_affine"]["within_seq_frac"],
                 "within_seq (classifier rows)": res["anova_views"]["classifier_rows"]["within_seq_frac"],
                 "within_seq (classifier complement)": res["anova_views"]["classifier_complement"]["within_seq_frac"],
                 "rho of laplacian heads (mean)": sum(geometry.head_means(res["heads"])["laplacian"]) / 2,
                 "rho of attention heads (mean)": sum(geometry.head_means(res["heads"])["attention"]) / 2}


# a run of the CPU default ViT recipe, as results/six_vit_default holds it, on 2 processes of 128 images (not 1 of 256)
DEFAULT_RECIPE = os.path.join(ROOT, "results", "six_vit_default", "k4-s0")


def curves_run(path, end_acc, **changed):
    """A run folder of the committed recipe's options (changed: some of them) and its log.jsonl: the committed seed's
    records with the last val_acc set to end_acc."""
    os.makedirs(path)
    config = json.load(open(os.path.join(DEFAULT_RECIPE, "analysis.json")))["train_config"]
    config = dict(config, seed=100, out_dir=str(path), batch_size=128, cpu_procs=2, **changed)
    log = figures.read_log(DEFAULT_RECIPE)
    log[-1]["val_acc"] = end_acc
    with open(os.path.join(path, "log.jsonl"), "w") as f:
        f.writelines(json.dumps(r) + "\n" for r in log)
    return str(path), config


def test_curves_draw_the_run_in_front_of_the_committed_seeds_of_its_recipe(tmp_path, figure_texts):
    """The run of the committed recipe finds its set (the one with the most seeds at its n_lap) and says where its
    end metric lies in their range (below it at 0.5); with one option changed it is drawn alone; at an n_lap the set
    lacks, the set's bands are drawn without a range."""
    ends = [json.loads(open(os.path.join(ROOT, "results", "six_vit_default", f"k4-s{s}", "log.jsonl")).readlines()[-1])
            ["val_acc"] for s in range(6)]
    run, config = curves_run(tmp_path / "k4", min(ends))  # the lowest seed's end: inside, just
    figure, line = analyze.run_curves(run, "vit", config, "4", "r (vit, n_lap=4)", run, figures.RESULTS)
    assert figure == "curves.png" and os.path.getsize(os.path.join(run, figure)) > 1000
    assert line == (f"curves.png: val_acc {min(ends):.4f} at step 4212 lies inside the range of six_vit_default's 6 "
                    f"seeds at n_lap=4, {min(ends):.4f} to {max(ends):.4f} (mean {sum(ends) / 6:.4f})")
    texts = figure_texts["curves.png"]
    assert "r (vit, n_lap=4) in front of the committed runs of its recipe:\nsix_vit_default, n_lap=4: 6 seeds" in texts["suptitle"]
    assert "val_acc, six_vit_default, n_lap=4: 6 seeds" in texts["legend"]
    assert "val_acc, this run, AMD_EPYC_AVX512" in texts["legend"]  # the committed seed's log names its machine
    assert all(x and y for x, y in texts["labels"]) and "look for: " in texts["suptitle"]
    run, config = curves_run(tmp_path / "lr", 0.5, lr=0.001)  # another recipe
    assert analyze.run_curves(run, "vit", config, "4", "r", run, figures.RESULTS)[1].startswith("curves.png: the run alone: ")
    assert analyze.run_curves(run, "vit", dict(config, lr=0.003), "4", "r", run, figures.RESULTS)[1].startswith(
        "curves.png: val_acc 0.5000 at step 4212 lies below the range of six_vit_default's 6 seeds")
    run, config = curves_run(tmp_path / "k2", 0.9)
    line = analyze.run_curves(run, "vit", config, "2", "r", run, figures.RESULTS)[1]
    assert line == "curves.png: six_vit_default holds this recipe at n_lap 0, 4, not 2: no range to compare"
    assert figure_texts["curves.png"]["suptitle"].startswith("r in front of the committed runs of its recipe:\n"
                                                             "six_vit_default, n_lap=0: 6 seeds, six_vit_default, n_lap=4")


def test_same_recipe_is_the_same_options_and_global_batch():
    """Seed, paths and how processes split the global batch may differ; options, the global batch read off the log
    and a GPT's corpus may not; what one run does not record compares with any."""
    config = dict(lr=1e-3, seed=0, out_dir="a", batch_size=256, cpu_procs=1, grad_accum=1)
    log = [{"step": 0, "epoch": 0}, {"step": 234, "epoch": 1}]
    split = dict(config, seed=1, out_dir="b", batch_size=64, cpu_procs=2, grad_accum=2)
    assert figures.same_recipe(config, log, split, log)
    assert not figures.same_recipe(config, log, dict(config, lr=2e-3), log)
    assert not figures.same_recipe(config, log, split, [{"step": 117, "epoch": 1}])  # a global batch of 512
    assert figures.same_recipe(config, log, dict(config, new_option=1), log[:1])  # unknown: compares with any
    gpt = [{"step": 250, "tokens": 512000, "corpus": "gutenberg-233f3954"}]
    assert figures.same_recipe(config, gpt, config, [{"step": 250, "tokens": 512000}])
    assert not figures.same_recipe(config, gpt, config, [dict(gpt[0], corpus="tinyshakespeare-5f6e7d8c")])
    assert not figures.same_recipe(dict(config, holdout=0.1), log, config, log)  # evaluated on the training split
    assert figures.same_recipe(dict(config, holdout=0.0), log, config, log)  # a run from before --holdout
    dino = dict(config, teacher_temp=0.025, lr=0.0005, clip_grad=3.0, batch_size=32)  # 2 processes x 32
    before = dict(config, teacher_temp=0.025, lr=0.002, grad_clip=3.0, batch_size=64)  # lr per 256, a global batch
    assert figures.same_recipe(dino, log, before, log)
    assert not figures.same_recipe(dict(dino, lr=0.002), log, before, log)


def test_curves_of_a_log_with_nan_and_a_line_cut_short(tmp_path, capsys, figure_texts):
    """DINO's step 0 as the committed logs hold it (NaN loss, not strict JSON), today's null, an Infinity and a last
    line cut short: the log reads, the run is drawn alone (no references), and the curves have no hole but step 0's."""
    lines = ['{"step": 0, "epoch": 0.0, "knn_acc": 0.64, "loss": NaN, "teacher_std": NaN, "seconds": 9.1}',
             '{"step": 500, "epoch": 0.53, "knn_acc": 0.69, "loss": 5.3, "teacher_std": Infinity, "seconds": 162.1}',
             '{"step": 1000, "epoch": 1.07, "knn_acc": 0.70, "train_loss": null, "lr": 0.001}',
             '{"step": 1000, "knn_acc": 0.71, "linear_acc": 0.75, "seg_miou": 0.1}',
             '{"step": 1406, "epoch": 1.5, "knn_acc": 0.7']
    (tmp_path / "log.jsonl").write_text("\n".join(lines))
    log = figures.read_log(str(tmp_path))
    assert [r["step"] for r in log] == [0, 500, 1000] and log[0]["train_loss"] is None and log[1]["train_loss"] == 5.3
    assert log[2] == {"step": 1000, "epoch": 1.07, "knn_acc": 0.71, "train_loss": None, "lr": 0.001, "linear_acc": 0.75,
                      "seg_miou": 0.1}
    assert log[1]["teacher_std"] is None and figures.data_per_step(log) == pytest.approx(1.07 / 1000)
    assert analyze.final_metric(str(tmp_path), "dino") == {"name": "knn_acc", "value": 0.71, "step": 1000}
    figure, line = analyze.run_curves(str(tmp_path), "dino", {"lr": 0.001}, "4", "d", str(tmp_path), "")
    assert figure == "curves.png" and line == "curves.png: the run alone: no run in (no --references) trained its recipe"
    assert "knn_acc, this run" in figure_texts["curves.png"]["legend"]
    assert analyze.run_curves(str(tmp_path / "none"), "dino", {}, "4", "d", str(tmp_path), "") == (None, None)


@pytest.mark.slow
def test_mean_pooling_measures_the_pooled_tokens_once(tmp_path, fashion_dir, figure_texts):
    """Mean pooling of the patch tokens: the pooled features are the token means, so one ETF panel of them (and one of
    single tokens) and one set of NC rows, which say so; with --tokens=all the token means include the CLS token."""
    run = make_run(tmp_path / "vit", "vit", n_lap=2, pooling="mean", dataset="fashion_mnist", data_dir=fashion_dir)
    run_analyze(run, "--max_samples=20", "--etf_classes=[1,4,7]")
    res = check_outputs(os.path.join(run, "analysis"), VIT_FIGURES)
    assert list(res["nc"]) == ["pooled"] and list(res["etf"]) == ["classes", "classifier_rows_2d", "pooled", "tokens"]
    assert res["nc"]["pooled"]["features"] == "pooled = mean of patch tokens, final norm"
    assert [title.replace("\n", " ") for title in figure_texts["etf.png"]["titles"]] == ["pooled = mean of patch tokens",
                                                 f"tokens = {analyze.ETF_TOKENS} per image (patch tokens only)"]
    summary = open(os.path.join(run, "analysis", "summary.md")).read()
    assert "| features (pooled) | pooled = mean of patch tokens, final norm |" in summary and "seq_means" not in summary
    run_analyze(run, "--max_samples=20", "--etf_classes=[1,4,7]", "--tokens=all", f"--out={tmp_path / 'all'}")
    res = check_outputs(tmp_path / "all", VIT_FIGURES)
    assert res["nc"]["seq_means"]["features"] == "seq_means = mean of the patch tokens and the CLS token, final norm"
    assert len(figure_texts["etf.png"]["titles"]) == 3 and res["nc"]["pooled"]["nc1"] != res["nc"]["seq_means"]["nc1"]
    m = report.run_metrics(res, {})  # a comparison's metrics: these tokens count as all tokens; no result.txt
    assert m["within_seq (all)"] == res["anova"]["within_seq_frac"] and m["within_seq (patch)"] is None
    assert m["val_acc"] == 0.5 and m["val_loss"] is None  # the headline metric from log.jsonl


@pytest.mark.slow
def test_vit_with_cls_token_and_an_earlier_layer(tmp_path, fashion_dir, capsys):
    run = make_run(tmp_path / "vit", "vit", n_lap=2, dataset="fashion_mnist", data_dir=fashion_dir)
    run_analyze(run, "--max_samples=20", "--tokens=all", "--layer=1", f"--out={tmp_path / 'a2'}")
    res2 = check_outputs(tmp_path / "a2", VIT_FIGURES)
    assert res2["settings"]["tokens"] == "patch tokens and the CLS token"
    assert res2["anova"] == res2["layerwise"]["anova"][0]  # --layer=1: after block 1
    assert len(res2["spectrum"]["lambda_mean"]) == 17
    assert result(capsys.readouterr().out)["within_seq_frac"] == f"{res2['layerwise']['within_seq_frac'][0]:.4f}"


def test_eval_images_follow_the_training_scripts(fashion_dir):
    """ViT: the validation split; DINO: train_dino.py's k-NN images (eval_val of them at global_size), then a fixed
    subset; normalisation from the checkpoint when it has one, else the dataset's training statistics."""
    split = images.load_images("fashion_mnist", fashion_dir)
    cfg = dict(dataset="fashion_mnist", data_dir=fashion_dir, eval_val=20, global_size=28)
    mc = dict(img_size=28)
    x, y, names, mean, std = images.eval_images(dict(kind="dino", config=cfg, model_config=mc), 12, 0)
    knn_x, knn_y = images.load_eval_images(split, "val", 20, 28)
    assert len(x) == 12 and mean == pytest.approx([np.mean(train_pixels(fashion_dir)) / 255]) and std == split["std"]
    rows = {t.numpy().tobytes(): int(c) for t, c in zip(knn_x, knn_y)}
    assert all(rows.get(t.numpy().tobytes()) == int(c) for t, c in zip(x, y))  # every image is a k-NN image
    x2, y2, *_ = images.eval_images(dict(kind="dino", config=cfg, model_config=mc), 12, 0)
    assert torch.equal(x, x2) and torch.equal(y, y2)  # a fixed subset
    x3, *_ = images.eval_images(dict(kind="dino", config=cfg, model_config=mc), 12, 1)
    assert not torch.equal(x, x3)  # another --seed, another subset
    xv, yv, names, mean, _ = images.eval_images(dict(kind="vit", config=cfg, model_config=mc, mean=[0.3]), 100, 0)
    assert torch.equal(xv, split["val"][0]) and mean == [0.3] and names == split["classes"]  # all 60, in order


def tiny_token_data(tmp_path):
    """data/tiny/val.bin (uint16) and meta.json in the token-dataset format, read through data.text."""
    d = tmp_path / "data" / "tiny"
    d.mkdir(parents=True)
    rng = np.random.default_rng(0)
    (rng.zipf(1.5, 3000) % 50).astype(np.uint16).tofile(d / "val.bin")  # a skewed unigram distribution
    chars = [chr(ord("a") + i) for i in range(26)] + [chr(ord("A") + i) for i in range(24)]
    (d / "meta.json").write_text(json.dumps({"vocab_size": 50, "tokenizer": "char", "chars": chars}))
    return str(tmp_path / "data")


@pytest.mark.slow
def test_end_to_end_gpt(tmp_path, capsys, figure_texts):
    data_dir = tiny_token_data(tmp_path)
    run = make_run(tmp_path / "gpt", "gpt", n_lap=[0, 4], dataset="tiny", data_dir=data_dir, block_size=32,
                   model="gpt-tiny")  # an older option name in the saved config is ignored
    run_analyze(run, "--max_samples=40", "--batch_size=16", "--n_targets=8", "--pca_images=6", f"--out={tmp_path / 'o'}")
    res = check_outputs(tmp_path / "o", ["spectrum.png", "collapse.png", "anova.png", "heads.png", "pca.png", "etf.png",
                                         "curves.png"])
    s = res["settings"]
    assert s["n_samples"] == 40 and s["seq_len"] == 32 and s["n_targets"] == 8 and s["pca_windows"] == 6
    # the PCA scatter and the ETF panel against the model run directly: windows, their next tokens, final-norm tokens
    model = analyze.common.load_model(torch.load(os.path.join(run, "ckpt.pt"), weights_only=True)).eval()
    x, targets = text.load_windows(data_dir, "tiny", 32, 40)
    names = {i: repr("abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWX"[i]) for i in range(50)}
    ids, counts = targets[:6].unique(return_counts=True)
    assert sorted(figure_texts["pca.png"]["legend"]) == sorted(names[i] for i in ids[counts.argsort(descending=True)[:10]].tolist())
    top3 = res["anova"]["targets"][:3]
    assert res["etf"]["classes"] == top3 and figure_texts["etf.png"]["legend"] == [names[i] for i in top3]
    with torch.no_grad():
        h = model.forward_features(x)  # (40, 32, d), after the final norm
    m = torch.isin(targets, torch.tensor(top3))
    t = targets[m]
    W3 = model.lm_head.weight.detach()[top3]
    center = torch.stack([h[m][t == c].double().mean(0) for c in top3]).mean(0)
    xy = geometry.etf_projection(W3, h[m], center)
    means = torch.stack([xy[t == c].mean(0) for c in top3])
    assert torch.allclose(torch.tensor(res["etf"]["tokens"]["class_means_2d"], dtype=torch.float64), means, atol=1e-5)
    a = res["anova"]
    assert a["n_classes"] == 8 and len(a["targets"]) == 8
    assert a["target_names"][0] == repr("abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWX"[a["targets"][0]])
    assert a["within_class_frac"] + a["between_class_frac"] == pytest.approx(1.0)
    assert 0 < a["target_share"] <= 1 and a["n_tokens"] == round(a["target_share"] * 40 * 32)
    assert res["nc"]["nc1"] > 0 and len(res["spectrum"]["lambda_mean"]) == 32
    assert res["n_lap_label"] == "2 [0, 4]" and res["final_metric"]["name"] == "val_loss"
    assert len(res["layerwise"]["within_seq_frac"]) == 3 and "anova" not in res["layerwise"]
    m = report_metrics(tmp_path, res, "val_loss=1.5 val_bpb=2.2")  # what the report reads of this analysis.json
    assert m["val_bpb"] == 2.2 and m["within_class (next-token)"] == a["within_class_frac"] and m["nc1"] == res["nc"]["nc1"]
    assert m["within_seq after last block"] == res["layerwise"]["within_seq_frac"][1] and "within_seq (patch)" not in m
    r = result(capsys.readouterr().out)
    assert r["kind"] == "gpt" and r["n_lap"] == "[0,4]" and r["nc1"] == f"{res['nc']['nc1']:.4g}"
    # the windows: evenly spread, non-overlapping, inputs followed by their next-token targets
    x, t = text.load_windows(data_dir, "tiny", 16, 5)
    val = np.fromfile(os.path.join(data_dir, "tiny", "val.bin"), dtype=np.uint16)
    starts = [i * (len(val) - 17) // 4 for i in range(5)]
    assert x.shape == t.shape == (5, 16) and torch.equal(x[:, 1:], t[:, :-1])
    assert x[:, 0].tolist() == val[starts].tolist() and starts[-1] + 17 == len(val)
    with pytest.raises(UsageError, match="seq_len"):
        run_analyze(run, "--seq_len=64")
    with pytest.raises(UsageError, match="fewer than one window"):
        text.load_windows(data_dir, "tiny", 4000, 5)
    with pytest.raises(UsageError, match="not prepared"):  # data.text's message for missing data
        run_analyze(make_run(tmp_path / "gpt2", "gpt", dataset="nowhere", data_dir=data_dir))
    run_analyze(run, "--max_samples=8", "--n_targets=2", f"--out={tmp_path / 'two'}")  # two classes: no ETF panel
    assert "etf.png" not in os.listdir(tmp_path / "two") and "etf" not in json.load(open(tmp_path / "two" / "analysis.json"))


@pytest.mark.slow
def test_a_loose_checkpoint_is_analysed_beside_it_under_its_own_name(tmp_path, capsys, figure_texts):
    """python analyze.py out/x.pt writes out/x-analysis/ and calls the run x (a run's ckpt.pt: RUN/analysis, RUN)."""
    run = make_run(tmp_path / "gpt", "gpt", dataset="tiny", data_dir=tiny_token_data(tmp_path), block_size=32)
    shutil.copy(os.path.join(run, "ckpt.pt"), tmp_path / "x.pt")
    run_analyze(tmp_path / "x.pt", "--max_samples=8")
    out = capsys.readouterr().out
    assert result(out)["out"] == str(tmp_path / "x-analysis") and not (tmp_path / "analysis").exists()
    assert "\nx: 8 sequences" in out and "x (gpt, n_lap=0)" in figure_texts["spectrum.png"]["titles"][0]
    assert (tmp_path / "x-analysis" / "summary.md").read_text().startswith(f"# {tmp_path / 'x.pt'}: gpt, n_lap = 0")


@pytest.mark.slow
def test_end_to_end_dino(tmp_path, fashion_dir, capsys):
    run = make_run(tmp_path / "dino", "dino", n_lap=4, dataset="fashion_mnist", data_dir=fashion_dir)
    run_analyze(run, "--max_samples=30", "--map_images=6", f"--out={tmp_path / 'o'}")
    res = check_outputs(tmp_path / "o", ["collapse.png", "anova.png", "spectrum.png", "heads.png", "pca_maps.png",
                                         "etf.png", "curves.png"])
    assert res["settings"]["map_images"] == 6 and res["settings"]["n_samples"] == 30
    assert res["etf"]["classes"] == [0, 1, 2] and res["etf"]["pooled"]["vertex_dist"] > 0  # no classifier: class means
    means = torch.tensor(res["etf"]["pooled"]["class_means_2d"], dtype=torch.float64)  # as analysis.json holds them
    assert means.sum(0).abs().max() < 1e-9  # centred by their mean
    assert "nc" not in res and sum(res["anova"][k] for k in FRACS) == pytest.approx(1.0)
    assert res["final_metric"]["name"] == "knn_acc" and res["n_lap"] == 4
    assert res["settings"]["normalisation"]["mean"] == pytest.approx([np.mean(train_pixels(fashion_dir)) / 255])
    r = result(capsys.readouterr().out)
    assert r["kind"] == "dino" and "nc1" not in r and list(r) == ["kind", "n_lap", "within_seq_frac", "k_0.9", "k_0.99",
                                                                 "out"]


def image_folder(root, n_per_class=4, size=36):
    """root/train/<class>/*.png and root/val/<class>/*.png: an ImageNet-style folder of three colour classes."""
    from PIL import Image
    rng = np.random.default_rng(0)
    for split in ("train", "val"):
        for c, name in enumerate(("red", "green", "blue")):
            os.makedirs(root / split / name)
            for i in range(n_per_class):
                img = rng.integers(0, 80, (size, size, 3), dtype=np.uint8)
                img[..., c] += 150
                Image.fromarray(img).save(root / split / name / f"{i}.png")
    return str(root)


@pytest.mark.slow
def test_end_to_end_image_folders(tmp_path, capsys):
    """ImageNet-style folders: the ViT decodes its validation subset, DINO its k-NN images; ImageNet statistics."""
    folder = image_folder(tmp_path / "folder")
    common = dict(dataset="imagefolder", data_dir=folder, num_workers=0)
    vit = make_run(tmp_path / "vit", "vit", in_chans=3, **common)
    dino = make_run(tmp_path / "dino", "dino", in_chans=3, imagefolder_base=40, global_size=28, eval_val=9, **common)
    run_analyze(vit, "--max_samples=10", "--etf_classes=[0,1,2]")
    res = check_outputs(os.path.join(vit, "analysis"), VIT_FIGURES)
    assert res["settings"]["n_samples"] == 10 and res["settings"]["normalisation"]["mean"] == folders.IMAGENET_MEAN
    assert res["nc"]["pooled"]["n_classes"] == 3
    run_analyze(dino, "--max_samples=100")
    res = check_outputs(os.path.join(dino, "analysis"), ["collapse.png", "anova.png", "spectrum.png", "heads.png",
                                                         "pca_maps.png", "etf.png", "curves.png"])
    assert res["settings"]["n_samples"] == 9  # train_dino.py's eval_val images, all of them
    assert result(capsys.readouterr().out)["kind"] == "dino"


def test_bad_input(tmp_path, fashion_dir):
    with pytest.raises(UsageError, match="run directories"):
        run_analyze("--max_samples=3")
    run = make_run(tmp_path / "v", "vit", dataset="fashion_mnist", data_dir=fashion_dir)
    with pytest.raises(UsageError, match="tokens"):
        run_analyze(run, "--tokens=cls")
    with pytest.raises(UsageError, match="unknown option"):
        run_analyze(run, "--colour=red")
    with pytest.raises(UsageError, match="expected int"):
        run_analyze(run, "--max_samples=many")
    with pytest.raises(UsageError, match="layer"):
        run_analyze(run, "--layer=7", "--max_samples=4")
    with pytest.raises(UsageError, match="three different class"):
        run_analyze(run, "--etf_classes=[1,1,2]")
    with pytest.raises(UsageError, match="not every class occurs"):
        run_analyze(run, "--etf_classes=[1,2,12]", "--max_samples=20")
    with pytest.raises(UsageError, match="at least two classes"):
        geometry.neural_collapse(torch.randn(5, 3), torch.zeros(5, dtype=torch.long))
    with pytest.raises(UsageError, match="n_targets"):
        run_analyze(run, "--n_targets=1")
    with pytest.raises(UsageError, match="no such run directory"):
        run_analyze(str(tmp_path / "typo"))
    (tmp_path / "file").write_text("")
    for bad in ("/proc/nope", str(tmp_path / "file" / "sub")):  # the option and the way out, not an OSError
        with pytest.raises(UsageError, match=f"^--out={re.escape(bad)} cannot be written .*; choose another --out$"):
            run_analyze(run, f"--out={bad}", "--max_samples=4")
    os.makedirs(tmp_path / "empty")
    with pytest.raises(FileNotFoundError, match="no checkpoint"):
        run_analyze(str(tmp_path / "empty"))
    torch.save({"kind": "bert", "model_config": {}, "model": {}}, tmp_path / "empty" / "ckpt.pt")
    with pytest.raises(UsageError, match="not a checkpoint of the training scripts.*'bert'"):
        run_analyze(str(tmp_path / "empty"))
    torch.save({"kind": "vit"}, tmp_path / "empty" / "ckpt.pt")  # no model, no model_config
    with pytest.raises(UsageError, match="with model and model_config"):
        run_analyze(str(tmp_path / "empty"))
    with open(tmp_path / "empty" / "ckpt.pt", "wb") as f:
        f.write(open(os.path.join(run, "ckpt.pt"), "rb").read()[:1000])  # a truncated copy
    with pytest.raises(UsageError, match="damaged or truncated"):
        run_analyze(str(tmp_path / "empty"))
    config = tmp_path / "opts.py"  # a config file of `key = value` lines is an option source, not a run
    config.write_text("tokens = 'cls'\n")
    with pytest.raises(UsageError, match="tokens"):
        run_analyze(run, str(config))


@pytest.mark.slow
def test_end_to_end_subprocess(tmp_path, fashion_dir):
    """The whole script in its own process, with the default output folder and a config file."""
    run = make_run(tmp_path / "dino", "dino", n_lap=2, dataset="fashion_mnist", data_dir=fashion_dir)
    (tmp_path / "small.py").write_text("max_samples = 12\nbatch_size = 5\n")
    p = subprocess.run([sys.executable, SCRIPT, run, str(tmp_path / "small.py"), "--device=cpu"], cwd=tmp_path,
                       capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stderr[-2000:]
    assert result(p.stdout)["out"] == os.path.join(run, "analysis")
    res = json.loads(open(os.path.join(run, "analysis", "analysis.json")).read())
    assert res["settings"]["n_samples"] == 12 and "max_samples=12" in p.stdout and "batch_size=5" in p.stdout
