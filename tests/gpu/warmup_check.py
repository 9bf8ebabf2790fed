"""GPU: does the launcher's boot warm-up (WARMUP=1, onecard/warmup.py) take the first-request
stall off a SPEC=dflash2 server? Job 73 (gpu/jobs/73-warmup.sh).

Two tiny d2k7 servers (MODEL=tiny SPEC=dflash2 DFLASH_TOKENS=7, job 70's knobs), each started
through the launcher itself (``python3 -m onecard.launch``: the warm-up is forked there, just
before the exec into vLLM), each with an empty Triton cache of its own (TRITON_CACHE_DIR), i.e.
what a bare user machine has on its first boot:

  warm   WARMUP=1: after /health, wait for the helper's "onecard warm-up: N requests in T s"
         line in the server log, then time the requests below
  cold   WARMUP=0: time the requests below as soon as /health answers

Requests, per server, one after another: greedy (64 prompt ids, 8 tokens), sampled (the same
prompt, temperature 1, top_k 8, 8 tokens), then both again. The figures are printed and kept
(OUT/warmup.json), never asserted on: on 2026-12-03 (job 70, no warm-up) a tiny d2k7 server's
first request took 3.21 s against 0.23 s without speculation. The check fails only when a server
does not boot, a request fails, or the warm arm never prints its line or reports failed requests.

Run: ``python3 tests/gpu/warmup_check.py --out DIR``; ``--dry-run`` (CPU) prints both arms'
launcher plans (``onecard.launch --dry-run`` with the same environment) and checks that the warm
arm's plan says WARMUP 1 and the cold arm's 0 (tests/dflash/test_gpu_warmup_dry.py).
"""
from __future__ import annotations

import json
import os
import re
import shlex
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
if str(HERE) not in sys.path:
    sys.path.insert(0, str(HERE))
import test_dflash2 as D  # noqa: E402  (Server, boot_all, recorded, verdict, write_json)

ARMS = {"warm": "1", "cold": "0"}
# job 70's d2k7 as a user would export it, less what job 70 adds for its FP8 check (the server's
# ENV and DRAFT_QUANT=fp8): this job times the warm-up of the drafter as stored
KNOBS = {**D.BASE_KNOBS, **{k: v for k, v in D.SERVERS["d2k7"].items() if k not in ("ENV", "DRAFT_QUANT")}}
WARMUP_LINE = re.compile(r"onecard warm-up: (\d+) requests in ([\d.]+) s \(first ([\d.]+|None) s\)"
                         r"(?:, (\d+) failed)?")
REQUESTS = (("greedy", {"temperature": 0.0}), ("sampled", {"temperature": 1.0, "top_k": 8, "seed": 5}))
WAIT_LINE_S = 240.0


def say(msg: str) -> None:
    print(f"[warmup] {msg}", flush=True)


def arm_env(arm: str, port: int, triton_dir: str) -> dict:
    """The launcher's environment for one arm (knobs as a user would export them)."""
    return {**KNOBS, "WARMUP": ARMS[arm], "PORT": str(port), "TRITON_CACHE_DIR": triton_dir,
            "EXTRA_ARGS": shlex.join(D.EXTRA)}


def launcher_argv(*extra: str) -> list[str]:
    return [sys.executable, "-m", "onecard.launch", *extra]


def parse_warmup_line(log_text: str) -> dict | None:
    """The helper's one line (onecard/warmup.py) -> {requests, total_s, first_s, failed}."""
    m = WARMUP_LINE.search(log_text)
    if not m:
        return None
    return {"requests": int(m[1]), "total_s": float(m[2]),
            "first_s": None if m[3] == "None" else float(m[3]), "failed": int(m[4] or 0)}


def timed_requests(srv) -> list[dict]:
    out = []
    for rnd in (1, 2):
        for kind, kw in REQUESTS:
            t0 = time.monotonic()
            srv.complete(D.FIRST_PROMPT, max_tokens=8, ignore_eos=True, **kw)
            out.append({"round": rnd, "kind": kind, "s": round(time.monotonic() - t0, 3)})
    return out


