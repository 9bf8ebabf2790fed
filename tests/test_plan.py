"""env -> ServePlan: golden argv per CTX x SPEC, bad inputs, sources, API key handling."""
import importlib.machinery
import importlib.util
import os
import shlex
from pathlib import Path

import pytest

from onecard import plan as P

GOLDEN = Path(__file__).parent / "golden" / "launch"


@pytest.fixture
def root(tmp_path):
    return tmp_path


@pytest.fixture
def features(fake_features, tmp_path):
    """Pretend KVarN and DFlash2 are installed (conftest.fake_features); a drafter dir too."""
    draft = tmp_path / "drafter"
    draft.mkdir()
    (draft / "config.json").write_text("{}")
    return draft


def mk(env, root, **kw):
    return P.make_plan(env, root, python="python3", **kw)


# huge + dflash2 (DFLASH_RING=1) reads a real sliding-window drafter config, which `features`'s
# DRAFT lacks: its argv is checked in tests/test_plan_dflash2_ring.py
COMBOS = [(c, s) for c in ("fast", "long", "huge") for s in ("off", "mtp", "dflash2") if (c, s) != ("huge", "dflash2")]


def test_huge_with_dflash2_without_rings_is_refused_before_boot(root, features):
    # DFLASH_RING=1 (auto with CTX=huge) is the only way: tests/test_plan_dflash2_ring.py
    for extra in ("", "--kv-cache-dtype-skip-layers 64 65 66 67 68"):  # the bf16-drafter route dies too
        with pytest.raises(P.PlanError, match="non-causal") as e:
            mk({"CTX": "huge", "SPEC": "dflash2", "DFLASH_RING": "0", "DRAFT": str(features), "EXTRA_ARGS": extra},
               root)
        assert "valid: DFLASH_RING=auto|1 with CTX=huge" in str(e.value) and "\n" not in str(e.value)
        assert "huge-dflash2-cpu" in str(e.value)


@pytest.mark.parametrize("ctx,spec", COMBOS)
def test_golden_argv(ctx, spec, root, features):
    env = {"CTX": ctx, "SPEC": spec, "DRAFT": "DRAFTDIR"} if spec != "dflash2" else {"CTX": ctx, "SPEC": spec}
    if spec == "dflash2":
        env["DRAFT"] = str(features)
    plan = mk(env, root)
    got = shlex.join(plan.argv).replace(str(features), "DRAFTDIR") + "\n"
    path = GOLDEN / f"{ctx}-{spec}.txt"
    if os.environ.get("UPDATE_GOLDEN"):
        path.write_text(got)
    assert got == path.read_text()
    # the argv's MAX_LEN with speculation is the pool's under the default GDN_DEFER=auto -> 1 (TP=1),
    # which reaches the server as a variable, not a flag
    assert plan.child_env.get("ONECARD_GDN_DEFER") == (None if spec == "off" else "1")


def test_sources(root):
    plan = mk({"CTX": "long", "PORT": "9000"}, root)
    assert plan.values["CTX"].source == "env"
    assert plan.values["PORT"].source == "env" and plan.get("PORT") == 9000
    assert plan.values["KV"].source == "profile"
    assert plan.values["HOST"].source == "default"
    assert plan.values["KV_MEM"].source == "profile"


def test_dotenv_and_env_precedence(root):
    (root / ".env").write_text("CTX=long\nPORT=1234\n")
    plan = mk({"PORT": "4321"}, root)
    assert plan.get("CTX") == "long" and plan.values["CTX"].source == ".env"
    assert plan.get("PORT") == 4321 and plan.values["PORT"].source == "env"


def test_kv_mem_units_and_auto(root):
    assert mk({"KV_MEM": "6G"}, root).get("KV_MEM") == 6 * 1024**3
    assert mk({"KV_MEM": "6000M"}, root).get("KV_MEM") == 6000 * 1024**2
    plan = mk({"KV_MEM": "auto", "GPU_UTIL": "0.9"}, root)
    assert "--gpu-memory-utilization" in plan.argv and "--kv-cache-memory-bytes" not in plan.argv
    assert any("CUDA-graph" in n for n in plan.notes)


