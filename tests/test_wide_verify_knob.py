"""WIDE_VERIFY: a launcher knob (profiles.KNOBS) that reaches the server only as the environment
variable ONECARD_WIDE_VERIFY, read once by patch 0070; the argv never changes."""
import pytest

from onecard import plan as P
from onecard import profiles


def mk(env, root):
    return P.make_plan(env, root, python="python3")


def test_default_on_and_passed_by_env(tmp_path):
    plan = mk({"CTX": "long", "SPEC": "mtp"}, tmp_path)
    assert profiles.KNOBS["WIDE_VERIFY"].default == "1"
    assert plan.values["WIDE_VERIFY"].source == "default"
    assert plan.child_env["ONECARD_WIDE_VERIFY"] == "1"


def test_off_changes_env_not_argv(tmp_path):
    on = mk({"CTX": "long", "SPEC": "mtp"}, tmp_path)
    off = mk({"CTX": "long", "SPEC": "mtp", "WIDE_VERIFY": "0"}, tmp_path)
    assert off.child_env["ONECARD_WIDE_VERIFY"] == "0" and off.values["WIDE_VERIFY"].source == "env"
    assert off.argv == on.argv


def test_dotenv(tmp_path):
    (tmp_path / ".env").write_text("WIDE_VERIFY=0\n")
    assert mk({}, tmp_path).child_env["ONECARD_WIDE_VERIFY"] == "0"


@pytest.mark.parametrize("bad", ["2", "on", "auto"])
def test_bad_value_one_line_error(tmp_path, bad):
    with pytest.raises(P.PlanError) as exc:
        mk({"WIDE_VERIFY": bad}, tmp_path)
    msg = str(exc.value)
    assert "\n" not in msg and "WIDE_VERIFY" in msg and "0|1" in msg


def test_patch_accepts_what_the_launcher_passes():
    """The launcher passes "0" or "1"; patch 0070's reader accepts both (and auto/on/off)."""
    from pathlib import Path

    text = (Path(__file__).resolve().parent.parent / "patches" / "0070-wide-verify-triton-attn.patch").read_text()
    assert 'os.environ.get("ONECARD_WIDE_VERIFY", "auto")' in text
    assert '("", "auto", "1", "on", "true", "yes")' in text and '("0", "off", "false", "no")' in text


def test_triton_autotune_cache_on_unless_set(tmp_path):
    """The launcher asks Triton to keep autotune winners (FLA GDN kernels retune at every boot
    otherwise); an explicit TRITON_CACHE_AUTOTUNING, even 0, is the user's."""
    assert mk({}, tmp_path).child_env["TRITON_CACHE_AUTOTUNING"] == "1"
    assert "TRITON_CACHE_AUTOTUNING" not in mk({"TRITON_CACHE_AUTOTUNING": "0"}, tmp_path).child_env


def test_one_triton_cache_dir_unless_set(tmp_path):
    """Every profile's server shares one Triton cache (vLLM's AOT compile would give each
    configuration hash its own, and torch puts TRITON_CACHE_DIR under it when unset); a user's
    TRITON_CACHE_DIR is left alone."""
    from pathlib import Path

    assert mk({}, tmp_path).child_env["TRITON_CACHE_DIR"] == str(Path.home() / ".triton" / "cache")
    assert "TRITON_CACHE_DIR" not in mk({"TRITON_CACHE_DIR": "/x"}, tmp_path).child_env


def test_cuda_jit_cache_sized_for_flash_attention_unless_set(tmp_path):
    """FA2 on a GPU its sm_80 kernels do not fit is compiled from PTX by the driver (107.8 s per
    module on the H200); the launcher sizes the driver's JIT cache to its 4 GiB maximum so the
    modules survive between boots; a user's CUDA_CACHE_MAXSIZE is left alone."""
    assert mk({}, tmp_path).child_env["CUDA_CACHE_MAXSIZE"] == "4294967296"
    assert "CUDA_CACHE_MAXSIZE" not in mk({"CUDA_CACHE_MAXSIZE": "1000"}, tmp_path).child_env


