#!/usr/bin/env bash
# songserve launcher: one worker per GPU id, then the dispatcher, then follow the logs.
#
#   bash run_backend.sh [--gpus 0,1] [--runtime-mode one_shot|keep_loaded|park] [--no-follow]
#   bash run_backend.sh --workers-only [--gpus …]          workers for a dispatcher elsewhere
#   bash run_backend.sh --api-only --worker-urls URL,URL   a dispatcher for workers elsewhere
#   bash run_backend.sh --workers-only --announce URL,URL  workers that register with those dispatchers
#   bash run_backend.sh --acestep-port 8011                also serve ACE-Step 1.5's API on that port
#   bash run_backend.sh stop                               stop everything this launcher started
#
# Environment: API_PORT (8889), ACESTEP_PORT (unset: not served), WORKER_BASE_PORT (8001), BASE_SEED (1283),
# BASE_MASTER_PORT (unset: no port; N: worker i's process group listens on N+i), MEGATRON_ARGS, WORKER_HOST
# (127.0.0.1), LOG_DIR (logs), STATE_DIR (state), HEALTH_TIMEOUT (600 s), STOP_TIMEOUT (40 s, per stage of a
# stop: the dispatcher, then the workers; DRAIN_TIMEOUT_SEC, 30 s, is the dispatcher's part of it), WORKER_TOKEN
# (generated when unset; "off" or empty = no token, for a dispatcher that sends none, such as the reference
# one, on a trusted network), and the checkpoint settings the worker reads (CHECKPOINTS_DIR, TOKENIZER_PATH,
# BACKBONE_MODELS, SUPERRES_MODELS, DECODER_*_PATH).
# --announce (or ANNOUNCE) needs WORKER_TOKEN: the dispatchers' worker token.
# Several dispatchers: STORE_URL=postgresql://user:pass@host/db (empty = SQLite in STATE_DIR, one
# dispatcher), RESULTS_DIR (shared storage the dispatchers all mount), DISPATCHER_ID (<hostname>:<port>).
# A relative path you give (CHECKPOINTS_DIR, LOG_DIR, STATE_DIR, RESULTS_DIR, OUTPUT_DIR, TAGS_FILE,
# API_KEYS_FILE, any path setting) is taken from the directory you run this in; the defaults live in
# the repository. LOG_LEVEL=debug also shows the libraries' start-up warnings.
set -euo pipefail
CALLER_DIR=$PWD
cd "$(dirname "$0")"
# Every other relative path setting (API_KEYS_FILE, …) is resolved by the services against this folder
# (songserve/process/settings.py, caller_path), so it too is the caller's, whichever setting it is.
export SONGSERVE_CALLER_DIR=$CALLER_DIR
for name in CHECKPOINTS_DIR LOG_DIR STATE_DIR RESULTS_DIR OUTPUT_DIR TAGS_FILE; do
  value=${!name:-}
  if [ -n "$value" ] && [ "${value#/}" = "$value" ]; then printf -v "$name" '%s' "$CALLER_DIR/$value"; fi
done

API_PORT=${API_PORT:-8889}
ACESTEP_PORT=${ACESTEP_PORT:-}
WORKER_BASE_PORT=${WORKER_BASE_PORT:-8001}
BASE_MASTER_PORT=${BASE_MASTER_PORT:-}  # unset: each worker's process group lives in the process, no port
BASE_SEED=${BASE_SEED:-1283}
MEGATRON_ARGS=${MEGATRON_ARGS:-}
WORKER_HOST=${WORKER_HOST:-127.0.0.1}
LOG_DIR=${LOG_DIR:-logs}
STATE_DIR=${STATE_DIR:-$PWD/state}   # the default lives in the repository, whoever runs this
HEALTH_TIMEOUT=${HEALTH_TIMEOUT:-600}
STOP_TIMEOUT=${STOP_TIMEOUT:-40}
PY=.venv/bin/python

