"""GPU job 41 (gpu/jobs/41-fit.sh, driver gpu/lib/fit.py) on the CPU: its contract, FIT_CASES refused
before any boot, nvidia-smi's per-process rows summed per server session (real /proc sessions),
vLLM 0.27.1's own memory lines (rendered from vLLM's source and patch 0080) parsed, the derived
figures and table, the dry run, and a whole run against a fake launcher, a fake nvidia-smi and a
fake context probe. Nothing here imports vLLM or torch."""
from __future__ import annotations

import importlib.util
import json
import os
import re
import shlex
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.conftest import check_job_contract

REPO = Path(__file__).resolve().parents[1]
JOB = REPO / "gpu" / "jobs" / "41-fit.sh"
DRIVER = REPO / "gpu" / "lib" / "fit.py"

_spec = importlib.util.spec_from_file_location("fit", DRIVER)
fit = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(fit)


def test_job_contract():
    text = check_job_contract(JOB, r"python3 gpu/lib/fit\.py")
    assert int(re.search(r"^# timeout: (\d+)$", text, re.M).group(1)) <= 540
    assert "EXTRA_ARGS" not in text     # the servers get the launcher's argv as a user does (CUDA graphs on)
    # KVarN only when a huge case is asked for, after the cases were checked
    assert re.search(r'case "\$\{FIT_CASES:-\}" in\n\s+\*huge-\*\) kvarn_site', text)
    assert text.index("--check-cases") < text.index("kvarn_site ||") < text.index("run_driver fit")


def test_driver_imports_no_vllm_or_torch():
    code = (f"import importlib.util, sys; s = importlib.util.spec_from_file_location('fit', {str(DRIVER)!r}); "
            "m = importlib.util.module_from_spec(s); s.loader.exec_module(m); "
            "print([n for n in sys.modules if n.split('.')[0] in ('torch', 'vllm', 'triton')])")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0 and out.stdout.strip() == "[]", out.stdout + out.stderr


def test_parse_cases():
    assert fit.parse_cases(None) == ["long-dflash2", "fast-dflash2", "long-mtp", "long-off"]
    assert fit.parse_cases("long-off,huge-mtp long-off") == ["long-off", "huge-mtp"]
    assert fit.needs_kvarn(["long-off", "huge-mtp"]) and not fit.needs_kvarn(fit.parse_cases(None))
    for bad, what in (("long-dflash2 bogus", "'bogus' is not a case"), ("", "FIT_CASES is empty"),
                      ("a b", "'a', 'b' are not cases")):
        with pytest.raises(fit.CaseError) as e:
            fit.parse_cases(bad)
        msg = str(e.value)
        assert what in msg and "\n" not in msg
        assert "valid: long-dflash2 long-dflash2-bf16 fast-dflash2 long-mtp long-off huge-dflash2 huge-mtp" in msg


def test_bad_cases_refused_before_any_boot(tmp_path):
    out = tmp_path / "out"
    env = dict(os.environ, FIT_CASES="long-dflash2 huge-off", JOB_OUT=str(out), MODELS=str(tmp_path / "m"),
               ONECARD_TREE_REV="abc1234")
    r = subprocess.run(["bash", str(JOB)], cwd=REPO, env=env, capture_output=True, text=True, timeout=60)
    assert r.returncode == 2, r.stdout + r.stderr
    lines = [ln for ln in r.stdout.splitlines() if "FIT_CASES" in ln]
    assert lines == ["41-fit: FIT_CASES: 'huge-off' is not a case; valid: long-dflash2 long-dflash2-bf16 fast-dflash2 long-mtp "
                     "long-off huge-dflash2 huge-mtp long-dflash2-es long-dflash2-eh long-dflash2-gd0 long-dflash2-ring, each also with -cap (space- or comma-separated; default: long-dflash2 "
                     "fast-dflash2 long-mtp long-off)"], r.stdout
    assert not list(out.glob("server-*.log")) and not (out / "run.txt").exists()
    assert "== 41-fit: FAIL (rc=2)" in r.stdout


