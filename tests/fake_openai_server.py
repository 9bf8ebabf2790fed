"""A small OpenAI-compatible server for CPU tests (127.0.0.1, threaded, stdlib only).

Streams completions in chunks of ``tokens_per_chunk`` tokens (as speculative decoding does:
one chunk per verify step), ends with a usage chunk when ``stream_options.include_usage`` is
set, and serves a vLLM-shaped /metrics text whose counters follow the traffic it served,
including the per-request histograms (TTFT, e2e, queue, prefill; ``histograms=False`` drops them).
``stall={k: s}`` makes the k-th POST (1-based, warmup included) wait ``s`` seconds before the
"engine" sees it: the client's TTFT grows, the server's TTFT and running gauge do not (a
client-side stall).
"""
from __future__ import annotations

import json
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer


class FakeState:
    def __init__(self, tokens_per_chunk: int = 3, delay: float = 0.002, send_usage: bool = True,
                 die_after_chunks: int | None = None, engines: int = 1, num_spec: int = 3,
                 phantom_requests_per_scrape: float = 0.0, histograms: bool = True,
                 stall: dict[int, float] | None = None, max_model_len: int = 8192):
        self.tokens_per_chunk = tokens_per_chunk
        self.delay = delay
        self.send_usage = send_usage
        self.die_after_chunks = die_after_chunks
        self.engines = engines
        self.num_spec = num_spec
        self.lock = threading.Lock()
        self.requests = 0.0
        self.gen_tokens = 0.0
        self.prompt_tokens = 0.0
        self.drafts = 0.0
        self.accepted_per_pos = [0.0] * num_spec
        self.running = 0
        self.bodies: list[dict] = []
        self.phantom = phantom_requests_per_scrape  # simulates another tenant's traffic
        self.histograms = histograms
        self.stall = dict(stall or {})
        self.max_model_len = max_model_len  # /tokenize's answer
        self.posts = 0
        # name -> [sum, count]
        self.hist = {n: [0.0, 0.0] for n in ("vllm:time_to_first_token_seconds",
                                             "vllm:e2e_request_latency_seconds",
                                             "vllm:request_queue_time_seconds",
                                             "vllm:request_prefill_time_seconds")}

    def observe(self, name: str, value: float) -> None:
        with self.lock:
            self.hist[name][0] += value
            self.hist[name][1] += 1

    def metrics_text(self) -> str:
        with self.lock:
            self.requests += self.phantom
            self.gen_tokens += 10 * self.phantom
            lines = []
            add = lines.append
            add("# HELP vllm:num_requests_running Number of requests in model execution batches.")
            add("# TYPE vllm:num_requests_running gauge")
            for e in range(self.engines):
                add(f'vllm:num_requests_running{{engine="{e}",model_name="fake"}} {self.running if e == 0 else 0}')
            add("# TYPE vllm:num_requests_waiting gauge")
            add('vllm:num_requests_waiting{engine="0",model_name="fake"} 0.0')
            add("# TYPE vllm:kv_cache_usage_perc gauge")
            add(f'vllm:kv_cache_usage_perc{{engine="0",model_name="fake"}} {min(1.0, 0.1 * self.running)}')
            for name, val in (("vllm:num_preemptions", 0.0), ("vllm:generation_tokens", self.gen_tokens),
                              ("vllm:prompt_tokens", self.prompt_tokens),
                              ("vllm:spec_decode_num_drafts", self.drafts),
                              ("vllm:spec_decode_num_draft_tokens", self.drafts * self.num_spec),
                              ("vllm:spec_decode_num_accepted_tokens", sum(self.accepted_per_pos))):
                add(f"# TYPE {name} counter")
                add(f'{name}_total{{engine="0",model_name="fake"}} {val}')
            add("# TYPE vllm:request_success counter")
            add(f'vllm:request_success_total{{engine="0",finished_reason="length",model_name="fake"}} {self.requests}')
            add('vllm:request_success_total{engine="0",finished_reason="stop",model_name="fake"} 0.0')
            add("# TYPE vllm:spec_decode_num_accepted_tokens_per_pos counter")
            for p, v in enumerate(self.accepted_per_pos):
                add(f'vllm:spec_decode_num_accepted_tokens_per_pos_total{{engine="0",model_name="fake",position="{p}"}} {v}')
            if self.histograms:
                for name, (total, count) in self.hist.items():
                    add(f"# TYPE {name} histogram")
                    add(f'{name}_bucket{{engine="0",le="+Inf",model_name="fake"}} {count}')
                    add(f'{name}_count{{engine="0",model_name="fake"}} {count}')
                    add(f'{name}_sum{{engine="0",model_name="fake"}} {total}')
            return "\n".join(lines) + "\n"

    def served(self, prompt_toks: int, gen: int, chunks: int) -> None:
        with self.lock:
            self.requests += 1
            self.gen_tokens += gen
            self.prompt_tokens += prompt_toks
            self.drafts += chunks
            # each verify step accepts tokens_per_chunk - 1 drafts, at the first positions
            for p in range(min(self.num_spec, self.tokens_per_chunk - 1)):
                self.accepted_per_pos[p] += chunks