def test_wide_decode_on_by_default_and_passed_by_env(tmp_path):
    """WIDE_DECODE (patch 0070's ONECARD_WIDE_DECODE): auto by default (on since session 28: job 31
    on an H100, SPEC=off 26-41 % faster per step at 32k / 72k, the same text; int4 too again since
    session 31: stock int4 decode returned NaN, ours did not), sent either way, silent by default;
    an explicit 1 notes it has no effect where decode is not TRITON_ATTN with int8/int4 KV or the
    wide-verify kernel is off; int4 with stock decode (WIDE_DECODE=0 or WIDE_VERIFY=0) is no longer
    warned about (patch 0021 removed stock int4's NaN, session 32); the argv never changes."""
    plan = mk({"CTX": "long", "SPEC": "off"}, tmp_path)
    assert profiles.KNOBS["WIDE_DECODE"].default == "auto" and plan.child_env["ONECARD_WIDE_DECODE"] == "auto"
    assert not any(n.startswith("WIDE_DECODE") for n in plan.notes)
    i4 = mk({"CTX": "long", "SPEC": "off", "KV": "int4_per_token_head"}, tmp_path)
    assert i4.child_env["ONECARD_WIDE_DECODE"] == "auto" and i4.argv != plan.argv
    assert not any("WIDE_DECODE" in n or "stock int4" in n for n in i4.notes)
    i4on = mk({"CTX": "long", "SPEC": "off", "KV": "int4_per_token_head", "WIDE_DECODE": "1"}, tmp_path)
    assert i4on.child_env["ONECARD_WIDE_DECODE"] == "1" and not any("WIDE_DECODE" in n for n in i4on.notes)
    i4off = mk({"CTX": "long", "SPEC": "off", "KV": "int4_per_token_head", "WIDE_DECODE": "0"}, tmp_path)
    assert i4off.child_env["ONECARD_WIDE_DECODE"] == "0" and not any("stock int4" in n for n in i4off.notes)
    i4wv0 = mk({"CTX": "long", "SPEC": "off", "KV": "int4_per_token_head", "WIDE_VERIFY": "0"}, tmp_path)
    assert not any("stock int4" in n or "KV=int4_per_token_head" in n for n in i4wv0.notes)
    for env in ({"CTX": "fast", "SPEC": "off"}, {"CTX": "long", "SPEC": "off", "WIDE_VERIFY": "0"}):
        assert not any(n.startswith("WIDE_DECODE") for n in mk(env, tmp_path).notes)
    off = mk({"CTX": "long", "SPEC": "off", "WIDE_DECODE": "0"}, tmp_path)
    assert off.child_env["ONECARD_WIDE_DECODE"] == "0" and off.argv == plan.argv
    assert not any(n.startswith("WIDE_DECODE") for n in off.notes)
    fast = mk({"CTX": "fast", "SPEC": "off", "WIDE_DECODE": "1"}, tmp_path)
    assert any(n.startswith("WIDE_DECODE=1 has no effect with KV=bf16") for n in fast.notes)
    wv0 = mk({"CTX": "long", "SPEC": "off", "WIDE_DECODE": "1", "WIDE_VERIFY": "0"}, tmp_path)
    assert any(n.startswith("WIDE_DECODE=1 has no effect with WIDE_VERIFY=0") for n in wv0.notes)
    with pytest.raises(P.PlanError, match="WIDE_DECODE"):
        mk({"WIDE_DECODE": "maybe"}, tmp_path)


def test_mtp_draft_wide_knob_passed_by_env_with_notes(tmp_path):
    """MTP_DRAFT_WIDE (patch 0087's ONECARD_MTP_DRAFT_WIDE): 1 by default, sent either way, silent
    by default; an explicit value notes where it does nothing (no MTP drafter, the wide-verify
    kernel off, KV the kernel does not run); bad values are one line; the argv never changes."""
    plan = mk({"CTX": "long", "SPEC": "mtp"}, tmp_path)
    assert profiles.KNOBS["MTP_DRAFT_WIDE"].default == "1" and plan.child_env["ONECARD_MTP_DRAFT_WIDE"] == "1"
    assert not any(n.startswith("MTP_DRAFT_WIDE") for n in plan.notes)
    for env in ({"CTX": "long", "SPEC": "off"}, {"CTX": "fast", "SPEC": "mtp"}):
        assert not any(n.startswith("MTP_DRAFT_WIDE") for n in mk(env, tmp_path).notes)
    ab = mk({"CTX": "long", "SPEC": "mtp", "MTP_DRAFT_WIDE": "0"}, tmp_path)
    assert ab.child_env["ONECARD_MTP_DRAFT_WIDE"] == "0" and ab.argv == plan.argv
    assert not any(n.startswith("MTP_DRAFT_WIDE") for n in ab.notes)
    for env, why in (({"CTX": "long", "SPEC": "off"}, "with SPEC=off"),
                     ({"CTX": "long", "SPEC": "mtp", "WIDE_VERIFY": "0"}, "with WIDE_VERIFY=0"),
                     ({"CTX": "fast", "SPEC": "mtp"}, "with KV=bf16")):
        notes = mk({**env, "MTP_DRAFT_WIDE": "0"}, tmp_path).notes
        assert any(n.startswith(f"MTP_DRAFT_WIDE=0 has no effect {why}") for n in notes), (env, notes)
    with pytest.raises(P.PlanError, match="MTP_DRAFT_WIDE"):
        mk({"MTP_DRAFT_WIDE": "maybe"}, tmp_path)