def test_check_cases_cli():
    r = subprocess.run([sys.executable, str(DRIVER), "--check-cases", "--cases", "huge-dflash2,long-off"],
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 0 and "cases: huge-dflash2 long-off (KVarN" in r.stdout


def test_sum_by_session_over_real_sessions(tmp_path):
    """Two servers in sessions of their own, each with a child (vLLM's EngineCore); nvidia-smi's rows
    name their pids and a stranger's: each server's sum is its own processes' only."""
    code = ("import subprocess, sys, time; c = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(60)']); "
            "print(c.pid, flush=True); time.sleep(60)")
    procs = [subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True, start_new_session=True)
             for _ in range(2)]
    try:
        kids = [int(p.stdout.readline()) for p in procs]
        (a, b), (ka, kb) = [p.pid for p in procs], kids
        assert fit.proc_session(ka) == a and fit.proc_session(kb) == b and fit.proc_session(2**22 + 7) is None
        smi = f"{a}, 300\n{ka}, 20000\n{b}, [N/A]\n{kb}, 18000\n{os.getpid()}, 5000\n"
        sums = fit.sum_by_session(fit.parse_compute_apps(smi), {a, b}, fit.proc_session)
        assert sums[a] == {"mib": 20300, "pids": [a, ka], "na": 0}
        assert sums[b] == {"mib": 18000, "pids": [b, kb], "na": 1}
        smp = fit.Sampler(0.01, lambda: smi)
        smp.watch("a", a)
        smp.watch("b", b, "decode")
        smp.tick()
        assert smp.stats["a"]["peak_mib"] == 20300 and smp.stats["a"]["procs"] == 2
        assert smp.stats["a"]["neighbours"] == 1 and smp.stats["b"]["phases"]["decode"]["peak_mib"] == 18000
    finally:
        for p in procs:
            os.killpg(p.pid, signal.SIGKILL)
            p.wait()


def test_parse_compute_apps_edge_cases():
    assert fit.parse_compute_apps("") == []
    assert fit.parse_compute_apps("No running processes found\n") == []
    assert fit.parse_compute_apps(" 12, 34 \n13, [N/A]\nbad line\n") == [(12, 34), (13, None)]


# the vLLM 0.27.1 (and patch 0080) message each pattern reads: (the first literal, how many
# consecutive string literals the message spans, the parsed field that must appear)
MESSAGES = {
    "model_loading": ("Model loading took %s GiB memory and %.6f seconds", 1, "model_loading_gib"),
    "kv_reserved": ("Initial free memory {format_gib(self.init_snapshot.free_memory)} ", 3, "kv_reserved_gib"),
    "available_kv": ("Available KV cache memory: %s GiB", 1, "available_kv_gib"),
    "kv_tokens": ("GPU KV cache size: %s tokens", 1, "kv_tokens"),
    "max_concurrency": ("Maximum concurrency for %s tokens per request: %.2fx", 1, "max_concurrency"),
    "graph_capture": ("Graph capturing finished in %.0f secs, took %.2f GiB", 1, "graph_capture_gib"),
    "graph_estimate": ("Estimated CUDA graph memory: %.2f GiB total", 1, "graph_estimate_gib"),
    "graph_pool": ("CUDA graph pool memory: %s GiB (actual), %s GiB (estimated), ", 2, "graph_pool_gib"),
    "profiling": ("Memory profiling takes {self.profile_time:.2f} seconds. ", 8, "profiling"),
    "usage": ("Actual usage is {format_gib(self.total_consumed)} ", 5, "usage"),
    "dflash2_ring": ("DFlash2 ring mode: %d ring tensors %s, %.1f MiB beside the KV pool", 1, "dflash2_ring_mib"),
    "dflash2_lane": ("DFlash2 lookup lane on the device: %.2f MiB of token history", 1, "dflash2_lane_mib"),
}
LITERAL = re.compile(r'f?"((?:[^"\\]|\\.)*)"')


def render(source: str, first: str, n: int) -> str:
    """The message as vLLM prints it: n string literals from the one that is ``first``, joined,
    every {expression} and %-conversion filled with 7."""
    start = source.index(f'"{first}"')
    lits = [m.group(1) for m in LITERAL.finditer(source, start - 1)][:n]
    text = "".join(lits)
    text = re.sub(r"\{[^{}]*\}", "7", text)
    text = re.sub(r"%(?:\.\d+)?[sdf]", "7", text)
    return text.replace("%%", "%")


