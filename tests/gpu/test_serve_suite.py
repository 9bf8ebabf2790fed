"""GPU suite: the tiny Qwen3.5 model under each SPEC / KV / dtype configuration, and SmolLM2.

All servers boot at once (conftest); each test waits only for the ones it names in
``@pytest.mark.uses``. Greedy exactness, SPEC=mtp against SPEC=off (gpu_suite_lib.judge):
float32 (strict mode) must match token for token; bfloat16 may diverge only at a near-tie of
SPEC=off's own raw logits: the chosen token's logit, among off's top TOP_K there, within 2 bf16
ulps of off's top logit (any rank: three-way ties count), each one reported.

Order: the bf16 sweep, then the float32 strict sweeps (the strongest exactness evidence: run
them before anything else can use up the job's time), then int8 KV, then SmolLM2.
"""
from __future__ import annotations

import json
import time
from concurrent.futures import ThreadPoolExecutor

import pytest

from gpu_suite_lib import (TOP_K, attention_block_in_log, corpus_text, judge_all,
                           predicted_hit_tokens, residue_prompts, summarize, top_entries)

pytestmark = pytest.mark.gpu

PROMPTS = [
    "The quick brown fox",
    "def fibonacci(n):\n    ",
    "In the beginning of the module documentation, the author explains that "
    "every function must be tested, and that the tests must run quickly on small inputs.",
    "1, 2, 3, 4,",
]
MAX_TOKENS = 48
SWEEP_TOKENS = 20
# prompt lengths 1024..1151 tokens: every residue mod 128. Long enough that the second pass hits
# the prefix cache under speculation too: vLLM 0.27.1 with MTP gives up one attention block of
# the hit (the block is aligned to the GDN state page: 208 tokens bf16, 400-416 int8 on the tiny
# model), so 512..639-token prompts had no hit at all on the int8 mtp server (2026-12-03).
SWEEP_BASE = 1024
MODULUS = 128


def say(msg: str) -> None:
    for line in str(msg).splitlines():
        print(f"[gpu-suite] {line}", flush=True)


def complete(server, prompt, max_tokens: int, logprobs: bool) -> dict:
    """One greedy completion: token ids, prompt token count, and (with ``logprobs``) SPEC=off's
    top TOP_K (token, raw logit) per position."""
    payload = {"model": server.served, "prompt": prompt, "max_tokens": max_tokens,
               "temperature": 0.0, "ignore_eos": True, "return_token_ids": True}
    if logprobs:
        payload.update(logprobs=TOP_K, return_tokens_as_token_ids=True)
    r = server.post("/v1/completions", payload)
    choice = r["choices"][0]
    ids = choice.get("token_ids")
    assert ids, f"no token_ids in response: {json.dumps(r)[:300]}"
    assert r["usage"]["completion_tokens"] == max_tokens, r["usage"]
    out = {"ids": list(ids), "prompt_tokens": r["usage"]["prompt_tokens"]}
    if logprobs:
        out["top"] = [top_entries(t) for t in (choice.get("logprobs") or {}).get("top_logprobs") or []]
    return out


def greedy(server, prompts=PROMPTS, max_tokens=MAX_TOKENS, logprobs=False, workers=1) -> list[dict]:
    if workers <= 1:
        return [complete(server, p, max_tokens, logprobs) for p in prompts]
    with ThreadPoolExecutor(workers) as ex:
        return list(ex.map(lambda p: complete(server, p, max_tokens, logprobs), prompts))


def ids(results: list[dict]) -> list[list[int]]:
    return [r["ids"] for r in results]


def tops(results: list[dict]) -> list:
    return [r.get("top") for r in results]


def counter(text: str, name: str) -> list[float]:
    """Values of a Prometheus counter's samples (``name`` or ``name_total``, any labels; not
    the ``_created`` timestamps prometheus_client adds)."""
    out = []
    for ln in text.splitlines():
        metric = ln.split("{", 1)[0].split(" ", 1)[0]
        if metric in (name, name + "_total"):
            out.append(float(ln.rsplit(" ", 1)[1]))
    return out


def attention_block(server) -> int | None:
    """The attention block size vLLM chose (gpu_suite_lib.attention_block_in_log)."""
    return attention_block_in_log(server.log_text())


