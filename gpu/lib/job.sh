# gpu/lib/job.sh: the preamble and the server helpers the GPU job scripts share. Sourced (not
# run) by gpu/jobs/*.sh from the repository root, once JOB_OUT has the job's default:
#   cd "$(dirname "$0")/../.."
#   : "${JOB_OUT:=/var/tmp/out/NN-name}"
#   . gpu/lib/job.sh
# It sets MODELS (default /var/tmp/models), exports JOB_OUT and MODELS, creates $JOB_OUT,
# empties $summary ($JOB_OUT/summary.txt), starts the clock (T0) and traps stop_server on EXIT.
# Jobs may run side by side on one GPU (a `+` group in gpu/run.sh): these helpers only ever
# signal the process group that this job's boot_server started (SPID), or pids the job itself
# recorded (kill_leftover_groups).
: "${MODELS:=/var/tmp/models}"
export JOB_OUT MODELS
# The launcher's boot warm-up (onecard/warmup.py) would add requests to every server's /metrics
# counters and run beside a job's first request: jobs measure both, so it is off unless a job says.
export WARMUP="${WARMUP:-0}"
mkdir -p "$JOB_OUT"
summary="$JOB_OUT/summary.txt"; : > "$summary"
T0=$(date +%s)
SPID=""         # the process group (= session) of the server boot_server started, "" when none
STOP_TRIES=20   # stop_server waits up to STOP_TRIES x 0.5 s after SIGTERM before SIGKILL
BOOT_TAIL=25    # log lines printed when a server dies during boot or never answers /health

