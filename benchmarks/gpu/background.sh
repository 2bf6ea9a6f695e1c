#!/usr/bin/env bash
# GPU work longer than one device call (10 min): run it in a session of its own on the device machine, which
# outlives the call that started it (the machine stays while calls follow each other), and collect it with
# later calls. From the repository root on the device, after the GPU lock's install (lock_kit.py):
#
#     bash benchmarks/gpu/background.sh start NAME [--after OTHER] 'COMMAND'
#     bash benchmarks/gpu/background.sh wait SECONDS NAME...
#     bash benchmarks/gpu/background.sh stop NAME
#
# start: waits for job OTHER to end (if given), copies the repository as it is in this call to
#   $QG_JOBS/NAME/repo (later calls replace the working tree; a running job keeps its own copy), and runs
#   COMMAND there under setsid with OUT=$QG_JOBS/NAME/out; its console goes to $QG_JOBS/NAME/console.txt and
#   its exit code to $QG_JOBS/NAME/rc.
# wait: returns when every named job has ended or SECONDS have passed, and packs each job's out/, console and
#   exit code into $OUT/NAME.tar.gz (what a cut-off job wrote so far comes back too).
set -uo pipefail
JOBS="${QG_JOBS:-/root/qg-jobs}"
OUT="${OUT:-$PWD/gpu-out}"
mkdir -p "$JOBS" "$OUT"

ended() { [ -f "$JOBS/$1/rc" ]; }

case "${1:-}" in
start)
    name="$2"; shift 2
    if [ "${1:-}" = "--after" ]; then
        other="$2"; shift 2
        [ -d "$JOBS/$other" ] || { echo "background: no job $other"; exit 2; }
        until ended "$other"; do sleep 2; done
        echo "background: $other ended (exit $(cat "$JOBS/$other/rc")) at $(date -u +%T)"
    fi
    cmd="$1"
    job="$JOBS/$name"
    if [ -d "$job" ] && ! ended "$name"; then echo "background: $name is still running"; exit 2; fi
    rm -rf "$job"
    mkdir -p "$job/out"
    tar -cf - --exclude=./.git --exclude=./gpu-out --exclude=./.devkit --exclude=./.lockkit --exclude=./.gpu-carry/gguf1 --exclude=./.gpu-carry/gguf2 --exclude=./.gpu-carry/bnb --exclude=./.gpu-carry/wheels --exclude=./.gpu-carry/wheels-gguf --exclude=./.venv . | tar -xf - -C "$job" --one-top-level=repo
    printf '%s\n' "$cmd" > "$job/command.txt"
    # The whole list is redirected, not only its last command: a backgrounded `cd && cmd > f` keeps the caller's
    # stdout open until the job ends, so `background.sh start ... | tail` would wait for the job.
    (cd "$job/repo" && OUT="$job/out" exec setsid bash -c 'bash -c "$1"; echo $? > "$2"' _ "$cmd" "$job/rc") \
        > "$job/console.txt" 2>&1 < /dev/null &
    # setsid in a subshell that is no group leader does not fork: this pid leads the job's session and group.
    echo $! > "$job/pid"
    echo "background: started $name at $(date -u +%T): $cmd"
    ;;
stop)
    # Ends a job early (its group: SIGTERM, then SIGKILL after 10 s), e.g. to give the GPU to the next one; what it
    # wrote stays for `wait`.
    name="$2"; job="$JOBS/$name"
    [ -f "$job/pid" ] || { echo "background: no job $name"; exit 2; }
    if ! ended "$name"; then
        kill -TERM -- "-$(cat "$job/pid")" 2>/dev/null
        for _ in $(seq 10); do ended "$name" && break; sleep 1; done
        ended "$name" || { kill -KILL -- "-$(cat "$job/pid")" 2>/dev/null; echo 137 > "$job/rc"; }
    fi
    echo "background: $name stopped at $(date -u +%T), exit $(cat "$job/rc")"
    ;;
wait)
    limit="$2"; shift 2
    start=$(date +%s)
    while :; do
        all=1
        for name in "$@"; do ended "$name" || all=0; done
        [ "$all" -eq 1 ] && break
        [ $(($(date +%s) - start)) -ge "$limit" ] && break
        sleep 5
    done
    for name in "$@"; do
        job="$JOBS/$name"
        # One file per job: the device returns only a few files per call.
        tar czf "$OUT/$name.tar.gz" -C "$job" --exclude=./repo . 2>/dev/null
        if ended "$name"; then state="ended, exit $(cat "$job/rc")"; else state="running"; fi
        echo "== $name: $state at $(date -u +%T)"
        tail -n 15 "$job/console.txt" 2>/dev/null
    done
    ;;
*)
    echo "usage: background.sh start NAME [--after OTHER] 'COMMAND' | wait SECONDS NAME... | stop NAME"; exit 2 ;;
esac