def test_log_patterns_read_vllms_own_lines(vllm_dir):
    assert set(MESSAGES) == set(fit.LOG_PATTERNS) == set(fit.LOG_SOURCES)
    for key, (where, fragments) in fit.LOG_SOURCES.items():
        path = (REPO / "patches" / where.split(":", 1)[1]) if where.startswith("patch:") else vllm_dir / where
        source = path.read_text()
        for frag in fragments:
            assert frag in source, (key, frag, path)
        first, n, field = MESSAGES[key]
        line = f"(EngineCore_DP0 pid=4242) INFO 12-05 10:00:00 [x.py:1] {render(source, first, n)}"
        parsed = fit.parse_vllm_log(line)
        assert field in parsed, (key, line)
    assert fit.parse_vllm_log("torch.OutOfMemoryError: CUDA out of memory. Tried to allocate")["oom"]


def test_self_check_cli():
    r = subprocess.run([sys.executable, str(DRIVER), "--self-check"], capture_output=True, text=True, timeout=60)
    assert r.returncode == 0 and r.stdout.splitlines()[-1] == "[fit] self-check PASS", r.stdout


def test_derive_and_table():
    rec = {"name": "long-dflash2", "measured": True, "peak_mib": 25000, "procs": 2,
           "plan": {"values": {"MAX_LEN": 70912, "MAX_SEQS": 4, "KV_MEM": 5000 * fit.MiB},
                    "vram": {"total": 28_000 * fit.MiB, "certain": 26_000 * fit.MiB, "reserves": 2560 * fit.MiB},
                    "prepared_vram": {"total": 25_300 * fit.MiB}}}
    d = rec["derived"] = fit.derive(rec, 600.0, 512.0)
    assert d["est_3090_mib"] == 25000 - 2 * 88 and d["layout_diff_mib"] == 2700
    assert d["est_prepared_mib"] == 25000 - 176 - 2700 == 22124
    assert d["verdict"] == {"fits": True, "margin_mib": 2452, "text": "fits, 2,452 MiB spare"}
    assert d["reserves_measured_mib"] == 25000 - (28000 - 2560) and d["diff_mib"] == -3000
    gone = {"name": "long-off", "measured": False, "error": "plan: no", "plan": {"values": {}}}
    gone["derived"] = fit.derive(gone, 600.0, 512.0)
    assert gone["derived"]["verdict"]["fits"] is None
    text = fit.render_table([rec, gone], {"context": {"context_mib": 600, "context_cublas_mib": 640,
                                                      "device": "NVIDIA H200"}, "ctx_3090_mib": 512.0,
                                          "ctx_3090_source": "onecard.memory.CUDA_CONTEXT"})
    rows = {ln.split()[0]: ln for ln in text.splitlines() if ln.startswith(("long-dflash2", "long-off"))}
    assert "25,000 (2)" in rows["long-dflash2"] and rows["long-dflash2"].endswith("fits, 2,452 MiB spare")
    assert "NOT MEASURED: plan: no" in rows["long-off"]
    assert "H200 bare CUDA context (torch.zeros(1) process, nvidia-smi): 600 MiB" in text
    assert "an ESTIMATE" in text and "not on a 3090" in text
    # the pin that leaves 256 MiB of 24 GiB free: 2,452 MiB spare - 256 more KV
    assert d["kv_pin_fit_mib"] == 5000 + 2452 - 256
    assert "long-dflash2      KV_MEM 5,000 MiB -> 7,196 MiB (+2,196): KV_MEM=7168M" in text
    assert gone["derived"]["kv_pin_fit_mib"] is None


def test_workload_and_waves():
    assert fit.workload_sizes(70912, 4, 0.5) == {"prefill_tokens": 35456, "batch": 4}
    assert fit.workload_sizes(1000, 2, 1.0) == {"prefill_tokens": 1000 - 64 - 16, "batch": 2}
    ids = fit.prompt_ids(500, 248320, 3)
    assert len(ids) == 500 and min(ids) >= 1000 and max(ids) < 150_000 and ids == fit.prompt_ids(500, 248320, 3)
    assert fit.boot_waves([("a", 50), ("b", 50), ("c", 50)], 120) == [["a", "b"], ["c"]]
    assert fit.boot_waves([("a", 500)], 120) == [["a"]]


