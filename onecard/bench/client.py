"""Streaming OpenAI-compatible client whose token counts come from the server, not the stream.

Under speculative decoding one streamed chunk is one verify step and may carry several tokens,
so counting chunks undercounts. Every request therefore asks for
``stream_options.include_usage`` and takes ``completion_tokens`` from the final usage chunk; SSE
deltas are used only for timestamps (first / last content). A stream without usage yields
``completion_tokens = None`` and the request is marked not ok: we never fall back to chunks.

Timings (``time.perf_counter``, seconds):
  TTFT        = t_first - t_start
  decode tok/s = (completion_tokens - 1) / (t_last - t_first)   (excludes TTFT and first token)
  e2e tok/s   = completion_tokens / (t_end - t_start)
"""
from __future__ import annotations

import json
import time
from dataclasses import asdict, dataclass, field
from typing import Any

#: Seconds our pooled HTTP clients keep an idle connection. vLLM's server closes one after
#: VLLM_HTTP_TIMEOUT_KEEP_ALIVE idle seconds (uvicorn; 5 by default, 30 under onecard's launcher)
#: and httpx keeps one 5 s by default: with equal timers a request can leave on a connection the
#: server is closing and fail with "Server disconnected without sending a response" (job 71's
#: first run, 2026-12-07: one request in ~1,500 against a healthy server). Expiring first closes
#: that window against any server that keeps connections 3 s or more.
KEEPALIVE_EXPIRY_S = 2.0


def http_limits(max_connections: int = 256, max_keepalive_connections: int = 64):
    """httpx.Limits for a pooled client of a vLLM server: the pool sizes given, and idle connections
    dropped after KEEPALIVE_EXPIRY_S, before the server would close them."""
    import httpx

    return httpx.Limits(max_connections=max_connections, max_keepalive_connections=max_keepalive_connections,
                        keepalive_expiry=KEEPALIVE_EXPIRY_S)

TOKEN_SOURCE = "usage.completion_tokens"


@dataclass
class RequestResult:
    ok: bool = False
    error: str | None = None
    t_start: float = 0.0
    t_first: float | None = None
    t_last: float | None = None
    t_end: float | None = None
    completion_tokens: int | None = None
    prompt_tokens: int | None = None
    cached_tokens: int | None = None
    chunks: int = 0  # content-bearing chunks: informative only, never a token count
    finish_reason: str | None = None
    text: str = ""
    token_count_source: str = TOKEN_SOURCE
    # arrival time of every content chunk (perf_counter), only when stream(keep_times=True)
    chunk_times: list[float] = field(default_factory=list)

    @property
    def ttft(self) -> float | None:
        return None if self.t_first is None else self.t_first - self.t_start

    @property
    def e2e(self) -> float | None:
        return None if self.t_end is None else self.t_end - self.t_start

    @property
    def decode_s(self) -> float | None:
        if self.t_first is None or self.t_last is None:
            return None
        return self.t_last - self.t_first

    @property
    def decode_tps(self) -> float | None:
        d = self.decode_s
        if not self.completion_tokens or self.completion_tokens < 2 or not d or d <= 0:
            return None
        return (self.completion_tokens - 1) / d

    @property
    def e2e_tps(self) -> float | None:
        e = self.e2e
        if self.completion_tokens is None or not e or e <= 0:
            return None
        return self.completion_tokens / e

    def summary(self, keep_text: bool = False) -> dict[str, Any]:
        d = asdict(self)
        if not keep_text:
            d.pop("text")
        if not d["chunk_times"]:
            d.pop("chunk_times")
        d.update(ttft=self.ttft, e2e=self.e2e, decode_s=self.decode_s,
                 decode_tps=self.decode_tps, e2e_tps=self.e2e_tps)
        return d


