#!/usr/bin/env bash
# Run N processes of one command on this machine, joined by jax.distributed over loopback: the multi-host code
# path (one mesh over every process's devices, per-process data, collective checkpoints) without a cluster.
#
#   launch/local.sh --num-processes 2 --devices-per-process 4 -- \
#       .venv/bin/specformer train --config configs/drafter-tiny.yaml --set model=... --set data=... --set out=...
#
# Process i runs the command with
#   JAX_PLATFORMS=cpu  XLA_FLAGS=--xla_force_host_platform_device_count=M  PYTHONUNBUFFERED=1
#   SPECFORMER_COORDINATOR=127.0.0.1:PORT  SPECFORMER_NUM_PROCESSES=N  SPECFORMER_PROCESS_ID=i
#   JAX_COORDINATOR_BIND_ADDRESS=127.0.0.1:PORT   (the coordinator listens on loopback only)
# and writes its output to LOG_DIR/process-i.log, also shown here with an "[i] " prefix.
# Exit status: 0 when every process succeeds; else the status of the first one to fail (the others are stopped),
# 124 when the time limit passes, 2 for bad arguments.
set -uo pipefail

usage() {
    cat <<'EOF'
usage: launch/local.sh --num-processes N --devices-per-process M [--timeout SECONDS] [--log-dir DIR]
                       [--port PORT] [--dry-run] -- COMMAND [ARG...]
  --num-processes N        processes to start (>= 1)
  --devices-per-process M  fake CPU devices per process (XLA_FLAGS=--xla_force_host_platform_device_count=M)
  --timeout SECONDS        stop everything after this long (default 3600)
  --log-dir DIR            per-process logs (default runs/launch/local-DATE-TIME)
  --port PORT              coordinator port on 127.0.0.1 (default: a free one)
  --dry-run                print the commands, start nothing
EOF
}

die() {
    echo "local.sh: error: $*" >&2
    exit 2
}

positive_int() {  # NAME VALUE
    [[ $2 =~ ^[1-9][0-9]*$ ]] || die "$1 expects a positive integer, got '$2'"
}

free_port() {
    "${PYTHON:-python3}" -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])' \
        || die "could not find a free port (set --port)"
}

num="" per="" timeout=3600 log_dir="" port="" dry_run=0
while (($# > 0)); do
    case $1 in
        --num-processes | --devices-per-process | --timeout | --log-dir | --port)
            (($# >= 2)) || die "$1 needs a value"
            case $1 in
                --num-processes) num=$2 ;;
                --devices-per-process) per=$2 ;;
                --timeout) timeout=$2 ;;
                --log-dir) log_dir=$2 ;;
                --port) port=$2 ;;
            esac
            shift 2
            ;;
        --dry-run) dry_run=1; shift ;;
        -h | --help) usage; exit 0 ;;
        --) shift; break ;;
        *) die "unknown option '$1' (the command goes after --; see --help)" ;;
    esac
done
[[ -n $num ]] || die "--num-processes is required"
[[ -n $per ]] || die "--devices-per-process is required"
positive_int --num-processes "$num"
positive_int --devices-per-process "$per"
positive_int --timeout "$timeout"
(($# > 0)) || die "no command given (put it after --)"
if [[ -z $port ]]; then
    port=$(free_port) || exit 2
fi
positive_int --port "$port"
((port < 65536)) || die "--port must be below 65536, got $port"
[[ -n $log_dir ]] || log_dir="runs/launch/local-$(date +%Y%m%d-%H%M%S)"

process_env() {  # I: sets `assigns` to the environment of process I
    assigns=("JAX_PLATFORMS=cpu"
        "XLA_FLAGS=${XLA_FLAGS:+$XLA_FLAGS }--xla_force_host_platform_device_count=$per"
        "PYTHONUNBUFFERED=1"
        "SPECFORMER_COORDINATOR=127.0.0.1:$port"
        "SPECFORMER_NUM_PROCESSES=$num"
        "SPECFORMER_PROCESS_ID=$1"
        "JAX_COORDINATOR_BIND_ADDRESS=127.0.0.1:$port")
}

if ((dry_run)); then
    echo "# local.sh: $num processes x $per CPU devices, coordinator 127.0.0.1:$port, timeout ${timeout}s;" \
        "each line runs in the background, its output also shown with an [i] prefix"
    for ((i = 0; i < num; i++)); do
        process_env "$i"
        printf '%q ' env "${assigns[@]}" "$@"
        printf '2>&1 | tee %q\n' "$log_dir/process-$i.log"
    done
    exit 0
fi

mkdir -p "$log_dir" || die "cannot create log directory $log_dir"
pids=()

stop_all() {  # TERM every process group still running, KILL after 10 s
    local pid waited=0
    for pid in "${pids[@]}"; do
        [[ -n $pid ]] && kill -TERM -- "-$pid" 2>/dev/null
    done
    while ((waited < 100)); do
        local alive=0
        for pid in "${pids[@]}"; do
            [[ -n $pid ]] && kill -0 "$pid" 2>/dev/null && alive=1
        done
        ((alive)) || break
        sleep 0.1
        waited=$((waited + 1))
    done
    for pid in "${pids[@]}"; do
        [[ -n $pid ]] && kill -KILL -- "-$pid" 2>/dev/null
    done
    wait 2>/dev/null
}

trap 'echo "local.sh: interrupted; stopping all processes" >&2; stop_all; exit 130' INT TERM

set -m  # every process in its own process group, so stopping it also stops what it started
for ((i = 0; i < num; i++)); do
    process_env "$i"
    (
        set +m
        env "${assigns[@]}" "$@" < /dev/null 2>&1 | tee "$log_dir/process-$i.log" \
            | awk -v prefix="[$i] " '{ print prefix $0; fflush() }'
    ) &
    pids+=("$!")
done
set +m
echo "local.sh: started $num processes (coordinator 127.0.0.1:$port, logs in $log_dir)" >&2

deadline=$((SECONDS + timeout))
running=$num
while ((running > 0)); do
    for i in "${!pids[@]}"; do
        pid=${pids[$i]}
        [[ -n $pid ]] || continue
        kill -0 "$pid" 2>/dev/null && continue
        rc=0
        wait "$pid" || rc=$?
        pids[i]=""
        running=$((running - 1))
        if ((rc != 0)); then
            echo "local.sh: process $i failed with exit status $rc (log: $log_dir/process-$i.log); stopping the others" >&2
            stop_all
            exit "$rc"
        fi
    done
    if ((running > 0 && SECONDS >= deadline)); then
        echo "local.sh: time limit of ${timeout}s reached; stopping all processes" >&2
        stop_all
        exit 124
    fi
    ((running > 0)) && sleep 0.2
done
echo "local.sh: all $num processes finished (logs in $log_dir)" >&2