def test_dry_run_prints_the_3090_plans(tmp_path):
    env = dict(os.environ, MODELS=str(tmp_path / "models"), FIT_CASES="long-dflash2 long-dflash2-gd0")
    env.pop("FIT_MODEL", None)
    r = subprocess.run([sys.executable, str(DRIVER), "--dry-run", "--out", str(tmp_path / "out")], cwd=REPO,
                       env=env, capture_output=True, text=True, timeout=180)
    assert r.returncode == 0, r.stdout + r.stderr
    out = r.stdout
    # the default GDN_DEFER=auto -> 1: docs/profiles.md's CTX=long SPEC=dflash2 row (FP8 drafter, the
    # 32 MB verify scratch); long-dflash2-gd0: the same pin on stock GDN states (GDN_DEFER=0)
    assert "[fit] case long-dflash2: CTX=long SPEC=dflash2 KV=int8_per_token_head MAX_LEN 90,368 MAX_SEQS 4" in out
    assert "predicted 23.78 GiB" in out
    assert "[fit] case long-dflash2-gd0: CTX=long SPEC=dflash2 KV=int8_per_token_head MAX_LEN 67,840 MAX_SEQS 4" in out
    assert "predicted 23.49 GiB" in out   # both with the reserves job 41 measured (memory.RESERVES_MEASURED)
    argv = next(ln for ln in out.splitlines() if "argv:" in ln)
    assert "--gpu-memory-utilization 0.1 " in argv and "--kv-cache-memory-bytes" in argv
    assert "--enforce-eager" not in argv and "--port" in argv and '"method":"dflash2"' in argv
    assert "workload: 1 request of 45,184 prompt ids + 64 tokens, then 4 x (128 + 64) at once" in out
    assert "workload: 1 request of 33,920 prompt ids + 64 tokens, then 4 x (128 + 64) at once" in out   # gd0
    assert out.rstrip().endswith("[fit] dry run PASS")


def geometry_checkpoint(root: Path) -> Path:
    """A header-only stand-in for job 20's checkpoint: the 27B geometry's config.json and one
    safetensors header with its tensors (bf16 lm_head / embed / MTP, as job 20 writes them)."""
    import struct

    from onecard import memory
    from onecard.prepare import geometry, tiny

    ids = {t: i for i, t in enumerate(tiny.SPECIAL_TOKENS + tiny.PLAIN_ADDED_TOKENS + tiny.VISION_TOKENS)}
    d = root / "qwen38-27b-geom"
    d.mkdir(parents=True)
    (d / "config.json").write_text(json.dumps(geometry.make_config(geometry.spec_for("27b"), ids, "27b", 1000)))
    hdr, off = {}, 0
    for name, nbytes in memory.layout_27b_tensors(head_bytes=2):
        hdr[name] = {"dtype": "U8", "shape": [nbytes], "data_offsets": [off, off + nbytes]}
        off += nbytes
    raw = json.dumps(hdr).encode()
    (d / "model.safetensors").write_bytes(struct.pack("<Q", len(raw)) + raw)
    return d


