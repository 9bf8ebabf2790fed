"""GDN_DEFER (the launcher's side of the deferred GDN commit): the knob and its refusal, the server
variable only under speculation, the memory model (GDN state blocks per resident sequence without
the per-draft states; the verify scratch beside the pin), the VRAM line and the plan notes. CPU
only; imports neither vLLM nor Triton. The patch ran exact on an H100 (jobs 75 and 31, 2026-12-05)
and is the default with speculation on one GPU (GDN_DEFER=auto -> 1); at TP>1 auto is 0 (not yet
run on two GPUs). The stock arms below set GDN_DEFER=0 explicitly."""
from __future__ import annotations

import json
import subprocess
import sys
import types

import pytest

from onecard import memory
from onecard import plan as P
from onecard import profiles
from tests.conftest import REPO

G = memory.QWEN38_27B
INT8 = "int8_per_token_head"
SCRATCH_27B = 32 * 48 * 20_864  # MAX_SEQS 4 x (1 + 7) positions x 48 GDN layers x bytes per position


@pytest.fixture
def mk(tmp_path, fake_features, drafter_27b):
    """make_plan with DFlash2 'installed', the 27B drafter's config in DRAFT and no checkpoint (the
    memory model's prepared 27B layout), as scripts/profile_table.py builds its plans."""
    root = tmp_path / "root"
    root.mkdir()

    def build(**env):
        base = {"MODEL": str(root / "models" / "qwen38-27b"), "DRAFT": str(drafter_27b)}
        return P.make_plan({**base, **env}, root, python="python3")
    return build


def _note(plan, start):
    found = [n for n in plan.notes if n.startswith(start)]
    assert len(found) == 1, plan.notes
    return found[0]


def _drafter_kw():
    return memory.DrafterVRAM(0, memory.DFLASH2_27B_LAYERS, "").pool_kw()


def test_imports_neither_vllm_nor_triton():
    code = ("import sys; import tests.test_gdn_defer_plan; "
            "bad = [m for m in ('vllm', 'triton') if m in sys.modules]; assert not bad, bad")
    out = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr


# ------------------------------------------------------------------ the knob

def test_knob_default_values_and_refusal(mk):
    k = profiles.KNOBS["GDN_DEFER"]
    assert (k.default, k.valid, k.choices) == ("auto", "auto|0|1", ("auto", "0", "1"))
    assert "not yet run on a gpu" not in k.doc.lower() and "not yet run on two GPUs" in k.doc
    assert "ONECARD_GDN_DEFER" in k.doc
    assert profiles.SERVER_ENV["GDN_DEFER"] == "ONECARD_GDN_DEFER"
    # auto: 1 with speculation on one GPU, 0 at TP>1 and with SPEC=off; never "auto" after resolve
    for spec in ("mtp", "dflash2"):
        v = mk(SPEC=spec).values["GDN_DEFER"]
        assert (v.value, v.source, v.reason) == ("1", "profile", f"auto with SPEC={spec}")
    v = mk(SPEC="off").values["GDN_DEFER"]
    assert (v.value, v.source) == ("0", "profile")
    v = mk(CTX="long", SPEC="mtp", TP="2", CUDA_VISIBLE_DEVICES="0,1").values["GDN_DEFER"]
    assert (v.value, v.source) == ("0", "profile") and "not yet run on two GPUs" in v.reason
    for explicit in ("0", "1"):
        v = mk(SPEC="mtp", GDN_DEFER=explicit).values["GDN_DEFER"]
        assert (v.value, v.source) == (explicit, "env")
    assert mk(SPEC="mtp", GDN_DEFER="auto").get("GDN_DEFER") == "1"
    for bad in ("yes", "2", "true"):
        with pytest.raises(P.PlanError) as e:
            mk(SPEC="mtp", GDN_DEFER=bad)
        assert str(e.value) == f"GDN_DEFER={bad!r} is not valid; valid: auto|0|1"