def _sent_with_note(tmp_path, knob: str, var: str, value: str, note: str) -> None:
    """A kernel knob on CTX=long SPEC=mtp: 'auto' sent by default with no note; `value` sent as
    itself, the argv unchanged, and a note starting with `note`."""
    plan = mk({"CTX": "long", "SPEC": "mtp"}, tmp_path)
    assert plan.child_env[var] == "auto"
    assert not any(n.startswith(knob) for n in plan.notes)
    on = mk({"CTX": "long", "SPEC": "mtp", knob: value}, tmp_path)
    assert on.child_env[var] == value and on.argv == plan.argv
    assert any(n.startswith(note) for n in on.notes), on.notes


def test_verify_row_split_knob_passed_by_env_with_notes(tmp_path):
    """VERIFY_ROW_SPLIT (the kernel's ONECARD_VERIFY_ROW_SPLIT): auto by default, sent either way;
    2 notes that it is unmeasured, or that it does nothing without verify blocks; bad values are
    one line naming the valid ones; the argv never changes."""
    _sent_with_note(tmp_path, "VERIFY_ROW_SPLIT", "ONECARD_VERIFY_ROW_SPLIT", "2",
                    "VERIFY_ROW_SPLIT=2: verify blocks of 9..16 tokens")
    assert any(n.startswith("VERIFY_ROW_SPLIT=2 has no effect with SPEC=off")
               for n in mk({"CTX": "long", "SPEC": "off", "VERIFY_ROW_SPLIT": "2"}, tmp_path).notes)
    assert any(n.startswith("VERIFY_ROW_SPLIT=2 has no effect with WIDE_VERIFY=0") for n in mk(
        {"CTX": "long", "SPEC": "mtp", "VERIFY_ROW_SPLIT": "2", "WIDE_VERIFY": "0"}, tmp_path).notes)
    with pytest.raises(P.PlanError, match="VERIFY_ROW_SPLIT.*auto.*1.*2"):
        mk({"VERIFY_ROW_SPLIT": "4"}, tmp_path)


def test_kernel_reads_verify_row_split(monkeypatch):
    """The kernel's side: auto -> one program; 1 / 2 -> that split for 128-row blocks only (the
    environment reader itself: test_kernel_env_settings)."""
    wv = pytest.importorskip("onecard.kernels.wide_verify")
    torch = pytest.importorskip("torch")
    cpu = torch.device("cpu")
    monkeypatch.setattr(wv, "_ROW_SPLIT_SETTING", None)
    assert wv.default_row_split(2, 128, 256, cpu) == 1
    monkeypatch.setattr(wv, "_ROW_SPLIT_SETTING", 2)
    assert wv.default_row_split(2, 128, 256, cpu) == 2 and wv.default_row_split(2, 64, 256, cpu) == 1


def test_patch_reads_wide_decode_auto_by_default():
    """The server side without the launcher: unset / auto -> None, 1 / on -> True (forward: every
    KV dtype on the wide kernel, int4 included since session 31), 0 / off -> stock decode."""
    from pathlib import Path

    text = (Path(__file__).resolve().parent.parent / "patches" / "0070-wide-verify-triton-attn.patch").read_text()
    assert 'os.environ.get("ONECARD_WIDE_DECODE", "auto")' in text
    assert 'if raw in ("", "auto"):\n+        return None' in text
    assert 'if raw in ("1", "on", "true", "yes"):\n+        return True' in text
    assert 'if raw in ("0", "off", "false", "no"):' in text
    assert "self._onecard_wide_decode = (\n+            _ONECARD_WIDE_DECODE is not False\n+        )" in text
    assert "and self._kv_quant_mode != KVQuantMode.INT4_PER_TOKEN_HEAD" not in text


