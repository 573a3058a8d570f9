#!/usr/bin/env bash
# The reproduction sweep behind RESULTS.md: every paradigm over n_lap (Laplacian heads per layer, of 4) and
# seeds 0-2, then analyze.py on every run. Two single-threaded runs at a time (accuracy does not depend on
# machine load); about two hours on 2 cores. Checkpoints stay in out/sweep/; the small artefacts each run
# keeps (log.jsonl, result.txt, analysis.json for patch tokens and analysis_all.json with the CLS token) are
# copied to results/<set>/k<n_lap>-s<seed>/ (set: vit, gpt, dino, vit_long, vit_cls, dino_scenes). A finished
# run (its result.txt copied) is skipped, so an interrupted sweep continues where it stopped.
#
#     bash results/sweep.sh                 # train, analyse, collect
#     bash results/sweep.sh vit_long        # only the jobs whose line matches this pattern (see jobs below)
#     python analyze.py --report=results    # the comparison tables and figures from the artefacts, in seconds
#
# Lengths are shorter than the scripts' CPU defaults so that the 47 runs fit in two hours of a 2-core machine:
# ViT 4 epochs (default 18), GPT 1000 steps (default 2000), DINO 1.5 epochs (default 6); the schedules are
# compressed, not cut. The long ViT runs (n_lap 0 and 4, three seeds) train three times as long: 12 epochs;
# vit_cls feeds the head the CLS token instead of the mean of the patch tokens (DeiT-III's choice).
# The ViT runs one process with batch 256, the same global batch, data order and draws as the default's
# 2 processes of 128.
set -euo pipefail
cd "$(dirname "$0")/.."
export OMP_NUM_THREADS=1 OMP_WAIT_POLICY=PASSIVE
JOBS=${JOBS:-2}

run() {  # run <kind> <n_lap> <seed> [<set> <extra options...>]: one training, its analyses, its artefacts
    local kind=$1 k=$2 s=$3 set=${4:-$1}; shift; shift; shift; shift || true
    local dst=results/$set/k$k-s$s out=out/sweep/$set/k$k-s$s
    [ -f "$dst/result.txt" ] && return 0
    mkdir -p "out/sweep/$set"
    case $kind in
        vit)  python train_vit.py --n_lap=$k --seed=$s --epochs=4 --cpu_procs=1 --batch_size=256 --out_dir=$out "$@" ;;
        gpt)  python train_gpt.py --n_lap=$k --seed=$s --max_iters=1000 --max_new_tokens=0 --out_dir=$out "$@" ;;
        dino) python train_dino.py --n_lap=$k --seed=$s --epochs=1.5 --cpu_procs=1 --out_dir=$out "$@" ;;
    esac > "$out.log" 2>&1 || { echo "FAILED: $set $k $s (see $out.log)"; return 1; }
    { python analyze.py "$out" && if [ "$kind" != gpt ]; then python analyze.py "$out" --tokens=all \
        --out="$out/analysis_all"; fi; } > "$out.analyze.log" 2>&1 || { echo "FAILED: analyze $out"; return 1; }
    mkdir -p "$dst"
    cp "$out/log.jsonl" "$out/analysis/analysis.json" "$dst/"
    if [ "$kind" != gpt ]; then cp "$out/analysis_all/analysis.json" "$dst/analysis_all.json"; fi
    if [ "$kind" = dino ]; then cp "$out/analysis/pca_maps.png" "$dst/"; fi
    cp "$out/result.txt" "$dst/"  # last: its presence marks the run as done
    echo "done: $set k$k-s$s: $(cat "$dst/result.txt")"
}
export -f run

jobs() {  # seed by seed, so that a cut-short sweep still has whole seeds; long jobs first within a seed
    for s in 0 1 2; do
        for k in 0 2 4; do echo "dino $k $s"; done
        for k in 0 2 4; do echo "gpt $k $s"; done
        for k in 0 1 2 3 4; do echo "vit $k $s"; done
    done
    for s in 0 1 2; do for k in 0 4; do echo "vit $k $s vit_long --epochs=12"; done; done  # three times as long
    for s in 0 1 2; do for k in 0 4; do echo "vit $k $s vit_cls --pooling=cls"; done; done  # the CLS token as the head's input
    # DINO on the generated scenes (items on textured backgrounds, where raw pixels are weak), for the PCA maps
    for k in 0 4; do echo "dino $k 0 dino_scenes --dataset=scenes --global_size=56 --epochs=3"; done
}
jobs | grep -E -- "${1:-.}" | xargs -P "$JOBS" -L 1 bash -c 'run "$@"' _
