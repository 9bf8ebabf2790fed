"""The fairness contract refuses each trap with a clear reason."""
import copy

import pytest

from onecard.bench import fairness


def _result(**over):
    r = {
        "kind": "ladder", "verdict": "VALID", "partial": False,
        "provenance": {
            "prompt_set": {"id": "prose", "hash": "abc"}, "sampling": {"temperature": 0.0},
            "max_tokens": 256, "token_count_source": "usage.completion_tokens",
            "warmup": {"discarded": 1}, "git": {"commit": "c1"}, "vllm_version": "0.27.1",
            "patch_series": {"hash": "s1"}, "gpu": {"gpus": [{"name": "H200"}], "driver": "1"},
            "server": {"model": "m", "max_model_len": 4096}, "env_knobs": {"VLLM_X": "1"},
        },
        "traffic": {"requests": 4, "completion_tokens": 1024, "failed": 0},
        "metrics": {"available": True, "counters": {"requests_finished": 4, "generation_tokens": 1024},
                    "engines": ["0"]},
    }
    for k, v in over.items():
        cur = r
        parts = k.split("__")
        for p in parts[:-1]:
            cur = cur[p]
        cur[parts[-1]] = v
    return r


def test_clean_result_is_valid():
    assert fairness.verdict_for(_result()) == ("VALID", [])


@pytest.mark.parametrize("over, needle", [
    ({"provenance__token_count_source": "sse_chunks"}, "not tokens"),
    ({"provenance__warmup": {"discarded": 0}}, "warmup"),
    ({"metrics__counters": {"requests_finished": 6, "generation_tokens": 1024}}, "other client traffic"),
    ({"metrics__counters": {"requests_finished": 4, "generation_tokens": 2000}}, "other client traffic"),
    ({"metrics__engines": ["0", "1"]}, "replica"),
    ({"metrics__running_peak": 3, "traffic__concurrency": 2}, "at once"),
    ({"traffic__failed": 1}, "failed"),
    ({"partial": True}, "partial"),
    ({"kind": "prefill"}, "salted"),
])
def test_result_traps_make_it_invalid(over, needle):
    verdict, reasons = fairness.verdict_for(_result(**over))
    assert verdict == "INVALID"
    assert any(needle in r for r in reasons), reasons


def test_prefill_with_salt_is_fine():
    r = _result(kind="prefill")
    r["provenance"]["prompt_set"]["salted"] = True
    assert fairness.verdict_for(r)[0] == "VALID"


def test_no_metrics_is_a_warning():
    verdict, reasons = fairness.verdict_for(_result(metrics={}))
    assert verdict == "VALID" and "not verified" in reasons[0]


@pytest.mark.parametrize("over, needle", [
    ({"provenance__prompt_set": {"id": "prose", "hash": "zzz"}}, "different prompts"),
    ({"provenance__sampling": {"temperature": 0.7}}, "different sampling"),
    ({"provenance__max_tokens": 128}, "different output lengths"),
    ({"provenance__token_count_source": "server_counters"}, "token-count sources"),
    ({"provenance__warmup": {"discarded": 0}}, "no warmup"),
    ({"verdict": "INVALID"}, "result B is INVALID"),
    ({"kind": "depth"}, "different benchmarks"),
])
def test_comparison_refusals(over, needle):
    v = fairness.compare(_result(), _result(**over))
    assert v.status == "REFUSED"
    assert any(needle in r for r in v.reasons), v.reasons


def test_confounded_when_more_than_the_knob_differs():
    a, b = _result(), _result()
    b["provenance"]["env_knobs"] = {"VLLM_X": "2"}
    v = fairness.compare(a, b, knob="VLLM_X")
    assert v.status == "UNRESOLVED" and "boot" in v.reasons[0]  # one boot per arm
    b["provenance"]["git"] = {"commit": "c2"}
    v = fairness.compare(a, b, knob="VLLM_X")
    assert v.status == "CONFOUNDED" and "git.commit" in v.reasons[0]
    assert fairness.compare(a, copy.deepcopy(a)).status == "OK"


def test_ab_one_boot_per_arm_is_unresolved():
    v = fairness.ab_verdict([100.0], [130.0], "K")
    assert v.status == "UNRESOLVED" and "boot floor unknown" in v.reasons[0]


def test_ab_effect_below_twice_the_floor_is_unresolved():
    v = fairness.ab_verdict([100.0, 104.0], [106.0, 108.0], "K")  # floor 4, effect 5
    assert v.status == "UNRESOLVED" and v.details["floor"] == 4.0


def test_ab_effect_above_twice_the_floor_resolves():
    v = fairness.ab_verdict([100.0, 102.0], [120.0, 121.0], "K")
    assert v.status == "RESOLVED" and v.details["effect"] == pytest.approx(19.5)


def test_ab_confounded_comparison_wins():
    v = fairness.ab_verdict([1.0, 1.0], [9.0, 9.0], "K", [fairness.Verdict("CONFOUNDED", ["x"])])
    assert v.status == "CONFOUNDED"
