"""verify.sh: offline checks on this environment, model directory completeness, the live checks
against the fake OpenAI server, and the exit status rule (1 on any FAIL)."""
from __future__ import annotations

import io
import json
import subprocess
import sys

from onecard import verify
from tests.conftest import REPO
from tests.fake_openai_server import FakeServer


def test_model_dir_problems(tmp_path):
    assert set(verify.model_dir_problems(tmp_path)) == {
        "config.json missing", "no tokenizer.json / tokenizer.model", "no *.safetensors weights"}
    (tmp_path / "config.json").write_text("{}")
    (tmp_path / "tokenizer.json").write_text("{}")
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps(
        {"weight_map": {"a": "model-00001-of-00002.safetensors", "b": "model-00002-of-00002.safetensors"}}))
    (tmp_path / "model-00001-of-00002.safetensors").write_bytes(b"x")
    assert verify.model_dir_problems(tmp_path) == [
        "1 of 2 shards missing (first: model-00002-of-00002.safetensors)"]
    (tmp_path / "model-00002-of-00002.safetensors").write_bytes(b"x")
    assert verify.model_dir_problems(tmp_path) == []


def test_a_crashing_check_is_a_fail_not_a_crash():
    def broken(ctx):
        raise RuntimeError("boom")

    out = io.StringIO()
    (res,) = verify.run_checks([broken], {}, out=out)
    assert res.status == verify.FAIL and "boom" in res.detail
    assert out.getvalue().startswith("FAIL broken")


def test_missing_model_fails_with_the_fix(tmp_path):
    res = verify.check_model({"model": str(tmp_path / "nope")})
    assert res.status == verify.FAIL and "install.sh --model" in res.detail


def test_offline_run_on_this_environment(vllm_dir):
    """In the test environment vLLM is pristine: the patches check must FAIL and the exit be 1."""
    out = subprocess.run([sys.executable, "-m", "onecard.verify", "--no-server"], capture_output=True,
                         text=True, cwd=REPO, timeout=300)
    lines = out.stdout.splitlines()
    assert out.returncode == 1
    assert any(l.startswith("PASS vllm ") and "0.27.1" in l for l in lines)
    assert any(l.startswith("FAIL patches") and "onecard patches apply" in l for l in lines)
    assert lines[-1].endswith("failed") and " 1 failed" in lines[-1]


def test_offline_run_on_the_patched_view(patched_site):
    out = subprocess.run([sys.executable, "-m", "onecard.verify", "--no-server", "--vllm-dir",
                          str(patched_site / "vllm")], capture_output=True, text=True, cwd=REPO, timeout=300)
    assert "PASS patches" in out.stdout and "PASS vllm files" in out.stdout


def test_live_checks_against_a_server(monkeypatch):
    monkeypatch.setattr(verify, "_smi_rows", lambda args: None)   # no GPU figures here, even on a GPU host
    with FakeServer() as srv:
        ctx = {"url": srv.url, "headers": {}}
        results = verify.run_checks(verify.LIVE_CHECKS, ctx, out=io.StringIO())
    assert [r.status for r in results] == [verify.PASS, verify.PASS, verify.PASS, verify.PASS]
    assert "usage.completion_tokens" in results[1].detail
    assert results[2].name == "speculation"   # the fake's counters (its plain completions draft nothing)
    assert results[3].name == "preemptions" and results[3].detail.startswith("none since the start")


def test_live_preemptions_warn(monkeypatch):
    import httpx

    calls = []

    def get(url, **kw):
        calls.append(url)
        return httpx.Response(200, text='# TYPE vllm:num_preemptions counter\nvllm:num_preemptions_total{engine="0"} 2\n',
                              request=httpx.Request("GET", url))

    monkeypatch.setattr(httpx, "get", get)
    ctx = {"url": "http://x", "headers": {}}
    r = verify.check_live_preemptions(ctx)
    assert r.status == verify.WARN and "preempted 2 time(s)" in r.detail and "MAX_SEQS" in r.detail
    assert verify.check_live_spec(ctx) is None and len(calls) == 1   # one /metrics fetch per verify run