def test_overrides(root):
    plan = mk({"CTX": "fast", "KV": "int8_per_token_head", "MAX_SEQS": "2", "PREFIX_CACHE": "0",
               "TOOLS": "0", "REASONING_PARSER": "none", "THINKING": "0", "GDN_PREFILL": "triton",
               "EXTRA_ARGS": "--seed 7", "SPEC_K": "2"}, root)
    a = plan.argv
    assert a[a.index("--kv-cache-dtype") + 1] == "int8_per_token_head" and "TRITON_ATTN" in a
    assert "--no-enable-prefix-caching" in a and "--enable-auto-tool-choice" not in a
    assert "--reasoning-parser" not in a and a[-2:] == ["--seed", "7"]
    assert '{"gdn_prefill_backend": "triton"}' in a
    assert '{"enable_thinking": false}' in a
    assert '"num_speculative_tokens":2' in a[a.index("--speculative-config") + 1]


def test_host_needs_key(root):
    with pytest.raises(P.PlanError, match="API key|VLLM_API_KEY"):
        mk({"HOST": "0.0.0.0"}, root)
    plan = mk({"HOST": "0.0.0.0", "VLLM_API_KEY": "sekrit"}, root)
    assert "sekrit" not in " ".join(plan.argv) and plan.child_env["VLLM_API_KEY"] == "sekrit"
    assert "sekrit" not in str(plan.to_json())
    for h in ("localhost", "::1", "127.0.0.1"):
        mk({"HOST": h}, root)


def test_key_from_dotenv_and_file(root):
    (root / ".env").write_text("VLLM_API_KEY=fromdotenv\n")
    assert mk({"HOST": "0.0.0.0"}, root).api_key == "fromdotenv"
    (root / ".env").unlink()
    kf = root / "api_key.txt"
    kf.write_text("fromfile\n")
    kf.chmod(0o644)
    with pytest.raises(P.PlanError, match="valid: 600"):
        mk({"HOST": "0.0.0.0"}, root)
    kf.chmod(0o600)
    plan = mk({"HOST": "0.0.0.0"}, root)
    assert plan.api_key == "fromfile" and plan.values["VLLM_API_KEY"].source == "api_key.txt"


def test_feature_refusals(root, monkeypatch, tmp_path):
    # a vLLM without the optional features' markers
    bare = tmp_path / "barevllm" / "vllm"
    bare.mkdir(parents=True)
    spec = importlib.machinery.ModuleSpec("vllm", None, is_package=True)
    spec.submodule_search_locations = [str(bare)]
    monkeypatch.setattr(importlib.util, "find_spec", lambda name: spec if name == "vllm" else None)
    with pytest.raises(P.PlanError, match="is not (installed into|applied to) this vLLM") as e:
        mk({"CTX": "huge"}, root)
    assert "\n" not in str(e.value)
    with pytest.raises(P.PlanError, match="is not (installed into|applied to) this vLLM"):
        mk({"SPEC": "dflash2"}, root)


def test_no_vllm_at_all_is_named_not_blamed_on_a_patch(root, monkeypatch):
    # session 23: a venv made with ./install.sh --venv DIR, started without VENV, ran the system
    # python3: SPEC=dflash2 said "patch 0080 is not applied", SPEC=off exec'd into ModuleNotFoundError
    monkeypatch.setattr(importlib.util, "find_spec", lambda name: None)
    for env in ({"CTX": "huge"}, {"SPEC": "dflash2"}):
        with pytest.raises(P.PlanError, match="no vLLM is installed for .*VENV=DIR") as e:
            mk(env, root)
        assert "\n" not in str(e.value) and "patch" not in str(e.value)
    assert mk({"SPEC": "off"}, root).argv  # a dry run stays machine-independent
    with pytest.raises(P.PlanError, match="no vLLM is installed for"):
        P.make_plan({"SPEC": "off", "MODEL": str(root)}, root, python="python3", check_paths=True)


