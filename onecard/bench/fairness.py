"""The fairness contract, machine-checked per result and per comparison.

Per result (:func:`check_result`): finished (not partial), every request ok, token counts from
the server (``usage.completion_tokens`` or server counters, never streamed chunks), warmup
discarded, single tenant (the server's counters saw no more requests / tokens than ours), one
replica (one engine label in /metrics), for prefill/TTFT axes salted prompts or prefix
caching off, and no client-side stall (:func:`stall_reason`): for each request measured alone in
flight, the client's TTFT may not exceed the server's (vLLM's TTFT histogram over the request's
window) by more than max(0.5 s, 50 %), and the engine may not sit idle (sampled
``vllm:num_requests_running`` = 0) for more than 1 s while the request waits for its first token.
INVALID on axes whose figures contain TTFT (``TTFT_KINDS``), a warning elsewhere.

Per comparison (:func:`compare`): both results valid, same kind, same prompts (hash), same output
lengths, same sampling, same token-count source, warmup done in both; configs that differ in
more than the declared knob are CONFOUNDED.

Per A/B across boots (:func:`ab_verdict`): each arm needs >= 2 boots so the boot-to-boot floor is
measured; an effect below 2x the floor is UNRESOLVED.
"""
from __future__ import annotations

import statistics
from dataclasses import dataclass, field
from typing import Any

SERVER_TOKEN_SOURCES = ("usage.completion_tokens", "server_counters", "server_logprobs")
PREFILL_KINDS = ("prefill", "ttft_slope", "depth_prefill")
#: kinds whose figures include TTFT: a client-side stall makes them INVALID (elsewhere a warning;
#: the ladder's TTFT column and aggregate tok/s both contain it; spec's decode tok/s does not)
TTFT_KINDS = ("prefix_turns", "depth", "needle", "ladder", *PREFILL_KINDS)
STALL_ABS_S = 0.5   # client TTFT may exceed the server's by max(STALL_ABS_S, STALL_REL x server)
STALL_REL = 0.5
STALL_IDLE_S = 1.0  # longest engine-idle stretch allowed before a request's first token
#: env knobs that never change what is measured (paths, logging)
IGNORED_KNOBS = ("PYTHONPATH", "VLLM_LOGGING_LEVEL", "CUDA_DEVICE_ORDER")


class FairnessError(ValueError):
    """A comparison the contract refuses; the message lists every reason."""


@dataclass
class Verdict:
    status: str  # OK | REFUSED | CONFOUNDED | UNRESOLVED | RESOLVED
    reasons: list[str] = field(default_factory=list)
    details: dict[str, Any] = field(default_factory=dict)

    def as_dict(self) -> dict[str, Any]:
        return {"status": self.status, "reasons": self.reasons, **self.details}


def _prov(result: dict) -> dict:
    return result.get("provenance") or {}


def stall_reason(rec: dict) -> str | None:
    """Why one request's TTFT is not the server's (None if it is). ``rec`` as recorded by the
    runner in ``result["server_side"]["requests"]`` (client_ttft, server_ttft, engine_idle_s)."""
    c, s, idle = rec.get("client_ttft"), rec.get("server_ttft"), rec.get("engine_idle_s")
    if c is None:
        return None
    parts = []
    if s is not None and c - s > max(STALL_ABS_S, STALL_REL * s):
        parts.append(f"client TTFT {c:.3f} s vs server {s:.3f} s")
    if idle is not None and idle > STALL_IDLE_S:
        parts.append(f"engine idle (vllm:num_requests_running 0) for {idle:.1f} s before the first "
                     f"token" + ("" if parts else f", client TTFT {c:.3f} s"))
    if not parts:
        return None
    at = f", {rec['at']}" if rec.get("at") else ""
    return f"client-side stall: {'; '.join(parts)} (request {rec.get('n')}{at})"


def _stall_checks(result: dict, problems: list[str], warnings: list[str]) -> None:
    ss = result.get("server_side")
    if not ss:
        return  # no request measured alone in flight (or a result from before this check)
    ttft_axis = result.get("kind") in TTFT_KINDS or result.get("axis") == "prefill"
    measured = [r for r in ss.get("requests") or [] if r.get("client_ttft") is not None]
    for rec in measured:
        why = stall_reason(rec)
        if why and ttft_axis:
            problems.append(why)
        elif why:
            warnings.append(f"{why} (not a TTFT axis: warning only)")
    # series missing (not vLLM, or an older one): say so; an ambiguous window is only a note
    if measured and not any(r.get("histograms") for r in measured):
        note = next((r["note"] for r in measured if r.get("note")), "no server-side TTFT")
        if any(r.get("engine_idle_s") is not None for r in measured):
            warnings.append(f"client-side stalls checked by the engine-idle gauge only: {note}")
        else:
            warnings.append(f"client-side stalls not verified: {note}")


