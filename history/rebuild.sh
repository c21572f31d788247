#!/usr/bin/env bash
# Rebuild the shipped drafter (v14) bit for bit: the weight average of v12, session 12's drafter and session 13's
# (`specformer average-drafters`, in that order; the last one's draft vocabulary and settings), then compare its
# params sha256 with the package's. The three sources come back from git history through restore.sh.
#
#   bash history/rebuild.sh              (SPECFORMER=path/to/specformer to use another install; OUT=dir to keep it)
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
root=$(cd "$here/.." && pwd)
bin=${SPECFORMER:-$root/.venv/bin/specformer}
[ -x "$bin" ] || bin=specformer
out=${OUT:-$(mktemp -d)/v14}

bash "$here/restore.sh" v12 s12 s13
d="$here/drafters"
"$bin" average-drafters --drafters "$d/v12,$d/s12,$d/s13" --out "$out"
built=$(sha256sum < "$out/params.safetensors" | cut -c1-64)
shipped=$(sha256sum < "$root/specformer_jax/assets/drafter-smollm2-135m-instruct/params.safetensors" | cut -c1-64)
echo "rebuilt: $built"
echo "shipped: $shipped"
if [ "$built" = "$shipped" ]; then echo "the same drafter, bit for bit ($out)"; else echo "rebuild differs" >&2; exit 1; fi