def prefix_cache_hits(server) -> float | None:
    """Sum of the vllm:prefix_cache_hits counters (None if the server exports none)."""
    vals = counter(server.metrics(), "vllm:prefix_cache_hits")
    return sum(vals) if vals else None


# ------------------------------------------------------------------------------ SPEC off, bf16

@pytest.mark.uses("off")
def test_off_greedy_is_deterministic(servers):
    # The first pass computes every prompt cold; the later ones hit the prefix cache, a
    # different bf16 computation, so they may flip a near-tie of the first pass's logits (job
    # 10, session 14: prompt 1 at position 36, the 1-ulp tie SPEC=mtp also meets there). Asking
    # for logprobs must not change the tokens beyond that either.
    s = servers.get("off")
    first = greedy(s, logprobs=True)
    second, third = greedy(s), greedy(s, logprobs=True)
    servers.cache["off"] = first
    servers.record["off_greedy"] = ids(first)
    for name, other in (("second pass (cached prefix)", second), ("pass with logprobs", third)):
        verdicts = judge_all(ids(first), ids(other), tops(first), "bfloat16")
        lines, bad = summarize(f"SPEC=off {name} vs first pass, bf16", verdicts)
        say("\n".join(lines))
        assert not bad, f"SPEC=off {name} differs beyond bf16 near-ties:\n" + "\n".join(lines)
    # Random weights, but scaled so greedy output is varied, not one token repeated.
    assert all(len(set(x)) > 4 for x in ids(first)), ids(first)


@pytest.mark.uses("off")
def test_off_chat_completion(servers):
    s = servers.get("off")
    r = s.post("/v1/chat/completions", {
        "model": s.served, "max_tokens": 24, "temperature": 0.0,
        "messages": [{"role": "system", "content": "You are terse."},
                     {"role": "user", "content": "Say hello."}],
    })
    msg = r["choices"][0]["message"]
    assert msg["role"] == "assistant"
    assert r["usage"]["completion_tokens"] > 0
    servers.record["chat"] = {"content": msg.get("content"), "usage": r["usage"]}


@pytest.mark.uses("off")
def test_off_chat_streamed(servers):
    s = servers.get("off")
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


@pytest.mark.uses("off")
def test_off_tool_call(servers):
    s = servers.get("off")
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
    assert calls, f"no tool_calls: {json.dumps(r)[:500]}"
    assert calls[0]["function"]["name"] == "get_weather"
    json.loads(calls[0]["function"]["arguments"])


# ------------------------------------------------------------------------------ SPEC=mtp, bf16

def _off_reference(servers):
    if "off" not in servers.cache:
        servers.cache["off"] = greedy(servers.get("off"), logprobs=True)
    return servers.cache["off"]


@pytest.mark.uses("off", "mtp")
def test_mtp_greedy_equals_off(servers):
    ref = _off_reference(servers)
    s = servers.get("mtp")
    got, again = greedy(s), greedy(s)
    verdicts = judge_all(ids(ref), ids(got), tops(ref), "bfloat16")
    lines, bad = summarize("SPEC=mtp vs SPEC=off, 4 prompts x 48 tokens, bf16", verdicts)
    say("\n".join(lines))
    servers.record["mtp_greedy"] = ids(got)
    servers.record["mtp_vs_off"] = {k: v.as_dict() for k, v in verdicts.items()}
    assert ids(got) == ids(again), "SPEC=mtp greedy output not deterministic"
    assert not bad, "SPEC=mtp != SPEC=off beyond bf16 near-ties:\n" + "\n".join(lines)


@pytest.mark.uses("mtp")
def test_mtp_metrics_show_drafts(servers):
    """The drafter ran (reported, not asserted beyond 'drafts were proposed')."""
    s = servers.get("mtp")
    if "mtp_greedy" not in servers.record:
        greedy(s, prompts=PROMPTS[:1], max_tokens=8)
    text = s.metrics()
    lines = [ln for ln in text.splitlines()
             if ln.startswith("vllm:spec_decode") and "_created" not in ln]
    servers.record["mtp_metrics"] = lines[:20]
    drafts = counter(text, "vllm:spec_decode_num_draft_tokens")
    say(f"SPEC=mtp drafts proposed: {max(drafts) if drafts else 'none'}")
    assert drafts and max(drafts) > 0, lines[:20]


