"""PREFILL_LAUNCH and KVARN_GRAPHS: launcher knobs that reach the server only as environment
variables (ONECARD_PREFILL_LAUNCH, read by patch 0083; ONECARD_KVARN_GRAPHS, read by the KVarN
backend); bad values are refused before the boot with one line naming what is valid."""

import pytest

from onecard import plan as P


def mk(env, root):
    return P.make_plan(env, root, python="python3")


@pytest.fixture
def kvarn_installed(fake_features):
    return fake_features


def test_prefill_launch_default_auto_and_env_only(tmp_path):
    auto = mk({"CTX": "long", "SPEC": "off"}, tmp_path)
    assert auto.child_env["ONECARD_PREFILL_LAUNCH"] == "auto"
    stock = mk({"CTX": "long", "SPEC": "off", "PREFILL_LAUNCH": "stock"}, tmp_path)
    assert stock.child_env["ONECARD_PREFILL_LAUNCH"] == "stock" and stock.argv == auto.argv
    tuned = mk({"CTX": "long", "SPEC": "off", "PREFILL_LAUNCH": " 64:64:8:2 "}, tmp_path)
    assert tuned.child_env["ONECARD_PREFILL_LAUNCH"] == "64:64:8:2" and tuned.argv == stock.argv


@pytest.mark.parametrize("bad", ["64:64:8", "48:64:8:2", "64:512:8:2", "64:64:3:2", "64:64:8:0", "fast", "Auto"])
def test_prefill_launch_bad_value_one_line(tmp_path, bad):
    with pytest.raises(P.PlanError) as exc:
        mk({"PREFILL_LAUNCH": bad}, tmp_path)
    msg = str(exc.value)
    assert "\n" not in msg and msg.startswith("PREFILL_LAUNCH=") and "valid: auto, stock, or BLOCK_M:TILE" in msg


def test_launcher_and_patch_parsers_agree():
    """The launcher's check and patch 0083's parser (read from the patch file) accept and refuse
    the same values."""
    from pathlib import Path

    text = (Path(P.__file__).resolve().parent.parent / "patches" / "0083-prefill-launch.patch").read_text()
    body = text[text.index("+def onecard_parse_prefill_launch"):text.index("+ONECARD_PREFILL_LAUNCH =")]
    src = "\n".join(ln[1:] for ln in body.splitlines())
    ns: dict = {}
    exec(src, ns)  # noqa: S102 - the patch's own function, from this repository
    for v in ("stock", "auto", "16:16:2:1", "64:64:8:2", "256:256:16:5", "128:32:4:3", "64:64:8", "32:48:4:2",
              "512:64:8:2", "64:64:1:2", "64:64:8:6", "x", "8:64:8:2"):
        try:
            ours = P.parse_prefill_launch(v) == v
        except P.PlanError:
            ours = False
        try:
            ns["onecard_parse_prefill_launch"](v)
            theirs = True
        except ValueError:
            theirs = False
        assert ours == theirs, v


@pytest.mark.parametrize("knob,spec,default,other", [
    ("KVARN_GRAPHS", "off", "1", "0"),
    ("KVARN_DRAFT_HOST", "mtp", "1", "0"),  # on since session 17 (job 31: 19.7 vs 24.5 ms per step; job 63 exact)
])
def test_kvarn_env_knob_passed_with_huge_only(tmp_path, kvarn_installed, knob, spec, default, other):
    env = "ONECARD_" + knob
    huge = mk({"CTX": "huge", "SPEC": spec}, tmp_path)
    assert huge.child_env[env] == default
    changed = mk({"CTX": "huge", "SPEC": spec, knob: other}, tmp_path)
    assert changed.child_env[env] == other and changed.argv == huge.argv
    long_ = mk({"CTX": "long", "SPEC": spec, knob: other}, tmp_path)
    assert env not in long_.child_env
    assert any(f"{knob}={other} has no effect" in n for n in long_.notes)
    with pytest.raises(P.PlanError) as exc:
        mk({"CTX": "huge", knob: "yes"}, tmp_path)
    assert "\n" not in str(exc.value) and "0|1" in str(exc.value)
