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
# Made first (the held-out set is committed as history/data/eval-heldout):
#   cat history/prompts/heldout-chat.jsonl specformer_jax/assets/code-prompts.jsonl > runs/heldout.jsonl
#   specformer distill --prompts runs/heldout.jsonl --for-eval --max-new-tokens 256 --batch-size 8 \
#       --out runs/eval-heldout
#   specformer pack-data runs/eval-heldout --out history/data/eval-heldout
# A cut run resumes where it stopped: an arm with checkpoints continues with --resume, a finished one is skipped.
#
# Each later session continued from the last drafter on more data (history/README.md lists them all, with the
# command of each at commit 3102113). The two runs behind the shipped drafter v14, on all ten data sets, live:
#   X=history/data/data-cpu; bash history/restore.sh v12
#   OUT=runs/s12 INIT=history/drafters/v12 ARMS=both-reach STATES=null STEPS=600 RESULTS=history/runs/s12 \
#   DATA=$X-2000,$X-sp3,$X-sp4,$X-sp5,$X-sp6,$X-sp7,$X-sp8,$X-sp9,$X-sp10,$X-sp11 history/recipe/run.sh
#   OUT=runs/s13 INIT=runs/s12/both-reach/drafter ARMS=both-reach STATES=null STEPS=600 LR=1e-4 \
#   RESULTS=history/runs/v14 DATA=... (the same ten) history/recipe/run.sh
# then v14 = the average of v12 and the two (bash history/rebuild.sh does it from the committed drafters).
# An arm made otherwise (an average: runs/v5-cpu-N/NAME/drafter with its evals) enters table.py's table too.
set -euo pipefail

bin=${SPECFORMER:-specformer}
out=${OUT:-runs/v5-cpu}
data=${DATA:-history/data/data-cpu-2000}
states=${STATES:-runs/states-cpu-2000}  # null: run the target live
bench=${BENCH:-history/data/eval-bench}
heldout=${HELDOUT:-history/data/eval-heldout}
arms=${ARMS:-"control next_token next_token-reach"}
init=${INIT:-history/drafters/v4}  # the drafter each arm starts from (restore.sh brings v4 back)
steps=${STEPS:-300}
batch=${BATCH:-8}
seq_len=${SEQ_LEN:-320}  # keeps 98.8% of the answer tokens; 512 would be 53% padding
lr=${LR:-3e-4}
eval_every=${EVAL_EVERY:-100}
here=$(dirname "$0")
results=${RESULTS:-$out}  # where table.py writes the table, curves and metrics
mkdir -p "$out/v4"

evals() {  # evals DRAFTER DIR: decoding and teacher-forced acceptance, benchmark prompts at k = 1..4, held-out 2, 4
  for run in bench:1 bench:2 bench:3 bench:4 heldout:2 heldout:4; do
    set=${run%:*} k=${run#*:}
    [[ $set == bench ]] && d=$bench || d=$heldout
    [[ -f "$2/eval_${set}_k$k.json" ]] || "$bin" eval-drafter --drafter "$1" --data "$d" --seq-len 512 \
      --batch-size 16 --draft-len "$k" > "$2/eval_${set}_k$k.json"
  done
}

evals history/drafters/v4 "$out/v4"  # v4, the drafter v5 was fine-tuned from, as it shipped
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
