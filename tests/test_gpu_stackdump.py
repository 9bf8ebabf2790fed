"""gpu/lib/stackdump: SIGUSR2 dumps a job process's stacks and it keeps running; the shadowed
sitecustomize still runs, once, also behind the float32 shim (which chains too)."""
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
STACKDUMP = ROOT / "gpu" / "lib" / "stackdump"
SHIM = ROOT / "tests" / "gpu" / "fp32_shim"
sys.path.insert(0, str(ROOT / "tests" / "gpu"))

CHILD = ("import sys, time\n"
         "def waiting_here():\n"
         "    print('rea' + 'dy', flush=True)\n"   # from inside the frame the dump must name
         "    time.sleep(20)\n"
         "waiting_here()\n"
         "print('still alive', flush=True)\n")


def _env(*dirs):
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(str(d) for d in dirs)
    return env


def _marker_dir(tmp_path):
    d = tmp_path / "next"
    d.mkdir()
    (d / "sitecustomize.py").write_text("import sys\nprint('next-sitecustomize', file=sys.stderr, flush=True)\n")
    return d


def test_sigusr2_dumps_stacks_and_the_process_carries_on(tmp_path):
    child = CHILD.replace("time.sleep(20)", "time.sleep(2)")
    p = subprocess.Popen([sys.executable, "-c", child], env=_env(STACKDUMP, _marker_dir(tmp_path)),
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    assert p.stdout.readline().strip() == "ready"
    os.kill(p.pid, signal.SIGUSR2)
    out, err = p.communicate(timeout=30)
    assert p.returncode == 0 and "still alive" in out
    assert " in waiting_here" in err                  # the dumped stack names the frame
    assert err.count("next-sitecustomize") == 1       # the shadowed hook ran, once


def test_behind_the_fp32_shim_each_hook_runs_once(tmp_path):
    code = "import sys; print('ok', flush=True)"
    r = subprocess.run([sys.executable, "-c", code], env=_env(SHIM, STACKDUMP, _marker_dir(tmp_path)),
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 0 and r.stdout.strip() == "ok", r.stderr
    assert r.stderr.count("next-sitecustomize") == 1


def test_switched_off(tmp_path):
    env = _env(STACKDUMP)
    env["ONECARD_STACK_SIGNAL"] = "0"
    code = "import faulthandler, signal; print(faulthandler.unregister(signal.SIGUSR2))"
    r = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=60)
    assert r.stdout.strip() == "False"


def test_server_dump_stacks_at_most_twice_into_its_log(tmp_path):
    import test_dflash2 as T

    srv = T.Server("x", [sys.executable, "-c", CHILD], 0, tmp_path)
    srv.start(_env(STACKDUMP))
    try:
        deadline = time.monotonic() + 20
        while "\nready\n" not in srv.log.read_text() and time.monotonic() < deadline:
            time.sleep(0.05)
        assert T.MAX_DUMPS == 2
        assert srv.dump_stacks("test") is True
        deadline = time.monotonic() + 20
        while " in waiting_here" not in srv.log.read_text() and time.monotonic() < deadline:
            time.sleep(0.05)
        assert srv.dump_stacks("second") is True      # a hang shows the same frames twice
        assert srv.dump_stacks("third") is False      # MAX_DUMPS per server
        deadline = time.monotonic() + 20
        while srv.log.read_text().count(" in waiting_here") < 2 and time.monotonic() < deadline:
            time.sleep(0.05)
        text = srv.log.read_text()
        assert "[driver] SIGUSR2 to process group" in text and " in waiting_here" in text
        assert srv.proc.poll() is None                # still running after the dump
    finally:
        srv.stop()


def test_recorded_reports_slow_servers(tmp_path):
    import test_dflash2 as T

    class Fake:
        def __init__(self, s):
            self.slowest_s = s

        def stop(self):
            pass

    lines, rec = [], {"failures": []}
    with T.recorded(rec, {"a": Fake(3.0), "b": Fake(124.4)}, time.monotonic(), lambda: None,
                    log=lines.append):
        pass
    assert rec["slowest_request_s"] == {"a": 3.0, "b": 124.4}
    assert any("slow requests" in ln and "b 124.4" in ln for ln in lines)


def test_first_requests_are_timed_per_server():
    import test_dflash2 as T

    class Fake:
        def __init__(self, delay):
            self.delay, self.calls = delay, []

        def complete(self, prompt, **kw):
            self.calls.append((prompt, kw))
            time.sleep(self.delay)
            return {}

    servers = {"off": Fake(0.0), "d2k7": Fake(0.2)}
    rec = {"servers": {"off": {}, "d2k7": {}}}
    lines = []
    T.first_requests(servers, rec, lines.append)
    assert rec["servers"]["d2k7"]["first_request_s"] >= 0.2 > rec["servers"]["off"]["first_request_s"]
    assert servers["off"].calls[0][0] == T.FIRST_PROMPT and servers["off"].calls[0][1]["max_tokens"] == 8
    assert lines and lines[0].startswith("first request")