def test_live_spec_check_warns_when_nothing_is_accepted_and_skips_without_speculation(monkeypatch):
    import httpx

    def serve(text):
        monkeypatch.setattr(httpx, "get", lambda url, **kw: httpx.Response(200, text=text, request=httpx.Request("GET", url)))

    base = "# TYPE vllm:spec_decode_num_drafts counter\nvllm:spec_decode_num_drafts_total{{engine=\"0\"}} {d}\n" \
           "# TYPE vllm:spec_decode_num_accepted_tokens counter\nvllm:spec_decode_num_accepted_tokens_total{{engine=\"0\"}} {a}\n"
    ctx = {"url": "http://x", "headers": {}}   # copied per call: a verify run fetches /metrics once
    serve(base.format(d=200, a=0))
    r = verify.check_live_spec(dict(ctx))
    assert r.status == verify.WARN and "no draft token accepted in 200 drafts" in r.detail and "DRAFT_QUANT=bf16" in r.detail
    serve(base.format(d=100, a=150) + "# TYPE vllm:spec_decode_num_accepted_tokens_per_pos counter\n"
          + "".join(f'vllm:spec_decode_num_accepted_tokens_per_pos_total{{engine="0",position="{i}"}} {v}\n'
                    for i, v in enumerate((80, 50, 20))))
    r = verify.check_live_spec(dict(ctx))
    assert r.status == verify.PASS and r.detail.startswith("2.50 tokens per verify step over 100 drafts")
    assert "acceptance by position: 0.80, 0.50, 0.20" in r.detail
    serve(base.format(d=5, a=0))          # too few drafts to judge
    assert verify.check_live_spec(dict(ctx)).status == verify.PASS
    serve(base.format(d=0, a=0))
    assert "no drafts yet" in verify.check_live_spec(dict(ctx)).detail
    serve("# TYPE vllm:num_requests_running gauge\nvllm:num_requests_running{engine=\"0\"} 0\n")
    assert verify.check_live_spec(dict(ctx)) is None   # SPEC=off: no speculation counters


def test_live_checks_without_a_server(monkeypatch):
    monkeypatch.setattr(verify, "_smi_rows", lambda args: None)
    ctx = {"url": "http://127.0.0.1:9", "headers": {}}
    results = verify.run_checks(verify.LIVE_CHECKS, ctx, out=io.StringIO())
    assert results[0].status == verify.FAIL and results[1].status == verify.FAIL
    assert results[2].name == "speculation" and results[2].status == verify.WARN   # /metrics unreadable


# --------------------------------------------------------------------------- flash-attn verdict

def test_flash_attention_verdicts():
    from onecard.verify import PASS, WARN, flash_attention_verdict as v

    assert v({"cuda": False}) is None
    r = v({"cuda": True, "cap": [8, 6], "fa": {"2": [True, None], "3": [False, "needs 9.x"]}})
    assert r.status == PASS and "sm_86: FA2" in r.detail
    r = v({"cuda": True, "cap": [9, 0], "fa": {"2": [True, None], "3": [True, None]}})
    assert r.status == PASS and r.detail == "sm_90: FA3"
    r = v({"cuda": True, "cap": [9, 0], "fa": {"2": [True, None], "3": [False, "undefined symbol: x"]}})
    assert r.status == WARN and "undefined symbol: x" in r.detail and "CUDA_CACHE_MAXSIZE" in r.detail
    assert "\n" not in r.detail
    r = v({"cuda": True, "cap": [8, 9], "fa": {"2": [False, "not built"], "3": [False, "x"]}})
    assert r.status == WARN and "not built" in r.detail


def test_flash_attention_check_runs_without_a_gpu():
    """On a machine without a CUDA GPU (CI) the check has nothing to say, or warns; never fails."""
    from onecard.verify import FAIL, check_flash_attention

    r = check_flash_attention({})
    assert r is None or r.status != FAIL


