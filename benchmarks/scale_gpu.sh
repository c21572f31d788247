#!/usr/bin/env bash
# The measurements of speculation at real model sizes, in one go on a GPU machine (benchmarks/README.md, "Scale"):
#   1. random-weight Llama-3.2-1B and Llama-3.1-8B shapes in bfloat16, speculative decoding with set acceptance
#      a = 0.5, 0.7, 0.8 against plain decoding, k = 2, 4, 8, batch 1 .. 256 (one request per slot);
#   2. the default model in bfloat16 with its shipped drafter: how many requests equal plain decoding, and where
#      the others first differ;
#   3. `specformer report` over the files of step 1 (measured speedup beside the TPU roofline estimates).
# Every file is written as soon as its batch sizes are done, so a run cut short keeps what it measured. Each
# (model, k) compiles one chunk per batch size for all three rates (the rate is run data). Where one command may
# only run for minutes, run a model (MODELS=...) or a draft length (DRAFT_LENS=...) per command, and choose the
# steps with STEPS (default "scale equivalence report").
#
#   OUT=benchmarks/results/scale MODELS="llama-3.2-1b llama-3.1-8b" bash benchmarks/scale_gpu.sh
# A smoke run on a CPU: MODELS=tiny DRAFT_LENS=2 BATCHES=1,2 NEW_TOKENS=8 EQ_BATCHES=2 EQ_REQUESTS=2 OUT=/tmp/scale \
#   SPECFORMER=.venv/bin/specformer bash benchmarks/scale_gpu.sh
set -euo pipefail

out=${OUT:-benchmarks/results/scale}
models=${MODELS:-"llama-3.2-1b llama-3.1-8b"}
draft_lens=${DRAFT_LENS:-"2 4 8"}
batches=${BATCHES:-"1,8,32,128,256"}
new_tokens=${NEW_TOKENS:-128}
eq_batches=${EQ_BATCHES:-"1,16,64"}
eq_requests=${EQ_REQUESTS:-64}
bin=${SPECFORMER:-specformer}
steps=${STEPS:-"scale equivalence report"}
mkdir -p "$out"

if [[ " $steps " == *" scale "* ]]; then
  for model in $models; do
    for k in $draft_lens; do
      name="$out/${model}_k${k}"
      "$bin" bench --model "random:$model" --set-acceptance 0.5,0.7,0.8 --draft-len "$k" --batch-sizes "$batches" \
        --max-new-tokens "$new_tokens" --repeats 1 --out "$name.json" --plot "$name.png"
    done
  done
fi

if [[ " $steps " == *" equivalence "* ]]; then
  "$bin" bench --model default --dtype bfloat16 --draft-len 4 --batch-sizes "$eq_batches" \
    --max-new-tokens "$new_tokens" --num-requests "$eq_requests" --repeats 1 \
    --out "$out/default_bfloat16_equivalence.json"
fi

if [[ " $steps " == *" report "* ]]; then
  "$bin" report "$out"/*_k*.json --out "$out/report.md" --plot "$out/report.png"
fi