@pytest.mark.parametrize("spec", ["mtp", "dflash2"])
@pytest.mark.parametrize("value", ["0", "1", None])
def test_server_variable_under_speculation(mk, spec, value):
    env = {"CTX": "long", "SPEC": spec, **({"GDN_DEFER": value} if value else {})}
    plan = mk(**env)
    assert plan.child_env["ONECARD_GDN_DEFER"] == (value or "1")   # unset: auto -> 1 on one GPU
    # no vLLM flag: the patch reads the variable (at a MAX_LEN neither pool caps, the argv is the same)
    assert mk(**env, MAX_LEN="65536").argv == mk(**{**env, "GDN_DEFER": "0"}, MAX_LEN="65536").argv


@pytest.mark.parametrize("value", ["0", "1"])
def test_spec_off_accepts_it_sends_nothing_and_says_so(mk, value):
    plan = mk(CTX="long", SPEC="off", GDN_DEFER=value)
    assert "ONECARD_GDN_DEFER" not in plan.child_env
    notes = [n for n in plan.notes if n.startswith("GDN_DEFER=1 has no effect with SPEC=off")]
    assert len(notes) == (1 if value == "1" else 0)
    assert not any("GDN_DEFER=1 (not yet run" in n for n in plan.notes)
    # no scratch, the pool as without the knob
    assert plan.prediction["vram"]["gdn_defer_scratch"] == 0
    assert plan.prediction["pool_tokens"] == mk(CTX="long", SPEC="off").prediction["pool_tokens"]


# ------------------------------------------------------------------ the memory model

@pytest.mark.parametrize("k", [7, 15])
@pytest.mark.parametrize("prefix", [False, True])
def test_predict_pool_state_blocks(k, prefix):
    base = 2 if prefix else 1
    assert memory.gdn_state_blocks_per_group(k, prefix) == base + k
    assert memory.gdn_state_blocks_per_group(k, prefix, gdn_defer=True) == base
    for kw, groups in (({}, 3), (_drafter_kw(), 10)):  # MTP layer in the target's bucket / the DFlash2 drafter's
        stock = memory.predict_pool(G, memory.LONG_KV_MEM, INT8, 65_536, k, prefix, **kw)
        defer = memory.predict_pool(G, memory.LONG_KV_MEM, INT8, 65_536, k, prefix, gdn_defer=True, **kw)
        assert stock.gdn_groups == defer.gdn_groups == groups
        assert stock.state_slots_per_seq == groups * (base + k) and defer.state_slots_per_seq == groups * base
        # same pages and blocks (the conv state keeps its + k width): only the per-sequence count changes
        for f in ("block_size", "page_bytes", "group_size", "num_blocks", "attn_groups"):
            assert getattr(stock, f) == getattr(defer, f), f
        assert memory.attention_block_size(G, INT8, k) == stock.block_size
        assert stock.blocks_per_request - defer.blocks_per_request == groups * k
        assert defer.pool_tokens > stock.pool_tokens
        assert defer.one_sequence_tokens() > stock.one_sequence_tokens()
    # no speculation: nothing to defer
    assert memory.predict_pool(G, memory.LONG_KV_MEM, INT8, 65_536, 0, prefix, gdn_defer=True) == \
        memory.predict_pool(G, memory.LONG_KV_MEM, INT8, 65_536, 0, prefix)


def test_the_callers_thread_it():
    args = (G, INT8, 131_072, 7, True)
    assert memory.tokens_per_gib(*args, gdn_defer=True) > memory.tokens_per_gib(*args)
    assert memory.max_concurrency(G, 8 * memory.GiB, INT8, 131_072, 7, True, gdn_defer=True) >= \
        memory.max_concurrency(G, 8 * memory.GiB, INT8, 131_072, 7, True)
    pool = memory.predict_pool(G, memory.LONG_KV_MEM, *args[1:], **_drafter_kw())
    pin = memory.kv_mem_for_pool(G, pool.pool_tokens, INT8, 131_072, 7, True, gdn_defer=True, **_drafter_kw())
    assert pin < memory.LONG_KV_MEM
    assert memory.predict_pool(G, pin, *args[1:], gdn_defer=True, **_drafter_kw()).pool_tokens >= pool.pool_tokens
    assert memory.predict_pool(G, pin - memory.MiB, *args[1:], gdn_defer=True,
                               **_drafter_kw()).pool_tokens < pool.pool_tokens
    w = memory.tp_weight_bytes(memory.layout_27b_tensors(), 2)
    tp = memory.predict_tp(G, 2, w, INT8, 131_072, 3, True, kv_bytes_per_gpu=4 * memory.GiB, gdn_defer=True)
    assert tp.pool.state_slots_per_seq == 3 * 2
    assert memory.predict_tp(G, 2, w, INT8, 131_072, 3, True, kv_bytes_per_gpu=4 * memory.GiB
                             ).pool.state_slots_per_seq == 3 * (2 + 3)