def test_plan_check_runs_the_launchers_own_plan(monkeypatch, vllm_dir):
    """check_plan: PASS with the plan's sizes; FAIL with the launcher's one-line refusal."""
    for k in ("CTX", "SPEC", "KV_MEM", "MAX_LEN", "MODEL", "CARD_GIB"):
        monkeypatch.delenv(k, raising=False)
    monkeypatch.setenv("CARD_GIB", "24")
    res = verify.check_plan({})
    assert res.status == verify.PASS and "CTX=fast SPEC=mtp: MAX_LEN 65,536" in res.detail
    assert "on a 24 GiB card (CARD_GIB)" in res.detail
    monkeypatch.setenv("CARD_GIB", "abc")
    res = verify.check_plan({})
    assert res.status == verify.FAIL and res.detail.startswith("CARD_GIB='abc' is not a number")


def test_plan_check_warns_when_the_card_lowered_the_pin(monkeypatch):
    import json as _json
    import types

    plan = {"values": {"CTX": {"value": "long"}, "SPEC": {"value": "dflash2"}, "MAX_LEN": {"value": 48384},
                       "MAX_SEQS": {"value": 4},
                       "KV_MEM": {"value": 3906 * 2**20, "source": "cap",
                                  "reason": "the profile's pin 4.95 GiB does not fit the 24 GiB card (CARD_GIB)"}}}
    monkeypatch.setenv("CARD_GIB", "24")
    monkeypatch.setattr(verify.subprocess, "run", lambda *a, **k: types.SimpleNamespace(
        returncode=0, stdout=_json.dumps(plan), stderr=""))
    res = verify.check_plan({})
    assert res.status == verify.WARN and "KV_MEM 3906M" in res.detail and "VRAM_CHECK=0" in res.detail


def test_plan_check_warns_when_only_the_estimate_is_over(monkeypatch):
    import json as _json
    import types

    plan = {"values": {"CTX": {"value": "long"}, "SPEC": {"value": "dflash2"}, "MAX_LEN": {"value": 70912},
                       "MAX_SEQS": {"value": 4}, "KV_MEM": {"value": 5309988864, "source": "profile", "reason": ""}},
            "prediction": {"vram": {"fits": False, "total": int(25.13 * 2**30), "certain": int(23.13 * 2**30),
                                    "card_bytes": 24 * 2**30, "kv_max": 3906 * 2**20 + 5}}}
    monkeypatch.setenv("CARD_GIB", "24")
    monkeypatch.setattr(verify.subprocess, "run", lambda *a, **k: types.SimpleNamespace(
        returncode=0, stdout=_json.dumps(plan), stderr=""))
    res = verify.check_plan({})
    assert res.status == verify.WARN and res.detail.endswith("if it runs out of GPU memory, KV_MEM <= 3906M")
    # with the embedding table's size known and EMBED_HOST off, the other way under the card too
    plan["values"]["EMBED_HOST"] = {"value": "0"}
    plan["prediction"]["embed_bytes"] = 1272391680
    res = verify.check_plan({})
    assert res.detail.endswith("KV_MEM <= 3906M, or EMBED_HOST=1 (1.19 GiB less; not yet run on a GPU)")


def test_plan_check_without_a_server_fits_what_other_processes_leave(monkeypatch):
    """--no-server (no url in ctx): the card is nvidia-smi's less what other processes hold now,
    as at a real launch, and the plan line says so; a driver's few MiB are not counted; with a
    server to check (url set) the card is the whole GPU (part of what is in use is that server)."""
    import json as _json
    import types

    from onecard import plan as P

    seen = []
    plan = {"values": {"CTX": {"value": "long"}, "SPEC": {"value": "off"}, "MAX_LEN": {"value": 131072},
                       "MAX_SEQS": {"value": 4}, "KV_MEM": {"value": 5309988864, "source": "profile", "reason": ""}}}
    monkeypatch.delenv("CARD_GIB", raising=False)
    monkeypatch.setattr(P, "card_memory", lambda env, probe=True: (24576 * 2**20, "nvidia-smi: GPU 0, 24,576 MiB"))
    monkeypatch.setattr(verify.subprocess, "run", lambda *a, **k: seen.append(k["env"]["CARD_GIB"]) or
                        types.SimpleNamespace(returncode=0, stdout=_json.dumps(plan), stderr=""))
    for used, ctx, card, src in ((700, {}, "23.32", "nvidia-smi, less 700 MiB in use by other processes"),
                                 (5, {}, "24.00", "nvidia-smi)"),
                                 (700, {"url": "http://127.0.0.1:18020"}, "24.00", "nvidia-smi)")):
        monkeypatch.setattr(P, "card_in_use", lambda env, probe=True, used=used: (used * 2**20, "nvidia-smi"))
        res = verify.check_plan(ctx)
        assert res.status == verify.PASS and seen[-1] == card and f"GiB card ({src}" in res.detail, res.detail


