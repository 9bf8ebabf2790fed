#!/usr/bin/env python3
"""Boot `vllm serve` on a model, send one greedy completion, record vLLM's own memory lines,
kill the server. Never hangs: boot and request have their own timeouts; the server runs in its
own process group and is killed (TERM, then KILL) on every exit path.

    python3 gpu/lib/serve_probe.py --model DIR --out res.json --log serve.log [--port P]
        [--boot-timeout S] -- [extra vllm serve args]
Exit 0 when the completion came back with text and tokens.
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
import urllib.request

LINES = {
    "kv_cache_tokens": (r"GPU KV cache size: ([\d,]+) tokens", lambda s: int(s.replace(",", ""))),
    "kv_cache_gib": (r"Available KV cache memory: ([\d.]+) GiB", float),
    "model_load_gib": (r"Model loading took ([\d.]+) GiB", float),
    "model_load_s": (r"Model loading took [\d.]+ GiB(?: memory)? and ([\d.]+) seconds", float),
    "weights_load_s": (r"Loading weights took ([\d.]+) seconds", float),
}


class _NoServer(Exception):
    pass


def parse_log(text: str) -> dict:
    out = {}
    for key, (pat, conv) in LINES.items():
        m = re.findall(pat, text)
        if m:
            out[key] = conv(m[-1])
    errs = [ln for ln in text.splitlines() if re.search(r"Error|Traceback|error:", ln)]
    if errs:
        out["error_lines"] = errs[-8:]
    return out


def _get(url: str, timeout: float = 5.0):
    with urllib.request.urlopen(url, timeout=timeout) as r:
        return r.status, r.read()


def _post(url: str, body: dict, timeout: float):
    req = urllib.request.Request(url, data=json.dumps(body).encode(), headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=timeout) as r:
        return json.loads(r.read())


def kill_group(p: subprocess.Popen, grace: float = 20.0) -> None:
    if p.poll() is not None:
        return
    try:
        os.killpg(p.pid, signal.SIGTERM)
    except ProcessLookupError:
        return
    try:
        p.wait(grace)
    except subprocess.TimeoutExpired:
        try:
            os.killpg(p.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        p.wait(10)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", required=True)
    ap.add_argument("--out", required=True)
    ap.add_argument("--log", required=True)
    ap.add_argument("--port", type=int, default=8321)
    ap.add_argument("--boot-timeout", type=float, default=240)
    ap.add_argument("--request-timeout", type=float, default=60)
    ap.add_argument("--prompt", default="The capital of France is")
    ap.add_argument("--max-tokens", type=int, default=16)
    ap.add_argument("--server-cmd", default=os.environ.get("PROBE_SERVER_CMD"),
                    help="override (dry runs): the command to run instead of vllm (env PROBE_SERVER_CMD)")
    ap.add_argument("--pidfile", default=None, help="write the server's pid (= its process group) here")
    ap.add_argument("extra", nargs="*")
    a = ap.parse_args(argv)
    if a.server_cmd:
        import shlex

        cmd = shlex.split(a.server_cmd)
    else:
        cmd = [sys.executable, "-m", "vllm.entrypoints.cli.main", "serve", a.model, "--host", "127.0.0.1",
               "--port", str(a.port), "--served-model-name", "probe", *a.extra]
    res = {"cmd": cmd, "ok": False}
    # a timeout around us sends TERM: turn it into SystemExit so the server is killed below
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    t0 = time.monotonic()
    with open(a.log, "w") as logf:
        try:
            p = subprocess.Popen(cmd, stdout=logf, stderr=subprocess.STDOUT, start_new_session=True)
            if a.pidfile:
                with open(a.pidfile, "w") as f:
                    f.write(str(p.pid))
        except OSError as e:
            p = None
            res["error"] = f"cannot start the server: {e}"
        try:
            if p is None:
                raise _NoServer
            base = f"http://127.0.0.1:{a.port}"
            up = False
            while time.monotonic() - t0 < a.boot_timeout:
                if p.poll() is not None:
                    res["error"] = f"server exited with {p.returncode} during boot"
                    break
                try:
                    up = _get(base + "/health")[0] == 200
                except Exception:  # noqa: BLE001
                    up = False
                if up:
                    break
                time.sleep(2)
            res["boot_s"] = round(time.monotonic() - t0, 1)
            if up:
                t1 = time.monotonic()
                try:
                    r = _post(base + "/v1/completions", {"model": "probe", "prompt": a.prompt, "max_tokens": a.max_tokens,
                                                         "temperature": 0}, a.request_timeout)
                    res["completion"] = r["choices"][0]["text"]
                    res["usage"] = r.get("usage")
                    res["request_s"] = round(time.monotonic() - t1, 2)
                    res["ok"] = bool(r.get("usage", {}).get("completion_tokens"))
                except Exception as e:  # noqa: BLE001
                    res["error"] = f"completion failed: {e}"
            elif "error" not in res:
                res["error"] = f"no /health within {a.boot_timeout} s"
        except _NoServer:
            pass
        finally:
            if p is not None:
                kill_group(p)
    try:
        res.update(parse_log(open(a.log, errors="replace").read()))
    except OSError:
        pass
    tmp = a.out + ".tmp"
    with open(tmp, "w") as f:
        json.dump(res, f, indent=2)
    os.replace(tmp, a.out)
    print(json.dumps({k: v for k, v in res.items() if k != "cmd"}, indent=1))
    return 0 if res["ok"] else 1


if __name__ == "__main__":
    raise SystemExit(main())
