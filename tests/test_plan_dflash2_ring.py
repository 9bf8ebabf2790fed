"""DFLASH_RING: CTX=huge + SPEC=dflash2 with the drafter's K/V in per-request rings outside vLLM's
KV pool (docs/dflash2-huge.md section 3, build step 4: the launcher). The plan, the refusals, the
pool predicted without the drafter's layers and the rings' bytes beside the pin. CPU only; no
vLLM import."""
from __future__ import annotations

import json
from pathlib import Path

import pytest

from onecard import memory
from onecard import plan as P
from onecard import profiles
from onecard.dflash import ring


@pytest.fixture
def features(fake_features):
    """KVarN and DFlash2 'installed' (conftest.fake_features)."""
    return fake_features


def _edit(src: Path, dst: Path, **over) -> Path:
    dst.mkdir()
    cfg = json.loads((src / "config.json").read_text())
    cfg.update(over)
    (dst / "config.json").write_text(json.dumps(cfg))
    return dst


def mk(env, root, **kw):
    return P.make_plan(env, root, python="python3", **kw)


def test_huge_dflash2_plans_with_rings(tmp_path, features, drafter_27b):
    plan = mk({"CTX": "huge", "SPEC": "dflash2", "DRAFT": str(drafter_27b)}, tmp_path)
    assert plan.get("DFLASH_RING") == "1" and plan.values["DFLASH_RING"].source == "profile"
    assert "window 2048" in plan.values["DFLASH_RING"].reason
    assert plan.child_env["ONECARD_DFLASH_RING"] == "1"
    # the drafter's layers are not kept out of KVarN by skip layers: they have no pool spec at all
    assert not any(a.startswith("--kv-cache-dtype-skip-layers") for a in plan.argv)
    assert plan.argv[plan.argv.index("--kv-cache-dtype") + 1] == "kvarn_k4v2_g128"
    sc = json.loads(plan.argv[plan.argv.index("--speculative-config") + 1])
    assert sc["method"] == "dflash2" and sc["num_speculative_tokens"] == 7
    # the pool is the target's alone at k=7: with the default GDN_DEFER=auto -> 1, 357,469 tokens at
    # 245,760 (1.45x; 6 GDN state blocks per sequence); stock GDN_DEFER=0 is docs/dflash2-huge.md
    # section 2's 271,183 (1.10x; 27 blocks)
    p = plan.prediction
    assert plan.get("GDN_DEFER") == "1" and plan.child_env["ONECARD_GDN_DEFER"] == "1"
    assert plan.get("MAX_LEN") == 245_760 and plan.values["MAX_LEN"].source == "profile"
    assert (p["pool_tokens"], p["block_size"], p["group_size"], p["gdn_groups"]) == (357_469, 4096, 16, 3)
    assert [tuple(g) for g in p["attn_groups"]] == [(1, 4096)] and round(p["max_concurrency"], 2) == 1.45
    assert p["state_slots_per_seq"] == 6
    stock = mk({"CTX": "huge", "SPEC": "dflash2", "DRAFT": str(drafter_27b), "GDN_DEFER": "0"}, tmp_path).prediction
    assert (stock["pool_tokens"], round(stock["max_concurrency"], 2), stock["state_slots_per_seq"]) == (271_183, 1.10, 27)
    # the rings beside the pin: 5 layers x (2 x 129 + 1) blocks x 16 x 8 x 128 x 2 x 2 B
    assert p["dflash2_ring_bytes"] == p["vram"]["dflash2_ring_bytes"] == ring.ring_bytes(5, 2, 2048, 7, 8, 128) \
        == 84_869_120
    # the drafter's weights counted: FP8 fc/o_proj/MLP (DRAFT_QUANT=auto on the 24 GiB assumption)
    assert plan.get("DRAFT_QUANT") == "fp8" and sc["dflash2_draft_quant"] == "fp8_per_block"
    assert p["vram"]["drafter_weights"] == memory.dflash_drafter_vram(str(drafter_27b), fp8=True).weight_bytes \
        < memory.DFLASH2_27B_PARAMS * 2
    notes = "\n".join(plan.notes)
    assert "84,869,120 B (84.9 MB)" in notes and "keep no KV in the pool" in notes
    assert "DFlash2 drafter K/V rings 0.08 (DFLASH_RING=1, MAX_SEQS=2, DFLASH_TOKENS=7)" in notes
    # the KVarN stage counts the target's 16 attention layers only (the drafter's are bf16 FLASH_ATTN)
    g = memory.QWEN38_27B
    assert p["vram"]["kvarn_stage"] == memory.kvarn_reserve_bytes(g, "kvarn", 2, 16, 3, 2)