BAD = [
    ({"CTX": "medium"}, "fast|long|huge"),
    ({"CTX": "FAST"}, "fast|long|huge"),
    ({"SPEC": "eagle"}, "off|mtp|dflash2"),
    ({"KV": "fp4"}, "valid"),
    ({"PREFIX_CACHE": "yes"}, "0|1"),
    ({"TOOLS": "true"}, "0|1"),
    ({"THINKING": "2"}, "0|1"),
    ({"LOOKUP": "on"}, "0|1"),
    ({"TOOL_PARSER": "json"}, "qwen3_coder"),
    ({"REASONING_PARSER": "deepseek"}, "qwen3|none"),
    ({"SSM_DTYPE": "fp8"}, "auto|bfloat16|float32"),
    ({"GDN_PREFILL": "cuda"}, "triton"),
    ({"PORT": "http"}, "1..65535"),
    ({"PORT": "70000"}, "1..65535"),
    ({"PORT": "0"}, "1..65535"),
    ({"MAX_LEN": "12"}, "256..1048576"),
    ({"MAX_LEN": "lots"}, "256..1048576"),
    ({"MAX_SEQS": "0"}, "1..256"),
    ({"MAX_SEQS": "1000"}, "1..256"),
    ({"GPU_UTIL": "1.5"}, "0.10..0.99"),
    ({"GPU_UTIL": "most"}, "0.10..0.99"),
    ({"KV_MEM": "lots"}, "K/M/G"),
    ({"KV_MEM": "-5G"}, "valid"),
    ({"SPEC": "mtp", "SPEC_K": "9"}, "1..7"),
    ({"SPEC": "mtp", "SPEC_K": "x"}, "1..7"),
    ({"SPEC": "off", "SPEC_K": "3"}, "SPEC=mtp"),
    ({"SPEC": "mtp", "DFLASH_TOKENS": "8"}, "SPEC=dflash2"),
    ({"SPEC": "mtp", "LOOKUP": "1"}, "SPEC=dflash2"),
    ({"HOST": "0.0.0.0"}, "VLLM_API_KEY"),
    ({"EXTRA_ARGS": "--seed 'unterminated"}, "shell words"),
    ({"EXTRA_ARGS": "--api-key abc"}, "VLLM_API_KEY"),
    # the listening address, the key and the preflight's figures, in every spelling vLLM reads
    ({"EXTRA_ARGS": "--host 0.0.0.0"}, "must not carry --host (the launcher sets --host); valid: HOST="),
    ({"EXTRA_ARGS": "--seed 1 --host=0.0.0.0"}, "must not carry --host"),
    ({"EXTRA_ARGS": "--ho 0.0.0.0"}, "must not carry --ho (the launcher sets --host)"),
    ({"EXTRA_ARGS": "--uds /tmp/s"}, "must not carry --uds"),
    ({"EXTRA_ARGS": "--api_key=abc"}, "VLLM_API_KEY"),
    ({"EXTRA_ARGS": "--config serve.yaml"}, "must not carry --config"),
    ({"EXTRA_ARGS": "--port 9"}, "valid: PORT="),
    ({"EXTRA_ARGS": "--max_model_len 999999"}, "valid: MAX_LEN="),
    ({"EXTRA_ARGS": "--max-num-seqs=64"}, "valid: MAX_SEQS="),
    ({"EXTRA_ARGS": "--kv-cache-memory-bytes 1"}, "valid: KV_MEM="),
    ({"EXTRA_ARGS": "--kv-cache-dtype fp8"}, "valid: KV="),
    ({"EXTRA_ARGS": "--speculative-config.num_speculative_tokens 9"}, "valid: SPEC="),
    ({"HOST": "0.0.0.0", "VLLM_API_KEY": "   "}, "VLLM_API_KEY in env is blank"),
    ({"EXTRA_ARGS": "--dtype float16"}, "float16"),
    ({"KV_MEM": "100M"}, "KV_MEM >="),
]