def test_scratch_bytes():
    per_pos = 16 * 128 * 4 + 48 * 128 * 2 + 48 * 4 * 2
    assert per_pos == 20_864
    assert memory.gdn_defer_scratch_bytes(G, 4, 7) == 4 * 8 * 48 * per_pos == SCRATCH_27B == 32_047_104
    # TP=2: every head count halves (16/48 -> 8/24 heads per rank), so does the scratch
    assert memory.gdn_defer_scratch_bytes(G, 4, 7, tp=2) == SCRATCH_27B // 2
    assert memory.gdn_defer_scratch_bytes(G, 4, 7, tp=4) == SCRATCH_27B // 4
    assert memory.gdn_defer_scratch_bytes(G, 4, 0) == 0
    assert memory.gdn_defer_scratch_bytes(G, 2, 15) == 2 * 16 * 48 * per_pos
    # the model dtype's bytes for the values
    g32 = memory.ModelGeometry(dtype_bytes=4)
    assert memory.gdn_defer_scratch_bytes(g32, 1, 1) == 2 * 48 * (16 * 128 * 4 + 48 * 128 * 4 + 48 * 8)


# ------------------------------------------------------------------ the plan: VRAM line and notes

def test_vram_line_counts_the_scratch(mk):
    off = mk(CTX="long", SPEC="dflash2", CARD_GIB="24", GDN_DEFER="0")   # stock
    on = mk(CTX="long", SPEC="dflash2", CARD_GIB="24", GDN_DEFER="1")
    assert mk(CTX="long", SPEC="dflash2", CARD_GIB="24").prediction["vram"] == on.prediction["vram"]  # the default
    v_off, v_on = off.prediction["vram"], on.prediction["vram"]
    assert v_off["gdn_defer_scratch"] == 0 and "gdn_defer_scratch_bytes" not in off.prediction
    assert v_on["gdn_defer_scratch"] == on.prediction["gdn_defer_scratch_bytes"] == SCRATCH_27B
    # the reserves differ too: job 41 measured each profile's own (memory.RESERVES_MEASURED)
    assert (v_on["reserves"], v_off["reserves"]) == (2519 * memory.MiB, 2257 * memory.MiB)
    assert (v_on["total"] - v_on["reserves"]) - (v_off["total"] - v_off["reserves"]) == SCRATCH_27B
    assert v_on["certain"] - v_off["certain"] == SCRATCH_27B
    line = _note(on, "VRAM on one GPU:")
    assert "+ GDN_DEFER=1 verify scratch 0.03 (48 GDN layers x MAX_SEQS=4 x 8 positions) + reserves" in line
    assert "GDN_DEFER" not in _note(off, "VRAM on one GPU:")
    # the pin stays: the pool gains blocks for KV, not bytes
    assert on.get("KV_MEM") == off.get("KV_MEM") == memory.LONG_KV_MEM


