#!/usr/bin/env bash
# Put drafters that left the working tree back, from the commit history/drafters.tsv names for each, under
# history/drafters/NAME (ignored by git), and check each one's params sha256 against the table.
#
#   bash history/restore.sh v12 v4        then: specformer generate --drafter history/drafters/v12 ...
#   bash history/restore.sh --list        the names it knows
#
# Needs the repository's history (a full clone); a drafter already restored with the right hash is left as it is.
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
root=$(cd "$here/.." && pwd)
table="$here/drafters.tsv"

die() { echo "restore.sh: $*" >&2; exit 2; }
names() { grep -v '^#' "$table" | cut -f1 | paste -sd' '; }
[ $# -gt 0 ] || die "name one or more drafters (--list shows them)"
if [ "$1" = "--list" ]; then names; exit 0; fi

for name in "$@"; do
  row=$(awk -F'\t' -v n="$name" '$1 == n' "$table")
  [ -n "$row" ] || die "no drafter '$name' in history/drafters.tsv (known: $(names))"
  IFS=$'\t' read -r _ commit path sha <<< "$row"
  out="$here/drafters/$name"
  if [ -f "$out/params.safetensors" ] && [ "$(sha256sum < "$out/params.safetensors" | cut -c1-64)" = "$sha" ]; then
    echo "$name: already in history/drafters/$name"; continue
  fi
  git -C "$root" cat-file -e "$commit^{commit}" 2>/dev/null \
    || die "this clone lacks commit ${commit:0:7} (a shallow clone?): run 'git fetch --unshallow' and try again"
  tmp=$(mktemp -d "$here/drafters.tmp.XXXXXX")
  trap 'rm -rf "$tmp"' EXIT
  for f in $(git -C "$root" ls-tree --name-only "$commit" "$path/"); do
    git -C "$root" show "$commit:$f" > "$tmp/$(basename "$f")"
  done
  got=$(sha256sum < "$tmp/params.safetensors" | cut -c1-64)
  [ "$got" = "$sha" ] || die "$name: params sha256 $got, the table says $sha"
  mkdir -p "$here/drafters"
  chmod 755 "$tmp" && rm -rf "$out" && mv "$tmp" "$out"
  trap - EXIT
  echo "$name: restored to history/drafters/$name from ${commit:0:7}:$path"
done
