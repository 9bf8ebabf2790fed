#!/usr/bin/env bash
# timeout: 540
# prejit: no-wait   (measures memory, times nothing)
# 42-fit-b: job 41 again with a second list of cases, so one `gpu/run.sh` call runs two fit tables
# back to back (41 reads FIT_CASES, this job FIT_CASES_B). Default: "long-mtp-cap long-off-cap
# huge-dflash2-cap huge-mtp-cap": the other profiles at a 24 GiB card's torch share, and
# CTX=huge SPEC=dflash2's first boot with the drafter's K/V rings (docs/dflash2-huge.md). Every
# other setting, the output files and the exit codes are job 41's (gpu/jobs/41-fit.sh).
set -u
cd "$(dirname "$0")/../.."
export FIT_CASES="${FIT_CASES_B:-long-mtp-cap long-off-cap huge-dflash2-cap huge-mtp-cap}"
export JOB_OUT="${JOB_OUT:-/var/tmp/out/42-fit-b}" JOB_NAME=42-fit-b
exec bash gpu/jobs/41-fit.sh