# ------------------------------------------------------------------------------ int8 KV

@pytest.mark.uses("int8", "off")
def test_int8_kv_vs_bf16(servers):
    """int8 KV is deterministic; its first divergence from bf16 KV per prompt is reported."""
    s = servers.get("int8")
    got = greedy(s)
    assert ids(got) == ids(greedy(s)), "int8 KV greedy output not deterministic"
    ref = _off_reference(servers)
    verdicts = judge_all(ids(ref), ids(got), tops(ref), "bfloat16")
    servers.record["int8_greedy"] = ids(got)
    servers.record["int8_vs_bf16"] = {k: v.as_dict() for k, v in verdicts.items()}
    say(f"int8 vs bf16 KV first divergence per prompt (report only, None = identical over "
        f"{MAX_TOKENS} tokens): { {k: v.position for k, v in verdicts.items()} }")


# ------------------------------------------------------------------------------ 128 residues

def _residue_prompts(servers):
    if "residues" not in servers.cache:
        from tokenizers import Tokenizer

        tok = Tokenizer.from_file(str(servers.model("tiny") / "tokenizer.json"))
        enc = lambda t: tok.encode(t, add_special_tokens=False).ids  # noqa: E731
        dec = lambda i: tok.decode(i, skip_special_tokens=False)     # noqa: E731
        servers.cache["residues"] = residue_prompts(enc, dec, corpus_text(), SWEEP_BASE, MODULUS)
    return servers.cache["residues"]


def _two_passes(server, texts, logprobs):
    """Every prompt sent concurrently, then every prompt again (prefix-cache hits)."""
    passes, hits = [], []
    for _ in range(2):
        h0 = prefix_cache_hits(server)
        passes.append(greedy(server, texts, SWEEP_TOKENS, logprobs, workers=len(texts)))
        h1 = prefix_cache_hits(server)
        hits.append(None if h0 is None or h1 is None else h1 - h0)
    return passes, hits


# float32 strict sweep -> the bf16-activation sweep of the same KV dtype (same-model check).
SAME_MODEL = {"fp32-strict": "bf16-kv", "fp32-int8-strict": "int8-kv"}


def _same_model_check(servers, label: str, n_prompts: int, residues: list) -> str | None:
    """So that "equal" cannot mean "equally wrong": a float32 sweep's SPEC=off outputs must not
    be degenerate and must share the first greedy token with the bf16 server of the same KV
    dtype on at least half the prompts. Runs when the second of the pair has run (the float32
    sweeps run before the int8 one), is reported in the float32 sweep's record, and returns the
    failure message (None: held or not both run yet)."""
    pair = ((label, SAME_MODEL[label]) if label in SAME_MODEL else
            next(((f, b) for f, b in SAME_MODEL.items() if b == label), None))
    if pair is None:
        return None
    f32, bf = pair
    if f"sweep_{f32}" not in servers.cache or f"sweep_{bf}" not in servers.cache:
        return None
    mine, other = servers.cache[f"sweep_{f32}"], servers.cache[f"sweep_{bf}"]
    same_first = sum(a[:1] == b[:1] for a, b in zip(mine, other))
    firsts = judge_all(other, mine, None, "float32", residues)
    servers.record.setdefault(f"sweep_{f32}", {})[f"vs_{bf}"] = {
        "same_first_token": same_first,
        "first_divergence": {r: v.position for r, v in firsts.items()}}
    say(f"{f32} vs {bf} (same model, other dtype; report): first token equal in "
        f"{same_first}/{n_prompts} prompts, identical outputs in "
        f"{sum(v.position is None for v in firsts.values())}")
    if same_first < n_prompts // 2:
        return (f"{f32}: first token equals {bf}'s in only {same_first} prompts (checked when "
                f"{label} ran)")
    return None


