"""GPU smoke suite: the tiny Qwen3.5 model under each SPEC / KV config, and SmolLM2.

Order matters (one server at a time, see conftest): off → mtp → int8 → smol.
"""
from __future__ import annotations

import json

import pytest

pytestmark = pytest.mark.gpu

PROMPTS = [
    "The quick brown fox",
    "def fibonacci(n):\n    ",
    "In the beginning of the module documentation, the author explains that "
    "every function must be tested, and that the tests must run quickly on small inputs.",
    "1, 2, 3, 4,",
]
MAX_TOKENS = 48


def greedy(server, prompts=PROMPTS, max_tokens=MAX_TOKENS, gaps: list | None = None) -> list[list[int]]:
    """Greedy token ids per prompt; with ``gaps`` (a list), also the top-1 minus top-2 logprob
    at every position, appended per prompt (to tell numerical near-ties from real bugs)."""
    out = []
    for p in prompts:
        payload = {"model": server.served, "prompt": p, "max_tokens": max_tokens,
                   "temperature": 0.0, "ignore_eos": True, "return_token_ids": True}
        if gaps is not None:
            payload.update(logprobs=2, return_tokens_as_token_ids=True)
        r = server.post("/v1/completions", payload)
        choice = r["choices"][0]
        ids = choice.get("token_ids")
        assert ids, f"no token_ids in response: {json.dumps(r)[:300]}"
        assert r["usage"]["completion_tokens"] == max_tokens
        out.append(list(ids))
        if gaps is not None:
            per_pos = []
            for top in (choice.get("logprobs") or {}).get("top_logprobs") or []:
                vals = sorted((v for v in (top or {}).values() if v is not None), reverse=True)
                per_pos.append(vals[0] - vals[1] if len(vals) >= 2 else None)
            gaps.append(per_pos)
    return out


def first_divergence(a: list[int], b: list[int]) -> int | None:
    for i, (x, y) in enumerate(zip(a, b)):
        if x != y:
            return i
    return None if len(a) == len(b) else min(len(a), len(b))


# ------------------------------------------------------------------------------ SPEC off, bf16

def test_off_boots_and_greedy_is_deterministic(servers):
    s = servers.use("off")
    first = greedy(s)
    second = greedy(s)
    gaps: list = []
    third = greedy(s, gaps=gaps)      # asking for logprobs must not change the tokens
    servers.cache["off"] = first
    servers.cache["off_gaps"] = gaps
    servers.record["off_greedy"] = first
    servers.save()
    for i, (a, b, c) in enumerate(zip(first, second, third)):
        assert a == b, f"prompt {i}: greedy differs at token {first_divergence(a, b)}"
        assert a == c, f"prompt {i}: greedy with logprobs differs at token {first_divergence(a, c)}"
    # Random weights, but scaled so greedy output is varied, not one token repeated.
    assert all(len(set(ids)) > 4 for ids in first), first


def test_off_chat_completion(servers):
    s = servers.use("off")
    r = s.post("/v1/chat/completions", {
        "model": s.served, "max_tokens": 24, "temperature": 0.0,
        "messages": [{"role": "system", "content": "You are terse."},
                     {"role": "user", "content": "Say hello."}],
    })
    msg = r["choices"][0]["message"]
    assert msg["role"] == "assistant"
    assert r["usage"]["completion_tokens"] > 0
    servers.record["chat"] = {"content": msg.get("content"), "usage": r["usage"]}


def test_off_chat_streamed(servers):
    s = servers.use("off")
    chunks = s.stream("/v1/chat/completions", {
        "model": s.served, "max_tokens": 24, "temperature": 0.0, "stream": True,
        "stream_options": {"include_usage": True},
        "messages": [{"role": "user", "content": "Count to five."}],
    })
    assert len(chunks) >= 3, chunks
    text = "".join((c["choices"][0]["delta"].get("content") or "")
                   for c in chunks if c.get("choices"))
    finish = [c["choices"][0].get("finish_reason") for c in chunks if c.get("choices")]
    usage = [c["usage"] for c in chunks if c.get("usage")]
    assert any(finish), "no finish_reason in the stream"
    assert usage and usage[-1]["completion_tokens"] > 0
    servers.record["stream"] = {"chunks": len(chunks), "text": text, "usage": usage[-1]}


TOOLS = [{
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Current weather in a city",
        # enum: forced decoding of a random model then ends quickly
        "parameters": {"type": "object",
                       "properties": {"city": {"type": "string", "enum": ["Paris", "Rome"]}},
                       "required": ["city"], "additionalProperties": False},
    },
}]


