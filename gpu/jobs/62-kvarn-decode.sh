#!/usr/bin/env bash
# timeout: 960
# 62-kvarn-decode (issue 9), a TIMING job: run it alone. First the GPU test of KVarN's CUDA-graph
# decode rows (tests/gpu/test_kvarn_graph.py: capture once, replay == eager bit for bit, vs the
# float64 reference). Then on the 27B-geometry checkpoint (job 20), through `python3 -m
# onecard.launch`, SPEC=off, 3090 KV_MEM pins, one boot per arm (ARMS62, default
# kvarn:huge:1,kvarn-pw:huge:0,int8:long:1 -- label:CTX:ONECARD_KVARN_GRAPHS[:PREFILL_LAUNCH][:KNOB=VALUE...], the
# launch auto (the launcher's default) unless given, e.g. int8-stock:long:1:stock): KVarN
# kvarn_k4v2_g128 with full decode graphs, KVarN piecewise only (the behaviour before
# 2026-12-04), int8_per_token_head; C1 greedy decode of 128 tokens at prompts of 8k / 32k / 120k
# tokens (DEPTHS; 120k because CTX=long's MAX_LEN is 124,928; sized with the server's /tokenize),
# two runs per depth with a fresh prefix, the second kept; the table prints tok/s per arm, the
# ratios and whether the two KVarN arms' greedy texts are the same.
# KVarN comes from kvarn/install.sh's installer into a private view (/var/tmp/site-kvarn, as job 61).
# Expected wall: three boots (~120-190 s each) + prefills. Writes $JOB_OUT/{decode.json,
# server-decode-*.log,summary.txt}. Exit 0 when every arm measured every depth.
set -u
cd "$(dirname "$0")/../.."
: "${JOB_OUT:=/var/tmp/out/62-kvarn-decode}"
. gpu/lib/job.sh  # MODELS, $summary, say, elapsed
H="gpu/jobs/61-kvarn-serve.py"
job_header
kvarn_site || exit 1
# per-step host timing in both servers' engine cores (gpu/lib/stackdump/onecard_host_timing.py);
# the driver copies each arm's last window medians into the summary
export ONECARD_HOST_TIMING=${ONECARD_HOST_TIMING:-1} ONECARD_HOST_TIMING_EVERY=${ONECARD_HOST_TIMING_EVERY:-40}
T0=$(date +%s)
timeout -k 10 240 python3 -m pytest -m gpu -q -s -p no:cacheprovider tests/gpu/test_kvarn_graph.py 2>&1 \
  | tail -n 30 | tee -a "$summary"
say "test_kvarn_graph rc=${PIPESTATUS[0]} ($(( $(date +%s) - T0 )) s)"
timeout -k 10 $(( T0 + 920 - $(date +%s) )) python3 "$H" decode --out "$JOB_OUT" --models "$MODELS" --deadline $(( T0 + 900 )) \
  --depths "${DEPTHS:-8192,32768,120000}" 2>&1 | tee -a "$summary"
rc=${PIPESTATUS[0]}
if [ -f "$JOB_OUT/server.pid" ]; then
  pid=$(cat "$JOB_OUT/server.pid")
  if kill -0 "$pid" 2>/dev/null; then say "killing leftover server group $pid"; kill -KILL -- "-$pid" 2>/dev/null; fi
fi
say "== 62-kvarn-decode: $([ $rc = 0 ] && echo PASS || echo FAIL) in $(( $(date +%s) - T0 )) s"
exit $rc