def test_dflash2_long_notes(mk, drafter_27b):
    """CTX=long SPEC=dflash2: 90 GDN state blocks per sequence (10 groups x 2+7) with stock GDN_DEFER=0;
    GDN_DEFER=1 (the default on one GPU): 20."""
    off = mk(CTX="long", SPEC="dflash2", GDN_DEFER="0")
    p = off.prediction
    assert (p["state_slots_per_seq"], p["gdn_groups"], off.get("MAX_LEN")) == (90, 10, 67_840)
    assert "each resident sequence holds 90 GDN state blocks (10 groups x 2+7)" in "\n".join(off.notes)
    note = _note(off, "GDN_DEFER=1 (the default with speculation on one GPU) would hold ")
    # the figures from predict_pool at the plan's own pool (the drafter's layers in it)
    kw = memory.dflash_drafter_vram(str(drafter_27b)).pool_kw()
    stock = memory.predict_pool(G, memory.LONG_KV_MEM, INT8, 67_840, 7, True, **kw)
    alt = memory.predict_pool(G, memory.LONG_KV_MEM, INT8, 67_840, 7, True, gdn_defer=True, **kw)
    pin = memory.kv_mem_for_pool(G, stock.pool_tokens, INT8, 67_840, 7, True, gdn_defer=True, **kw)
    assert stock.pool_tokens == p["pool_tokens"] and alt.state_slots_per_seq == 20
    # the longest sequence that runs without preemption (2,048-token chunk, 8 lookahead slots)
    s0, s1 = stock.one_sequence_tokens(chunk=2048, lookahead=8), alt.one_sequence_tokens(chunk=2048, lookahead=8)
    assert (s0, s1, stock.pool_tokens, pin // memory.MiB) == (67_864, 90_488, 70_327, 3890)
    assert note == (
        f"GDN_DEFER=1 (the default with speculation on one GPU) would hold 20 instead of 90 GDN state blocks per "
        f"resident sequence: "
        f"one sequence {s1:,} instead of {s0:,} tokens (+{s1 - s0:,}; MAX_LEN 90,368 instead of 67,840), or "
        f"KV_MEM {(memory.LONG_KV_MEM - pin) / memory.GiB:.2f} GiB lower for the same 70,327-token pool "
        f"(KV_MEM=3890M); its verify scratch takes 32.0 MB beside the KV pin")
    assert "\n" not in note
    assert off.prediction["gdn_defer"] == {"state_slots_per_seq": 20, "one_sequence_tokens": s1,
                                           "pool_tokens": alt.pool_tokens, "scratch_bytes": SCRATCH_27B,
                                           "kv_mem_same_pool": pin}

    on = mk(CTX="long", SPEC="dflash2", GDN_DEFER="1")
    assert on.prediction["state_slots_per_seq"] == 20 and on.get("MAX_LEN") == 90_368
    # vLLM's logged pool at MAX_LEN 90,368 (job 31 logged 93,998 at the 3090 pin and MAX_LEN 93,696,
    # the cap before the running-fit rule: tests/test_pool_vs_vllm.py)
    assert on.prediction["pool_tokens"] == 93_681
    default = mk(CTX="long", SPEC="dflash2")
    assert (default.get("MAX_LEN"), default.prediction) == (on.get("MAX_LEN"), on.prediction)
    assert on.prediction["num_blocks"] == p["num_blocks"] and on.prediction["block_size"] == p["block_size"]
    assert ("each resident sequence holds 20 GDN state blocks (10 groups x 2, from GDN_DEFER=1: no state per "
            "draft position; 90 without it)") in _note(on, "each resident sequence holds")
    assert not any(n.startswith("GDN_DEFER=1 (") for n in on.notes)
    assert "gdn_defer" not in on.prediction
    # the short-request residency note goes: 311 blocks hold 14 sequences of 20 state blocks + 1
    assert any(n.startswith("MAX_SEQS=4 > 3") for n in off.notes)
    assert not any(n.startswith("MAX_SEQS=") for n in on.notes)


def test_mtp_long_notes(mk):
    off = mk(CTX="long", SPEC="mtp", GDN_DEFER="0")   # stock
    assert off.get("MAX_LEN") == 118_784 and off.prediction["state_slots_per_seq"] == 15
    note = _note(off, "GDN_DEFER=1 (the default with speculation on one GPU) would hold ")
    assert note.startswith("GDN_DEFER=1 (the default with speculation on one GPU) would hold 6 instead of 15 GDN "
                           "state blocks per resident sequence: one sequence 133,053 instead of 118,797 tokens (+14,256; MAX_LEN "
                           "131,072 instead of 118,784), or KV_MEM ")
    assert note.endswith("; its verify scratch takes 16.0 MB beside the KV pin")   # MAX_SEQS 4 x (1 + 3)
    on = mk(CTX="long", SPEC="mtp", GDN_DEFER="1")
    assert on.get("MAX_LEN") == 131_072 and on.values["MAX_LEN"].source == "profile"
    assert "6 GDN state blocks (3 groups x 2, from GDN_DEFER=1" in _note(on, "each resident sequence holds")
    assert on.prediction["gdn_defer_scratch_bytes"] == memory.gdn_defer_scratch_bytes(G, 4, 3) == 16_023_552
    default = mk(CTX="long", SPEC="mtp")
    assert (default.get("MAX_LEN"), default.prediction) == (131_072, on.prediction)


@pytest.mark.parametrize("prefix", ["0", "1"])
def test_dflash2_k15_and_mode_none(mk, prefix):
    plan = mk(CTX="long", SPEC="dflash2", DFLASH_TOKENS="15", PREFIX_CACHE=prefix, GDN_DEFER="0")
    base = 2 if prefix == "1" else 1
    assert plan.prediction["state_slots_per_seq"] == 10 * (base + 15)
    assert f"would hold {10 * base} instead of {10 * (base + 15)} GDN state blocks" in \
        _note(plan, "GDN_DEFER=1 (the default")
    on = mk(CTX="long", SPEC="dflash2", DFLASH_TOKENS="15", PREFIX_CACHE=prefix, GDN_DEFER="1")
    assert on.prediction["state_slots_per_seq"] == 10 * base
    assert on.prediction["vram"]["gdn_defer_scratch"] == memory.gdn_defer_scratch_bytes(G, 4, 15)


def test_does_not_fit_note_names_gdn_defer(mk):
    """Over the card with the pin (stock GDN_DEFER=0): GDN_DEFER=1 at the lower pin that keeps the same
    pool is named when it would fit."""
    plan = mk(CTX="long", SPEC="mtp", CARD_GIB="21.5", VRAM_CHECK="0", GDN_DEFER="0")
    pin = plan.prediction["gdn_defer"]["kv_mem_same_pool"]
    line = _note(plan, "VRAM on one GPU")
    assert "does NOT fit" in line
    assert (f"; or GDN_DEFER=1 with KV_MEM={pin // memory.MiB}M (the same 124,063-token pool, no GDN state per draft "
            f"position: 21.45 GiB; the default with speculation on one GPU)") in line


def test_verify_plan_warn_names_gdn_defer(mk, monkeypatch):
    from onecard import verify

    plan = mk(CTX="long", SPEC="mtp", CARD_GIB="21.5", VRAM_CHECK="0", GDN_DEFER="0")
    doc = json.dumps(plan.to_json(), default=str)
    monkeypatch.setenv("CARD_GIB", "21.5")
    monkeypatch.setattr(verify.subprocess, "run", lambda *a, **k: types.SimpleNamespace(
        returncode=0, stdout=doc, stderr=""))
    res = verify.check_plan({})
    pin = plan.prediction["gdn_defer"]["kv_mem_same_pool"] // memory.MiB
    assert res.status == verify.WARN
    assert res.detail.endswith(f", or GDN_DEFER=1 with KV_MEM={pin}M (the same pool; the default with speculation "
                               f"on one GPU)")


def test_tp2(mk):
    off = mk(CTX="long", SPEC="mtp", TP="2", CUDA_VISIBLE_DEVICES="0,1")   # auto -> 0 at TP>1
    assert off.values["GDN_DEFER"].source == "profile"
    on = mk(CTX="long", SPEC="mtp", TP="2", CUDA_VISIBLE_DEVICES="0,1", GDN_DEFER="1")
    scratch = memory.gdn_defer_scratch_bytes(G, 4, 3, tp=2)
    assert scratch == memory.gdn_defer_scratch_bytes(G, 4, 3) // 2 == 8_011_776
    assert on.child_env["ONECARD_GDN_DEFER"] == "1" and off.child_env["ONECARD_GDN_DEFER"] == "0"
    assert on.prediction["gdn_defer_scratch_bytes"] == scratch
    # the scratch comes out of what GPU_UTIL leaves for the pool on each GPU
    assert off.prediction["kv_bytes_per_gpu"] - on.prediction["kv_bytes_per_gpu"] == scratch
    assert (off.prediction["state_slots_per_seq"], on.prediction["state_slots_per_seq"]) == (15, 6)
    assert "8.0 MB on each GPU" in _note(on, "GDN_DEFER=1 (not yet run on two GPUs): each resident sequence holds 6")
    note = _note(off, "GDN_DEFER=1 (available, not yet run on two GPUs) would hold 6 instead of 15")
    assert "KV_MEM" not in note and note.endswith("8.0 MB on each GPU, out of what GPU_UTIL leaves for the pool")
