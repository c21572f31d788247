#!/usr/bin/env bash
# The drafter v5 ablation (issue: drafts that see the token just emitted, a draft vocabulary, eight slots): v4's
# recipe (configs/drafter-smollm2.yaml) and one change per arm, each trained from scratch on the same data with
# the same steps, then scored on the benchmark prompts (eval-drafter: per-slot accuracy, teacher-forced and
# decoding accepted length) at k = K and, for the eight-slot arm, at every k = 1..8.
#
#   arms   v4             the shipped drafter's recipe
#          next_token     + the token after the position, at the slots (next_token_input)
#          context_token  + that token at the context layer (context_token_input, EAGLE's input)
#          draft_vocab    + a head over the V' = DRAFT_VOCAB most frequent answer tokens
#          k8             + eight slots (num_slots: 8)
#
# At full scale on a GPU (v4's data and steps; DATA and EVAL as configs/drafter-smollm2.yaml names them):
#   bash benchmarks/drafter-smollm2/v5-ablation/run.sh
# The CPU run of README.md here set STEPS, SEQ_LEN, BATCH, EVAL_SEQ_LEN, DATA, EVAL and OUT (see there). A cut run resumes
# where it stopped: an arm with checkpoints continues with --resume, a finished one is skipped.
set -euo pipefail

bin=${SPECFORMER:-specformer}
py=${PYTHON:-python}
out=${OUT:-runs/v5-ablation}
data=${DATA:-runs/distill-smollm2,runs/distill-self,runs/distill-self2}
eval_data=${EVAL:-runs/eval-bench}
arms=${ARMS:-"v4 next_token context_token draft_vocab k8"}
steps=${STEPS:-2800}
seq_len=${SEQ_LEN:-512}
batch=${BATCH:-64}
draft_vocab=${DRAFT_VOCAB:-8192}
eval_every=${EVAL_EVERY:-400}
eval_seq_len=${EVAL_SEQ_LEN:-512}
here=$(dirname "$0")
mkdir -p "$out"

for arm in $arms; do
  case $arm in
    v4) extra=() ;;
    next_token) extra=(next_token_input=true) ;;
    context_token) extra=(context_token_input=true) ;;
    draft_vocab) extra=(draft_vocab_size="$draft_vocab") ;;
    k8) extra=(num_slots=8) ;;
    *) echo "unknown arm $arm" >&2; exit 2 ;;
  esac
  run="$out/$arm"
  if [[ ! -f "$run/drafter/drafter.json" ]]; then
    resume=()
    [[ -d "$run/checkpoints" ]] && [[ -n "$(ls -A "$run/checkpoints")" ]] && resume=(--resume)
    "$bin" train --config configs/drafter-smollm2.yaml "${resume[@]}" --set "data=$data" "eval_data=$eval_data" \
      "out=$run" "steps=$steps" "seq_len=$seq_len" "batch_size=$batch" "eval_every=$eval_every" \
      "save_every=$eval_every" "${extra[@]}"
  fi
  slots=4; [[ $arm == k8 ]] && slots=8
  ks=$slots; [[ $arm == k8 ]] && ks="1 2 3 4 5 6 7 8"
  for k in $ks; do
    [[ -f "$run/eval_k$k.json" ]] || "$bin" eval-drafter --drafter "$run/drafter" --data "$eval_data" \
      --seq-len "$eval_seq_len" --batch-size 16 --draft-len "$k" > "$run/eval_k$k.json"
  done
done
# the table holds every finished arm under $out, not only this run's (one arm a command adds to it)
finished=(); for arm in v4 next_token context_token draft_vocab k8; do
  [[ -f "$out/$arm/drafter/drafter.json" ]] && finished+=("$arm"); done
"$py" "$here/table.py" "$out" --arms "${finished[@]}" --out "$here"