def test_verify_flat_words_knob_passed_by_env_with_notes(tmp_path):
    """VERIFY_FLAT_WORDS (the kernel's ONECARD_VERIFY_FLAT_WORDS): auto by default, sent either
    way; an explicit 0 / 1 notes when it does nothing (wide-verify off, bf16 KV); bad values are one
    line naming the valid ones; the argv never changes."""
    plan = mk({"CTX": "long", "SPEC": "mtp"}, tmp_path)
    assert plan.child_env["ONECARD_VERIFY_FLAT_WORDS"] == "auto"
    assert not any(n.startswith("VERIFY_FLAT_WORDS") for n in plan.notes)
    for v in ("0", "1"):
        on = mk({"CTX": "long", "SPEC": "mtp", "VERIFY_FLAT_WORDS": v}, tmp_path)
        assert on.child_env["ONECARD_VERIFY_FLAT_WORDS"] == v and on.argv == plan.argv
        assert not any(n.startswith("VERIFY_FLAT_WORDS") for n in on.notes)
    assert any(n.startswith("VERIFY_FLAT_WORDS=1 has no effect with KV=bf16") for n in mk(
        {"CTX": "fast", "SPEC": "mtp", "VERIFY_FLAT_WORDS": "1"}, tmp_path).notes)
    assert any(n.startswith("VERIFY_FLAT_WORDS=0 has no effect with WIDE_VERIFY=0") for n in mk(
        {"CTX": "long", "SPEC": "mtp", "VERIFY_FLAT_WORDS": "0", "WIDE_VERIFY": "0"}, tmp_path).notes)
    with pytest.raises(P.PlanError, match="VERIFY_FLAT_WORDS.*auto.*0.*1"):
        mk({"VERIFY_FLAT_WORDS": "2"}, tmp_path)


def test_verify_qk_int8_knob_passed_by_env_with_notes(tmp_path):
    """VERIFY_QK_INT8 (the kernel's ONECARD_VERIFY_QK_INT8): auto (off) by default and sent either
    way; 1 notes what it changes (numerics), or that it does nothing (bf16 / int4 KV, wide-verify
    off); bad values are one line naming the valid ones; the argv never changes."""
    _sent_with_note(tmp_path, "VERIFY_QK_INT8", "ONECARD_VERIFY_QK_INT8", "1",
                    "VERIFY_QK_INT8=1: the wide-verify kernel's Q.K^T is an int8 dot")
    off = mk({"CTX": "long", "SPEC": "mtp", "VERIFY_QK_INT8": "0"}, tmp_path)
    assert off.child_env["ONECARD_VERIFY_QK_INT8"] == "0" and not any(
        n.startswith("VERIFY_QK_INT8") for n in off.notes)
    assert any(n.startswith("VERIFY_QK_INT8=1 has no effect with KV=bf16") for n in mk(
        {"CTX": "fast", "SPEC": "mtp", "VERIFY_QK_INT8": "1"}, tmp_path).notes)
    assert any(n.startswith("VERIFY_QK_INT8=1 has no effect with KV=int4_per_token_head") for n in mk(
        {"CTX": "long", "SPEC": "mtp", "KV": "int4_per_token_head", "VERIFY_QK_INT8": "1"}, tmp_path).notes)
    assert any(n.startswith("VERIFY_QK_INT8=1 has no effect with WIDE_VERIFY=0") for n in mk(
        {"CTX": "long", "SPEC": "mtp", "VERIFY_QK_INT8": "1", "WIDE_VERIFY": "0"}, tmp_path).notes)
    with pytest.raises(P.PlanError, match="VERIFY_QK_INT8.*auto.*0.*1"):
        mk({"VERIFY_QK_INT8": "yes"}, tmp_path)


