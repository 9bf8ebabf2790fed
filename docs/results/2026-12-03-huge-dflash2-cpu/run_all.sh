#!/usr/bin/env bash
# The matrix of FINDINGS.md (run from anywhere; setup: see repro_huge_dflash2.py's docstring).
# /tmp/helper-hd2/site: patched view + KVarN (stock). /tmp/helper-hd2/site-fix: the same with
# candidate-fix.diff applied (cd /tmp/helper-hd2/site-fix && patch -p1 < candidate-fix.diff).
cd "$(dirname "$0")/../../.."
run() {
  local site=$1; shift
  echo "\$ [$(basename "$site")] repro_huge_dflash2.py $*"
  env PYTHONPATH="$site:/tmp/helper-hd2/sc:$(pwd)" TRITON_INTERPRET=1 MODELS="${MODELS:-/tmp/helper-models}" \
    .venv-test/bin/python docs/results/2026-12-03-huge-dflash2-cpu/repro_huge_dflash2.py "$@" 2>&1 \
    | grep -v "^INFO \|^WARNING \|transformers\]"
  echo
}
S=/tmp/helper-hd2/site F=/tmp/helper-hd2/site-fix
TINY="--model tiny --max-len 4096 --kv-mem 1073741824 --max-seqs 16"
echo "######## 27B geometry, CTX=huge pin 5,309,988,864 B, MAX_LEN 245,760, MAX_SEQS 2 (stock)"
run $S --model 27b --spec mtp                         # control: job 61 measured 296,827
run $S --model 27b --spec dflash2                     # the escape hatch
run $S --model 27b --spec dflash2 --skip none         # drafter in KVarN (the launcher refuses it)
run $S --model 27b --spec dflash2 --fix phase3-kvarn-page
run $S --model 27b --spec dflash2 --fix kvarn-stride-pad --max-len 4096
echo "######## tiny, job 63's settings: MAX_LEN 4096, KV_MEM 1 GiB, MAX_SEQS 16 (stock)"
run $S $TINY --spec off
run $S $TINY --spec mtp
run $S $TINY --spec dflash2
run $S $TINY --spec dflash2 --skip none
run $S $TINY --spec dflash2 --fix phase3-kvarn-page
echo "######## with candidate-fix.diff applied"
run $F --model 27b --spec dflash2
run $F --model 27b --spec dflash2 --max-len 73728
run $F --model 27b --spec mtp                         # unchanged: 296,827
run $F $TINY --spec dflash2
run $F $TINY --spec mtp                               # unchanged
echo "######## the same fix as monkeypatches on the stock site (must equal the diff's rows)"
run $S --model 27b --spec dflash2 --fix phase3-kvarn-page,skip-block --max-len 73728
run $S $TINY --spec dflash2 --fix phase3-kvarn-page,skip-block