@pytest.mark.parametrize("env,needle", BAD, ids=[",".join(f"{k}={v}" for k, v in e.items()) for e, _ in BAD])
def test_bad_inputs_one_line(env, needle, root):
    with pytest.raises(P.PlanError) as e:
        mk(env, root)
    msg = str(e.value)
    assert needle in msg
    assert "\n" not in msg and "valid" in msg.lower()


def test_bad_dflash_tokens_and_missing_drafter(root, features):
    with pytest.raises(P.PlanError, match="7..15"):
        mk({"SPEC": "dflash2", "DFLASH_TOKENS": "20", "DRAFT": str(features)}, root)
    with pytest.raises(P.PlanError, match="needs a drafter"):
        mk({"SPEC": "dflash2", "DRAFT": str(root / "missing")}, root)
    with pytest.raises(P.PlanError, match="DFLASH_TOKENS"):
        mk({"SPEC": "dflash2", "SPEC_K": "3", "DRAFT": str(features)}, root)
    with pytest.raises(P.PlanError, match="CTX=huge"):
        mk({"CTX": "huge", "KV": "bf16"}, root)


def test_dflash_lookup_and_tokens(root, features):
    plan = mk({"SPEC": "dflash2", "DFLASH_TOKENS": "9", "LOOKUP": "1", "DRAFT": str(features)}, root)
    sc = plan.argv[plan.argv.index("--speculative-config") + 1]
    # fields of patches/0080-dflash2.patch's SpeculativeConfig (0.27.1 has no prompt_lookup for dflash)
    assert '"num_speculative_tokens":9' in sc and '"dflash2_lookup":true' in sc and '"method":"dflash2"' in sc
    plan = mk({"SPEC": "dflash2", "DFLASH_TOKENS": "9", "LOOKUP": "0", "DRAFT": str(features)}, root)
    assert '"dflash2_lookup":false' in plan.argv[plan.argv.index("--speculative-config") + 1]
    assert any("LOOKUP=0" in n for n in plan.notes)


def test_format_table_lists_every_value(root):
    plan = mk({"CTX": "long"}, root)
    t = P.format_table(plan)
    for name in plan.values:
        assert name in t
    assert "predicted pool" in t


def test_dotenv_fallback_parser():
    text = "# c\nexport CTX=long\nPORT = '9000'\nEXTRA_ARGS=\"--seed 1\"\nHOST=localhost # here\n"
    assert P._parse_dotenv(text) == {"CTX": "long", "PORT": "9000", "EXTRA_ARGS": "--seed 1", "HOST": "localhost"}
    with pytest.raises(P.PlanError, match="KEY=VALUE"):
        P._parse_dotenv("just words\n")


def test_dotenv_without_library(root, monkeypatch):
    import builtins

    real = builtins.__import__

    def fake(name, *a, **k):
        if name == "dotenv":
            raise ImportError(name)
        return real(name, *a, **k)

    monkeypatch.setattr(builtins, "__import__", fake)
    (root / ".env").write_text("CTX=long\n")
    assert mk({}, root).get("CTX") == "long"


def test_unknown_dotenv_key_is_noted(root):
    (root / ".env").write_text("CTXX=long\n")
    assert any("CTXX" in n for n in mk({}, root).notes)


def test_missing_model_checked_only_when_launching(root):
    with pytest.raises(P.PlanError, match="no config.json"):
        P.make_plan({"MODEL": str(root / "nope")}, root, python="python3", check_paths=True)
    mk({"MODEL": str(root / "nope")}, root)  # dry-run: fine


# ---------------------------------------------------------------- FlashInfer sampler at launch

def test_flashinfer_sampler_left_alone_when_nvcc_or_prebuilt_cache_exists(tmp_path):
    from onecard.plan import flashinfer_sampler
    no_spec = lambda name: None  # noqa: E731
    env, note = flashinfer_sampler({"CUDA_HOME": str(tmp_path)}, which=lambda n: "/usr/bin/nvcc", find_spec=no_spec)
    assert env == {} and "first boot" in note
    env, note = flashinfer_sampler({}, which=lambda n: None, find_spec=lambda n: object())
    assert env == {} and note is None


