#!/usr/bin/env bash
# Run a specformer command on every worker of a Cloud TPU VM slice (one process per worker host).
#
#   launch/tpu_pod.sh --name my-tpu --zone us-central2-b --accelerator-type v4-16 --project my-project --create \
#       --copy runs/distill-smollm2 -- \
#       specformer train --config configs/drafter-smollm2.yaml --set data=runs/distill-smollm2 --set out=/mnt/shared/run1
#
# Steps (each a gcloud command; --dry-run prints them instead of running them):
#   1. --create: create the slice (gcloud compute tpus tpu-vm create); otherwise check that it exists (describe).
#   2. Pack this repository (without .git, .venv, runs) and copy it to every worker (tpu-vm scp --worker=all).
#   3. On every worker: unpack into ~/specformer-jax, create .venv, pip install -e . "jax[tpu]" (tpu-vm ssh --worker=all).
#   4. Copy each --copy PATH to the same relative place under ~/specformer-jax on every worker (e.g. distilled data).
#   5. Run the command on every worker in ~/specformer-jax with .venv activated and SPECFORMER_DISTRIBUTED=auto:
#      jax.distributed.initialize() finds the workers, their number and its own id from the TPU VM metadata.
# Checkpoints: `out` must be a directory all workers share (a Filestore/NFS mount, or a gcsfuse-mounted bucket).
set -uo pipefail

usage() {
    cat <<'EOF'
usage: launch/tpu_pod.sh --name NAME --zone ZONE --accelerator-type TYPE --project PROJECT
                         [--create] [--version RUNTIME] [--spot] [--copy PATH]... [--skip-install] [--dry-run]
                         -- COMMAND [ARG...]
  --create          create the TPU VM slice first (otherwise it must exist)
  --version         TPU VM runtime for --create (default tpu-ubuntu2204-base; v5e: v2-alpha-tpuv5-lite,
                    v6e: v2-alpha-tpuv6e)
  --spot            create a Spot slice
  --copy PATH       also copy PATH (file or directory) to every worker (repeatable): a relative path keeps its
                    place under ~/specformer-jax, an absolute one lands in ~/specformer-jax/BASENAME
  --skip-install    do not copy or install the repository (it is already there)
  --dry-run         print the gcloud commands, run nothing
EOF
}

die() {
    echo "tpu_pod.sh: error: $*" >&2
    exit 2
}

name="" zone="" accel="" project="" version="tpu-ubuntu2204-base" create=0 spot=0 install=1 dry_run=0
copies=()
while (($# > 0)); do
    case $1 in
        --name | --zone | --accelerator-type | --project | --version | --copy)
            (($# >= 2)) || die "$1 needs a value"
            case $1 in
                --name) name=$2 ;;
                --zone) zone=$2 ;;
                --accelerator-type) accel=$2 ;;
                --project) project=$2 ;;
                --version) version=$2 ;;
                --copy) copies+=("$2") ;;
            esac
            shift 2
            ;;
        --create) create=1; shift ;;
        --spot) spot=1; shift ;;
        --skip-install) install=0; shift ;;
        --dry-run) dry_run=1; shift ;;
        -h | --help) usage; exit 0 ;;
        --) shift; break ;;
        *) die "unknown option '$1' (the command goes after --; see --help)" ;;
    esac
done
for required in name zone accel project; do
    [[ -n ${!required} ]] || die "--${required/accel/accelerator-type} is required"
done
(($# > 0)) || die "no command given (put it after --, e.g. -- specformer train --config ...)"
for path in "${copies[@]+"${copies[@]}"}"; do
    [[ -e $path || $dry_run == 1 ]] || die "--copy $path: no such file or directory"
done

repo=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
remote_dir="specformer-jax"  # under the worker user's home directory
tarball="${TMPDIR:-/tmp}/specformer-jax-src.tgz"
where=(--zone="$zone" --project="$project")

run() {  # print the command (dry run) or run it, stopping at the first failure
    if ((dry_run)); then
        printf '%q ' "$@"
        echo
    else
        echo "+ $*" >&2
        "$@" || die "command failed (exit $?): $*"
    fi
}

on_all_workers() {  # REMOTE_SHELL_COMMAND
    run gcloud compute tpus tpu-vm ssh "$name" "${where[@]}" --worker=all --command="$1"
}

if ((create)); then
    spot_flag=()
    ((spot)) && spot_flag=(--spot)
    run gcloud compute tpus tpu-vm create "$name" "${where[@]}" --accelerator-type="$accel" --version="$version" \
        "${spot_flag[@]+"${spot_flag[@]}"}"
else
    run gcloud compute tpus tpu-vm describe "$name" "${where[@]}" --format="value(state,acceleratorType)"
fi

if ((install)); then
    run tar -czf "$tarball" -C "$repo" --exclude=./.git --exclude=./.venv --exclude=./runs --exclude=__pycache__ .
    run gcloud compute tpus tpu-vm scp "$tarball" "$name:$remote_dir.tgz" "${where[@]}" --worker=all
    on_all_workers "set -e; mkdir -p ~/$remote_dir; tar -xzf ~/$remote_dir.tgz -C ~/$remote_dir; cd ~/$remote_dir;\
 python3 -m venv .venv; .venv/bin/pip install -q --upgrade pip; .venv/bin/pip install -q -e . 'jax[tpu]'"
fi
copy_parent() {  # PATH: the directory under ~/specformer-jax that receives it (relative paths keep their place)
    local parent
    parent=$(dirname "$1")
    if [[ $1 == /* || $1 == ../* || $parent == . ]]; then
        echo "$remote_dir"
    else
        echo "$remote_dir/$parent"
    fi
}

if ((${#copies[@]} > 0)); then
    parents=""
    for path in "${copies[@]}"; do
        parents+=" ~/$(copy_parent "$path")"
    done
    on_all_workers "mkdir -p$parents"
    for path in "${copies[@]}"; do
        run gcloud compute tpus tpu-vm scp --recurse "$path" "$name:$(copy_parent "$path")/" "${where[@]}" --worker=all
    done
fi

command_line=$(printf '%q ' "$@")
on_all_workers "cd ~/$remote_dir && . .venv/bin/activate && SPECFORMER_DISTRIBUTED=auto $command_line"
