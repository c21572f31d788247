#!/usr/bin/env bash
# Drafter v5 on the CPU: v4 (shipped before v5) fine-tuned on the CPU-distilled data from cached target states, one
# change per arm, the same data, batches and steps for all; then each scored on the benchmark prompts (eval-bench)
# at k = 1..4 and on a second held-out set (heldout: 24 chat prompts written for this and the 16 code prompts) at
# k = 2 and 4.
#
#   arms   control        v4's settings with its draft vocabulary: what fine-tuning alone adds
#          context_token  + the emitted token at the context layer (context_token_input, EAGLE's input)
#          next_token     + the emitted token at the slots (next_token_input)
#          both           + both inputs
#          ARM-reach      an arm above with the reach-weighted loss (slot_loss_reach)
#
# Made first (README.md here says how long each took):
#   specformer cache-states --data benchmarks/drafter-smollm2/data-cpu-2000 --out runs/states-cpu-2000
#   cat benchmarks/drafter-smollm2/v5-cpu/heldout-chat.jsonl specformer_jax/assets/code-prompts.jsonl \
#       > runs/heldout.jsonl
#   specformer distill --prompts runs/heldout.jsonl --for-eval --max-new-tokens 256 --batch-size 8 \
#       --out runs/eval-heldout
#   specformer pack-data runs/eval-heldout --out benchmarks/drafter-smollm2/v5-cpu/eval-heldout
# A cut run resumes where it stopped: an arm with checkpoints continues with --resume, a finished one is skipped.
#
# Later sessions continue from the last committed drafter on new data, e.g. session 2 (../v5-cpu-2/README.md):
#   OUT=runs/v5-cpu-2 INIT=benchmarks/drafter-smollm2/v5-cpu/drafter-next_token-reach \
#   ARMS="next_token-reach both-reach" DATA=benchmarks/drafter-smollm2/data-cpu-sp3 STATES=runs/states-cpu-sp3 \
#   RESULTS=benchmarks/drafter-smollm2/v5-cpu-2 benchmarks/drafter-smollm2/v5-cpu/run.sh
# and session 3, which made v5 (../v5-cpu-3/README.md), on both data sets with their two caches:
#   D=benchmarks/drafter-smollm2; OUT=runs/v5-cpu-3 INIT=$D/v5-cpu-2/drafter-both-reach ARMS=both-reach \
#   DATA=$D/data-cpu-2000,$D/data-cpu-sp3 STATES=runs/states-cpu-2000,runs/states-cpu-sp3 STEPS=600 \
#   RESULTS=$D/v5-cpu-3 $D/v5-cpu/run.sh
# and session 5, which made v6 (../v5-cpu-5/README.md), from v5 on three data sets:
#   OUT=runs/v5-cpu-5 INIT=v5 ARMS=both-reach DATA=$D/data-cpu-2000,$D/data-cpu-sp3,$D/data-cpu-sp4 \
#   STATES=runs/states-cpu-2000,runs/states-cpu-sp3,runs/states-cpu-sp4 STEPS=600 RESULTS=$D/v5-cpu-5 $D/v5-cpu/run.sh
# and session 6, which made v7 (../v5-cpu-6/README.md), from v6 on four data sets:
#   OUT=runs/v5-cpu-6 INIT=v6 ARMS=both-reach DATA=$D/data-cpu-2000,$D/data-cpu-sp3,$D/data-cpu-sp4,$D/data-cpu-sp5 \
#   STATES=runs/states-cpu-2000,runs/states-cpu-sp3,runs/states-cpu-sp4,runs/states-cpu-sp5 STEPS=700 \
#   RESULTS=$D/v5-cpu-6 $D/v5-cpu/run.sh
# and session 7, which made v8 (../v5-cpu-7/README.md), from v7 on five data sets:
#   S=runs/states-cpu; OUT=runs/v5-cpu-7 INIT=v7 ARMS=both-reach \
#   DATA=$D/data-cpu-2000,$D/data-cpu-sp3,$D/data-cpu-sp4,$D/data-cpu-sp5,$D/data-cpu-sp6 \
#   STATES=$S-2000,$S-sp3,$S-sp4,$S-sp5,$S-sp6 STEPS=700 RESULTS=$D/v5-cpu-7 $D/v5-cpu/run.sh
# and session 8 (../v5-cpu-8/README.md), from v8 on six data sets:
#   S=runs/states-cpu; OUT=runs/v5-cpu-8 INIT=v8 ARMS=both-reach \
#   DATA=$D/data-cpu-2000,$D/data-cpu-sp3,$D/data-cpu-sp4,$D/data-cpu-sp5,$D/data-cpu-sp6,$D/data-cpu-sp7 \
#   STATES=$S-2000,$S-sp3,$S-sp4,$S-sp5,$S-sp6,$S-sp7 STEPS=700 RESULTS=$D/v5-cpu-8 $D/v5-cpu/run.sh
# and session 9 (../v5-cpu-9/README.md), from v9 on seven data sets:
#   S=runs/states-cpu; X=$D/data-cpu; OUT=runs/v5-cpu-9 INIT=v9 ARMS=both-reach \
#   DATA=$X-2000,$X-sp3,$X-sp4,$X-sp5,$X-sp6,$X-sp7,$X-sp8 \
#   STATES=$S-2000,$S-sp3,$S-sp4,$S-sp5,$S-sp6,$S-sp7,$S-sp8 STEPS=800 RESULTS=$D/v5-cpu-9 $D/v5-cpu/run.sh
# and session 10 (../v5-cpu-10/README.md), from v10 on eight data sets:
#   S=runs/states-cpu; X=$D/data-cpu; OUT=runs/v5-cpu-10 INIT=v10 ARMS=both-reach \
#   DATA=$X-2000,$X-sp3,$X-sp4,$X-sp5,$X-sp6,$X-sp7,$X-sp8,$X-sp9 \
#   STATES=$S-2000,$S-sp3,$S-sp4,$S-sp5,$S-sp6,$S-sp7,$S-sp8,$S-sp9 STEPS=850 RESULTS=$D/v5-cpu-10 $D/v5-cpu/run.sh
# and session 11 (../v5-cpu-11/README.md), from v11 on nine data sets with the target run live (STATES=null; no
# caches were kept from session 10, and a run that reads its data 0.3 times trains sooner live than after caching it):
#   X=$D/data-cpu; OUT=runs/v5-cpu-11 INIT=v11 ARMS=both-reach \
#   DATA=$X-2000,$X-sp3,$X-sp4,$X-sp5,$X-sp6,$X-sp7,$X-sp8,$X-sp9,$X-sp10 STATES=null STEPS=600 \
#   RESULTS=$D/v5-cpu-11 $D/v5-cpu/run.sh
# and session 12 (../v5-cpu-12/README.md), from v12 on all ten data sets, live; level with v12, not shipped:
#   X=$D/data-cpu; OUT=runs/v5-cpu-12 INIT=v12 ARMS=both-reach \
#   DATA=$X-2000,$X-sp3,$X-sp4,$X-sp5,$X-sp6,$X-sp7,$X-sp8,$X-sp9,$X-sp10,$X-sp11 STATES=null STEPS=600 \
#   RESULTS=$D/v5-cpu-12 $D/v5-cpu/run.sh
# and session 13 (../v5-cpu-13/README.md), that run's drafter on the same ten sets at a third of the learning rate;
# then v14, the average of v12 and the two continuations (specformer average-drafters --drafters
# v12,$D/v5-cpu-12/drafter-both-reach,$D/v5-cpu-13/drafter-both-reach):
#   X=$D/data-cpu; OUT=runs/v5-cpu-13 INIT=$D/v5-cpu-12/drafter-both-reach ARMS=both-reach \
#   DATA=$X-2000,$X-sp3,$X-sp4,$X-sp5,$X-sp6,$X-sp7,$X-sp8,$X-sp9,$X-sp10,$X-sp11 STATES=null STEPS=600 LR=1e-4 \
#   RESULTS=$D/v5-cpu-13 $D/v5-cpu/run.sh
# An arm made otherwise (an average: runs/v5-cpu-N/NAME/drafter with its evals) enters table.py's table too.
set -euo pipefail