def make_handler(state: FakeState):
    class H(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def log_message(self, *a):  # quiet
            pass

        def _json(self, obj, code=200):
            data = json.dumps(obj).encode()
            self.send_response(code)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def do_GET(self):
            if self.path == "/metrics":
                data = state.metrics_text().encode()
                self.send_response(200)
                self.send_header("Content-Type", "text/plain; version=0.0.4")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)
            elif self.path == "/v1/models":
                self._json({"data": [{"id": "fake", "max_model_len": 4096}]})
            elif self.path == "/version":
                self._json({"version": "0.27.1"})
            elif self.path == "/health":
                self._json({})
            else:
                self._json({"error": "not found"}, 404)

        def do_POST(self):
            n = int(self.headers.get("Content-Length", 0))
            body = json.loads(self.rfile.read(n) or b"{}")
            state.bodies.append(body)
            with state.lock:
                state.posts += 1
                stall = state.stall.get(state.posts, 0.0)
            if stall:
                time.sleep(stall)  # before the "engine" sees it: no gauge, no server clock
            if self.path == "/tokenize":  # one id per word (vLLM's TokenizeResponse fields)
                words = str(body.get("prompt", "")).split()
                self._json({"count": len(words), "max_model_len": state.max_model_len,
                            "tokens": [100 + i for i in range(len(words))]})
                return
            arrival = time.perf_counter()
            prompt = body.get("prompt") or " ".join(m["content"] for m in body.get("messages", []))
            ptoks = max(1, len(prompt) if isinstance(prompt, list) else len(prompt.split()))
            max_tokens = int(body.get("max_tokens", 16))
            if not body.get("stream"):
                if body.get("echo"):
                    lps = [None] + [-1.0] * (ptoks - 1)
                    self._json({"choices": [{"text": prompt, "logprobs": {"token_logprobs": lps}}],
                                "usage": {"prompt_tokens": ptoks, "completion_tokens": 0}})
                    state.served(ptoks, 0, 0)
                else:
                    self._json({"choices": [{"text": "x"}], "usage": {"prompt_tokens": ptoks,
                                                                       "completion_tokens": 1}})
                return
            chat = self.path.endswith("/chat/completions")
            self.send_response(200)
            self.send_header("Content-Type", "text/event-stream")
            self.send_header("Connection", "close")
            self.end_headers()
            with state.lock:
                state.running += 1
            sent, chunks = 0, 0
            try:
                time.sleep(state.delay * 2)  # "prefill"
                while sent < max_tokens:
                    if chunks == 0:
                        ttft = time.perf_counter() - arrival
                        state.observe("vllm:time_to_first_token_seconds", ttft)
                        state.observe("vllm:request_prefill_time_seconds", ttft)
                        state.observe("vllm:request_queue_time_seconds", 0.0)
                    k = 1 if chunks == 0 else min(state.tokens_per_chunk, max_tokens - sent)
                    text = "tok " * k
                    choice = ({"index": 0, "delta": {"content": text}} if chat else {"index": 0, "text": text})
                    if sent + k >= max_tokens:
                        choice["finish_reason"] = "length"
                    self.wfile.write(f"data: {json.dumps({'choices': [choice]})}\n\n".encode())
                    self.wfile.flush()
                    sent += k
                    chunks += 1
                    if state.die_after_chunks is not None and chunks >= state.die_after_chunks:
                        self.close_connection = True
                        return
                    time.sleep(state.delay)
                if state.send_usage and (body.get("stream_options") or {}).get("include_usage"):
                    u = {"choices": [], "usage": {"prompt_tokens": ptoks, "completion_tokens": sent,
                                                  "total_tokens": ptoks + sent}}
                    self.wfile.write(f"data: {json.dumps(u)}\n\n".encode())
                state.observe("vllm:e2e_request_latency_seconds", time.perf_counter() - arrival)
                state.served(ptoks, sent, chunks)
                self.wfile.write(b"data: [DONE]\n\n")
                self.wfile.flush()
            finally:
                with state.lock:
                    state.running -= 1

    return H