def residue_sweep(servers, off_name: str, mtp_name: str, dtype: str, label: str) -> None:
    """SPEC=mtp vs SPEC=off over the 128 residues (see the module docstring), and the
    same-model check of a float32 sweep against its bf16 partner (``SAME_MODEL``)."""
    prompts = _residue_prompts(servers)
    texts = [t for _, t, _ in prompts]
    off, mtp = servers.get(off_name), servers.get(mtp_name)
    t0 = time.monotonic()
    with ThreadPoolExecutor(2) as ex:
        f_off = ex.submit(_two_passes, off, texts, True)
        f_mtp = ex.submit(_two_passes, mtp, texts, False)
        try:
            (off_p, off_hits), (mtp_p, mtp_hits) = f_off.result(), f_mtp.result()
        except Exception as e:   # a server that died mid-sweep: say so, with its log tail
            dead = [f"{x.name} exited rc={x.proc.returncode}; log tail:\n{x.tail(30)}"
                    for x in (off, mtp) if x.proc is not None and x.proc.poll() is not None]
            raise AssertionError(f"{label}: sweep requests failed ({e!r})\n" + "\n".join(dead)) from e
    wall = time.monotonic() - t0
    residues = [r for r, _, _ in prompts]
    lengths = {r: n for r, _, n in prompts}
    for res in (off_p[0], off_p[1], mtp_p[0], mtp_p[1]):
        wrong = {r: x["prompt_tokens"] for r, x in zip(residues, res) if x["prompt_tokens"] != lengths[r]}
        assert not wrong, f"server counted other prompt lengths than the tokenizer: {wrong}"
    assert {n % MODULUS for n in lengths.values()} == set(range(MODULUS))
    cold, cached, floor = ("mtp vs off (cold prefix)", "mtp vs off (cached prefix)",
                           "off cached vs off cold")
    comparisons = {
        cold: judge_all(ids(off_p[0]), ids(mtp_p[0]), tops(off_p[0]), dtype, residues),
        cached: judge_all(ids(off_p[1]), ids(mtp_p[1]), tops(off_p[1]), dtype, residues),
        floor: judge_all(ids(off_p[0]), ids(off_p[1]), tops(off_p[0]), dtype, residues),
    }
    blocks = {"off": attention_block(off), "mtp": attention_block(mtp)}
    predicted = {k: predicted_hit_tokens(lengths.values(), blocks[k], k == "mtp") for k in blocks}
    say(f"== residue sweep {label} ({dtype}, {off_name} vs {mtp_name}): {MODULUS} prompts of "
        f"{SWEEP_BASE}..{SWEEP_BASE + MODULUS - 1} tokens x 2 passes x {SWEEP_TOKENS} tokens, "
        f"{wall:.1f} s; prefix-cache hit tokens in pass 2: off {off_hits[1]}, mtp {mtp_hits[1]} "
        f"(attention blocks {blocks['off']} / {blocks['mtp']} tokens; whole blocks predict "
        f"{predicted['off']} / {predicted['mtp']}, speculation one block fewer)")
    failing, findings = {}, []
    rec = {"wall_s": round(wall, 1), "prefix_cache_hit_tokens": {"off": off_hits, "mtp": mtp_hits},
           "attention_block": blocks, "predicted_hit_tokens": predicted}
    for name, verdicts in comparisons.items():
        lines, bad = summarize(name, verdicts)
        say("\n".join(lines))
        div = sorted(r for r, v in verdicts.items() if v.position is not None)
        rec[name] = {"diverged_residues": div, "failing_residues": bad,
                     "divergences": {r: verdicts[r].as_dict() for r in div}}
        if bad:
            failing[name] = bad
    n = len(prompts)
    noise = {k: len(rec[k]["diverged_residues"]) for k in (floor, cold, cached)}
    rec["noise_floor"] = {"off_cold_vs_off_cached_differ": noise[floor], "of": n,
                          "mtp_vs_off_cold_differ": noise[cold],
                          "mtp_vs_off_cached_differ": noise[cached]}
    say(f"{label} noise floor: {noise[floor]}/{n} off-cold vs off-cached pairs already differ "
        f"(SPEC=off against itself); SPEC=mtp vs off differs in {noise[cold]}/{n} (cold), "
        f"{noise[cached]}/{n} (cached)")
    if mtp_hits[1] is not None and mtp_hits[1] <= 0:
        findings.append(f"the speculating server {mtp_name} had zero prefix-cache hits in pass 2 "
                        f"({mtp_hits[1]} hit tokens; {off_name}: {off_hits[1]}): its 'cached' "
                        f"pass recomputed every prompt")
    for k, got in (("off", off_hits[1]), ("mtp", mtp_hits[1])):
        if got is not None and predicted[k] and got < predicted[k]:
            findings.append(f"{off_name if k == 'off' else mtp_name} hit {got:.0f} prefix-cache "
                            f"tokens in pass 2, fewer than the {predicted[k]} whole blocks predict")
    for f in findings:
        say(f"{label} FINDING (not a failure): {f}")
    rec["findings"] = findings
    servers.cache[f"sweep_{label}"] = ids(off_p[0])
    varied = sum(len(set(x)) > 2 for x in ids(off_p[0]))   # NaN / garbage: one token repeated
    rec["varied_outputs"] = varied
    servers.record[f"sweep_{label}"] = {**servers.record.get(f"sweep_{label}", {}), **rec}
    same_model_error = _same_model_check(servers, label, n, residues)
    assert varied >= n // 2, f"{label}: degenerate outputs ({varied} varied)"
    assert same_model_error is None, same_model_error
    assert off_hits[1] is None or off_hits[1] > 0, \
        f"{label}: second pass on {off_name} (SPEC=off) hit no prefix-cache blocks"
    assert not failing, f"{label}: divergences the {dtype} rule does not accept: {failing}"