def test_kernel_reads_verify_qk_int8(monkeypatch):
    """The kernel's side: auto -> on for int8 page-tile launches on a GPU with Hopper's shared
    memory (never on the CPU or an sm_8x-sized block); 0 / 1 -> that, for int8 page-tile launches
    only (int4 / bf16 and tiles that straddle pages keep the bf16 dot)."""
    wv = pytest.importorskip("onecard.kernels.wide_verify")
    torch = pytest.importorskip("torch")
    cpu = torch.device("cpu")
    monkeypatch.setattr(wv, "_QK_INT8_SETTING", None)
    monkeypatch.setattr(wv, "QK_INT8_HOPPER", True)
    assert wv.default_qk_int8(2, True, cpu) is False and wv.default_qk_int8(2, True) is False
    monkeypatch.setattr(wv, "block_shared", lambda d: 232448)
    assert wv.default_qk_int8(2, True, cpu) is True
    assert wv.default_qk_int8(2, False, cpu) is False
    assert wv.default_qk_int8(4, True, cpu) is False and wv.default_qk_int8(0, True, cpu) is False
    monkeypatch.setattr(wv, "QK_INT8_HOPPER", False)
    assert wv.default_qk_int8(2, True, cpu) is False
    monkeypatch.setattr(wv, "QK_INT8_HOPPER", True)
    monkeypatch.setattr(wv, "block_shared", lambda d: 101376)  # a 3090's block: not timed there
    assert wv.default_qk_int8(2, True, cpu) is False
    monkeypatch.setattr(wv, "_QK_INT8_SETTING", False)
    monkeypatch.setattr(wv, "block_shared", lambda d: 232448)
    assert wv.default_qk_int8(2, True, cpu) is False
    monkeypatch.setattr(wv, "_QK_INT8_SETTING", True)
    monkeypatch.setattr(wv, "block_shared", lambda d: 101376)
    assert wv.default_qk_int8(2, True, cpu) is True
    assert wv.default_qk_int8(2, False, cpu) is False
    assert wv.default_qk_int8(4, True, cpu) is False and wv.default_qk_int8(0, False, cpu) is False


def test_kernel_reads_verify_flat_words(monkeypatch):
    """The kernel's side: auto -> the GPU's default (never on the CPU, never for bf16); 0 / 1 ->
    that load for int8 / int4 (the environment reader itself: test_kernel_env_settings)."""
    wv = pytest.importorskip("onecard.kernels.wide_verify")
    torch = pytest.importorskip("torch")
    cpu = torch.device("cpu")
    monkeypatch.setattr(wv, "_FLAT_WORDS_SETTING", None)
    monkeypatch.setattr(wv, "FLAT_WORDS_HOPPER", True)
    assert wv.default_flat_words(2, cpu) is False  # no Hopper shared memory on the CPU
    monkeypatch.setattr(wv, "block_shared", lambda d: 232448)
    assert wv.default_flat_words(2, cpu) is True and wv.default_flat_words(4, cpu) is True
    assert wv.default_flat_words(0, cpu) is False  # bf16 reads no words
    monkeypatch.setattr(wv, "FLAT_WORDS_HOPPER", False)
    assert wv.default_flat_words(2, cpu) is False
    monkeypatch.setattr(wv, "_FLAT_WORDS_SETTING", True)
    monkeypatch.setattr(wv, "block_shared", lambda d: 101376)
    assert wv.default_flat_words(4, cpu) is True and wv.default_flat_words(0, cpu) is False


@pytest.mark.parametrize("reader, var, cases, bad, valid", [
    ("_row_split_setting", "ONECARD_VERIFY_ROW_SPLIT", (("1", 1), (" 2 ", 2)), "3", "auto, 1, 2"),
    ("_flat_words_setting", "ONECARD_VERIFY_FLAT_WORDS", (("0", False), (" 1 ", True)), "yes",
     "auto, 0, 1"),
    ("_qk_int8_setting", "ONECARD_VERIFY_QK_INT8", (("0", False), ("1", True)), "on", "auto, 0, 1"),
])
def test_kernel_env_settings(monkeypatch, reader, var, cases, bad, valid):
    """The kernel's environment knobs (read once at import in the server): auto / empty -> None,
    each valid value -> its setting, anything else one line naming the valid ones."""
    wv = pytest.importorskip("onecard.kernels.wide_verify")
    read = getattr(wv, reader)
    for raw, want in (("auto", None), ("", None), *cases):
        monkeypatch.setenv(var, raw)
        assert read() == want
    monkeypatch.setenv(var, bad)
    with pytest.raises(ValueError, match=f"{var}='{bad}' is not valid; valid: {valid}"):
        read()
