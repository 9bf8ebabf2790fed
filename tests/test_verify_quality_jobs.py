"""GPU jobs 31 (verify step cost) and 32 (KV quality): their client drivers against a small
in-test OpenAI/vLLM-shaped server (token-id prompts, /metrics with decode-time and draft
counters, echo logprobs, greedy token ids), the compare table, and job 31's CPU dry run."""
from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
pytest.importorskip("httpx")
pytest.importorskip("prometheus_client")


def _load(name: str):
    spec = importlib.util.spec_from_file_location(name.replace("-", "_"), REPO / "gpu" / "jobs" / f"{name}.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


class _Fake:
    """spec: one stream event per step, 1 token each (acceptance 0), drafts += steps."""

    def __init__(self, spec: bool, step_s: float = 0.002, quant_noise: float = 0.0, port: int = 0,
                 prof_dir: str | None = None, log: bool = False):
        self.spec, self.step_s, self.noise = spec, step_s, quant_noise
        self.prof_dir, self.profiling = prof_dir, False
        self.bodies: list[dict] = []  # every completion request's JSON body (log: also printed)
        self.log = log
        self.decode_sum = self.drafts = self.gen = self.iters = 0.0
        outer = self

        class H(BaseHTTPRequestHandler):
            def log_message(self, *a):
                pass

            def _json(self, obj):
                data = json.dumps(obj).encode()
                self.send_response(200)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def do_GET(self):
                if self.path == "/metrics":
                    o = outer
                    text = (f"# TYPE vllm:request_decode_time_seconds histogram\n"
                            f'vllm:request_decode_time_seconds_sum{{engine="0",model_name="m"}} {o.decode_sum}\n'
                            f'vllm:request_decode_time_seconds_count{{engine="0",model_name="m"}} 1.0\n'
                            f"# TYPE vllm:spec_decode_num_drafts counter\n"
                            f'vllm:spec_decode_num_drafts_total{{engine="0",model_name="m"}} {o.drafts}\n'
                            f"# TYPE vllm:generation_tokens counter\n"
                            f'vllm:generation_tokens_total{{engine="0",model_name="m"}} {o.gen}\n'
                            f"# TYPE vllm:iteration_tokens_total histogram\n"
                            f'vllm:iteration_tokens_total_count{{engine="0",model_name="m"}} {o.iters}\n'
                            f'vllm:iteration_tokens_total_sum{{engine="0",model_name="m"}} 0.0\n')
                    data = text.encode()
                elif self.path == "/v1/models":
                    data = json.dumps({"data": [{"id": "m", "max_model_len": 131072}]}).encode()
                elif self.path == "/version":
                    data = b'{"version": "0.27.1"}'
                else:
                    data = b"{}"
                self.send_response(200)
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def do_POST(self):
                if self.path in ("/start_profile", "/stop_profile"):
                    # vLLM's profiler endpoints: a trace (Chrome JSON, gzipped) and vLLM's table
                    # appear in the profiler dir at the stop
                    if self.path == "/stop_profile" and outer.prof_dir and outer.profiling:
                        import gzip
                        d = Path(outer.prof_dir)
                        d.mkdir(parents=True, exist_ok=True)
                        evs = [{"ph": "X", "cat": "kernel", "name": "fake_kernel", "ts": i * 100, "dur": 60}
                               for i in range(24)]
                        (d / "w.pt.trace.json.gz").write_bytes(gzip.compress(json.dumps({"traceEvents": evs}).encode()))
                        (d / "profiler_out_0.txt").write_text("fake vllm table\n")
                    outer.profiling = self.path == "/start_profile"
                    return self._json({})
                body = json.loads(self.rfile.read(int(self.headers.get("Content-Length", 0))))
                outer.bodies.append(body)
                if outer.log:
                    print("fake request " + " ".join(f"{k}={body.get(k)}" for k in
                                                     ("temperature", "seed", "top_p", "top_k")), flush=True)
                prompt = body["prompt"]
                ptoks = len(prompt) if isinstance(prompt, list) else len(prompt.split())
                n = int(body.get("max_tokens", 16))
                if not body.get("stream"):
                    if body.get("echo"):
                        lps = [None] + [-1.0 - outer.noise * (i % 3) for i in range(ptoks - 1)]
                        return self._json({"choices": [{"text": prompt, "logprobs": {"token_logprobs": lps}}],
                                           "usage": {"prompt_tokens": ptoks, "completion_tokens": 0}})
                    toks = [f"token_id:{i}" for i in range(n)]
                    if outer.noise:
                        toks[n // 2] = "token_id:999999"
                    return self._json({"choices": [{"text": "x", "logprobs": {"tokens": toks}}],
                                       "usage": {"prompt_tokens": ptoks, "completion_tokens": n}})
                self.send_response(200)
                self.send_header("Content-Type", "text/event-stream")
                self.end_headers()
                t_first = None
                for i in range(n):
                    time.sleep(outer.step_s)
                    t_first = t_first or time.perf_counter()
                    self.wfile.write(f"data: {json.dumps({'choices': [{'index': 0, 'text': 't'}]})}\n\n".encode())
                    self.wfile.flush()
                outer.decode_sum += time.perf_counter() - t_first
                outer.gen += n
                outer.iters += n
                if outer.spec:
                    outer.drafts += n - 1
                u = {"choices": [], "usage": {"prompt_tokens": ptoks, "completion_tokens": n}}
                self.wfile.write(f"data: {json.dumps(u)}\n\ndata: [DONE]\n\n".encode())

        self.httpd = ThreadingHTTPServer(("127.0.0.1", port), H)
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}"
        threading.Thread(target=self.httpd.serve_forever, daemon=True).start()

    def close(self):
        self.httpd.shutdown()
        self.httpd.server_close()


@pytest.mark.parametrize("spec", [True, False])
def test_verify_e2e_driver(tmp_path, spec):
    job = _load("31-verify-e2e")
    fake = _Fake(spec)
    try:
        out = tmp_path / "arm.json"
        rc = job.main(["--url", fake.url, "--model", "m", "--label", "arm", "--depths", "64,128",
                       "--out-tokens", "8", "--warmup-tokens", "32", "--json", str(out)]
                      + (["--spec"] if spec else []))
    finally:
        fake.close()
    rec = json.loads(out.read_text())
    assert rc == 0, rec["rows"]
    assert [r["depth"] for r in rec["rows"]] == [64, 128]
    for r in rec["rows"]:
        assert r["steps"] == 7 and r["completion_tokens"] == 8 and not r["problems"]
        assert r["server_ms_per_step"] > 1.0 and r["client_ms_per_step"] > 1.0
        assert r["tokens_per_step"] == 1.0
    assert rec["provenance"]["prompt_set"]["depths"] == [64, 128]


def test_verify_e2e_flags_missing_speculation(tmp_path):
    """--spec against a server whose draft counter never moves: not a valid measurement."""
    job = _load("31-verify-e2e")
    fake = _Fake(spec=False)
    try:
        rc = job.main(["--url", fake.url, "--model", "m", "--label", "x", "--spec", "--depths", "64",
                       "--out-tokens", "4", "--warmup-tokens", "16", "--json", str(tmp_path / "x.json")])
    finally:
        fake.close()
    assert rc == 1
    assert "did not move" in " ".join(json.loads((tmp_path / "x.json").read_text())["rows"][0]["problems"])


def test_verify_e2e_bad_args(capsys):
    job = _load("31-verify-e2e")
    assert job.main(["--url", "u", "--model", "m", "--label", "l", "--json", "/tmp/x", "--depths", "8k"]) == 2
    assert "valid" in capsys.readouterr().err


def test_kv_quality_measure_and_compare(tmp_path, capsys):
    job = _load("32-kv-quality")
    for label, noise in (("bf16", 0.0), ("int8", 0.01)):
        fake = _Fake(False, quant_noise=noise)
        try:
            assert job.main(["measure", "--url", fake.url, "--model", "m", "--label", label,
                             "--json", str(tmp_path / f"kvq-{label}.json"), "--gen", "10"]) == 0
        finally:
            fake.close()
    assert job.main(["compare", "--dir", str(tmp_path)]) == 0
    res = json.loads((tmp_path / "compare.json").read_text())
    assert res["arms"]["bf16"]["delta_ppl_pct"] == 0 and res["arms"]["bf16"]["first_divergence_min"] is None
    i8 = res["arms"]["int8"]
    assert i8["delta_ppl_pct"] > 0 and i8["first_divergence_min"] == 5 and i8["mean_abs_dlogprob"] > 0
    assert "| int8 |" in capsys.readouterr().out


def test_kv_quality_compare_counts_a_failed_greedy_as_failed(tmp_path, capsys):
    # session 30: int4's greedy continuation came back as HTTP 400 (a NaN logprob) on two texts;
    # their teacher-forced log-probabilities still count, the table names the failure, exit 1
    job = _load("32-kv-quality")

    def arm(label, rows):
        (tmp_path / f"kvq-{label}.json").write_text(json.dumps({"kind": "kvq", "label": label, "rows": rows}))

    base = [{"id": "a", "logprobs": [-1.0, -2.0], "greedy": ["x", "y"]},
            {"id": "b", "logprobs": [-1.5], "greedy": ["z"]}]
    arm("bf16", base)
    arm("int4", [{"id": "a", "logprobs": [-1.1, -2.0], "greedy": ["x", "q"]},
                 {"id": "b", "logprobs": [-1.5], "error": "HTTPStatusError: HTTP 400: nan",
                  "greedy_failure": {"step": 7, "passing_tokens": ["z"] * 7, "error": "nan"}}])
    assert job.main(["compare", "--dir", str(tmp_path)]) == 1
    res = json.loads((tmp_path / "compare.json").read_text())["arms"]["int4"]
    assert res["tokens"] == 3 and res["failed"] == ["b"] and res["first_divergence"] == {"a": 1}
    assert res["failed_from_position"] == {"b": 7}
    assert "b:ERROR@7" in capsys.readouterr().out


def test_kv_quality_compare_counts_texts_an_arm_never_reached(tmp_path, capsys):
    # session 31: the stock int4 arm's measurement hit its time limit after 4 of 8 texts (each
    # failure bisected); measure now writes its file after every text, and compare names the
    # texts the arm never reached as failed
    job = _load("32-kv-quality")
    base = [{"id": i, "logprobs": [-1.0], "greedy": ["x"]} for i in ("a", "b", "c")]
    (tmp_path / "kvq-bf16.json").write_text(json.dumps({"label": "bf16", "rows": base}))
    (tmp_path / "kvq-int4st.json").write_text(json.dumps(
        {"label": "int4st", "complete": False, "rows": [{"id": "a", "logprobs": [-1.0], "greedy": ["x"]}]}))
    assert job.main(["compare", "--dir", str(tmp_path)]) == 1
    res = json.loads((tmp_path / "compare.json").read_text())["arms"]["int4st"]
    assert res["failed"] == ["b", "c"] and res["tokens"] == 1
    assert "b:ERROR, c:ERROR" in capsys.readouterr().out


def test_kv_quality_measure_keeps_each_text_as_it_goes(tmp_path):
    job = _load("32-kv-quality")
    fake = _Fake(False)
    try:
        assert job.main(["measure", "--url", fake.url, "--model", "m", "--label", "bf16",
                         "--json", str(tmp_path / "kvq-bf16.json"), "--gen", "4"]) == 0
    finally:
        fake.close()
    rec = json.loads((tmp_path / "kvq-bf16.json").read_text())
    assert rec["complete"] is True and len(rec["rows"]) == len(job.texts()) and "provenance" in rec


@pytest.mark.parametrize("n,bad_from", [(96, 37), (96, 0), (96, 95), (1, 0), (2, 1)])
def test_kv_quality_bisects_the_first_failing_position(n, bad_from):
    # a greedy request whose continuation reaches position bad_from fails (as a NaN logprob did);
    # the bisection names that position and keeps the longest passing continuation
    job = _load("32-kv-quality")
    calls = []

    class Client:
        def complete(self, body, text, max_tokens):
            calls.append(max_tokens)
            if max_tokens > bad_from:
                raise RuntimeError("HTTP 400: nan")
            return {"choices": [{"logprobs": {"tokens": [f"token_id:{i}" for i in range(max_tokens)]}}]}

    r = job.first_failing_length(Client(), "text", n, "RuntimeError: HTTP 400: nan (the first request)")
    assert r["step"] == bad_from and len(r["passing_tokens"]) == bad_from
    assert "nan" in r["error"] and len(calls) <= n.bit_length() + 1


def test_kv_quality_compare_without_base(tmp_path):
    job = _load("32-kv-quality")
    assert job.main(["compare", "--dir", str(tmp_path)]) == 1


def test_job31_dry_run_and_skip(tmp_path):
    env = {**os.environ, "JOB_OUT": str(tmp_path / "out"), "MODELS": str(tmp_path / "models"),
           "PYTHONPATH": str(REPO), "JOB31_DRY": "1"}
    env.pop("WIDE_VERIFY", None)
    r = subprocess.run(["bash", str(REPO / "gpu/jobs/31-verify-e2e.sh")], env=env, capture_output=True,
                       text=True, timeout=180, cwd=str(tmp_path))
    assert r.returncode == 0, r.stdout + r.stderr
    # arms in order: off, mtp WIDE_VERIFY=1, dflash2 k7, dflash2 k15, mtp WIDE_VERIFY=0
    labels = [ln.split()[2].rstrip(":") for ln in r.stdout.splitlines() if ln.startswith("-- plan ")]
    assert labels == ["off", "mtp-wide1", "d2k7", "d2k15", "mtp-wide0"]
    assert r.stdout.count("--speculative-config") == 4 and "int8_per_token_head" in r.stdout
    assert r.stdout.count('"method":"mtp"') == 2 and r.stdout.count('"method":"dflash2"') == 2
    draft = str(tmp_path / "out" / "dry-drafter")  # no geometry drafter in MODELS: a scaled-down one
    assert f'"num_speculative_tokens":7,"model":"{draft}"' in r.stdout
    assert f'"num_speculative_tokens":15,"model":"{draft}"' in r.stdout
    assert "ONECARD_WIDE_VERIFY" in r.stdout
    env.pop("JOB31_DRY")
    r = subprocess.run(["bash", str(REPO / "gpu/jobs/31-verify-e2e.sh")], env=env, capture_output=True,
                       text=True, timeout=60, cwd=str(tmp_path))
    assert r.returncode == 0 and "SKIP" in r.stdout, r.stdout + r.stderr


def test_job31_budget_and_drafter_skips(tmp_path):
    """Arms that cannot fit the time left are skipped and named (no boot is tried); dflash2 arms
    without the geometry drafter are skipped; a skipped required arm (off) fails the job."""
    models = tmp_path / "models"
    (models / "qwen38-27b-geom").mkdir(parents=True)
    (models / "qwen38-27b-geom" / "config.json").write_text("{}")
    env = {**os.environ, "JOB_OUT": str(tmp_path / "out"), "MODELS": str(models), "PYTHONPATH": str(REPO),
           "JOB_BUDGET_S": "60", "ARM_MIN_S": "110"}
    env.pop("JOB31_DRY", None)
    r = subprocess.run(["bash", str(REPO / "gpu/jobs/31-verify-e2e.sh")], env=env, capture_output=True,
                       text=True, timeout=60, cwd=str(tmp_path))
    assert r.returncode == 1, r.stdout + r.stderr
    assert "off skipped:" in r.stdout and "< 110s for a 27B boot" in r.stdout and "ARM_MIN_S=110" in r.stdout
    assert "arms skipped: off(time) mtp-wide1(time) d2k7(no-drafter) d2k15(no-drafter) mtp-wide0(time)" in r.stdout
    assert "booting" not in r.stdout and "| depth | off ms/step |" in r.stdout
    (models / "qwen38-27b-geom-dflash2").mkdir()
    (models / "qwen38-27b-geom-dflash2" / "config.json").write_text("{}")
    r = subprocess.run(["bash", str(REPO / "gpu/jobs/31-verify-e2e.sh")], env=env, capture_output=True,
                       text=True, timeout=60, cwd=str(tmp_path))
    assert "arms skipped: off(time) mtp-wide1(time) d2k7(time) d2k15(time) mtp-wide0(time)" in r.stdout


def _job31_fakes(tmp_path, logged: tuple, pre: str, fake_kw: str):
    """The 27B geometry dirs job 31 wants, and a python3 shim on PATH that answers
    `python3 -m onecard.launch` with a fake server (_Fake) after logging the launcher env names
    in ``logged`` (``pre``: statements before _Fake, ``fake_kw``: its extra keywords)."""
    models = tmp_path / "models"
    for d in ("qwen38-27b-geom", "qwen38-27b-geom-dflash2"):
        (models / d).mkdir(parents=True)
        (models / d / "config.json").write_text("{}")
    shim = tmp_path / "bin"
    shim.mkdir()
    serve = ("import os, sys, time; sys.path.insert(0, %r); from test_verify_quality_jobs import _Fake; "
             "e = os.environ; print('fake launch ' + ' '.join(f'{k}={e.get(k)}' for k in %r), flush=True); "
             "%sf = _Fake(e['SPEC'] != 'off', port=int(e['PORT']), %s); "
             "time.sleep(600)") % (str(REPO / "tests"), logged, pre, fake_kw)
    (shim / "python3").write_text(
        "#!/bin/sh\n"
        f'if [ "$1" = "-m" ] && [ "$2" = "onecard.launch" ]; then exec {sys.executable} -c "{serve}"; fi\n'
        f'exec {sys.executable} "$@"\n')
    (shim / "python3").chmod(0o755)
    return models, shim


def test_job31_all_arms_against_fake_servers(tmp_path):
    """The whole job with every boot answered by a fake server (a python3 shim on PATH stands in
    for `python3 -m onecard.launch` and logs the launcher env it got): five arms in order, each
    measured, the dflash2 arms with DRAFT and DFLASH_TOKENS, the table with every column."""
    models, shim = _job31_fakes(
        tmp_path, ("SPEC", "WIDE_VERIFY", "DFLASH_TOKENS", "DRAFT", "VLLM_ALLOW_LONG_MAX_MODEL_LEN"),
        "pd = [w.split('=', 1)[1] for w in e.get('EXTRA_ARGS', '').split() "
        "if w.startswith('--profiler-config.torch_profiler_dir=')]; ",
        "prof_dir=(pd or [None])[0]")
    env = {**os.environ, "JOB_OUT": str(tmp_path / "out"), "MODELS": str(models), "PYTHONPATH": str(REPO),
           "PATH": f"{shim}{os.pathsep}{os.environ.get('PATH', '')}", "DEPTHS": "64,128", "OUT_TOK": "8",
           "PROF_ROOT": str(tmp_path / "prof"),
           "ARMS": "off:off:1:-:1 mtp-wide1:mtp:1:-:1 d2k7:dflash2:1:7:0:prof d2k15:dflash2:1:15:0 "
                   "mtp-wide0:mtp:0:-:0 d2k7-wv0:dflash2:0:7:0"}
    env.pop("JOB31_DRY", None)
    r = subprocess.run(["bash", str(REPO / "gpu/jobs/31-verify-e2e.sh")], env=env, capture_output=True,
                       text=True, timeout=240, cwd=str(tmp_path))
    out = tmp_path / "out"
    # the `prof` arm: profiler args reached the launcher, the request was profiled, the trace summarized
    assert (tmp_path / "prof" / "prof-d2k7" / "w.pt.trace.json.gz").exists()   # dir from EXTRA_ARGS
    assert json.loads((out / "d2k7.json").read_text())["profile"]["ok"] is True
    assert json.loads((out / "off.json").read_text())["profile"] is None
    assert "fake_kernel" in (out / "prof-d2k7.txt").read_text()
    assert (out / "prof-d2k7-vllm.txt").read_text() == "fake vllm table\n"
    assert json.loads((out / "prof-d2k7.json").read_text())["steps"] == 24
    assert r.returncode == 0, r.stdout[-4000:] + r.stderr[-2000:]
    assert "arms measured: off mtp-wide1 d2k7 d2k15 mtp-wide0 d2k7-wv0" in r.stdout and "arms skipped" not in r.stdout
    booted = [ln.split()[2] for ln in r.stdout.splitlines() if "] booting " in ln]
    assert booted == ["off", "mtp-wide1", "d2k7", "d2k15", "mtp-wide0", "d2k7-wv0"]
    assert "SPEC=dflash2 WIDE_VERIFY=0 DFLASH_TOKENS=7" in (out / "server-d2k7-wv0.log").read_text()
    assert "| d2k7-wv0 ms/step (ratio) |" in (out / "table.txt").read_text()   # an extra arm's column
    logs = {k: (out / f"server-{k}.log").read_text() for k in booted}
    draft = models / "qwen38-27b-geom-dflash2"
    assert f"SPEC=dflash2 WIDE_VERIFY=1 DFLASH_TOKENS=7 DRAFT={draft} VLLM_ALLOW_LONG_MAX_MODEL_LEN=1" in logs["d2k7"]
    assert "DFLASH_TOKENS=15" in logs["d2k15"] and "SPEC=mtp WIDE_VERIFY=0 DFLASH_TOKENS=None" in logs["mtp-wide0"]
    assert "SPEC=off" in logs["off"]
    for k in booted:
        rec = json.loads((out / f"{k}.json").read_text())
        assert [row["depth"] for row in rec["rows"]] == [64, 128] and rec["spec"] == (k != "off")
    table = (out / "table.txt").read_text()
    assert "dflash2 k15 ms/step (ratio)" in table and "mtp (WIDE_VERIFY=0) ms/step (ratio)" in table
    assert table.count("| 64 |") == 1 and table.count("| 128 |") == 1


@pytest.mark.parametrize("job", ["31-verify-e2e.sh", "32-kv-quality.sh"])
def test_job_headers(job):
    text = (REPO / "gpu" / "jobs" / job).read_text()
    assert text.splitlines()[1].startswith("# timeout: ")
    # gpu/run.sh --detach runs a job past one call's 10 minutes; the driver's wait.sh calls follow
    # it (job 31's four 27B boots take ~15-17 minutes, 2026-12-03)
    assert 60 <= int(text.splitlines()[1].split(":")[1]) <= 1200
    r = subprocess.run(["bash", "-n", str(REPO / "gpu" / "jobs" / job)], capture_output=True, text=True)
    assert r.returncode == 0, r.stderr


def test_job31_table(tmp_path):
    """The summary table job 31 prints last: ms/step per arm with the ratio vs the plain step, the
    mtp goal MET/MISSED, tokens per step, texts; a skipped depth row is left out."""
    script = (REPO / "gpu/jobs/31-verify-e2e.sh").read_text()
    block = script.split("<<'PY'", 2)[2].split("\n", 1)[1].split("\nPY\n", 1)[0]
    assert "ms per engine step" in block
    (tmp_path / "t.py").write_text(block)
    for label, ms, text in (("mtp-wide1", 20.0, "abd"), ("off", 16.0, "abc"), ("d2k7", 24.0, "abc"),
                            ("d2k15", 32.0, "ab")):
        rows = [{"depth": 8192, "server_ms_per_step": ms, "client_ms_per_step": ms + 1, "text": text,
                 "tokens_per_step": 1.0}]
        if label == "d2k15":
            rows.append({"depth": 73728, "skipped": "depth + out > max_model_len 33792", "problems": []})
        (tmp_path / f"{label}.json").write_text(json.dumps({"rows": rows}))
    r = subprocess.run([sys.executable, str(tmp_path / "t.py"), str(tmp_path)], capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    assert ("| depth | off ms/step | mtp (WIDE_VERIFY=1) ms/step (ratio) | dflash2 k7 ms/step (ratio) | "
            "dflash2 k15 ms/step (ratio) | mtp goal <= 1.3x |") in r.stdout
    assert ("| 8192 | 16.00 / 17.00 | 20.00 / 21.00 (1.25x) | 24.00 / 25.00 (1.50x) | 32.00 / 33.00 (2.00x) "
            "| MET |") in r.stdout
    assert "73728" not in r.stdout and "WIDE_VERIFY=0" not in r.stdout
    assert "mtp-wide1: differs at char 2" in r.stdout and "d2k7: same" in r.stdout
    assert "d2k15: prefix-equal (2 vs 3 chars)" in r.stdout
    # the optional fifth arm gets its own column when it ran
    (tmp_path / "mtp-wide0.json").write_text(json.dumps({"rows": [{"depth": 8192, "server_ms_per_step": 40.0,
                                                                    "client_ms_per_step": 41.0, "text": "abc"}]}))
    r = subprocess.run([sys.executable, str(tmp_path / "t.py"), str(tmp_path)], capture_output=True, text=True)
    assert "| 40.00 / 41.00 (2.50x) | MET |" in r.stdout and "mtp-wide0: same" in r.stdout


def test_verify_e2e_driver_skips_depths_past_max_len(tmp_path):
    """A depth past the server's max_model_len (a dflash2 server's capped pool) is a skipped row."""
    job = _load("31-verify-e2e")
    fake = _Fake(True)
    try:
        out = tmp_path / "d.json"
        rc = job.main(["--url", fake.url, "--model", "m", "--label", "d2k7", "--spec", "--depths", "64,131070",
                       "--out-tokens", "4", "--warmup-tokens", "16", "--json", str(out)])
    finally:
        fake.close()
    rows = json.loads(out.read_text())["rows"]
    assert rc == 0 and rows[0]["steps"] == 3 and "max_model_len 131072" in rows[1]["skipped"]


def test_job31_arm_extra_env(tmp_path):
    """An arm's 7th field adds launcher knobs for that arm only (PREFIX_CACHE=0: no prefix
    caching, no mamba align mode); a name that is not a launcher knob is a one-line error."""
    env = {**os.environ, "JOB_OUT": str(tmp_path / "out"), "MODELS": str(tmp_path / "models"),
           "PYTHONPATH": str(REPO), "JOB31_DRY": "1",
           "ARMS": "off:off:1:-:1 mtp-pc0:mtp:1:-:0:-:PREFIX_CACHE=0,WARMUP=0"}
    r = subprocess.run(["bash", str(REPO / "gpu/jobs/31-verify-e2e.sh")], env=env, capture_output=True,
                       text=True, timeout=180, cwd=str(tmp_path))
    assert r.returncode == 0, r.stdout + r.stderr
    off, pc0 = r.stdout.split("-- plan mtp-pc0")
    assert "--mamba-cache-mode align" in off and "--enable-prefix-caching" in off
    assert "--no-enable-prefix-caching" in pc0 and "mamba-cache-mode" not in pc0
    assert "PREFIX_CACHE=0,WARMUP=0" in pc0.splitlines()[0]
    env["ARMS"] = "off:off:1:-:1:-:PREFX_CACHE=0"
    r = subprocess.run(["bash", str(REPO / "gpu/jobs/31-verify-e2e.sh")], env=env, capture_output=True,
                       text=True, timeout=60, cwd=str(tmp_path))
    assert r.returncode == 2 and "'PREFX_CACHE=0' is not valid; valid:" in r.stderr


def test_verify_e2e_sampling_params():
    """Greedy requests stay exactly as before; sampled ones carry the fixed seed, top_p / top_k
    only when given; a bad value is a one-line ValueError naming what is valid."""
    job = _load("31-verify-e2e")
    assert job.sampling_params(0.0) == {"temperature": 0.0, "ignore_eos": True}
    assert job.sampling_params(0) == {"temperature": 0.0, "ignore_eos": True}
    assert job.sampling_params(0.7) == {"temperature": 0.7, "ignore_eos": True, "seed": 31}
    assert job.sampling_params(1.0, top_p=0.95, top_k=20, seed=5) == {
        "temperature": 1.0, "ignore_eos": True, "seed": 5, "top_p": 0.95, "top_k": 20}
    for kw, msg in (({"temperature": -0.1}, "--temperature -0.1 is not valid; valid: a number >= 0"),
                    ({"temperature": float("nan")}, "--temperature nan is not valid"),
                    ({"temperature": 0.7, "top_p": 0.0}, "--top-p 0.0 is not valid; valid: 0 < top_p <= 1"),
                    ({"temperature": 0.7, "top_p": 1.5}, "--top-p 1.5 is not valid"),
                    ({"temperature": 0.7, "top_k": 0}, "--top-k 0 is not valid; valid: -1 (all) or"),
                    ({"temperature": 0.7, "seed": -1}, "--seed -1 is not valid"),
                    ({"temperature": 0.0, "top_k": 20}, "not valid with --temperature 0; valid: only with")):
        with pytest.raises(ValueError) as e:
            job.sampling_params(**kw)
        assert msg in str(e.value) and "\n" not in str(e.value)
    assert job.sampling_params(0.7, top_k=-1)["top_k"] == -1


@pytest.mark.parametrize("temperature", [None, "0.7"])
def test_verify_e2e_driver_temperature(tmp_path, temperature):
    """The driver's requests and record: greedy by default (no seed sent, as before); with
    --temperature every request (warm-up, repeats, profile) is sampled with the fixed seed, the
    record and every row say so, and differing texts between sampled repeats are no problem."""
    job = _load("31-verify-e2e")
    fake = _Fake(True)
    try:
        out = tmp_path / "arm.json"
        rc = job.main(["--url", fake.url, "--model", "m", "--label", "arm", "--spec", "--depths", "64,131070",
                       "--out-tokens", "4", "--warmup-tokens", "16", "--repeats", "2", "--json", str(out)]
                      + (["--temperature", temperature] if temperature else []))
    finally:
        fake.close()
    rec = json.loads(out.read_text())
    assert rc == 0, rec["rows"]
    assert len(fake.bodies) == 3  # warm-up + 2 repeats of depth 64 (131070 is past max_model_len)
    if temperature is None:
        assert all(b["temperature"] == 0.0 and "seed" not in b for b in fake.bodies)
        assert rec["temperature"] == 0.0 and rec["sampled"] is False and rec["seed"] is None
        assert rec["provenance"]["sampling"] == {"temperature": 0.0, "ignore_eos": True}
    else:
        assert all(b["temperature"] == 0.7 and b["seed"] == 31 for b in fake.bodies)
        assert not any("top_p" in b or "top_k" in b for b in fake.bodies)
        assert rec["temperature"] == 0.7 and rec["sampled"] is True and rec["seed"] == 31
        assert rec["provenance"]["sampling"] == {"temperature": 0.7, "ignore_eos": True, "seed": 31}
    for r in rec["rows"]:  # the skipped row too
        assert r["temperature"] == rec["temperature"] and r["sampled"] == rec["sampled"]
    # repeats whose texts differ: a problem for greedy requests only
    job_reps = [{"server_ms_per_step": 1.0, "client_ms_per_step": 1.0, "text": t, "problems": []} for t in "ab"]
    assert job.median_repeat(job_reps)["problems"]
    row = job.median_repeat(job_reps, greedy=False)
    assert not row["problems"] and row["repeat_texts_equal"] is False


@pytest.mark.parametrize("args, msg", [
    (["--temperature", "-1"], "--temperature -1.0 is not valid; valid: a number >= 0"),
    (["--top-p", "0.9"], "--top-p / --top-k are not valid with --temperature 0"),
    (["--temperature", "0.7", "--top-k", "0"], "--top-k 0 is not valid; valid:"),
])
def test_verify_e2e_bad_sampling_args(capsys, args, msg):
    job = _load("31-verify-e2e")
    assert job.main(["--url", "http://127.0.0.1:9", "--model", "m", "--label", "l", "--json", "/tmp/x"] + args) == 2
    err = capsys.readouterr().err
    assert msg in err and len(err.strip().splitlines()) == 1


def test_job31_sampled_and_env_arms_dry_run(tmp_path):
    """An arm's TEMPERATURE= / TOP_P= / TOP_K= / SEED= fields become the driver's request
    arguments (the job-wide TEMPERATURE / SEED otherwise), never launcher env; ONECARD_* fields
    are accepted for the server unless the launcher sets them from a knob (the DFlash2 lane is
    the knob LOOKUP_LANE)."""
    env = {**os.environ, "JOB_OUT": str(tmp_path / "out"), "MODELS": str(tmp_path / "models"),
           "PYTHONPATH": str(REPO), "JOB31_DRY": "1",
           "ARMS": "d2k7:dflash2:1:7:0 d2k7-t07:dflash2:1:7:0:-:TEMPERATURE=0.7 "
                   "d2k7-tk:dflash2:1:7:0:-:TEMPERATURE=1,TOP_P=0.95,TOP_K=20,SEED=7,PREFIX_CACHE=0 "
                   "d2k15-host:dflash2:1:15:0:-:LOOKUP_LANE=host "
                   "off-marlin:off:1:-:1:-:VLLM_DISABLED_KERNELS=MacheteLinearKernel "
                   "d2k7-q8:dflash2:1:7:1:-:DRAFT_QUANT=fp8,GEMM=ampere"}
    for k in ("TEMPERATURE", "SEED"):
        env.pop(k, None)
    r = subprocess.run(["bash", str(REPO / "gpu/jobs/31-verify-e2e.sh")], env=env, capture_output=True,
                       text=True, timeout=180, cwd=str(tmp_path))
    assert r.returncode == 0, r.stdout + r.stderr
    plans = dict(p.split(":", 1) for p in r.stdout.split("-- plan ")[1:])
    assert "requests: --temperature 0\n" in plans["d2k7"]
    assert "requests: --temperature 0.7 --seed 31\n" in plans["d2k7-t07"]
    assert "requests: --temperature 1 --seed 7 --top-p 0.95 --top-k 20\n" in plans["d2k7-tk"]
    assert "--no-enable-prefix-caching" in plans["d2k7-tk"]   # the launcher knob beside them still applies
    assert "requests: --temperature 0\n" in plans["d2k15-host"]
    assert "LOOKUP_LANE=host" in plans["d2k15-host"].splitlines()[0]
    assert "VLLM_DISABLED_KERNELS=MacheteLinearKernel" in plans["off-marlin"].splitlines()[0]
    # GEMM=ampere (every variable of onecard.profiles.AMPERE_GEMM_ENV) beside a launcher knob
    assert "DRAFT_QUANT=fp8,GEMM=ampere" in plans["d2k7-q8"].splitlines()[0]
    assert '"dflash2_draft_quant":"fp8_per_block"' in plans["d2k7-q8"]
    # the job-wide default: every arm without its own TEMPERATURE= samples
    env["TEMPERATURE"], env["ARMS"] = "0.6", "off:off:1:-:1 mtp-t1:mtp:1:-:1:-:TEMPERATURE=1.0"
    r = subprocess.run(["bash", str(REPO / "gpu/jobs/31-verify-e2e.sh")], env=env, capture_output=True,
                       text=True, timeout=180, cwd=str(tmp_path))
    assert r.returncode == 0, r.stdout + r.stderr
    assert "requests: --temperature 0.6 --seed 31" in r.stdout and "requests: --temperature 1.0 --seed 31" in r.stdout


@pytest.mark.parametrize("arms, extra_env, msg", [
    ("d2k7-t:dflash2:1:7:0:-:TEMPERATURE=-1", {}, "arm d2k7-t: 'TEMPERATURE=-1' is not valid; valid: TEMPERATURE=a number >= 0"),
    ("d2k7-t:dflash2:1:7:0:-:TEMPERATURE=hot", {}, "'TEMPERATURE=hot' is not valid; valid: TEMPERATURE=a number"),
    ("d2k7-t:dflash2:1:7:0:-:TEMPERATURE=", {}, "'TEMPERATURE=' is not valid; valid: TEMPERATURE=a number"),
    ("d2k7-t:dflash2:1:7:0:-:TEMPERATURE=0.7,TOP_P=1.5", {}, "'TOP_P=1.5' is not valid; valid: TOP_P=0 < TOP_P <= 1"),
    ("d2k7-t:dflash2:1:7:0:-:TEMPERATURE=0.7,TOP_K=0", {}, "'TOP_K=0' is not valid; valid: TOP_K=-1 (all) or"),
    ("d2k7-t:dflash2:1:7:0:-:TEMPERATURE=0.7,SEED=x", {}, "'SEED=x' is not valid; valid: SEED=an integer >= 0"),
    ("d2k7-t:dflash2:1:7:0:-:TOP_P=0.9", {}, "TOP_P= / TOP_K= with temperature 0 is not valid; valid: TOP_P= / TOP_K= only with TEMPERATURE > 0"),
    ("d2k7-w:dflash2:1:7:0:-:ONECARD_WIDE_VERIFY=0", {}, "'ONECARD_WIDE_VERIFY=0' is not valid; valid: the launcher knob WIDE_VERIFY=VALUE"),
    ("d2k7-d:dflash2:1:15:0:-:ONECARD_DFLASH_LANE=host", {}, "'ONECARD_DFLASH_LANE=host' is not valid; valid: the launcher knob LOOKUP_LANE=VALUE"),
    ("d2k7-v:dflash2:1:7:0:-:VLLM_USE_V1=0", {}, "'VLLM_USE_V1=0' is not valid; valid: KNOB=VALUE"),
    ("d2k7-l:dflash2:1:7:0:-:onecard_dflash_lane=host", {}, "'onecard_dflash_lane=host' is not valid; valid: KNOB=VALUE"),
    ("d2k7-g:dflash2:1:7:0:-:GEMM=h200", {}, "'GEMM=h200' is not valid; valid: GEMM=ampere (the 3090's Marlin kernels) or GEMM=vllm"),
    ("d2k7:dflash2:1:7:0", {"TEMPERATURE": "warm"}, "31-verify-e2e: TEMPERATURE='warm' is not valid; valid: a number >= 0"),
    ("d2k7:dflash2:1:7:0", {"SEED": "-3"}, "31-verify-e2e: SEED='-3' is not valid; valid: an integer >= 0"),
])
def test_job31_bad_sampling_fields_refused_before_any_boot(tmp_path, arms, extra_env, msg):
    """A bad request field (in any arm, however late) or job-wide TEMPERATURE / SEED is a one-line
    error, exit 2, before the first arm boots (here off, first, would otherwise be tried)."""
    models = tmp_path / "models"
    for d in ("qwen38-27b-geom", "qwen38-27b-geom-dflash2"):
        (models / d).mkdir(parents=True)
        (models / d / "config.json").write_text("{}")
    env = {**os.environ, "JOB_OUT": str(tmp_path / "out"), "MODELS": str(models), "PYTHONPATH": str(REPO),
           "JOB_BUDGET_S": "60", "ARM_MIN_S": "110", "ARMS": "off:off:1:-:1 " + arms, **extra_env}
    env.pop("JOB31_DRY", None)
    for k in ("TEMPERATURE", "SEED"):
        if k not in extra_env:
            env.pop(k, None)
    r = subprocess.run(["bash", str(REPO / "gpu/jobs/31-verify-e2e.sh")], env=env, capture_output=True,
                       text=True, timeout=60, cwd=str(tmp_path))
    assert r.returncode == 2, r.stdout + r.stderr
    assert msg in r.stderr and len(r.stderr.strip().splitlines()) == 1, r.stderr
    assert "off skipped" not in r.stdout and "booting" not in r.stdout and "arms " not in r.stdout


def test_job31_sampled_and_lane_arms_against_fake_servers(tmp_path):
    """The next lease's pairs through the whole job on fake servers: greedy d2k7 vs sampled d2k7
    (temperature 0.7, seed 31 on every request, no top_p / top_k, the field never in the server's
    env), and LOOKUP_LANE=host reaching only its arm's launcher; the table marks the
    sampled column and does not compare its text with off's."""
    models, shim = _job31_fakes(tmp_path, ("SPEC", "DFLASH_TOKENS", "LOOKUP_LANE", "TEMPERATURE", "SEED"),
                                "", "log=True")
    env = {**os.environ, "JOB_OUT": str(tmp_path / "out"), "MODELS": str(models), "PYTHONPATH": str(REPO),
           "PATH": f"{shim}{os.pathsep}{os.environ.get('PATH', '')}", "DEPTHS": "64", "OUT_TOK": "8",
           "REPEATS": "2",
           "ARMS": "off:off:1:-:1 d2k7:dflash2:1:7:0 d2k7-t07:dflash2:1:7:0:-:TEMPERATURE=0.7 "
                   "d2k15-host:dflash2:1:15:0:-:LOOKUP_LANE=host"}
    for k in ("JOB31_DRY", "TEMPERATURE", "SEED", "LOOKUP_LANE"):
        env.pop(k, None)
    r = subprocess.run(["bash", str(REPO / "gpu/jobs/31-verify-e2e.sh")], env=env, capture_output=True,
                       text=True, timeout=240, cwd=str(tmp_path))
    assert r.returncode == 0, r.stdout[-4000:] + r.stderr[-2000:]
    out = tmp_path / "out"
    logs = {k: (out / f"server-{k}.log").read_text() for k in ("off", "d2k7", "d2k7-t07", "d2k15-host")}
    assert "LOOKUP_LANE=host" in logs["d2k15-host"]
    assert all("LOOKUP_LANE=None" in logs[k] for k in ("off", "d2k7", "d2k7-t07"))
    assert all("TEMPERATURE=None SEED=None" in v for v in logs.values())   # client fields stay client-side
    reqs = {k: [ln for ln in v.splitlines() if ln.startswith("fake request ")] for k, v in logs.items()}
    assert len(reqs["d2k7-t07"]) == 3   # warm-up + 2 repeats
    assert set(reqs["d2k7-t07"]) == {"fake request temperature=0.7 seed=31 top_p=None top_k=None"}
    for k in ("off", "d2k7", "d2k15-host"):
        assert set(reqs[k]) == {"fake request temperature=0.0 seed=None top_p=None top_k=None"}
    recs = {k: json.loads((out / f"{k}.json").read_text()) for k in logs}
    assert recs["d2k7-t07"]["temperature"] == 0.7 and recs["d2k7-t07"]["rows"][0]["sampled"] is True
    assert recs["d2k7"]["temperature"] == 0.0 and recs["d2k7"]["rows"][0]["sampled"] is False
    assert "d2k7-t07 [sampled T=0.7 seed 31] depth     64: server" in r.stdout
    table = (out / "table.txt").read_text()
    assert "C1 greedy, the columns marked [sampled T=..] sampled (seeded)" in table
    assert "| depth | off ms/step | mtp (WIDE_VERIFY=1) ms/step (ratio) | dflash2 k7 ms/step (ratio) |" in table  # greedy: unmarked
    assert "| d2k7-t07 [sampled T=0.7] ms/step (ratio) | d2k15-host ms/step (ratio) |" in table
    assert "depth 64 d2k7-t07: not compared (sampled requests: d2k7-t07 [sampled T=0.7], off greedy)" in table
    assert "depth 64 d2k15-host: same" in table


def test_job31_table_sampled_arms(tmp_path):
    """The table with every arm sampled (job-wide TEMPERATURE): every column marked, the title
    says sampled, no text compared with off's, a SAME_TEXT pair of sampled arms marked informative."""
    script = (REPO / "gpu/jobs/31-verify-e2e.sh").read_text()
    block = script.split("<<'PY'", 2)[2].split("\n", 1)[1].split("\nPY\n", 1)[0]
    (tmp_path / "t.py").write_text(block)
    for label, ms in (("off", 16.0), ("d2k7", 24.0), ("d2k7-b", 25.0)):
        rows = [{"depth": 8192, "server_ms_per_step": ms, "client_ms_per_step": ms + 1, "text": "abc",
                 "tokens_per_step": 1.0, "temperature": 0.7, "sampled": True}]
        (tmp_path / f"{label}.json").write_text(json.dumps({"temperature": 0.7, "sampled": True, "rows": rows}))
    r = subprocess.run([sys.executable, str(tmp_path / "t.py"), str(tmp_path), "off:off:1:-:1",
                        "d2k7:dflash2:1:7:0", "d2k7-b:dflash2:1:7:0"], capture_output=True, text=True,
                       env={**os.environ, "SAME_TEXT": "d2k7=d2k7-b"})
    assert r.returncode == 0, r.stderr
    assert "ms per engine step, C1 sampled (seeded), CTX=long" in r.stdout
    assert ("| depth | off [sampled T=0.7] ms/step | mtp (WIDE_VERIFY=1) ms/step (ratio) | "
            "dflash2 k7 [sampled T=0.7] ms/step (ratio) |") in r.stdout
    assert "| d2k7-b [sampled T=0.7] ms/step (ratio) |" in r.stdout
    assert "depth 8192 d2k7: not compared (sampled requests: d2k7 [sampled T=0.7], off [sampled T=0.7])" in r.stdout
    assert ("same text d2k7 = d2k7-b, depth 8192: SAME (sampled: d2k7 [sampled T=0.7], d2k7-b [sampled T=0.7]; "
            "informative)") in r.stdout


@pytest.mark.parametrize("labels, goals", [(("off", "mtp"), ("MET", "MISSED")),
                                            (("off", "mtp-wide1"), ("MISSED", "MET")),
                                            (("off", "mtp", "mtp-wide1"), ("MISSED", "MET"))])
def test_job31_table_goal_column(tmp_path, labels, goals):
    """The goal column judges the mtp arm whether it is labelled mtp-wide1 or mtp (gpu/README's
    next lease names it mtp; session 36's table printed '-' for it); mtp-wide1 wins when both ran."""
    script = (REPO / "gpu/jobs/31-verify-e2e.sh").read_text()
    block = script.split("<<'PY'", 2)[2].split("\n", 1)[1].split("\nPY\n", 1)[0]
    (tmp_path / "t.py").write_text(block)
    ms = {"off": {8192: 10.0, 32768: 10.0}, "mtp": {8192: 12.9, 32768: 13.2},
          "mtp-wide1": {8192: 13.5, 32768: 12.0}}
    for label in labels:
        rows = [{"depth": d, "server_ms_per_step": v, "client_ms_per_step": v, "text": "abc",
                 "tokens_per_step": 1.0} for d, v in ms[label].items()]
        (tmp_path / f"{label}.json").write_text(json.dumps({"rows": rows}))
    argv = [f"{lb}:{'off' if lb == 'off' else 'mtp'}:1:-:1" for lb in labels]
    r = subprocess.run([sys.executable, str(tmp_path / "t.py"), str(tmp_path), *argv],
                       capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    rows = [ln for ln in r.stdout.splitlines() if ln.startswith("| 8192 ") or ln.startswith("| 32768 ")]
    assert [ln.rstrip(" |").rsplit("| ", 1)[1] for ln in rows] == list(goals), r.stdout


@pytest.mark.parametrize("arms, why", [("bf16 int4st", "KVQ_ARMS names 'int4st'"),
                                       ("bf16 int4raw", "KVQ_ARMS names 'int4raw'"),
                                       ("bf16 int8bf", "KVQ_ARMS names 'int8bf'"),
                                       ("int8 int4", "must include bf16")])
def test_job32_refuses_bad_arms_before_any_boot(tmp_path, arms, why):
    """KVQ_ARMS is checked before the SmolLM2 conversion or a boot: a typo on a lease costs nothing,
    and the line names what is valid (int4st only exists with KVQ_INT4_STOCK_DECODE=1)."""
    env = {**os.environ, "JOB_OUT": str(tmp_path / "out"), "MODELS": str(tmp_path / "models"),
           "KVQ_ARMS": arms, "PYTHONPATH": str(REPO)}
    (tmp_path / "out").mkdir()
    r = subprocess.run(["bash", str(REPO / "gpu/jobs/32-kv-quality.sh")], env=env, capture_output=True,
                       text=True, timeout=60, cwd=str(tmp_path))
    assert r.returncode == 2, r.stdout + r.stderr
    assert why in r.stdout and "converting" not in r.stdout.lower()
    if "int4st" in arms or "int4raw" in arms or "int8bf" in arms:
        assert "valid here: bf16 int8 int4 " in r.stdout and "int4raw with KVQ_INT4_RAW=1" in r.stdout
        assert "int8qk / int8bf with KVQ_QK_INT8=1" in r.stdout