def _shim_report(servers, names) -> dict:
    """Which GDN prefill precision the float32 servers ran (tests/gpu/fp32_shim markers)."""
    out = {}
    for n in names:
        log = servers.servers[n].log_text() if n in servers.servers else ""
        out[n] = ("fell back to bf16 prefill" if "FELL BACK" in log else
                  "float32 prefill" if "prefill ran in float32" in log else
                  "shim applied, no prefill seen" if "refusal lifted" in log else
                  "shim NOT applied")
    say(f"float32 GDN prefill: {out}")
    return out


@pytest.mark.uses("off", "mtp")
def test_residue_sweep_bf16_kv(servers):
    residue_sweep(servers, "off", "mtp", "bfloat16", "bf16-kv")


# ------------------------------------------------------------------------------ float32 strict
# Right after the bf16 sweep: the strongest exactness evidence (no tie allowance).

def _strict_sweep(servers, off, mtp, label, prefill_key):
    """The float32 sweep of off vs mtp (no tie allowance), then, pass or fail, which GDN prefill
    path each server took (record[prefill_key])."""
    try:
        residue_sweep(servers, off, mtp, "float32", label)
    finally:
        servers.record[prefill_key] = _shim_report(servers, [off, mtp])


@pytest.mark.uses("fp32", "fp32-mtp")
def test_residue_sweep_fp32_strict(servers):
    _strict_sweep(servers, "fp32", "fp32-mtp", "fp32-strict", "fp32_prefill")


@pytest.mark.uses("fp32-int8", "fp32-int8-mtp")
def test_residue_sweep_fp32_int8_strict(servers):
    """Its same-model check against the int8-kv sweep runs when that sweep has run (next)."""
    _strict_sweep(servers, "fp32-int8", "fp32-int8-mtp", "fp32-int8-strict", "fp32_int8_prefill")


# ------------------------------------------------------------------------------ int8 KV sweep

@pytest.mark.uses("int8", "int8-mtp")
def test_residue_sweep_int8_kv(servers):
    residue_sweep(servers, "int8", "int8-mtp", "bfloat16", "int8-kv")


# ------------------------------------------------------------------------------ SmolLM2

@pytest.mark.uses("smol")
def test_smollm2_answers_france(servers):
    s = servers.get("smol")
    r = s.post("/v1/chat/completions", {
        "model": s.served, "max_tokens": 40, "temperature": 0.0,
        "messages": [{"role": "user", "content": "What is the capital of France?"}],
    })
    answer = r["choices"][0]["message"]["content"] or ""
    servers.record["smol_answer"] = answer
    say(f"SmolLM2: {answer!r}")
    assert "paris" in answer.lower(), answer