def test_huge_dflash2_on_a_24_gib_card_fits_by_its_measured_reserves(tmp_path, features, drafter_27b):
    """By the estimated reserves 24.15 GiB, over a 24 GiB card; job 41 measured this profile's
    reserves (memory.RESERVES_MEASURED, 1.94 GiB) and the plan counts them: it fits, and the note
    says where the reserves come from. With an unmeasured MAX_SEQS the estimate applies again: over
    the card by the reserves only, so the pin stays and the note says what to set."""
    plan = mk({"CTX": "huge", "SPEC": "dflash2", "DRAFT": str(drafter_27b), "CARD_GIB": "24"}, tmp_path)
    v = plan.prediction["vram"]
    assert v["fits"] and v["reserves"] == 1983 * memory.MiB and plan.values["KV_MEM"].source == "profile"
    (note,) = [n for n in plan.notes if n.startswith("VRAM on one GPU")]
    assert memory.RESERVES_MEASURED_WHERE in note and note.endswith("fits a 24 GiB card (CARD_GIB)")
    plan = mk({"CTX": "huge", "SPEC": "dflash2", "DRAFT": str(drafter_27b), "CARD_GIB": "24", "MAX_SEQS": "3",
               "MAX_LEN": "131072"}, tmp_path)
    v = plan.prediction["vram"]
    assert not v["fits"] and v["certain"] <= v["card_bytes"] and plan.values["KV_MEM"].source == "profile"
    (note,) = [n for n in plan.notes if n.startswith("VRAM on one GPU")]
    assert "does NOT fit a 24 GiB card (CARD_GIB)" in note and "so the pin stays" in note


def test_longer_ring_with_more_seqs_and_tokens(tmp_path, features, drafter_27b):
    plan = mk({"CTX": "huge", "SPEC": "dflash2", "DRAFT": str(drafter_27b), "MAX_SEQS": "4",
               "DFLASH_TOKENS": "15", "MAX_LEN": "65536"}, tmp_path)
    assert plan.prediction["dflash2_ring_bytes"] == ring.ring_bytes(5, 4, 2048, 15, 8, 128)


def test_ring_off_with_huge_is_refused(tmp_path, features, drafter_27b):
    with pytest.raises(P.PlanError, match="needs DFLASH_RING=1") as e:
        mk({"CTX": "huge", "SPEC": "dflash2", "DFLASH_RING": "0", "DRAFT": str(drafter_27b)}, tmp_path)
    assert "valid: DFLASH_RING=auto|1 with CTX=huge" in str(e.value) and "\n" not in str(e.value)


@pytest.mark.parametrize("over", [
    {"layer_types": ["sliding_attention"] * 4 + ["full_attention"]},
    {"use_sliding_window": False},
])
def test_full_attention_drafter_is_refused(tmp_path, features, drafter_27b, over):
    d = _edit(drafter_27b, tmp_path / "full", **over)
    with pytest.raises(P.PlanError, match="ring mode needs a drafter whose every layer is sliding-window.*; valid: ") as e:
        mk({"CTX": "huge", "SPEC": "dflash2", "DRAFT": str(d)}, tmp_path)
    assert "\n" not in str(e.value)