def test_geometry_checkpoint_gets_the_products_plan(tmp_path):
    """The geometry's bf16 head puts a dflash2 plan's certain part over 24 GiB: with the default
    VRAM_CHECK=1 the preflight would lower the pin (or refuse); the job's VRAM_CHECK=0 keeps the
    profile's pin, MAX_LEN and MAX_SEQS, equal to the prepared 27B's plan (docs/profiles.md)."""
    geometry_checkpoint(tmp_path / "models")
    env = dict(os.environ, MODELS=str(tmp_path / "models"), FIT_CASES="long-dflash2")
    env.pop("FIT_MODEL", None)
    r = subprocess.run([sys.executable, str(DRIVER), "--dry-run", "--out", str(tmp_path / "out")], cwd=REPO,
                       env=env, capture_output=True, text=True, timeout=180)
    assert r.returncode == 0, r.stdout + r.stderr
    # (the default GDN_DEFER=auto -> 1: MAX_LEN 90,368 at the pin, + its 0.03 GiB verify scratch)
    assert "MAX_LEN 90,368 MAX_SEQS 4 KV_MEM 4.95 GiB" in r.stdout and "no checkpoint" not in r.stdout
    pred = re.search(r"predicted ([\d.]+) GiB .*; prepared 27B layout ([\d.]+) GiB", r.stdout)
    assert pred and float(pred.group(1)) > 25.5 and float(pred.group(2)) == 23.78, r.stdout
    assert "dflash2_draft_quant" in r.stdout   # DRAFT_QUANT=auto: fp8 for both layouts on 24 GiB
    # the same case with the drafter as stored (DRAFT_QUANT=bf16): 1.44 GiB more
    env["FIT_CASES"] = "long-dflash2-bf16"
    r = subprocess.run([sys.executable, str(DRIVER), "--dry-run", "--out", str(tmp_path / "out2")], cwd=REPO,
                       env=env, capture_output=True, text=True, timeout=180)
    assert r.returncode == 0, r.stdout + r.stderr
    pred = re.search(r"predicted ([\d.]+) GiB .*; prepared 27B layout ([\d.]+) GiB", r.stdout)
    assert pred and float(pred.group(2)) == 25.26 and "dflash2_draft_quant" not in r.stdout, r.stdout
    assert "FAIL" not in r.stdout


# ----------------------------------------------------------------------------- a whole run, faked

FAKE_SERVER = r'''
import http.server, json, os, subprocess, sys, threading, time
d = os.environ["FAKE_SMI_DIR"]
def reg(pid, mib):
    tmp = os.path.join(d, f".{pid}.{threading.get_ident()}")
    open(tmp, "w").write(str(mib))
    os.replace(tmp, os.path.join(d, str(pid)))
if os.environ.get("FAKE_CRASH_SPEC") == os.environ["SPEC"]:
    print("Traceback (most recent call last):\nValueError: boom", flush=True)
    sys.exit(1)
engine = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"])
reg(os.getpid(), 300)
reg(engine.pid, 20000)
print("(EngineCore_DP0 pid=%d) INFO [gpu_model_runner.py:5406] Model loading took 16.83 GiB memory and 4.5 seconds" % engine.pid)
print("(EngineCore_DP0 pid=%d) INFO [kv_cache_utils.py:2235] GPU KV cache size: 146,915 tokens" % engine.pid)
print("(EngineCore_DP0 pid=%d) INFO [gpu_model_runner.py:6914] Graph capturing finished in 9 secs, took 0.11 GiB" % engine.pid, flush=True)
class H(http.server.BaseHTTPRequestHandler):
    def do_GET(self):
        self.send_response(200 if self.path == "/health" else 404)
        self.end_headers()
    def do_POST(self):
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        n = len(body["prompt"])
        reg(engine.pid, 21000 if n > 1000 else 20500)
        time.sleep(0.8 if n > 1000 else 0.4)
        reg(engine.pid, 20000)
        out = json.dumps({"choices": [{"text": ""}], "usage": {"prompt_tokens": n, "completion_tokens": body["max_tokens"]}}).encode()
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(out)))
        self.end_headers()
        self.wfile.write(out)
    def log_message(self, *a):
        pass
http.server.ThreadingHTTPServer(("127.0.0.1", int(os.environ["PORT"])), H).serve_forever()
'''
FAKE_SMI = r'''
import os, sys
d = os.environ["FAKE_SMI_DIR"]
if any(a.startswith("--query-gpu") for a in sys.argv):
    print("NVIDIA H200, 143771, 1000, 142771")
    sys.exit(0)
for f in os.listdir(d):
    if not f.startswith(".") and os.path.exists(f"/proc/{f}"):
        print(f"{f}, {open(os.path.join(d, f)).read().strip()}")
'''
PROBE = "import json; print(json.dumps({'pid': 1, 'context_mib': 540, 'context_cublas_mib': 566, 'device': 'NVIDIA H200'}))"