def check_result(result: dict) -> tuple[list[str], list[str]]:
    """(problems, warnings). Any problem makes the result INVALID."""
    problems: list[str] = []
    warnings: list[str] = []
    prov = _prov(result)
    if not prov:
        return ["no provenance record"], warnings
    src = prov.get("token_count_source")
    if src not in SERVER_TOKEN_SOURCES:
        problems.append(f"token counts from {src!r}; valid sources: {', '.join(SERVER_TOKEN_SOURCES)} "
                        "(streamed chunks are verify steps under speculation, not tokens)")
    warm = prov.get("warmup") or {}
    if int(warm.get("discarded", 0) or 0) < 1:
        problems.append("no warmup request discarded (the first run after a boot reads low)")
    if not prov.get("prompt_set") or not (prov.get("prompt_set") or {}).get("hash"):
        problems.append("prompt set hash not recorded")
    traffic = result.get("traffic") or {}
    failed = int(traffic.get("failed", 0) or 0)
    if failed:
        problems.append(f"{failed} request(s) failed: {traffic.get('first_error')}")
    if result.get("partial"):
        problems.append("partial result (run did not finish)")
    m = result.get("metrics") or {}
    if not m.get("available"):
        warnings.append("single tenancy and one replica not verified (no /metrics samples)")
    else:
        c = m.get("counters") or {}
        n_req = traffic.get("requests")
        seen = c.get("requests_finished")
        if n_req is not None and seen is not None and seen > n_req:
            problems.append(f"other client traffic: server finished {seen:g} requests during the "
                            f"run, we sent {n_req}")
        toks = traffic.get("completion_tokens")
        gen = c.get("generation_tokens")
        if toks is not None and gen is not None and gen > toks:
            problems.append(f"other client traffic: server generated {gen:g} tokens during the run, "
                            f"we received {toks}")
        conc, running = traffic.get("concurrency"), m.get("running_peak")
        if conc is not None and running is not None and running > conc:
            problems.append(f"other client traffic: server ran {running:g} requests at once, "
                            f"we sent at most {conc}")
        engines = m.get("engines") or []
        if len(engines) > 1:
            problems.append(f"more than one replica/engine serving: {engines}")
    if result.get("kind") in PREFILL_KINDS or result.get("axis") == "prefill":
        ps = prov.get("prompt_set") or {}
        if not ps.get("salted") and (prov.get("server") or {}).get("prefix_caching") is not False:
            problems.append("prefill axis without salted prompts or prefix caching off "
                            "(cache hits contaminate prefill numbers)")
    _stall_checks(result, problems, warnings)
    return problems, warnings


def verdict_for(result: dict) -> tuple[str, list[str]]:
    problems, warnings = check_result(result)
    result["fairness"] = {"problems": problems, "warnings": warnings}
    return ("INVALID" if problems else "VALID"), (problems or warnings)


def arm_config(result: dict) -> dict[str, Any]:
    """The flattened configuration an A/B must hold constant except for the declared knob."""
    prov = _prov(result)
    server = prov.get("server") or {}
    cfg: dict[str, Any] = {
        "git.commit": (prov.get("git") or {}).get("commit"),
        "vllm_version": prov.get("vllm_version"),
        "patch_series": (prov.get("patch_series") or {}).get("hash"),
        "gpu": tuple(g.get("name") for g in (prov.get("gpu") or {}).get("gpus", [])),
        "driver": (prov.get("gpu") or {}).get("driver"),
        "server.model": server.get("model"),
        "server.max_model_len": server.get("max_model_len"),
    }
    for k, v in (prov.get("env_knobs") or {}).items():
        if k not in IGNORED_KNOBS:
            cfg[f"env.{k}"] = v
    for k, v in (result.get("server_config") or {}).items():
        cfg[f"server_config.{k}"] = v
    return cfg


def _knob_matches(key: str, knob: str | None) -> bool:
    if not knob:
        return False
    return key == knob or key.endswith("." + knob)