def test_flashinfer_sampler_off_without_nvcc_and_cache(tmp_path):
    from onecard.plan import flashinfer_sampler
    env, note = flashinfer_sampler({"CUDA_HOME": str(tmp_path)}, which=lambda n: None, find_spec=lambda n: None)
    assert env == {"VLLM_USE_FLASHINFER_SAMPLER": "0"} and "PyTorch" in note
    (tmp_path / "bin").mkdir()
    (tmp_path / "bin" / "nvcc").write_text("")
    env, _ = flashinfer_sampler({"CUDA_HOME": str(tmp_path)}, which=lambda n: None, find_spec=lambda n: None)
    assert env == {}


def test_flashinfer_sampler_respects_an_explicit_setting():
    from onecard.plan import flashinfer_sampler
    for v in ("0", "1"):
        assert flashinfer_sampler({"VLLM_USE_FLASHINFER_SAMPLER": v}, which=lambda n: None,
                                  find_spec=lambda n: None) == ({}, None)


def test_explicit_gpu_util_is_passed_beside_a_kv_pin_as_the_boot_free_memory_bar(tmp_path):
    from onecard.plan import make_plan
    argv = make_plan({"CTX": "fast"}, tmp_path).argv
    assert "--kv-cache-memory-bytes" in argv and "--gpu-memory-utilization" not in argv
    argv = make_plan({"CTX": "fast", "GPU_UTIL": "0.2"}, tmp_path).argv
    assert "--kv-cache-memory-bytes" in argv
    assert argv[argv.index("--gpu-memory-utilization") + 1] == "0.2"


def test_kvarn_preset(root, features):
    default = mk({"CTX": "huge"}, root)
    a = default.argv
    assert a[a.index("--kv-cache-dtype") + 1] == "kvarn_k4v2_g128" and default.get("KV") == "kvarn"
    v4 = mk({"CTX": "huge", "KVARN_PRESET": "k4v4_g128"}, root)
    a = v4.argv
    assert a[a.index("--kv-cache-dtype") + 1] == "kvarn_k4v4_g128" and v4.get("KV") == "kvarn_k4v4_g128"
    # 4-bit V: more bytes per token, so a smaller predicted pool at the same pin
    assert v4.prediction["pool_tokens"] < default.prediction["pool_tokens"]
    with pytest.raises(P.PlanError, match="k4v2_g128|k4v4_g128") as e:
        mk({"CTX": "huge", "KVARN_PRESET": "k8v8"}, root)
    assert "\n" not in str(e.value)
    long = mk({"CTX": "long", "KVARN_PRESET": "k4v4_g128"}, root)
    assert any("KVARN_PRESET=k4v4_g128 has no effect" in n for n in long.notes)
    assert "kvarn" not in " ".join(long.argv)


def test_kvarn_window_and_sinks_reach_the_server_and_size_the_stage(root, features):
    """KVARN_WINDOW (1|2|3) and KVARN_SINKS (1|2) reach the server as ONECARD_KVARN_WINDOW /
    ONECARD_KVARN_SINKS; the prediction's stage is sized for the same read rule (window 3 +
    two sinks, the default since session 17: 7 slots per request; window 2 + one sink: 5); bad
    values are one-line errors."""
    from onecard import memory

    w3 = mk({"CTX": "huge"}, root)
    assert w3.child_env["ONECARD_KVARN_WINDOW"] == "3" and w3.child_env["ONECARD_KVARN_SINKS"] == "2"
    w2 = mk({"CTX": "huge", "KVARN_WINDOW": "2", "KVARN_SINKS": "1"}, root)
    assert w2.child_env["ONECARD_KVARN_WINDOW"] == "2" and w2.child_env["ONECARD_KVARN_SINKS"] == "1"
    seqs = int(w3.get("MAX_SEQS"))
    grow = w3.prediction["vram"]["kvarn_stage"] - w2.prediction["vram"]["kvarn_stage"]
    slot = 128 * 4 * 256 * 2 * 2  # one tile of K and V, fp16, 27B geometry
    assert grow > 0 and grow % (2 * seqs * slot) == 0  # two more slots per request and layer
    g = memory.QWEN38_27B
    assert memory.kvarn_stage_bytes(g, "kvarn", 2, window=3, sinks=2) == 17 * (7 * 2 + 4) * slot
    for knob, bad, valid in (("KVARN_WINDOW", "4", "1|2|3"), ("KVARN_SINKS", "3", "1|2")):
        with pytest.raises(P.PlanError) as e:
            mk({"CTX": "huge", knob: bad}, root)
        assert valid in str(e.value) and "\n" not in str(e.value)
    long = mk({"CTX": "long", "KVARN_SINKS": "2"}, root)
    assert any("KVARN_SINKS=2 has no effect" in n for n in long.notes)
    assert "ONECARD_KVARN_SINKS" not in long.child_env