def test_no_model_named_checks_the_launchers_default(tmp_path, monkeypatch):
    """Without --model / $MODEL, verify looks where ./start_qwen.sh would (MODEL's default,
    models/qwen38-27b in the repository) and warns, naming the install command, when it is
    not there; a tiny MODEL in .env passes (built at the first start)."""
    monkeypatch.delenv("MODEL", raising=False)
    monkeypatch.setattr(verify, "_launcher_default_model", lambda: ("models/qwen38-27b", tmp_path / "none"))
    res = verify.check_model({})
    assert res.status == verify.WARN and "./install.sh --model dbirks/Qwen3.8-27B-W4A16-AutoRound" in res.detail
    monkeypatch.setattr(verify, "_launcher_default_model", lambda: ("tiny", tmp_path / "tiny"))
    assert verify.check_model({}).status == verify.PASS


def test_live_memory_sums_the_vllm_processes_and_names_the_prediction(monkeypatch, tmp_path):
    """check_live_memory: nvidia-smi's per-process figures summed over the processes whose command
    line names vLLM (the API server and its engine core, not a desktop's), with the card's free
    memory and the plan's prediction; None for a server elsewhere or without nvidia-smi; a WARN
    when no vLLM process shows a figure."""
    from onecard import plan as P

    smi = {"--query-gpu=uuid,index,name,memory.total,memory.used":
           "GPU-aaaa, 0, NVIDIA GeForce RTX 3090, 24576, 24010\n",
           "--query-compute-apps=gpu_uuid,pid,used_memory":
           "GPU-aaaa, 101, 320\nGPU-aaaa, 102, 23100\nGPU-aaaa, 103, 500\nGPU-aaaa, 104, [N/A]\n"}
    monkeypatch.setattr(P, "_nvidia_smi", lambda args: (smi[args[0]], ""))
    for pid, cmd in ((101, b"python\0-m\0vllm.entrypoints.cli.main\0serve"), (102, b"VLLM::EngineCore"),
                     (103, b"/usr/bin/Xorg"), (104, b"vllm")):
        (tmp_path / str(pid)).mkdir()
        (tmp_path / str(pid) / "cmdline").write_bytes(cmd)
    ctx = {"url": "http://127.0.0.1:18020", "headers": {},
           "plan_doc": ({"prediction": {"vram": {"total": 24_357 * 2**20}}}, {}, "", "")}
    r = verify.check_live_memory(ctx, proc=tmp_path)
    assert r.status == verify.PASS and r.name == "gpu memory"
    assert "GPU 0 (NVIDIA GeForce RTX 3090, 24,576 MiB): vLLM holds 23,420 MiB in 2 process(es), 566 MiB free" in r.detail
    assert "predicts 24,357 MiB" in r.detail
    assert verify.check_live_memory({**ctx, "url": "http://10.0.0.5:18020"}, proc=tmp_path) is None
    smi["--query-compute-apps=gpu_uuid,pid,used_memory"] = "GPU-aaaa, 103, 500\n"
    assert verify.check_live_memory(ctx, proc=tmp_path).status == verify.WARN
    monkeypatch.setattr(P, "_nvidia_smi", lambda args: (None, "no nvidia-smi"))
    assert verify.check_live_memory(ctx, proc=tmp_path) is None
