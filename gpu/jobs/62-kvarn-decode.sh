#!/usr/bin/env bash
# timeout: 600
# 62-kvarn-decode (issue 9), a TIMING job: run it alone. On the 27B-geometry checkpoint (job 20),
# through `python3 -m onecard.launch`, SPEC=off, CUDA graphs on, 3090 KV_MEM pins: CTX=huge (KVarN
# kvarn_k4v2_g128) then CTX=long (int8_per_token_head); C1 greedy decode of 128 tokens at prompts
# of 8k / 32k / 120k tokens (DEPTHS; 120k because CTX=long's MAX_LEN is 124,928), two runs per
# depth with a fresh prefix, the second kept; the table prints KVarN / int8 per depth.
# KVarN comes from kvarn/install.sh's installer into a private view (/var/tmp/site-kvarn, as job 61).
# Expected wall: two boots (~120-190 s each) + prefills (KVarN's windowed prefill at 120k unmeasured).
# Writes $JOB_OUT/{decode.json,server-decode-*.log,summary.txt}. Exit 0 when both arms measured
# every depth.
set -u
cd "$(dirname "$0")/../.."
: "${JOB_OUT:=/var/tmp/out/62-kvarn-decode}"
. gpu/lib/job.sh  # MODELS, $summary, say, elapsed
H="gpu/jobs/61-kvarn-serve.py"
job_header
SRC=$(python3 -c 'import importlib.util as u; print(list(u.find_spec("vllm").submodule_search_locations)[0])' 2>/dev/null)
timeout 60 python3 "$H" setup --src "${SRC:-/var/tmp/site/vllm}" --site /var/tmp/site-kvarn 2>&1 | tee -a "$summary"
if [ "${PIPESTATUS[0]}" != 0 ]; then say "FAIL: kvarn install into /var/tmp/site-kvarn"; exit 1; fi
export PYTHONPATH="$(pwd):/var/tmp/site-kvarn:${PYTHONPATH:-/var/tmp/site}"
# per-step host timing in both servers' engine cores (gpu/lib/stackdump/onecard_host_timing.py);
# the driver copies each arm's last window medians into the summary
export ONECARD_HOST_TIMING=${ONECARD_HOST_TIMING:-1} ONECARD_HOST_TIMING_EVERY=${ONECARD_HOST_TIMING_EVERY:-40}
T0=$(date +%s)
timeout -k 10 570 python3 "$H" decode --out "$JOB_OUT" --models "$MODELS" --deadline $(( T0 + 560 )) \
  --depths "${DEPTHS:-8192,32768,120000}" 2>&1 | tee -a "$summary"
rc=${PIPESTATUS[0]}
if [ -f "$JOB_OUT/server.pid" ]; then
  pid=$(cat "$JOB_OUT/server.pid")
  if kill -0 "$pid" 2>/dev/null; then say "killing leftover server group $pid"; kill -KILL -- "-$pid" 2>/dev/null; fi
fi
say "== 62-kvarn-decode: $([ $rc = 0 ] && echo PASS || echo FAIL) in $(( $(date +%s) - T0 )) s"
exit $rc
