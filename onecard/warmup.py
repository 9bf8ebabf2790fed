"""The launcher's boot warm-up (knob WARMUP, default 1): a few requests right after the server
answers /health, so the first real request does not compile vLLM's own Triton kernels.

Why: vLLM 0.27.1 compiles a number of small Triton kernels at their first use, not at boot: on the
H200 (2026-12-03, job 70, `--jit-monitor-verbose`) a SPEC=dflash2 tiny server compiled 24-26 of
them in its first requests (`copy_and_expand_dflash_inputs_kernel` in five BLOCK_SIZE variants,
`eagle_prepare_*`, `rejection_greedy_sample_kernel`, `precopy/postprocess_mamba_*`,
`_topk_topp_kernel`, ...), and its first request took 3.2 s against 0.23 s without speculation.
Several are specialised by value (Triton compiles `num_reqs == 1` apart from larger batches, and
BLOCK_SIZE follows the token count), so the warm-up sends greedy and sampled requests, alone and
two at once, with short and longer prompts. A last pair of rounds sends a prompt of about 1.5
prefill chunks, sized with the server's /tokenize, twice: its second chunk is a prefill over a
prefix already in the KV cache, and the repeat a prefix-cache hit. Those paths compiled their own
kernels at the first long request before (H100, 2026-12-05, jobs 31 and 41 with WARMUP=0:
KVarN's prefill over a packed prefix, the GDN_DEFER commit, the wide-verify split / reduce, vLLM's
unified attention). Compiled kernels land in TRITON_CACHE_DIR (the launcher sets one), so later
boots load them from disk; the warm-up then costs a few seconds.

The launcher forks this before it execs vLLM; the child polls /health while its parent (the
server, same pid after exec) lives, runs the requests, prints one line to stderr and exits. It
never raises and never blocks the server; a server that dies or never becomes healthy ends it.
Its requests count in the server's /metrics like any others (the GPU jobs set WARMUP=0 so their
counter deltas and first-request timings stay their own).
"""
from __future__ import annotations

import os
import sys
import threading
import time

# Prompts: one short, one of ~600 words (a multi-chunk input-setup and more draft positions).
_SHORT = "Write one sentence about the sea."
_LONG = " ".join(["The quick brown fox jumps over the lazy dog while the river runs to the sea."] * 40)


_GREEDY = {"temperature": 0.0}
_SAMPLED = {"temperature": 1.0, "top_p": 0.95, "top_k": 20, "seed": 1}   # the sampler's top-k / top-p kernels


def _requests(model: str) -> list[list[dict]]:
    """Rounds of request bodies; the bodies of one round are sent at the same time."""
    greedy = {"model": model, "max_tokens": 24, **_GREEDY}
    sampled = {"model": model, "max_tokens": 24, **_SAMPLED}
    return [
        [{**greedy, "prompt": _SHORT}],
        [{**sampled, "prompt": _SHORT}],
        [{**greedy, "prompt": _LONG}, {**sampled, "prompt": _SHORT}],
        [{**greedy, "prompt": _SHORT}, {**greedy, "prompt": _LONG}, {**sampled, "prompt": _LONG}],
    ]


def _chunked_rounds(client, base_url: str, model: str, chunk: int) -> list[list[dict]]:
    """The long-prompt rounds: token ids of about 1.5 prefill chunks (capped 64 tokens under the
    server's max_model_len), once alone, then again beside a sampled short request (a prefix-cache
    hit where caching is on). Empty when /tokenize does not answer or max_model_len leaves no
    second chunk."""
    try:
        r = client.post(f"{base_url}/tokenize", json={"model": model, "prompt": _LONG, "add_special_tokens": False},
                        timeout=30.0)
        d = r.json() if r.status_code == 200 else {}
        ids, max_len = list(d.get("tokens") or []), int(d.get("max_model_len") or 0)
    except Exception:  # noqa: BLE001 - an older server or a refused request: skip the rounds
        return []
    want = min(chunk + chunk // 2, max_len - 64)
    if not ids or want <= chunk:
        return []
    prompt = (ids * (want // len(ids) + 1))[:want]
    greedy = {"model": model, "max_tokens": 8, **_GREEDY, "prompt": prompt}
    sampled = {"model": model, "max_tokens": 8, **_SAMPLED, "prompt": _SHORT}
    return [[greedy], [dict(greedy), sampled]]


def _alive(pid: int | None) -> bool:
    if pid is None:
        return True
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def wait_healthy(client, base_url: str, timeout_s: float, parent_pid: int | None = None,
                 poll_s: float = 2.0) -> bool:
    """True once GET /health answers 200; False when the parent dies or ``timeout_s`` passes."""
    end = time.monotonic() + timeout_s
    while time.monotonic() < end and _alive(parent_pid):
        try:
            if client.get(f"{base_url}/health", timeout=5.0).status_code == 200:
                return True
        except Exception:  # noqa: BLE001 - not up yet
            pass
        time.sleep(poll_s)
    return False


def warm(base_url: str, model: str, api_key: str | None = None, timeout_s: float = 1800.0,
         parent_pid: int | None = None, log=None, chunk: int | None = None) -> dict:
    """Wait for the server, then send the warm-up rounds (with ``chunk``, the server's prefill chunk
    in tokens, also the long-prompt rounds). Returns a summary dict; never raises."""
    import httpx

    log = log or (lambda s: print(s, file=sys.stderr, flush=True))
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    out = {"healthy": False, "requests": 0, "failed": 0, "first_s": None, "total_s": None}
    try:
        with httpx.Client(headers=headers) as client:
            if not wait_healthy(client, base_url, timeout_s, parent_pid):
                return out
            out["healthy"] = True
            t0 = time.monotonic()
            lock = threading.Lock()

            def one(body: dict) -> None:
                t = time.monotonic()
                try:
                    ok = client.post(f"{base_url}/v1/completions", json=body, timeout=300.0).status_code == 200
                except Exception:  # noqa: BLE001 - a warm-up failure is only reported
                    ok = False
                with lock:
                    out["requests"] += 1
                    out["failed"] += 0 if ok else 1
                    if out["first_s"] is None:
                        out["first_s"] = round(time.monotonic() - t, 2)

            rounds = _requests(model) + (_chunked_rounds(client, base_url, model, chunk) if chunk else [])
            for rnd in rounds:
                threads = [threading.Thread(target=one, args=(b,)) for b in rnd]
                for th in threads:
                    th.start()
                for th in threads:
                    th.join()
            out["total_s"] = round(time.monotonic() - t0, 2)
        log(f"onecard warm-up: {out['requests']} requests in {out['total_s']} s (first {out['first_s']} s)"
            + (f", {out['failed']} failed" if out["failed"] else "")
            + "; WARMUP=0 turns it off")
    except Exception as e:  # noqa: BLE001 - never disturb the server
        log(f"onecard warm-up: skipped ({type(e).__name__}: {e})")
    return out


def fork_warmup(base_url: str, model: str, api_key: str | None, chunk: int | None = None) -> bool:
    """Start a detached process that warms the server this process is about to exec into (double
    fork: the server never has to reap it). False where fork is unavailable."""
    if not hasattr(os, "fork"):
        return False
    server = os.getpid()
    sys.stdout.flush()
    sys.stderr.flush()
    pid = os.fork()
    if pid:
        os.waitpid(pid, 0)  # the intermediate child exits at once
        return True
    try:
        if os.fork() == 0:
            code = 0
            try:
                warm(base_url, model, api_key, parent_pid=server, chunk=chunk)
            except BaseException:  # noqa: BLE001
                code = 1
            os._exit(code)
    finally:
        os._exit(0)