def test_unparsable_drafter_config_is_refused_in_ring_mode(tmp_path, features):
    d = tmp_path / "empty"
    d.mkdir()
    (d / "config.json").write_text("{}")
    with pytest.raises(P.PlanError, match="DFLASH_RING=1 reads the drafter's layer_types") as e:
        mk({"CTX": "huge", "SPEC": "dflash2", "DRAFT": str(d)}, tmp_path)
    assert "valid" in str(e.value) and "\n" not in str(e.value)


@pytest.mark.parametrize("spec", ["mtp", "off"])
def test_ring_needs_dflash2(tmp_path, features, spec):
    with pytest.raises(P.PlanError) as e:
        mk({"CTX": "huge", "SPEC": spec, "DFLASH_RING": "1"}, tmp_path)
    assert str(e.value) == f"DFLASH_RING=1 needs SPEC=dflash2; valid with SPEC={spec}: DFLASH_RING=auto|0"
    for val in ("0", "auto"):   # no effect otherwise, and the server gets nothing
        plan = mk({"CTX": "huge", "SPEC": spec, "DFLASH_RING": val}, tmp_path)
        assert plan.get("DFLASH_RING") == "0" and "ONECARD_DFLASH_RING" not in plan.child_env


def test_bad_value_names_the_valid_ones(tmp_path):
    k = profiles.KNOBS["DFLASH_RING"]
    assert k.default == "auto" and k.choices == ("auto", "0", "1")
    assert "ONECARD_DFLASH_RING" in k.doc and "Run on a GPU with CTX=huge" in k.doc
    with pytest.raises(P.PlanError, match=r"DFLASH_RING='yes' is not valid; valid: auto\|0\|1"):
        mk({"DFLASH_RING": "yes"}, tmp_path)


def test_long_dflash2_unchanged_under_auto(tmp_path, features, drafter_27b):
    plan = mk({"CTX": "long", "SPEC": "dflash2", "DRAFT": str(drafter_27b)}, tmp_path)
    assert plan.get("DFLASH_RING") == "0" and plan.child_env["ONECARD_DFLASH_RING"] == "0"
    # the drafter's 5 layers share the pool as before (group size 5), no rings
    # (with the default GDN_DEFER=auto -> 1: no GDN state per draft position)
    d = memory.dflash_drafter_vram(str(drafter_27b))
    assert plan.get("GDN_DEFER") == "1"
    want = memory.predict_pool(memory.QWEN38_27B, int(plan.get("KV_MEM")), "int8_per_token_head",
                               int(plan.get("MAX_LEN")), 7, True, gdn_defer=True, **d.pool_kw())
    assert plan.prediction["pool_tokens"] == want.pool_tokens and plan.prediction["group_size"] == 5
    assert "dflash2_ring_bytes" not in plan.prediction and plan.prediction["vram"]["dflash2_ring_bytes"] == 0
    assert not any("DFLASH_RING" in n for n in plan.notes)


def test_explicit_ring_with_long_frees_the_pool(tmp_path, features, drafter_27b):
    base = {"CTX": "long", "SPEC": "dflash2", "DRAFT": str(drafter_27b)}
    off = mk(base, tmp_path)
    on = mk({**base, "DFLASH_RING": "1"}, tmp_path)
    assert on.child_env["ONECARD_DFLASH_RING"] == "1" and on.prediction["group_size"] == 16
    assert on.prediction["pool_tokens"] > off.prediction["pool_tokens"]
    assert any(n.startswith("DFLASH_RING=1 with CTX=long") and "not yet run on a GPU" in n for n in on.notes)


def test_drafter_vram_in_ring_mode_holds_no_pool_layers(drafter_27b):
    d = memory.dflash_drafter_vram(str(drafter_27b), ring=True)
    assert d.attn_layers == 0 and d.pool_kw()["draft_attn_layers"] == 0
    assert d.weight_bytes == memory.dflash_drafter_vram(str(drafter_27b)).weight_bytes



