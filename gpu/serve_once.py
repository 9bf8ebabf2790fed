"""Boot `vllm serve` once, wait for it, send one chat completion, stop it; print one JSON line.

    python3 gpu/serve_once.py --label stock --model DIR --port 18101 -- [vllm serve args]

Used by GPU jobs to prove "boots and serves" (or to record how it fails). The server's log goes
to $JOB_OUT/<label>.log. Exit 0 if a completion came back, 1 otherwise.
"""
from __future__ import annotations

import argparse
import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--label", required=True)
    ap.add_argument("--model", required=True)
    ap.add_argument("--port", type=int, default=18101)
    ap.add_argument("--boot-timeout", type=float, default=240)
    ap.add_argument("--prompt", default="Hello, my name is")
    ap.add_argument("serve_args", nargs=argparse.REMAINDER)
    args = ap.parse_args()
    extra = args.serve_args[1:] if args.serve_args[:1] == ["--"] else args.serve_args
    log_path = Path(os.environ.get("JOB_OUT", ".")) / f"{args.label}.log"
    cmd = [sys.executable, "-m", "vllm.entrypoints.cli.main", "serve", args.model,
           "--host", "127.0.0.1", "--port", str(args.port), "--served-model-name", "m", *extra]
    result = {"label": args.label, "cmd": " ".join(cmd), "booted": False, "served": False}
    t0 = time.monotonic()
    with open(log_path, "w") as log:
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    url = f"http://127.0.0.1:{args.port}"
    try:
        while time.monotonic() - t0 < args.boot_timeout and proc.poll() is None:
            try:
                if httpx.get(f"{url}/health", timeout=2).status_code == 200:
                    result["booted"] = True
                    break
            except httpx.HTTPError:
                pass
            time.sleep(1)
        result["boot_s"] = round(time.monotonic() - t0, 1)
        if result["booted"]:
            try:
                r = httpx.post(f"{url}/v1/completions", timeout=120, json={
                    "model": "m", "prompt": args.prompt, "max_tokens": 16, "temperature": 0})
                result["http_status"] = r.status_code
                if r.status_code == 200:
                    body = r.json()
                    result["served"] = True
                    result["text"] = body["choices"][0]["text"]
                    result["completion_tokens"] = body.get("usage", {}).get("completion_tokens")
                else:
                    result["response"] = r.text[:300]
            except httpx.HTTPError as exc:
                result["request_error"] = f"{type(exc).__name__}: {exc}"
            time.sleep(2)
        result["server_alive_after"] = proc.poll() is None
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGTERM)
            try:
                proc.wait(20)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
    text = log_path.read_text(errors="replace")
    errors = [l.strip() for l in text.splitlines()
              if re.search(r"(Error|Exception|cutlass|unavailable|GDN prefill)", l) and "Traceback" not in l]
    result["log_lines"] = errors[-8:]
    print(json.dumps(result))
    return 0 if result["served"] else 1


if __name__ == "__main__":
    raise SystemExit(main())