say() { echo "run_backend: $*"; }
die() { echo "run_backend: $*" >&2; exit 1; }
full() { case $1 in /*) echo "$1" ;; *) echo "$PWD/$1" ;; esac; }
TOKEN_FILE="$LOG_DIR/worker_token"
NONCE_FILE="$LOG_DIR/launch_nonce"

# ---- ports: free before anything starts; a child is known by the nonce its /health echoes ------
NONCE=$(od -An -N8 -tx1 /dev/urandom | tr -d ' \n')

check_ports() {  # one line naming the port and the setting that moves it, or nothing
  local specs=() i host=${API_HOST:-127.0.0.1} problem
  if [ $API = 1 ]; then
    specs+=("$host" "$API_PORT" "the dispatcher" API_PORT)
    [ -z "$ACESTEP_PORT" ] || specs+=("$host" "$ACESTEP_PORT" "ACE-Step's API" "ACESTEP_PORT (--acestep-port)")
  fi
  if [ $WORKERS = 1 ]; then
    for i in "${!GPU_IDS[@]}"; do
      specs+=("$WORKER_HOST" $((WORKER_BASE_PORT + i)) "worker $i" WORKER_BASE_PORT)
      [ "${BASE_MASTER_PORT:-0}" = 0 ] || specs+=("${MASTER_ADDR:-127.0.0.1}" $((BASE_MASTER_PORT + i)) \
        "worker $i's process group" "BASE_MASTER_PORT (or unset it: no port)")
    done
  fi
  problem=$($PY -m songserve.cli.launcher_probe ports "${specs[@]}") || die "${problem:-checking the ports failed}"
}

launched_here() {  # does pid $1 carry the nonce of the launch that wrote NONCE_FILE (if one did)?
  local nonce="" vars=() v
  { read -r nonce <"$NONCE_FILE" || [ -n "$nonce" ]; } 2>/dev/null || return 0   # pid files from before nonces: the command line decides
  mapfile -d '' vars 2>/dev/null <"/proc/$1/environ" || return 1
  [ ${#vars[@]} -gt 0 ] || return 0   # empty: exiting, as in ours()
  for v in "${vars[@]}"; do
    [[ $v == "LAUNCH_NONCE=$nonce-"* && ${v#"LAUNCH_NONCE=$nonce-"} =~ ^[a-z0-9]*$ ]] && return 0
  done
  return 1
}

health_word() {  # url nonce: ready, starting, other (not the child given that nonce) or none
  $PY -m songserve.cli.launcher_probe health "$1" "$2" 2>/dev/null || echo none
}

# ---- stop -------------------------------------------------------------------------------------
# The checks and naps of stopping are builtins only (no cat, tr, grep, command substitution): bash runs
# an INT trap after a foreground child it waits for dies of the signal, and not at all when that child
# exits normally instead (it assumes the child took the Ctrl-C); a helper that was exiting anyway as
# the second Ctrl-C came lost it (a CI run on a loaded machine showed a second Ctrl-C unheard). A nap
# is a background sleep waited for with the wait builtin, which a trapped signal interrupts at once.
ours() {  # is pid $1 one of our processes and not yet gone (a stale pid reused by something else is not)?
  local pid=$1 stat="" args=()
  [ -n "$pid" ] || return 1
  { read -r stat <"/proc/$pid/stat" || [ -n "$stat" ]; } 2>/dev/null || return 1
  set -- ${stat##*) }                  # state, parent pid, ...
  [ "$1" != Z ] || return 1            # a zombie has exited; only its parent's wait is left
  [ "$2" != 2 ] || return 1            # a kernel thread (child of kthreadd) took the pid
  mapfile -d '' args 2>/dev/null <"/proc/$pid/cmdline" || return 1
  # an exiting process gives up its memory, and with it its command line, some time before it is
  # gone: an empty command line is still ours (else stop would return while it closes its files)
  [ ${#args[@]} -eq 0 ] || { [[ " ${args[*]} " =~ backend_(api|worker)\.py ]] && launched_here "$pid"; }
}

NAP=""
nap() { sleep "$1" & NAP=$!; wait "$NAP" 2>/dev/null || true; kill "$NAP" 2>/dev/null || true; NAP=""; }
end_nap() { [ -z "$NAP" ] || kill "$NAP" 2>/dev/null || true; }

wait_gone() {  # until pid $1 is gone or the clock ($SECONDS) reaches $2
  while ours "$1" && [ $SECONDS -lt "$2" ]; do nap 0.2; done
}

# ---- stop, narrated ----------------------------------------------------------------------------
# Ctrl-C (or `bash run_backend.sh stop`) says in one line what it waits for. The dispatcher goes
# first and alone: it lets its running tracks finish (DRAIN_TIMEOUT_SEC) and collects their files,
# deleting them on the workers; only then are the workers stopped, so a take finished during the
# drain is never left behind on a worker that exited first. A second Ctrl-C stops at once: each
# process is signalled again (a second signal ends it without waiting), and what was running is
# picked up again at the next start.
STOP_NOW=0
STOPPED=0
DRAIN_SEC=${DRAIN_TIMEOUT_SEC:-30}

stop_at_once() {
  [ "$STOP_NOW" = 1 ] && return 0
  STOP_NOW=1
  say "stopping at once: unfinished tracks stay in the job store and run again at the next start"
}

stop_plan() {  # the one line: what stopping waits for, and how to stop at once
  local api=$1 workers=$2 what=()
  [ "$api" = 1 ] && what+=("the dispatcher to finish its running tracks and collect their files (up to ${DRAIN_SEC}s)")
  [ "$workers" -gt 0 ] && what+=("$workers worker(s) to stop")
  local line
  line=$(printf '%s, then ' "${what[@]}")
  say "stopping: waiting for ${line%, then }; press Ctrl-C again to stop at once"
}


pidof_file() { pid=""; read -r pid <"$1" 2>/dev/null || true; }  # a builtin: no helper a Ctrl-C could kill

stop_group() {  # deadline pidfile…: SIGTERM each, wait until gone (a second Ctrl-C: signal again), else SIGKILL
  local deadline=$1 f g pid resent=0 naps=0
  shift
  for f in "$@"; do
    pidof_file "$f"
    if ours "$pid"; then kill -TERM "$pid" 2>/dev/null || true; STOPPED=$((STOPPED + 1))
    else say "removing stale pid file $f"; rm -f "$f"; fi
  done
  for f in "$@"; do
    [ -f "$f" ] || continue
    pidof_file "$f"
    while ours "$pid" && [ $SECONDS -lt "$deadline" ]; do
      # Stopping at once: the signal again, each second. Two signals that come before a process has
      # taken the first count as one (a group stopped at once from its start gets both together).
      if [ "$STOP_NOW" = 1 ]; then
        [ $resent = 1 ] || { resent=1; deadline=$((SECONDS + 10)); naps=0; }
        if [ $((naps % 5)) = 0 ]; then
          for g in "$@"; do pidof_file "$g"; ! ours "$pid" || kill -TERM "$pid" 2>/dev/null || true; done
          pidof_file "$f"
        fi
        naps=$((naps + 1))
      fi
      nap 0.2
    done
    if ours "$pid"; then
      say "$(basename "$f" .pid) did not stop in $([ $resent = 1 ] && echo 10 || echo "$STOP_TIMEOUT")s: killing"
      kill -KILL "$pid" 2>/dev/null || true
      wait_gone "$pid" $((SECONDS + 10))
    fi
    rm -f "$f"
  done
}

stop_all() {  # [quiet]: no plan line (a failed start cleaning up)
  local api=() workers=() t0=$SECONDS
  shopt -s nullglob
  api=("$LOG_DIR"/api[.]pid)   # [.]: a pattern, so a missing file drops out
  workers=("$LOG_DIR"/worker_*.pid)
  shopt -u nullglob
  [ $((${#api[@]} + ${#workers[@]})) -eq 0 ] && { say "nothing to stop (no pid files in $LOG_DIR/)"; return 0; }
  trap stop_at_once INT   # before the line that tells a person to press it
  [ -n "${1:-}" ] || stop_plan ${#api[@]} ${#workers[@]}
  STOPPED=0
  [ ${#api[@]} -eq 0 ] || stop_group $((SECONDS + STOP_TIMEOUT)) "${api[@]}"
  [ ${#workers[@]} -eq 0 ] || stop_group $((SECONDS + STOP_TIMEOUT)) "${workers[@]}"
  rm -f "$TOKEN_FILE" "$NONCE_FILE"
  say "stopped $STOPPED processes in $((SECONDS - t0))s"
}

fresh_log() {  # the log of this run alone: the previous run's is kept as <log>.1 (one generation)
  [ ! -s "$1" ] || mv -f "$1" "$1.1"
  : >"$1"
}

# Children get their own session: a terminal's Ctrl-C reaches the launcher only, which stops them in
# order (the dispatcher before the workers), instead of every process at the same moment.
DETACH=(); command -v setsid >/dev/null 2>&1 && DETACH=(setsid)

if [ "${1:-}" = "stop" ]; then stop_all; exit 0; fi

# ---- arguments --------------------------------------------------------------------------------
GPUS=0; MODE=one_shot; FOLLOW=1; WORKERS=1; API=1; WORKER_URLS=""; ANNOUNCE=${ANNOUNCE:-}
while [ $# -gt 0 ]; do
  case "$1" in
    --gpus) GPUS=${2:-}; shift 2 ;;
    --gpus=*) GPUS=${1#*=}; shift ;;
    --runtime-mode) MODE=${2:-}; shift 2 ;;
    --runtime-mode=*) MODE=${1#*=}; shift ;;
    --workers-only) API=0; shift ;;
    --api-only) WORKERS=0; shift ;;
    --worker-urls) WORKER_URLS=${2:-}; shift 2 ;;
    --worker-urls=*) WORKER_URLS=${1#*=}; shift ;;
    --announce) ANNOUNCE=${2:-}; shift 2 ;;
    --announce=*) ANNOUNCE=${1#*=}; shift ;;
    --acestep-port) ACESTEP_PORT=${2:-}; shift 2 ;;
    --acestep-port=*) ACESTEP_PORT=${1#*=}; shift ;;
    --no-follow) FOLLOW=0; shift ;;
    -h|--help) awk 'NR > 1 && /^#/ { sub(/^# ?/, ""); print; next } NR > 1 { exit }' "$0"; exit 0 ;;
    *) die "unknown option '$1' (see --help)" ;;
  esac
done
[[ "$GPUS" =~ ^[0-9]+(,[0-9]+)*$ ]] || die "--gpus must be comma-separated GPU ids such as 0 or 0,1; got '$GPUS'"
[ "$(tr ',' '\n' <<<"$GPUS" | sort | uniq -d)" = "" ] || die "--gpus lists an id twice: '$GPUS'"
[[ "$MODE" =~ ^(one_shot|keep_loaded|park)$ ]] || die "--runtime-mode must be one_shot, keep_loaded or park; got '$MODE'"
[ $WORKERS = 1 ] || [ -n "$WORKER_URLS" ] || die "--api-only needs --worker-urls URL,URL,…"
[ $WORKERS = 1 ] || [ $API = 1 ] || die "--workers-only and --api-only together start nothing"
[ -z "$ANNOUNCE" ] || [ $WORKERS = 1 ] || die "--announce is a worker setting; --api-only starts no worker"
[ -z "$ACESTEP_PORT" ] || [[ "$ACESTEP_PORT" =~ ^[0-9]+$ ]] || die "--acestep-port must be a port number; got '$ACESTEP_PORT'"
[[ "$BASE_MASTER_PORT" =~ ^[0-9]*$ ]] || die "BASE_MASTER_PORT must be a port number or unset (no port); got '$BASE_MASTER_PORT'"
[ -z "$ACESTEP_PORT" ] || [ $API = 1 ] || die "--acestep-port is a dispatcher setting; --workers-only starts none"
[ -z "$ANNOUNCE" ] || { [ -n "${WORKER_TOKEN:-}" ] && [ "$WORKER_TOKEN" != off ]; } \
  || die "--announce needs WORKER_TOKEN set to the dispatchers' worker token"
IFS=, read -r -a GPU_IDS <<<"$GPUS"
mkdir -p "$LOG_DIR"
for f in "$LOG_DIR"/api.pid "$LOG_DIR"/worker_*.pid; do
  [ -f "$f" ] && ours "$(cat "$f")" && die "already running (pid file $f); use 'bash run_backend.sh stop' first"
done

# ---- set-up (first run only) ------------------------------------------------------------------
bash scripts/setup
check_ports
printf '%s\n' "$NONCE" >"$NONCE_FILE"   # stop knows this launch's processes by it
if [ "${WORKER_TOKEN+set}" = set ] && { [ -z "$WORKER_TOKEN" ] || [ "$WORKER_TOKEN" = off ]; }; then
  WORKER_TOKEN=""  # a foreign dispatcher that sends no token (the reference one) can drive the workers
  say "WORKER_TOKEN is off: anyone who can reach the workers can use them; use this on a trusted network only"
elif [ -z "${WORKER_TOKEN:-}" ]; then
  WORKER_TOKEN=$($PY -c 'import secrets; print(secrets.token_hex(16))')
  (umask 077; printf '%s\n' "$WORKER_TOKEN" >"$TOKEN_FILE")  # readable by this user only
  if [ $API = 0 ]; then say "generated WORKER_TOKEN=$WORKER_TOKEN: start the dispatcher with the same value"
  elif [ $WORKERS = 1 ]; then
    # Said where a person may need it: workers reachable from other hosts, or LOG_LEVEL=debug. Here the
    # dispatcher is the only caller; a worker's 401 names the file too (docs/configuration.md).
    case "$WORKER_HOST:${LOG_LEVEL:-}" in
      127.0.0.1:|localhost:|::1:) ;;
      *) say "worker token generated into $(full "$TOKEN_FILE"); a worker's /config needs it:" \
           "curl -H \"Authorization: Bearer \$(cat $(full "$TOKEN_FILE"))\" http://127.0.0.1:$WORKER_BASE_PORT/config" ;;
    esac
  else say "note: WORKER_TOKEN is unset; set it to the workers' token if they were started with one"; fi
else
  say "WORKER_TOKEN is taken from the environment (the workers and the dispatcher share it)"
fi
export WORKER_TOKEN
if [ $WORKERS = 1 ]; then
  # torch's count where a driver is (its tool is there); elsewhere none, without torch's 2 s import
  CUDA_COUNT=0
  if command -v nvidia-smi >/dev/null 2>&1; then
    CUDA_COUNT=$($PY -c 'import torch; print(torch.cuda.device_count())' 2>/dev/null || echo 0)
  fi
  if [ "$CUDA_COUNT" = 0 ] && [ ${#GPU_IDS[@]} -gt 1 ]; then
    say "no CUDA device found: --gpus $GPUS starts ${#GPU_IDS[@]} workers on the CPU instead, one process each" \
      "sharing this machine's $(nproc) CPU cores (--gpus 0 starts one)"
  elif [ "$CUDA_COUNT" = 0 ]; then
    say "no CUDA device found: the worker runs on the CPU"
  else
    for g in "${GPU_IDS[@]}"; do [ "$g" -lt "$CUDA_COUNT" ] || die "--gpus $g: this machine has $CUDA_COUNT GPUs (ids 0..$((CUDA_COUNT - 1)))"; done
  fi
  if [ -z "${CHECKPOINTS_DIR:-}${TOKENIZER_PATH:-}${BACKBONE_MODELS:-}${SUPERRES_MODELS:-}${DECODER_CONFIG_PATH:-}${DECODER_CHECKPOINT_PATH:-}" ]; then
    if ! $PY -c 'import sys; from songserve.pipeline.tiny.manifest import is_built; from songserve.pipeline.config import DEFAULT_TINY_DIR; sys.exit(0 if is_built(DEFAULT_TINY_DIR) else 1)'; then
      say "no checkpoint set configured: building the tiny set in checkpoints/tiny (once, ~10 s)"
      $PY -m songserve.pipeline.tiny >/dev/null
    fi
    say "using the tiny checkpoint set (untrained: noise of the right shape and length)"
  fi
fi

STARTED=()
on_failure() { say "stopping what was started"; stop_all quiet >/dev/null; exit 1; }

wait_health() {  # name url pid log nonce setting (what moves its port)
  local name=$1 url=$2 pid=$3 log=$4 nonce=$5 setting=$6 deadline=$((SECONDS + HEALTH_TIMEOUT)) state
  while [ $SECONDS -lt $deadline ]; do
    if ! kill -0 "$pid" 2>/dev/null; then
      echo "run_backend: $name failed to start; last lines of $log:" >&2
      tail -n 5 "$log" | sed 's/^/  | /' >&2
      on_failure
    fi
    state=$(health_word "$url" "$nonce")
    case "$state" in
      ready) say "$name is up at $url"; return 0 ;;
      other) echo "run_backend: port ${url##*:} answers for another process, not the $name started here (pid $pid);" \
        "set $setting to a free port" >&2; on_failure ;;
    esac
    sleep 0.5
  done
  echo "run_backend: $name did not become healthy in ${HEALTH_TIMEOUT}s; see $log" >&2
  on_failure
}

# From the first process started, Ctrl-C (or a TERM) at any moment stops what was started, in order,
# saying so: its processes have their own sessions, so the terminal's signal reaches the launcher only.
trap 'echo; stop_all; exit 130' INT TERM

# ---- workers ----------------------------------------------------------------------------------
if [ $WORKERS = 1 ]; then
  for i in "${!GPU_IDS[@]}"; do
    port=$((WORKER_BASE_PORT + i)); log="$LOG_DIR/worker_$i.log"
    if [ "$CUDA_COUNT" = 0 ]; then where="the CPU"; else where="GPU ${GPU_IDS[$i]}"; fi
    say "starting worker $i on $where (port $port, $MODE)"
    fresh_log "$log"
    CUDA_VISIBLE_DEVICES=${GPU_IDS[$i]} WORKER_INDEX=$i LAUNCH_NONCE="$NONCE-worker$i" nohup "${DETACH[@]}" $PY backend_worker.py \
      --worker-port "$port" --host "$WORKER_HOST" --runtime-mode "$MODE" --gpu-id "${GPU_IDS[$i]}" \
      --master-port $(( BASE_MASTER_PORT == 0 ? 0 : BASE_MASTER_PORT + i )) --seed $((BASE_SEED + i * 1000)) \
      --megatron-args "$MEGATRON_ARGS" ${ANNOUNCE:+--announce "$ANNOUNCE"} >>"$log" 2>&1 </dev/null &
    echo $! >"$LOG_DIR/worker_$i.pid"; STARTED+=("$log")
  done
  for i in "${!GPU_IDS[@]}"; do
    wait_health "worker $i" "http://127.0.0.1:$((WORKER_BASE_PORT + i))" "$(cat "$LOG_DIR/worker_$i.pid")" \
      "$LOG_DIR/worker_$i.log" "$NONCE-worker$i" WORKER_BASE_PORT
  done
fi

# ---- dispatcher -------------------------------------------------------------------------------
if [ $API = 1 ]; then
  args=(--port "$API_PORT" --state-dir "$STATE_DIR" --health-interval 1.0)
  [ -z "${STORE_URL:-}" ] || args+=(--store-url "$STORE_URL")
  [ -z "${RESULTS_DIR:-}" ] || args+=(--results-dir "$RESULTS_DIR")
  [ -z "${DISPATCHER_ID:-}" ] || args+=(--dispatcher-id "$DISPATCHER_ID")
  [ -z "$ACESTEP_PORT" ] || args+=(--acestep-port "$ACESTEP_PORT")
  if [ -n "$WORKER_URLS" ]; then args+=(--worker-urls "$WORKER_URLS")
  else args+=(--num-workers "${#GPU_IDS[@]}" --worker-base-port "$WORKER_BASE_PORT" --worker-host 127.0.0.1); fi
  say "starting the dispatcher on port $API_PORT"
  fresh_log "$LOG_DIR/api.log"
  LAUNCH_NONCE="$NONCE-api" nohup "${DETACH[@]}" $PY backend_api.py "${args[@]}" >>"$LOG_DIR/api.log" 2>&1 </dev/null &
  echo $! >"$LOG_DIR/api.pid"; STARTED+=("$LOG_DIR/api.log")
  wait_health "dispatcher" "http://127.0.0.1:$API_PORT" "$(cat "$LOG_DIR/api.pid")" "$LOG_DIR/api.log" "$NONCE-api" API_PORT
  say "ready: http://127.0.0.1:$API_PORT/ (page), /docs (API); stop with: bash run_backend.sh stop"
  [ -z "$ACESTEP_PORT" ] || say "ACE-Step's API: http://127.0.0.1:$ACESTEP_PORT (its clients' base URL)"
fi
[ $FOLLOW = 1 ] || exit 0

# ---- follow the logs until stopped --------------------------------------------------------------
# stop_all narrates, and a second Ctrl-C inside it stops at once. tail, a background job, ignores
# SIGINT: it is ended here, else it would go on printing into the terminal after the launcher, and
# waited for (a kill only sends the signal: the launcher would exit while tail still lives).
TAIL=""
end_tail() { [ -z "$TAIL" ] || { kill "$TAIL" 2>/dev/null || true; wait "$TAIL" 2>/dev/null || true; }; }
trap 'echo; end_nap; stop_all; end_tail; exit 0' INT TERM
tail -q -n 0 -F "${STARTED[@]}" &  # -q: no "==> file <==" headers; each line names its service
TAIL=$!
while :; do
  alive=0
  for f in "$LOG_DIR"/api.pid "$LOG_DIR"/worker_*.pid; do [ -f "$f" ] && pidof_file "$f" && ours "$pid" && alive=1; done
  [ $alive = 1 ] || break
  nap 1
done
end_tail
say "all processes have exited"