def run(out: Path, deadline_s: float) -> int:
    t_start = time.monotonic()
    left = lambda: deadline_s - (time.monotonic() - t_start)  # noqa: E731
    rec: dict = {"servers": {}, "requests": {}, "warmup_line": None, "failures": []}
    servers: dict = {}
    caches = {arm: tempfile.mkdtemp(prefix=f"onecard-triton-{arm}-", dir=os.environ.get("TMPDIR", "/var/tmp"))
              for arm in ARMS}
    rec["triton_cache_dirs"] = caches
    from onecard.bench import provenance

    rec["provenance"] = provenance.build(
        argv=launcher_argv(), prompt_set={"id": "job70-first-prompt", "prompt_ids": D.FIRST_PROMPT},
        sampling=dict(REQUESTS), max_tokens=8, token_count_source="none (request wall times only)",
        warmup={"arms": {arm: f"WARMUP={v}" for arm, v in ARMS.items()},
                "triton_cache": "empty per arm"},
        environ={**os.environ, **KNOBS})

    def plan(arm, port):
        return launcher_argv(), arm_env(arm, port, caches[arm]), None

    with D.recorded(rec, servers, t_start, lambda: D.write_json(out / "warmup.json", rec), log=say):
        D.boot_all(ARMS, plan, out, rec, servers, left, min_left=60, log=say, first=False)
        rec["requests"]["cold"] = timed_requests(servers["cold"])
        t = time.monotonic()
        while rec["warmup_line"] is None and time.monotonic() - t < min(WAIT_LINE_S, left() - 30):
            rec["warmup_line"] = parse_warmup_line(servers["warm"].log.read_text(errors="replace"))
            if rec["warmup_line"] is None:
                time.sleep(0.5)
        if rec["warmup_line"] is None:
            rec["failures"].append(f"warm: no 'onecard warm-up:' line in its log after {time.monotonic() - t:.0f} s")
        else:
            w = rec["warmup_line"]
            say(f"warm-up line: {w['requests']} requests in {w['total_s']} s (first {w['first_s']} s), "
                f"seen {time.monotonic() - t:.1f} s after the cold arm's requests began")
            if w["failed"]:
                rec["failures"].append(f"warm-up: {w['failed']} of its requests failed")
        rec["requests"]["warm"] = timed_requests(servers["warm"])
        for arm, rows in rec["requests"].items():
            say(f"{arm} (WARMUP={ARMS[arm]}, empty Triton cache, boot {rec['servers'][arm]['boot_s']} s): "
                + ", ".join(f"{r['kind']}#{r['round']} {r['s']:.2f} s" for r in rows))
    return D.verdict(rec, log=say)


def dry_run(out: Path) -> int:
    """CPU: each arm's launcher plan, from `onecard.launch --dry-run` under the arm's environment."""
    ok = True
    for arm, want in ARMS.items():
        env = {**os.environ, **arm_env(arm, D.free_port(), str(out / f"triton-{arm}"))}
        p = subprocess.run(launcher_argv("--json"), env=env, capture_output=True, text=True,
                           cwd=str(D.REPO), timeout=300)
        if p.returncode != 0:
            say(f"{arm}: launcher --json rc {p.returncode}: {(p.stderr or p.stdout).strip()[-400:]}")
            ok = False
            continue
        plan = json.loads(p.stdout)
        got = {k: (plan["values"].get(k) or {}).get("value") for k in ("WARMUP", "SPEC", "DFLASH_TOKENS", "MODEL")}
        say(f"plan {arm}: {json.dumps(got)}; TRITON_CACHE_DIR {env['TRITON_CACHE_DIR']}")
        ok &= str(got["WARMUP"]) == want and got["SPEC"] == "dflash2"
    sample = "INFO x\nonecard warm-up: 7 requests in 2.4 s (first 1.1 s); WARMUP=0 turns it off\n"
    ok &= parse_warmup_line(sample) == {"requests": 7, "total_s": 2.4, "first_s": 1.1, "failed": 0}
    say("dry run " + ("PASS" if ok else "FAIL"))
    return 0 if ok else 1


def main(argv: list[str] | None = None) -> int:
    return D.driver_main(argv, __doc__, "/tmp/warmup", dry_run, run)


if __name__ == "__main__":
    sys.exit(main())