class _Httpd(ThreadingHTTPServer):
    # socketserver's default listen backlog is 5: eight streams connecting at once (a C8 level)
    # plus the /metrics sampler overflowed it, and the kernel's SYN retry (1 s) made some streams
    # start after others had finished (the decode window then saw no instant with all 8 running)
    request_queue_size = 128


class FakeServer:
    def __init__(self, port: int = 0, **kw):
        self.state = FakeState(**kw)
        self.httpd = _Httpd(("127.0.0.1", port), make_handler(self.state))
        self.httpd.daemon_threads = True
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}"
        self.thread = threading.Thread(target=self.httpd.serve_forever, daemon=True)

    def __enter__(self):
        self.thread.start()
        return self

    def __exit__(self, *exc):
        self.httpd.shutdown()
        self.httpd.server_close()


def _fake_boot_log(env) -> None:
    """Print vLLM-shaped boot lines (the pool the launcher plan predicts for this env, times
    FAKE_POOL_SCALE) so boot-log parsers can be tested; FAKE_BOOT_FAIL=1 dies like a bad boot."""
    if env.get("FAKE_BOOT_FAIL"):
        print("RuntimeError: fake boot failure (FAKE_BOOT_FAIL)", flush=True)
        raise SystemExit(1)
    if not env.get("FAKE_VLLM_LOG"):
        return
    from pathlib import Path
    from onecard import memory
    from onecard.plan import make_plan
    geom = memory.ModelGeometry.from_model_dir(env["MODEL"]) if (Path(env.get("MODEL", "")) / "config.json").is_file() else None
    p = make_plan(dict(env), ".", python="python3", geometry=geom).prediction
    pool = int(p["pool_tokens"] * float(env.get("FAKE_POOL_SCALE", "1")))
    print(f"INFO Setting attention block size to {p['block_size']} tokens to ensure that attention page size is >= mamba page size.")
    print(f"INFO [kv_cache_utils.py:1] GPU KV cache size: {pool:,} tokens")
    print(f"INFO [kv_cache_utils.py:1] Maximum concurrency for {p['max_len']:,} tokens per request: {p['max_concurrency']:.2f}x",
          flush=True)


if __name__ == "__main__":
    # `python fake_openai_server.py [PORT]` (else $PORT): for boot-per-arm tests. Env knobs:
    # FAKE_DELAY (s per chunk), FAKE_TOKENS_PER_CHUNK (SPEC=off forces 1), FAKE_CRASH_AFTER (the
    # process dies on that many-th POST, like a server crash), FAKE_VLLM_LOG / FAKE_POOL_SCALE /
    # FAKE_BOOT_FAIL (see _fake_boot_log).
    import os
    import sys
    env = os.environ
    _fake_boot_log(env)
    port = int(sys.argv[1]) if len(sys.argv) > 1 else int(env["PORT"])
    tpc = 1 if env.get("SPEC") == "off" else int(env.get("FAKE_TOKENS_PER_CHUNK", "3"))
    srv = FakeServer(port, delay=float(env.get("FAKE_DELAY", "0.002")), tokens_per_chunk=tpc)
    crash = int(env.get("FAKE_CRASH_AFTER", "0"))
    if crash:
        posts = [0]
        handler = srv.httpd.RequestHandlerClass
        orig = handler.do_POST

        def do_post(self):
            posts[0] += 1
            if posts[0] >= crash:
                print(f"RuntimeError: fake engine crash at POST {posts[0]} (FAKE_CRASH_AFTER)", flush=True)
                os._exit(3)
            orig(self)
        handler.do_POST = do_post
    try:
        srv.httpd.serve_forever()
    except KeyboardInterrupt:
        pass