def compare(a: dict, b: dict, knob: str | None = None) -> Verdict:
    """Check two results may be compared. REFUSED lists every reason; CONFOUNDED lists the
    config keys that differ beyond the declared knob; otherwise OK."""
    reasons: list[str] = []
    pa, pb = _prov(a), _prov(b)
    for name, r in (("A", a), ("B", b)):
        if r.get("verdict") != "VALID":
            reasons.append(f"result {name} is {r.get('verdict', 'unchecked')}: "
                           f"{'; '.join(r.get('verdict_reasons') or []) or 'no verdict'}")
    if a.get("kind") != b.get("kind"):
        reasons.append(f"different benchmarks: {a.get('kind')!r} vs {b.get('kind')!r}")
    ha = (pa.get("prompt_set") or {}).get("hash")
    hb = (pb.get("prompt_set") or {}).get("hash")
    if not ha or ha != hb:
        reasons.append(f"different prompts: prompt-set hash {str(ha)[:12]} vs {str(hb)[:12]}")
    if pa.get("sampling") != pb.get("sampling"):
        reasons.append(f"different sampling: {pa.get('sampling')} vs {pb.get('sampling')}")
    if pa.get("max_tokens") != pb.get("max_tokens"):
        reasons.append(f"different output lengths: {pa.get('max_tokens')} vs {pb.get('max_tokens')}")
    if pa.get("token_count_source") != pb.get("token_count_source"):
        reasons.append(f"different token-count sources: {pa.get('token_count_source')} vs "
                       f"{pb.get('token_count_source')}")
    for name, p in (("A", pa), ("B", pb)):
        if int((p.get("warmup") or {}).get("discarded", 0) or 0) < 1:
            reasons.append(f"no warmup discarded in {name}")
    if reasons:
        return Verdict("REFUSED", reasons)
    ca, cb = arm_config(a), arm_config(b)
    diff = sorted(k for k in set(ca) | set(cb) if ca.get(k) != cb.get(k))
    extra = [k for k in diff if not _knob_matches(k, knob)]
    details = {"differs": {k: [ca.get(k), cb.get(k)] for k in diff}, "knob": knob}
    if extra:
        return Verdict("CONFOUNDED", [f"configs differ beyond the declared knob {knob!r}: "
                                      f"{', '.join(extra)}"], details)
    if diff:
        return Verdict("UNRESOLVED", [f"{knob} differs between two single runs: a toggle that needs "
                                      "a restart is only readable against the boot-to-boot floor "
                                      "(>= 2 boots per arm: `onecard bench ab`)"], details)
    return Verdict("OK", [], details)


def boot_floor(boots: list[float]) -> float | None:
    """Boot-to-boot spread of one arm: max - min of the per-boot figures (None if < 2 boots)."""
    return (max(boots) - min(boots)) if len(boots) >= 2 else None


def ab_verdict(arm_a: list[float], arm_b: list[float], knob: str,
               compare_verdicts: list[Verdict] | None = None) -> Verdict:
    """A/B across boots: each arm a list of per-boot figures (e.g. C1 decode tok/s)."""
    details: dict[str, Any] = {"knob": knob, "boots": [len(arm_a), len(arm_b)],
                               "a": arm_a, "b": arm_b}
    for v in compare_verdicts or []:
        if v.status in ("REFUSED", "CONFOUNDED"):
            return Verdict(v.status, v.reasons, details)
    if not arm_a or not arm_b:
        return Verdict("REFUSED", ["an arm has no boots"], details)
    ma, mb = statistics.fmean(arm_a), statistics.fmean(arm_b)
    effect = mb - ma
    details.update(mean_a=ma, mean_b=mb, effect=effect,
                   effect_pct=(100.0 * effect / ma) if ma else None)
    floors = [boot_floor(arm_a), boot_floor(arm_b)]
    if any(f is None for f in floors):
        details["floor"] = None
        return Verdict("UNRESOLVED", [f"boot floor unknown: boots per arm {len(arm_a)}/{len(arm_b)}, "
                                      "need >= 2 each (an env toggle needs a restart)"], details)
    floor = max(floors)
    details["floor"] = floor
    if abs(effect) < 2 * floor:
        return Verdict("UNRESOLVED", [f"effect {effect:+.3g} is below 2x the boot floor "
                                      f"({floor:.3g})"], details)
    return Verdict("RESOLVED", [f"effect {effect:+.3g} >= 2x boot floor {floor:.3g}"], details)