def fake_run(tmp_path, monkeypatch, cases: str, crash_spec: str = "") -> tuple[int, Path, str]:
    from onecard.dflash.tiny_drafter import build_geometry_drafter

    smi_dir = tmp_path / "smi"
    smi_dir.mkdir()
    server = tmp_path / "fake_server.py"
    server.write_text(FAKE_SERVER)
    smi = tmp_path / "nvidia-smi"
    smi.write_text(f"#!{sys.executable}\n" + FAKE_SMI)
    smi.chmod(0o755)
    draft = tmp_path / "drafter"
    build_geometry_drafter(draft, config_only=True, log=lambda *a, **k: None)
    monkeypatch.setenv("FAKE_SMI_DIR", str(smi_dir))
    monkeypatch.setenv("FAKE_CRASH_SPEC", crash_spec)
    out = tmp_path / "out"
    proc = subprocess.run([sys.executable, str(DRIVER), "--out", str(out), "--cases", cases,
                           "--model", str(tmp_path / "no-model"), "--draft", str(draft), "--deadline", "200",
                           "--poll", "0.1", "--pretend-installed", "--nvidia-smi", str(smi),
                           "--launcher", f"{sys.executable} {server}",
                           "--probe-cmd", shlex.join([sys.executable, "-c", PROBE])],
                          cwd=REPO, capture_output=True, text=True, timeout=240)
    # every server process (leaders and their engine children) is gone when the driver returns
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline and any(Path(f"/proc/{p.name}").exists() for p in smi_dir.iterdir()):
        time.sleep(0.2)
    assert not [p.name for p in smi_dir.iterdir() if Path(f"/proc/{p.name}").exists()]
    return proc.returncode, out, proc.stdout + proc.stderr


def test_whole_run_against_fakes(tmp_path, monkeypatch):
    rc, out, log = fake_run(tmp_path, monkeypatch, "long-off")
    assert rc == 0, log
    top = json.loads((out / "fit.json").read_text())
    (r,) = top["cases"]
    assert r["measured"] and r["peak_mib"] == 21300 and r["procs"] == 2, log
    assert r["phases"]["boot"]["peak_mib"] == 20300 and r["phases"]["prefill"]["peak_mib"] == 21300
    assert r["phases"]["decode"]["peak_mib"] == 20800
    assert r["workload"]["prefill_tokens"] == 65536 and r["workload"]["batch_completion_tokens"] == [64] * 4
    assert r["vllm_log"]["model_loading_gib"] == 16.83 and r["vllm_log"]["graph_capture_gib"] == [0.11]
    d = r["derived"]
    assert d["est_3090_mib"] == 21300 - 2 * (540 - 512) and d["layout_diff_mib"] == 0
    assert d["verdict"]["fits"] and d["verdict"]["margin_mib"] == 24576 - 21244
    assert round(d["predicted_mib"]) == 22063       # docs/profiles.md: CTX=long SPEC=off, 21.55 GiB
    assert top["context"]["context_mib"] == 540 and top["gpu_start"]["free_mib"] == 142771
    table = (out / "fit-table.txt").read_text()
    assert re.search(r"^long-off .*21,300 \(2\).*fits, 3,332 MiB spare$", table, re.M), table
    assert (out / "server-long-off.log").is_file() and (out / "server.pids").read_text().strip()
    assert "t_s,case,phase,mib,procs" in (out / "fit-samples.csv").read_text()
    assert "[fit] PASS" in log


def test_whole_run_reports_a_failed_boot(tmp_path, monkeypatch):
    rc, out, log = fake_run(tmp_path, monkeypatch, "long-off long-dflash2", crash_spec="dflash2")
    assert rc == 1, log
    recs = {r["name"]: r for r in json.loads((out / "fit.json").read_text())["cases"]}
    assert recs["long-off"]["measured"] and not recs["long-dflash2"]["measured"]
    assert "boom" in recs["long-dflash2"]["error"]
    assert "NOT MEASURED" in (out / "fit-table.txt").read_text()
    assert "[fit] FAIL" in log