def test_extra_args_that_vllm_reads_as_other_flags_pass(root):
    """Flags the plan does not own pass through, including ones that share a prefix with an
    owned flag (--config-format, --max-num-batched-tokens-x) and an ambiguous prefix (--ma)."""
    from onecard.plan import owned_flag

    for word in ("--seed", "--config-format", "--max-num-batched-tokens-x", "--ma", "--", "-O3",
                 "--kv-cache-dtype-skip-layers", "0.0.0.0", "--served-model-name-x"):
        assert owned_flag(word) is None, word
    plan = mk({"EXTRA_ARGS": "--seed 1 --enable-chunked-prefill"}, root)
    assert plan.argv[-3:] == ["--seed", "1", "--enable-chunked-prefill"]


def test_prefill_chunk_is_pinned_and_checked(root):
    """PREFILL_CHUNK pins --max-num-batched-tokens (vLLM would pick 8192 on an H200 and 2048 on a
    3090); below one decode step's tokens it is refused in one line naming the valid range; in
    EXTRA_ARGS the flag is refused and names the knob."""
    from onecard.plan import owned_flag

    plan = mk({"CTX": "long", "SPEC": "mtp"}, root)
    i = plan.argv.index("--max-num-batched-tokens")
    assert plan.argv[i + 1] == "2048"
    plan = mk({"PREFILL_CHUNK": "8192"}, root)
    assert plan.argv[plan.argv.index("--max-num-batched-tokens") + 1] == "8192"
    with pytest.raises(P.PlanError) as e:
        mk({"CTX": "fast", "SPEC": "mtp", "MAX_SEQS": "256", "PREFILL_CHUNK": "512"}, root)
    msg = str(e.value)
    assert "PREFILL_CHUNK=512 is below MAX_SEQS x (1 + draft tokens)" in msg and "valid: 1280..65536" in msg
    assert "\n" not in msg
    with pytest.raises(P.PlanError, match="valid: 256..65536"):
        mk({"PREFILL_CHUNK": "lots"}, root)
    assert owned_flag("--max-num-batched-tokens") == "--max-num-batched-tokens"
    with pytest.raises(P.PlanError, match="PREFILL_CHUNK"):
        mk({"EXTRA_ARGS": "--max-num-batched-tokens 4096"}, root)


def test_loopback_hosts_need_no_key_and_keys_are_stripped(root):
    for host in ("127.0.0.1", "127.0.0.2", "localhost", "::1"):
        assert mk({"HOST": host}, root).get("HOST") == host
    plan = mk({"HOST": "0.0.0.0", "VLLM_API_KEY": " sk-abc\n"}, root)
    assert plan.api_key == "sk-abc"


def test_misspelt_knob_in_the_environment_gets_a_note(root):
    plan = mk({"MAXLEN": "1000", "MODELS": "/var/tmp/models", "HOSTNAME": "box"}, root)
    assert any("MAXLEN is set in the environment but is not a launcher knob (ignored); did you mean MAX_LEN?" in n
               for n in plan.notes)
    assert not any("MODELS" in n or "HOSTNAME" in n for n in plan.notes)


