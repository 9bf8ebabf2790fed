"""A/B across boots: an env toggle needs a restart, so each arm is booted ``boots`` times
(interleaved A B A B ... so drift hits both arms), a short ladder runs on each boot, and the
effect is read against the measured boot-to-boot floor (fairness.ab_verdict).

The server command (default ``bash start_qwen.sh``) gets the knob in its environment.
"""
from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

from . import fairness, provenance
from . import prompts as P
from .results import ResultFile
from .runner import Target, ladder
from .server import ServerProcess

FIGURES = ("aggregate_tps", "per_stream_decode_tps", "ttft_mean")


def run_ab(t: Target, server_cmd: str, knob: str, value_a: str, value_b: str, boots: int = 2,
           pset: P.PromptSet | None = None, ns: tuple[int, ...] = (1,), max_tokens: int = 128,
           reps: int = 1, figure: str = "per_stream_decode_tps", boot_timeout: float = 600.0) -> dict:
    if figure not in FIGURES:
        raise ValueError(f"figure {figure!r} invalid; valid: {', '.join(FIGURES)}")
    if boots < 1:
        raise ValueError("boots must be >= 1")
    pset = pset or P.load("prose")
    prov = provenance.build(argv=t.argv, prompt_set=pset.record(), sampling=t.sampling,
                            warmup={"policy": "per boot, see arm results", "discarded": t.warmup},
                            server={"url": t.url, "model": t.model}, max_tokens=max_tokens)
    result: dict[str, Any] = {"kind": "ab", "label": t.label, "provenance": prov,
                              "data": {"knob": knob, "a": value_a, "b": value_b, "boots": boots,
                                       "figure": figure, "server_cmd": server_cmd, "per_boot": []}}
    rf = ResultFile(t.out_dir, "ab", result, label=t.label)
    arms: dict[str, list[float]] = {"A": [], "B": []}
    arm_results: dict[str, list[dict]] = {"A": [], "B": []}
    try:
        for boot in range(boots):
            for arm, value in (("A", value_a), ("B", value_b)):
                log = Path(t.out_dir) / f"ab-server-{arm}{boot}.log"
                tt = dataclasses.replace(t, label=f"{t.label or 'ab'}-{arm}{boot}",
                                         server_config={knob: value, "server_cmd": server_cmd})
                # the launcher's boot warm-up (WARMUP) off unless it is the knob: it would run beside
                # the first measured requests
                srv = ServerProcess(server_cmd, env={"WARMUP": "0", knob: value}, log_path=log)
                try:
                    srv.start()
                    boot_s = srv.wait_healthy(t.url, boot_timeout)
                    res = ladder(tt, pset, list(ns), max_tokens, reps)
                finally:
                    srv.stop()
                lv = ((res.get("data") or {}).get("levels") or [{}])[0]
                fig = lv.get(figure)
                result["data"]["per_boot"].append({"arm": arm, "boot": boot, "value": value,
                                                   "figure": fig, "boot_s": boot_s,
                                                   "result": res.get("path"), "verdict": res.get("verdict")})
                arm_results[arm].append(res)
                if fig is not None and res.get("verdict") == "VALID":
                    arms[arm].append(float(fig))
                rf.save()
        cmp = [fairness.compare(a, b, knob=knob) for a, b in zip(arm_results["A"], arm_results["B"])]
        v = fairness.ab_verdict(arms["A"], arms["B"], knob, cmp)
        result["data"]["verdict"] = v.as_dict()
    except Exception as exc:  # noqa: BLE001
        rf.abort(f"aborted: {type(exc).__name__}: {exc}")
        result["path"] = str(rf.path)
        return result
    ok = v.status == "RESOLVED"
    rf.finish("VALID" if ok else v.status, v.reasons)
    result["path"] = str(rf.path)
    return result