bin=${SPECFORMER:-specformer}
out=${OUT:-runs/v5-cpu}
data=${DATA:-benchmarks/drafter-smollm2/data-cpu-2000}
states=${STATES:-runs/states-cpu-2000}  # null: run the target live
bench=${BENCH:-benchmarks/drafter-smollm2/v5-ablation/eval-bench}
heldout=${HELDOUT:-benchmarks/drafter-smollm2/v5-cpu/eval-heldout}
arms=${ARMS:-"control next_token next_token-reach"}
init=${INIT:-v4}  # the drafter each arm starts from
steps=${STEPS:-300}
batch=${BATCH:-8}
seq_len=${SEQ_LEN:-320}  # keeps 98.8% of the answer tokens; 512 would be 53% padding
lr=${LR:-3e-4}
eval_every=${EVAL_EVERY:-100}
here=$(dirname "$0")
results=${RESULTS:-$here}  # where table.py writes the table, curves and metrics
mkdir -p "$out/v4"

evals() {  # evals DRAFTER DIR: decoding and teacher-forced acceptance, benchmark prompts at k = 1..4, held-out 2, 4
  for run in bench:1 bench:2 bench:3 bench:4 heldout:2 heldout:4; do
    set=${run%:*} k=${run#*:}
    [[ $set == bench ]] && d=$bench || d=$heldout
    [[ -f "$2/eval_${set}_k$k.json" ]] || "$bin" eval-drafter --drafter "$1" --data "$d" --seq-len 512 \
      --batch-size 16 --draft-len "$k" > "$2/eval_${set}_k$k.json"
  done
}

evals v4 "$out/v4"  # v4, the drafter v5 was fine-tuned from, as it shipped
for arm in $arms; do
  extra=()
  case ${arm%-reach} in
    control) ;;
    context_token) extra=(context_token_input=true) ;;
    next_token) extra=(next_token_input=true) ;;
    both) extra=(context_token_input=true next_token_input=true) ;;
    *) echo "unknown arm $arm" >&2; exit 2 ;;
  esac
  [[ $arm == *-reach ]] && extra+=(slot_loss_reach=true)
  run="$out/$arm"
  if [[ ! -f "$run/drafter/drafter.json" ]]; then
    resume=()
    [[ -d "$run/checkpoints" ]] && [[ -n "$(ls -A "$run/checkpoints")" ]] && resume=(--resume)
    "$bin" train --config configs/drafter-smollm2.yaml "${resume[@]}" --set "data=$data" "states=$states" \
      "eval_data=$bench" "out=$run" "init_from=$init" draft_vocab_size=8192 "steps=$steps" "batch_size=$batch" \
      "seq_len=$seq_len" "lr=$lr" warmup_frac=0.05 log_every=10 "eval_every=$eval_every" "save_every=$eval_every" \
      eval_batches=2 "${extra[@]}"
  fi
  evals "$run/drafter" "$run"
done
"${PYTHON:-python}" "$here/table.py" "$out" --out "$results"