def test_gpu_readme_lists_job_41_and_plans_it():
    text = (REPO / "gpu" / "README.md").read_text()
    assert "- `41-fit`:" in text
    plan = text[text.index("Next lease, in this order"):text.index("Done since and not needed again")]
    assert "`41` with `FIT_CASES=" in plan and "-cap" in plan
    assert "`onecard.memory.RESERVES_MEASURED`" in plan


def test_gemm_choice_runs_the_3090_kernel_by_default(tmp_path):
    """FIT_GEMM: marlin (default) disables vLLM's Machete so the H200 runs the 3090's W4A16 kernel;
    vllm keeps vLLM's choice; anything else is one line, exit 2, before any plan or boot."""
    from onecard.profiles import AMPERE_GEMM_ENV

    assert fit.gemm_env("marlin") == AMPERE_GEMM_ENV
    assert AMPERE_GEMM_ENV["VLLM_DISABLED_KERNELS"].startswith("MacheteLinearKernel,")
    assert fit.gemm_env("vllm") == {}
    r = subprocess.run([sys.executable, str(REPO / "gpu/lib/fit.py"), "--check-cases", "--gemm", "cutlass"],
                       capture_output=True, text=True, timeout=60, cwd=str(tmp_path))
    assert r.returncode == 2
    assert r.stdout.strip() == "41-fit: FIT_GEMM='cutlass' is not valid; valid: marlin | vllm"


def test_torch_cap_parse_and_auto():
    """FIT_TORCH_CAP: off / auto / MiB; a bad value is one line naming what is valid; auto leaves a
    24 GiB card's context and non-torch share out and adds the checkpoint's excess over the
    prepared layout."""
    import pytest

    assert fit.parse_torch_cap(None) is None and fit.parse_torch_cap("off") is None
    assert fit.parse_torch_cap("auto") == "auto" and fit.parse_torch_cap("22000") == 22000
    for bad in ("lots", "12"):
        with pytest.raises(fit.CaseError, match=r"valid: off \| auto \| a number of MiB"):
            fit.parse_torch_cap(bad)
    rec = {"plan": {"vram": {"total": 26_000 * fit.MiB}, "prepared_vram": {"total": 24_000 * fit.MiB}}}
    assert fit.torch_cap_mib(rec, "auto", 512, 256) == 24 * 1024 - 512 - 256 + 2000
    assert fit.torch_cap_mib(rec, None, 512, 256) is None
    assert fit.torch_cap_mib(rec, 20000, 512, 256) == 20000


def test_read_torch_stats(tmp_path):
    """The engine process is the one with the largest reserved peak; no files, no figures."""
    assert fit.read_torch_stats(tmp_path / "none") == {}
    (tmp_path / "torch-1.json").write_text(json.dumps({"pid": 1, "reserved_peak_mib": 2.0}))
    (tmp_path / "torch-2.json").write_text(json.dumps({"pid": 2, "reserved_peak_mib": 22000.0, "ooms": 0}))
    (tmp_path / "torch-3.json").write_text("{broken")
    t = fit.read_torch_stats(tmp_path)
    assert t["pid"] == 2 and t["processes"] == 2


def test_torch_mem_hook_queues_without_cuda(tmp_path):
    """gpu/lib/stackdump's sitecustomize with ONECARD_TORCH_CAP_MIB: importing torch queues the cap
    for CUDA's lazy initialization and creates no CUDA context; without the variables torch is
    not touched."""
    code = ("import sys, torch, torch.cuda as c; "
            "print(any('_after_torch' in getattr(f, '__qualname__', '') for f, _ in c._queued_calls), "
            "c.is_initialized(), 'onecard_torch_mem' in sys.modules)")
    env = {**os.environ, "PYTHONPATH": str(REPO / "gpu" / "lib" / "stackdump")}
    env.pop("ONECARD_TORCH_STATS_DIR", None)
    r = subprocess.run([sys.executable, "-c", code], env={**env, "ONECARD_TORCH_CAP_MIB": "1000",
                       "ONECARD_TORCH_STATS_DIR": str(tmp_path)}, capture_output=True, text=True, timeout=120)
    assert r.stdout.split() == ["True", "False", "True"], r.stdout + r.stderr
    env.pop("ONECARD_TORCH_CAP_MIB", None)
    r = subprocess.run([sys.executable, "-c", "import sys; print('onecard_torch_mem' in sys.modules, 'torch' in sys.modules)"],
                       env=env, capture_output=True, text=True, timeout=60)
    assert r.stdout.split() == ["False", "False"], r.stdout + r.stderr


