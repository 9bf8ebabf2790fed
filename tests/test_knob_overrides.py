"""onecard.profiles.knob_overrides: the one KNOB=VALUE rule that job 61's decode arms
(gpu/jobs/61-kvarn-serve.py parse_arms) and SPEC_KV_KNOBS (tests/gpu/spec_kv_sweep.py) share."""
from __future__ import annotations

import importlib.util
import subprocess
import sys
from pathlib import Path

import pytest

from onecard import profiles

REPO = Path(__file__).resolve().parent.parent


def test_knob_words_become_a_dict_last_word_winning():
    assert profiles.knob_overrides(["KVARN_WINDOW=2", "KVARN_SINKS=1", "KVARN_WINDOW=3"]) == {
        "KVARN_WINDOW": "3", "KVARN_SINKS": "1"}
    assert profiles.knob_overrides([]) == {}
    assert profiles.knob_overrides(["EXTRA_ARGS=--seed=0"]) == {"EXTRA_ARGS": "--seed=0"}  # split at the first =


@pytest.mark.parametrize("bad", ["KVARN_WINDOW", "KVARN_WINDOW=", "=1", "kvarn_window=3", "KVARN_WINDW=3",
                                 "ONECARD_KVARN_WINDOW=3"])
def test_a_bad_word_is_one_line_naming_every_knob(bad):
    with pytest.raises(ValueError) as e:
        profiles.knob_overrides(["CTX=huge", bad], "SOMETHING word")
    msg = str(e.value)
    assert "\n" not in msg and msg.startswith(f"SOMETHING word {bad!r} is not valid; valid: KNOB=VALUE")
    assert all(k in msg for k in profiles.KNOBS)


def test_both_callers_refuse_a_name_that_is_not_a_launcher_knob():
    spec = importlib.util.spec_from_file_location("job61_knobs", REPO / "gpu" / "jobs" / "61-kvarn-serve.py")
    job61 = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(job61)
    assert job61.parse_arms("w:huge:1:KVARN_WINDOW=2")[0][4] == {"KVARN_WINDOW": "2"}
    with pytest.raises(ValueError, match=r"decode arm 'w:huge:1:KVARN_WINDW=2': field 'KVARN_WINDW=2' is not "
                                         r"valid; valid: KNOB=VALUE"):
        job61.parse_arms("w:huge:1:KVARN_WINDW=2")
    sys.path.insert(0, str(REPO / "tests" / "gpu"))
    import spec_kv_sweep as sk

    assert sk.knob_overrides(" KVARN_DRAFT_HOST=1 ") == {"KVARN_DRAFT_HOST": "1"}
    with pytest.raises(ValueError, match=r"SPEC_KV_KNOBS word 'KVARN_DRAFTHOST=1' is not valid; valid: KNOB=VALUE"):
        sk.knob_overrides("KVARN_DRAFTHOST=1")


def test_job61_imports_no_vllm_or_torch():
    """The job's helper module loads on a machine without vLLM/torch on the path (the knob table
    is stdlib only)."""
    code = (f"import importlib.util, sys; s = importlib.util.spec_from_file_location('j', {str(REPO / 'gpu/jobs/61-kvarn-serve.py')!r}); "
            "m = importlib.util.module_from_spec(s); s.loader.exec_module(m); "
            "print(sorted(x for x in ('vllm', 'torch', 'triton') if x in sys.modules))")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, cwd="/")
    assert r.returncode == 0 and r.stdout.strip() == "[]", r.stderr


def test_server_env_is_the_one_table_of_knob_variables():
    """Every server variable the plan sets from a knob goes through profiles.SERVER_ENV (job 31
    refuses an arm's ONECARD_* field that the launcher would override, by that table)."""
    assert set(profiles.SERVER_ENV) <= set(profiles.KNOBS)
    assert all(v.startswith("ONECARD_") for v in profiles.SERVER_ENV.values())
    src = (REPO / "onecard" / "plan.py").read_text()
    assert 'child_env["ONECARD_' not in src
    assert all(f'_to_server(plan, "{k}")' in src for k in profiles.SERVER_ENV)