# say TEXT...: print and append to the summary
say() { echo "$*" | tee -a "$summary"; }
# job_header [SUFFIX]: the job's first summary line: its name (JOB_NAME, else the script's file name), the UTC
# time and the tree it runs (ONECARD_TREE_REV, passed by gpu/run.sh's caller; else the device's
# .git HEAD, which may be stale), then SUFFIX
job_header() {
  say "== ${JOB_NAME:-$(basename "$0" .sh)} $(date -u +%FT%TZ) commit ${ONECARD_TREE_REV:-$(git rev-parse --short HEAD 2>/dev/null || echo '?')}${1:-}"
}
# job_end RC: the job's last summary line (PASS when RC is 0, else FAIL, with RC) and exit RC
job_end() {
  say "== ${JOB_NAME:-$(basename "$0" .sh)}: $([ "$1" -eq 0 ] && echo PASS || echo FAIL) (rc=$1)"
  exit "$1"
}
# elapsed: whole seconds since the job sourced this file
elapsed() { echo $(( $(date +%s) - T0 )); }
# free_port: a TCP port free on 127.0.0.1 now
# kvarn_site: KVarN (kvarn/install.sh's installer, through 61-kvarn-serve.py setup) into a private
# view of the patched tree at /var/tmp/site-kvarn, put first on PYTHONPATH (run from the repo root);
# rc 1 with a FAIL line when the install fails
kvarn_site() {
  local src
  src=$(python3 -c 'import importlib.util as u; print(list(u.find_spec("vllm").submodule_search_locations)[0])' 2>/dev/null)
  timeout 60 python3 gpu/jobs/61-kvarn-serve.py setup --src "${src:-/var/tmp/site/vllm}" --site /var/tmp/site-kvarn 2>&1 | tee -a "$summary"
  if [ "${PIPESTATUS[0]}" != 0 ]; then say "FAIL: kvarn install into /var/tmp/site-kvarn"; return 1; fi
  export PYTHONPATH="$(pwd):/var/tmp/site-kvarn:${PYTHONPATH:-/var/tmp/site}"
}
free_port() { "${PY:-python3}" -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1",0)); print(s.getsockname()[1])'; }

# http_get URL [OUTFILE]: HTTP GET without curl (may be missing on the GPU host); rc 0 on HTTP 200
http_get() {
  "${PY:-python3}" - "$@" <<'PYEOF' 2>/dev/null
import sys, urllib.request
try:
    with urllib.request.urlopen(sys.argv[1], timeout=3) as r:
        body = r.read()
        if len(sys.argv) > 2:
            open(sys.argv[2], "wb").write(body)
        sys.exit(0 if r.status == 200 else 1)
except Exception:
    sys.exit(1)
PYEOF
}

# stop_server: end the server group boot_server started (SIGTERM, then SIGKILL), if it still runs
stop_server() {
  if [ -n "$SPID" ] && kill -0 "$SPID" 2>/dev/null; then
    kill -TERM -- "-$SPID" 2>/dev/null
    for _ in $(seq 1 "$STOP_TRIES"); do kill -0 "$SPID" 2>/dev/null || break; sleep 0.5; done
    kill -KILL -- "-$SPID" 2>/dev/null
  fi
  SPID=""
}
trap stop_server EXIT

# wait_health LABEL WAIT_S LOG: poll $URL/health once a second for up to WAIT_S s; rc 0 once it
# answers. A server (SPID) that exits meanwhile, or one still not healthy at the limit, gets the
# last BOOT_TAIL lines of LOG printed and rc 1 (the latter is stopped first).
wait_health() {
  local label=$1 wait_s=$2 log=$3 t=0
  while [ $t -lt "$wait_s" ]; do
    if ! kill -0 "$SPID" 2>/dev/null; then
      say "server $label exited during boot; last log lines:"; tail -"$BOOT_TAIL" "$log" | tee -a "$summary"
      SPID=""; return 1
    fi
    if http_get "$URL/health"; then say "[$(elapsed)s] $label healthy after ${t}s"; return 0; fi
    sleep 1; t=$((t + 1))
  done
  say "server $label not healthy after ${wait_s}s; last log lines:"; tail -"$BOOT_TAIL" "$log" | tee -a "$summary"
  stop_server; return 1
}

# boot_server LABEL WAIT_S COMMAND...: run COMMAND in a session of its own (its pid, the group,
# in SPID), output to $JOB_OUT/server-LABEL.log, then wait_health. The caller says what it boots.
boot_server() {
  local label=$1 wait_s=$2; shift 2
  local log="$JOB_OUT/server-$label.log"
  setsid "$@" > "$log" 2>&1 &
  SPID=$!
  wait_health "$label" "$wait_s" "$log"
}

# kill_leftover_groups PIDFILE: end the process groups whose leaders' pids PIDFILE lists (servers
# a driver of this job started in sessions of their own) should any have outlived it
kill_leftover_groups() {
  [ -f "$1" ] || return 0
  local pid
  while read -r pid; do
    if [ -n "$pid" ] && kill -0 "$pid" 2>/dev/null; then
      say "killing leftover server process group $pid"
      kill -TERM -- "-$pid" 2>/dev/null; sleep 5; kill -KILL -- "-$pid" 2>/dev/null
    fi
  done < "$1"
}

# --- the tiny-model speculation jobs (70, 71, 63) ---------------------------------------------
# vllm_markers: one line naming the vLLM on PYTHONPATH and which onecard feature markers it has
vllm_markers() {
  "${PY:-python3}" -c "import vllm, pathlib; d = pathlib.Path(vllm.__file__).parent; \
print(f'vllm {vllm.__version__} at {d}; ' + ', '.join(f'{m} marker: {(d / (m + \"_installed.txt\")).is_file()}' for m in ('dflash2', 'kvarn')))" \
    2>&1 | tail -1 | tee -a "$summary"
}
# correctness_boots: for jobs that check outputs, never speed. Exports
# VLLM_TRITON_FORCE_FIRST_CONFIG=1 (vLLM 0.27.1's own switch: every @triton.autotune'd kernel runs
# its first config that compiles instead of benchmarking all of them). The FLA GDN kernels are
# autotuned; on 2026-12-03 every tiny server spent 84-103 s in vLLM's profiling run with warm
# Triton caches and TRITON_CACHE_AUTOTUNING=1. It also makes the kernel choice identical across
# the servers an exactness test compares (autotune winners can differ between processes by
# timing noise). Timing jobs (30, 31, 40, 50, 62, 80) never call it. A caller's value wins.
correctness_boots() {
  export VLLM_TRITON_FORCE_FIRST_CONFIG=${VLLM_TRITON_FORCE_FIRST_CONFIG:-1}
  say "VLLM_TRITON_FORCE_FIRST_CONFIG=$VLLM_TRITON_FORCE_FIRST_CONFIG (correctness job: no Triton autotuning)"
}
# ensure_tiny_drafter JOBNAME: the tiny model and its DFlash2 drafter (CPU, cached in $MODELS
# across jobs); on failure says so and ends the job with exit 1
ensure_tiny_drafter() {
  timeout 90 "${PY:-python3}" -c "from onecard.prepare.tiny import main; raise SystemExit(main(['--drafter']))" \
    > "$JOB_OUT/build.txt" 2>&1
  local rc=$?
  tail -2 "$JOB_OUT/build.txt" | tee -a "$summary"
  if [ $rc -ne 0 ]; then say "tiny model/drafter build FAILED rc=$rc"; say "== $1: FAIL"; exit 1; fi
}
# run_driver TAG END_S CMD...: run a Python driver (it gets --deadline, 20 s inside the time left
# until END_S seconds of the job's clock, which must end inside the job's `# timeout:` header:
# whatever the builds took comes off the driver), its output in $JOB_OUT/run.txt; prints its
# "[TAG] ..." lines (without the launch lines) and, if it failed, its last 20 lines; returns its rc.
# Afterwards ends any server group it recorded in server.pids (a driver killed by timeout cannot).
run_driver() {
  local tag=$1 end=$2 left rc; shift 2
  left=$(( end - SECONDS ))
  timeout -k 10 "$left" "$@" --deadline $(( left - 20 )) > "$JOB_OUT/run.txt" 2>&1
  rc=$?
  grep "^\[$tag\]" "$JOB_OUT/run.txt" | grep -v "^\[$tag\] launch " | tee -a "$summary"
  [ $rc -eq 0 ] || tail -20 "$JOB_OUT/run.txt" | tee -a "$summary"
  kill_leftover_groups "$JOB_OUT/server.pids"
  return $rc
}