def test_off_tool_call(servers):
    s = servers.use("off")
    messages = [{"role": "user", "content": "What's the weather in Paris?"}]
    # auto: the random model will not call, but the parser path must answer cleanly.
    r = s.post("/v1/chat/completions", {"model": s.served, "messages": messages, "tools": TOOLS,
                                        "tool_choice": "auto", "max_tokens": 32,
                                        "temperature": 0.0})
    assert r["choices"][0]["message"]["role"] == "assistant"
    # required: structured output forces a call; it must come back as a parsed tool call.
    r = s.post("/v1/chat/completions", {"model": s.served, "messages": messages, "tools": TOOLS,
                                        "tool_choice": "required", "max_tokens": 256,
                                        "temperature": 0.0})
    calls = r["choices"][0]["message"].get("tool_calls") or []
    servers.record["tool_call"] = calls
    servers.save()
    assert calls, f"no tool_calls: {json.dumps(r)[:500]}"
    assert calls[0]["function"]["name"] == "get_weather"
    json.loads(calls[0]["function"]["arguments"])


def divergence_report(ref: list[list[int]], got: list[list[int]], gaps: list) -> dict:
    """Per prompt: the first position where `got` leaves `ref`, and off's top-1/top-2 logprob gap
    there (None where identical or unknown)."""
    report = {}
    for i, (a, b) in enumerate(zip(ref, got)):
        d = first_divergence(a, b)
        gap = gaps[i][d] if d is not None and i < len(gaps) and d < len(gaps[i]) else None
        report[i] = {"first_divergence": d, "off_top2_gap": gap}
    return report


# ------------------------------------------------------------------------------ SPEC=mtp

# A divergence where SPEC=off's own top-1 / top-2 logprobs are closer than this is a bf16 near-tie
# (verify and plain decode run different kernels), reported; anything wider fails the test.
# ONECARD_GPU_STRICT_SPEC=1 demands exact equality.
NEAR_TIE = 0.05


def test_mtp_greedy_equals_off(servers):
    import os

    if "off" not in servers.cache:
        pytest.skip("SPEC=off outputs missing (its test failed)")
    s = servers.use("mtp")
    got = greedy(s)
    again = greedy(s)
    ref = servers.cache["off"]
    report = divergence_report(ref, got, servers.cache.get("off_gaps") or [])
    servers.record["mtp_greedy"] = got
    servers.record["mtp_vs_off"] = report
    servers.save()
    print(f"[gpu-suite] SPEC=mtp vs SPEC=off first divergence per prompt: {report}")
    assert got == again, "SPEC=mtp greedy output not deterministic"
    if os.environ.get("ONECARD_GPU_STRICT_SPEC", "") not in ("", "0"):
        assert got == ref, f"SPEC=mtp != SPEC=off: {report}"
    bad = {i: r for i, r in report.items() if r["first_divergence"] is not None
           and (r["off_top2_gap"] is None or r["off_top2_gap"] >= NEAR_TIE)}
    assert not bad, f"SPEC=mtp != SPEC=off beyond bf16 near-ties: {bad}"


def test_mtp_metrics_show_drafts(servers):
    """The drafter ran (reported, not asserted beyond 'drafts were proposed')."""
    import httpx

    s = servers.use("mtp")
    text = httpx.get(s.url + "/metrics", timeout=10).text
    lines = [ln for ln in text.splitlines()
             if ln.startswith("vllm:spec_decode") and not ln.startswith("#")]
    servers.record["mtp_metrics"] = lines[:20]
    servers.save()
    drafts = [float(ln.rsplit(" ", 1)[1]) for ln in lines
              if ln.startswith("vllm:spec_decode_num_draft_tokens")]
    assert drafts and max(drafts) > 0, lines[:20]


# ------------------------------------------------------------------------------ int8 KV

def test_int8_kv_vs_bf16(servers):
    s = servers.use("int8")
    got = greedy(s)
    assert got == greedy(s), "int8 KV greedy output not deterministic"
    ref = servers.cache.get("off")
    report = divergence_report(ref, got, servers.cache.get("off_gaps") or []) if ref else {}
    servers.record["int8_first_divergence"] = report
    servers.record["int8_greedy"] = got
    servers.save()
    print(f"[gpu-suite] int8 vs bf16 first divergence per prompt (None = identical "
          f"over {MAX_TOKENS} tokens): {report}")


# ------------------------------------------------------------------------------ SmolLM2

def test_smollm2_answers_france(servers):
    s = servers.use("smol")
    r = s.post("/v1/chat/completions", {
        "model": s.served, "max_tokens": 40, "temperature": 0.0,
        "messages": [{"role": "user", "content": "What is the capital of France?"}],
    })
    answer = r["choices"][0]["message"]["content"] or ""
    servers.record["smol_answer"] = answer
    servers.save()
    print(f"[gpu-suite] SmolLM2: {answer!r}")
    assert "paris" in answer.lower(), answer