def test_tiny_drafter_ring_bytes(tmp_path, features, tiny_pair):
    """The preflight's ring term for the tiny drafter (job 63's kvarn-d2k7 settings) is
    ring.ring_bytes of its config; DRAFT=tiny (the spec, before the drafter is built) agrees."""
    from onecard.dflash.config import DrafterConfig

    target, drafter = tiny_pair
    cfg = DrafterConfig.load(drafter)
    want = ring.ring_bytes(cfg.num_layers, 16, cfg.sliding_window, 7, cfg.num_kv_heads, cfg.head_dim)
    env = {"CTX": "huge", "SPEC": "dflash2", "DFLASH_TOKENS": "7", "KV_MEM": "1G", "MAX_LEN": "4096",
           "MAX_SEQS": "16", "MODEL": str(target), "DRAFT": str(drafter)}
    plan = mk(env, tmp_path, geometry=memory.ModelGeometry.from_model_dir(target))
    assert plan.get("DFLASH_RING") == "1" and plan.child_env["ONECARD_DFLASH_RING"] == "1"
    assert plan.prediction["dflash2_ring_bytes"] == plan.prediction["vram"]["dflash2_ring_bytes"] == want
    assert want == 2 * 2 * (16 * 5 + 1) * 16 * 2 * 64 * 2    # 2 layers, window 64: 5 blocks a slot
    env = {k: v for k, v in env.items() if k != "DRAFT"}   # MODEL=tiny: DRAFT resolves to "tiny"
    tiny = mk({**env, "MODEL": "tiny"}, tmp_path, model_path=str(target),
              geometry=memory.ModelGeometry.from_model_dir(target))
    assert tiny.get("DRAFT") == "tiny" and tiny.prediction["dflash2_ring_bytes"] == want
    shape = lambda r: (r.layers, r.window, r.kv_heads, r.head_dim)  # noqa: E731
    assert shape(P.ring_drafter("tiny")) == shape(P.ring_drafter(str(drafter))) == (2, 64, 2, 64)


def test_huge_verify_of_more_than_8_tokens_needs_more_shared_memory_than_a_3090(tmp_path, features, drafter_27b,
                                                                               monkeypatch):
    """KVarN's verify kernel at 9..16 query tokens needs 152 KiB of shared memory per block
    (tests/test_kvarn_compile.py): a real launch on a card of 99 KiB (RTX 3090 / 4090) refuses
    DFLASH_TOKENS > 7 with CTX=huge before the boot, one line naming what is valid; Hopper plans it;
    a dry run (no probe) notes it; DFLASH_TOKENS=7 and CTX=long are not affected."""
    env = {"CTX": "huge", "SPEC": "dflash2", "DRAFT": str(drafter_27b), "DFLASH_TOKENS": "15"}
    asked = []

    def cap(c):
        return lambda environ, probe=True: (asked.append(probe) or (c if probe else None),
                                             f"nvidia-smi: GPU 0, compute capability {c[0]}.{c[1]}")

    monkeypatch.setattr(P, "card_capability", cap((8, 6)))
    with pytest.raises(P.PlanError) as e:
        P.resolve(env, tmp_path, probe_gpus=True)
    msg = str(e.value)
    assert msg.startswith("DFLASH_TOKENS=15 with CTX=huge: KVarN's verify kernel at 16 query tokens needs 152 KiB")
    assert "has 99 KiB" in msg and "valid: DFLASH_TOKENS=7 with CTX=huge" in msg and "\n" not in msg
    monkeypatch.setattr(P, "card_capability", cap((9, 0)))
    assert P.resolve(env, tmp_path, probe_gpus=True).get("SPEC_K") == 15
    dry = mk(env, tmp_path)   # no probe: a note
    assert any(n.startswith("DFLASH_TOKENS=15 with CTX=huge: KVarN's verify kernel") for n in dry.notes)
    monkeypatch.setattr(P, "card_capability", cap((8, 6)))
    for ok in ({**env, "DFLASH_TOKENS": "7"}, {**env, "CTX": "long"}):
        plan = P.resolve(ok, tmp_path, probe_gpus=True)
        assert not any("KVarN's verify kernel" in n for n in plan.notes)
    assert True in asked