@dataclass
class Client:
    base_url: str  # e.g. http://127.0.0.1:8000 (with or without /v1)
    model: str
    api_key: str | None = None
    timeout: float = 600.0
    endpoint: str = "completions"  # or "chat"
    extra_headers: dict[str, str] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.endpoint not in ("completions", "chat"):
            raise ValueError(f"endpoint {self.endpoint!r} is not valid; valid: completions, chat")
        self.base_url = self.base_url.rstrip("/")
        if self.base_url.endswith("/v1"):
            self.base_url = self.base_url[:-3]

    # -- plumbing -------------------------------------------------------------------------
    def _headers(self) -> dict[str, str]:
        h = {"Content-Type": "application/json", **self.extra_headers}
        if self.api_key:
            h["Authorization"] = f"Bearer {self.api_key}"
        return h

    def _http(self):
        """One pooled httpx.Client per Client (thread-safe; building one loads the CA bundle,
        tens of ms, which must not land inside a TTFT). Used as a context manager that does
        not close the pool."""
        import contextlib
        import httpx
        if getattr(self, "_pool", None) is None:
            limits = http_limits(max_connections=256, max_keepalive_connections=64)
            self._pool = httpx.Client(timeout=httpx.Timeout(self.timeout, connect=10.0),
                                      headers=self._headers(), limits=limits,
                                      verify=not self.base_url.startswith("http://"))
        return contextlib.nullcontext(self._pool)

    def close(self) -> None:
        if getattr(self, "_pool", None) is not None:
            self._pool.close()
            self._pool = None

    def get_json(self, path: str) -> Any:
        with self._http() as c:
            r = c.get(self.base_url + path)
            r.raise_for_status()
            return r.json()

    def server_info(self) -> dict[str, Any]:
        """url, served model ids, max_model_len, server vLLM version (best effort)."""
        info: dict[str, Any] = {"url": self.base_url, "model": self.model, "endpoint": self.endpoint}
        try:
            models = self.get_json("/v1/models").get("data", [])
            info["served_models"] = [m.get("id") for m in models]
            for m in models:
                if m.get("id") == self.model:
                    info["max_model_len"] = m.get("max_model_len")
        except Exception as exc:  # noqa: BLE001
            info["models_error"] = str(exc)
        try:
            info["version"] = self.get_json("/version").get("version")
        except Exception:  # noqa: BLE001
            info["version"] = None
        return info

    def _body(self, prompt: str, max_tokens: int, sampling: dict | None, stream: bool) -> dict:
        body: dict[str, Any] = {"model": self.model, "max_tokens": int(max_tokens), "stream": stream}
        if self.endpoint == "chat":
            body["messages"] = [{"role": "user", "content": prompt}]
        else:
            body["prompt"] = prompt
        if stream:
            body["stream_options"] = {"include_usage": True}
        body.update(sampling or {})
        return body

    # -- streaming --------------------------------------------------------------------------
    def stream(self, prompt: str, max_tokens: int, sampling: dict | None = None,
               keep_text: bool = True, keep_times: bool = False) -> RequestResult:
        import httpx
        res = RequestResult()
        path = "/v1/chat/completions" if self.endpoint == "chat" else "/v1/completions"
        body = self._body(prompt, max_tokens, sampling, stream=True)
        res.t_start = time.perf_counter()
        try:
            with self._http() as c, c.stream("POST", self.base_url + path, json=body) as r:
                if r.status_code != 200:
                    r.read()
                    res.error = f"HTTP {r.status_code}: {r.text[:300]}"
                    res.t_end = time.perf_counter()
                    return res
                done = False
                for line in r.iter_lines():
                    if not line or not line.startswith("data:"):
                        continue
                    data = line[5:].strip()
                    if data == "[DONE]":
                        done = True
                        break
                    now = time.perf_counter()
                    try:
                        obj = json.loads(data)
                    except json.JSONDecodeError:
                        res.error = f"bad SSE payload: {data[:120]!r}"
                        continue
                    if "error" in obj and not obj.get("choices"):
                        res.error = f"server error in stream: {str(obj['error'])[:300]}"
                        continue
                    piece = self._delta_text(obj)
                    if piece:
                        res.chunks += 1
                        if res.t_first is None:
                            res.t_first = now
                        res.t_last = now
                        if keep_times:
                            res.chunk_times.append(now)
                        if keep_text:
                            res.text += piece
                    for ch in obj.get("choices") or []:
                        if ch.get("finish_reason"):
                            res.finish_reason = ch["finish_reason"]
                    usage = obj.get("usage")
                    if usage:
                        if usage.get("completion_tokens") is not None:
                            res.completion_tokens = int(usage["completion_tokens"])
                        if usage.get("prompt_tokens") is not None:
                            res.prompt_tokens = int(usage["prompt_tokens"])
                        details = usage.get("prompt_tokens_details") or {}
                        if details.get("cached_tokens") is not None:
                            res.cached_tokens = int(details["cached_tokens"])
                res.t_end = time.perf_counter()
                if not done and res.error is None:
                    res.error = "stream ended without [DONE] (server died?)"
        except (httpx.HTTPError, OSError) as exc:
            res.t_end = time.perf_counter()
            res.error = f"{type(exc).__name__}: {exc}"
            return res
        if res.completion_tokens is None and res.error is None:
            res.error = "no usage in stream (server ignored stream_options.include_usage)"
        res.ok = res.error is None
        return res

    def _delta_text(self, obj: dict) -> str:
        out = []
        for ch in obj.get("choices") or []:
            if self.endpoint == "chat":
                delta = ch.get("delta") or {}
                for key in ("content", "reasoning_content", "reasoning"):
                    if delta.get(key):
                        out.append(delta[key])
            elif ch.get("text"):
                out.append(ch["text"])
        return "".join(out)

    # -- non-streaming (perplexity, needle) ----------------------------------------------------
    def complete(self, body_extra: dict, prompt: str, max_tokens: int) -> dict:
        """POST /v1/completions (never chat) without streaming; returns the JSON."""
        import httpx
        body = {"model": self.model, "prompt": prompt, "max_tokens": int(max_tokens), **body_extra}
        with self._http() as c:
            r = c.post(self.base_url + "/v1/completions", json=body)
            if r.status_code != 200:
                raise httpx.HTTPStatusError(f"HTTP {r.status_code}: {r.text[:300]}",
                                            request=r.request, response=r)
            return r.json()