def test_the_device_lookup_lane_is_in_the_vram_sum(features, root):
    """DFLASH_TOKENS past the drafter's rows with the device lane: its token history is a VRAM
    term beside the pin (memory.dflash2_lane_bytes), named once it shows at two decimals."""
    from onecard import memory

    env = {"SPEC": "dflash2", "CTX": "long", "DFLASH_TOKENS": "15", "MAX_SEQS": "64", "CARD_GIB": "80",
           "DRAFT": str(features)}
    plan = mk(env, root)
    line = next(n for n in plan.notes if n.startswith("VRAM on one GPU"))
    assert "DFlash2 lookup lane history" in line and "LOOKUP_LANE=device, MAX_SEQS=64" in line
    assert memory.dflash2_lane_bytes(64, 131072, 15) > memory.GiB // 100
    for off in ({"LOOKUP_LANE": "host"}, {"LOOKUP": "0"}, {"DFLASH_TOKENS": "7"}):
        plan = mk({**env, **off}, root)
        assert not any("lookup lane history" in n for n in plan.notes), off


def test_oom_hint_names_the_plan_and_what_to_lower(root, features):
    """ONECARD_OOM_HINT (logged by patch 0002 after an out-of-memory error): one line with the plan
    that ran out, the prediction, and the knobs to lower, in their own spelling."""
    plan = mk({"CTX": "long", "SPEC": "dflash2", "DRAFT": str(features), "CARD_GIB": "24",
               "DRAFT_QUANT": "bf16", "PREFILL_CHUNK": "4096"}, root)
    hint = plan.child_env["ONECARD_OOM_HINT"]
    pin = int(plan.get("KV_MEM"))
    lower = (pin - 512 * 2**20) // (64 * 2**20) * 64
    assert "\n" not in hint and hint.startswith("onecard: the GPU ran out of memory with CTX=long SPEC=dflash2 ")
    assert f"KV_MEM={pin // 2**20}M" in hint and "the preflight predicted" in hint and "of 24.00 GiB" in hint
    for fix in (f"KV_MEM={lower}M", "PREFILL_CHUNK=2048", "DRAFT_QUANT=fp8", "MAX_SEQS=2", "SPEC=mtp"):
        assert fix in hint, fix
    auto = mk({"CTX": "fast", "SPEC": "off", "KV_MEM": "auto", "MAX_SEQS": "1"}, root).child_env["ONECARD_OOM_HINT"]
    assert "KV_MEM=auto" in auto and "GPU_UTIL=0.88" in auto and "MAX_SEQS=" not in auto.split("Try")[1]
    tries = auto.split("Try")[1]
    assert "SPEC=mtp" not in tries and "PREFILL_CHUNK" not in tries


def test_oom_hint_patch_logs_only_after_an_oom(monkeypatch, caplog):
    """Patch 0002's helper, run from the patch text itself: logs the hint for an OutOfMemoryError
    anywhere in the exception chain (a worker's, wrapped) and for nothing else."""
    import logging

    from tests.conftest import patch_added_source

    src = patch_added_source("0002-oom-hint.patch", "def _onecard_oom_hint(e: BaseException) -> None:")
    log = logging.getLogger("oomhint-test")
    ns = {"os": os, "logger": log}
    exec(compile(src, "0002-oom-hint", "exec"), ns)

    class OutOfMemoryError(RuntimeError):
        pass

    monkeypatch.setenv("ONECARD_OOM_HINT", "onecard: HINT")
    with caplog.at_level(logging.ERROR, logger="oomhint-test"):
        ns["_onecard_oom_hint"](ValueError("bad config"))
        assert "HINT" not in caplog.text
        try:
            try:
                raise OutOfMemoryError("CUDA error")
            except OutOfMemoryError as inner:
                raise RuntimeError("Worker failed") from inner
        except RuntimeError as e:
            ns["_onecard_oom_hint"](e)
        assert caplog.text.count("onecard: HINT") == 1
        ns["_onecard_oom_hint"](RuntimeError("CUDA out of memory. Tried to allocate 2.00 GiB"))
        assert caplog.text.count("onecard: HINT") == 2
    monkeypatch.delenv("ONECARD_OOM_HINT")
    caplog.clear()
    ns["_onecard_oom_hint"](RuntimeError("out of memory"))
    assert "HINT" not in caplog.text