def test_cap_cases():
    """'<case>-cap' is the same server with its torch allocator capped (auto unless FIT_TORCH_CAP
    says otherwise), so a capped and an uncapped server of one profile run side by side."""
    assert fit.parse_cases("long-dflash2 long-dflash2-cap huge-mtp-cap") == ["long-dflash2", "long-dflash2-cap",
                                                                            "huge-mtp-cap"]
    assert fit.needs_kvarn(["huge-mtp-cap"]) and not fit.needs_kvarn(["long-off-cap"])
    with pytest.raises(fit.CaseError, match="'long-cap' is not a case"):
        fit.parse_cases("long-cap")
    env = fit.case_env("long-dflash2-es-cap", "/m", "/d", 1, "0.1")
    assert env["PYTORCH_CUDA_ALLOC_CONF"] == "expandable_segments:True" and env["SPEC"] == "dflash2"
    rec = {"name": "long-off-cap", "plan": {"vram": {"total": 26_000 * fit.MiB}, "prepared_vram": {"total": 24_000 * fit.MiB}}}
    assert fit.torch_cap_mib(rec, None, 512, 256) == 24 * 1024 - 512 - 256 + 2000
    assert fit.torch_cap_mib(rec, 20000, 512, 256) == 20000
    assert fit.torch_cap_mib({**rec, "name": "long-off"}, None, 512, 256) is None


def test_job_42_is_job_41_with_its_own_cases(tmp_path):
    """gpu/jobs/42-fit-b.sh: job 41 under its own name with FIT_CASES_B (a FIT_CASES meant for
    job 41 in the same gpu/run.sh call does not reach it); a bad list is refused before any boot."""
    job = REPO / "gpu" / "jobs" / "42-fit-b.sh"
    text = job.read_text()
    assert re.search(r"^# timeout: (\d+)$", text, re.M) and subprocess.run(["bash", "-n", str(job)]).returncode == 0
    out = tmp_path / "out"
    env = dict(os.environ, FIT_CASES="long-off", FIT_CASES_B="huge-mtp-cap bogus", JOB_OUT=str(out),
               MODELS=str(tmp_path / "m"), ONECARD_TREE_REV="abc1234")
    r = subprocess.run(["bash", str(job)], cwd=REPO, env=env, capture_output=True, text=True, timeout=60)
    assert r.returncode == 2, r.stdout + r.stderr
    assert "41-fit: FIT_CASES: 'bogus' is not a case" in r.stdout
    assert "== 42-fit-b" in r.stdout and "== 42-fit-b: FAIL (rc=2)" in r.stdout
    r = subprocess.run([sys.executable, str(DRIVER), "--check-cases", "--cases",
                        "long-mtp-cap long-off-cap huge-dflash2-cap huge-mtp-cap"], capture_output=True, text=True,
                       timeout=60)
    assert r.returncode == 0 and "(KVarN" in r.stdout    # its default list is valid and installs KVarN


def test_cap_applied_reads_the_hooks_line(tmp_path):
    """A -cap case counts as capped only when its server log shows onecard_torch_mem's line."""
    log = tmp_path / "server-x.log"
    assert not fit.cap_applied(log)
    log.write_text("INFO boot\nonecard-torch-mem: pid 4242: torch caching allocator capped at 23,808 MiB of 143,155\n")
    assert fit.cap_applied(log)
    log.write_text("INFO boot only\n")
    assert not fit.cap_applied(log)


def test_preemptions_read_from_the_servers_metrics():
    """The workload records vllm:num_preemptions_total (FIT_PROMPT_FRAC=1: a MAX_LEN prompt must run
    without one); an unreachable server gives None, not an error."""
    sys.path.insert(0, str(REPO / "tests"))
    from fake_openai_server import FakeServer

    with FakeServer() as srv:
        assert fit.preemptions(srv.url) == 0.0
    assert fit.preemptions("http://127.0.0.1:9") is None
