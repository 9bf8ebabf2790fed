"""The agreeing pair (onecard.dflash.agree) and the CPU dry run of GPU job 72-dflash2-lane
(tests/gpu/dflash2_lane.py --dry-run)."""
from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import check_job_contract
import torch

REPO = Path(__file__).resolve().parents[2]
DRIVER = REPO / "tests" / "gpu" / "dflash2_lane.py"
JOB = REPO / "gpu" / "jobs" / "72-dflash2-lane.sh"


@pytest.fixture(scope="module")
def root(tmp_path_factory):
    return tmp_path_factory.mktemp("agree-models")


@pytest.fixture(scope="module")
def pair(root):
    from onecard.dflash.agree import ensure_agreeing_pair

    return ensure_agreeing_pair(root)


@pytest.fixture(scope="module")
def weights(pair):
    from safetensors.torch import load_file

    model, draft, _ = pair
    return load_file(str(model / "model.safetensors")), load_file(str(draft / "model.safetensors"))


def test_layout(pair, root):
    from onecard.dflash.tiny_drafter import tiny_drafter_dir
    from onecard.prepare.tiny import tiny_model_dir

    model, draft, x = pair
    assert model == root / "qwen35-tiny-agree" and draft == tiny_drafter_dir(model)
    tiny = tiny_model_dir(root)
    for name in ("config.json", "tokenizer.json", "tokenizer_config.json", "chat_template.jinja",
                 "generation_config.json", "special_tokens_map.json"):
        assert (model / name).read_bytes() == (tiny / name).read_bytes(), name
    info = json.loads((model / "agree.json").read_text())
    assert info["token"] == x and info["margin"] > 10 and info["margin_bf16_ulps"] >= 64
    assert not list(root.glob(".*tmp-*"))          # no leftover temp dirs


def test_target_invariants(pair, weights):
    from onecard.dflash.agree import margin_of, target_logits

    model, _, x = pair
    w, _ = weights
    lm = "model.language_model"
    emb = w[f"{lm}.embed_tokens.weight"]
    assert emb.dtype == torch.bfloat16 and torch.equal(emb, emb[:1].expand_as(emb))
    cfg = json.loads((model / "config.json").read_text())["text_config"]
    outs = [n for n in w if n.startswith(f"{lm}.layers.") and n.endswith(
        ("self_attn.o_proj.weight", "linear_attn.out_proj.weight", "mlp.down_proj.weight"))]
    assert len(outs) == 2 * cfg["num_hidden_layers"]
    assert all(not w[n].any() for n in outs)
    assert not any(".shared_expert" in n or ".experts." in n for n in w)   # dense: no other writer
    top, margin, ulps = margin_of(target_logits(w, cfg["rms_norm_eps"]))
    assert top == x and ulps >= 64 and margin > 10
    # X is an ordinary word piece: not an added / special token, decodes to letters
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(model / "tokenizer.json"))
    assert x not in tok.get_added_tokens_decoder()
    assert tok.decode([x]).strip().isalpha()


def test_drafter_predicts_x_every_row(pair, weights):
    from onecard.dflash import drafter as ref
    from onecard.dflash.config import DrafterConfig
    from onecard.dflash.select import top_candidates

    model, draft, x = pair
    w, _ = weights
    cfg = DrafterConfig.load(draft)
    dw = {k: v.float() for k, v in ref.load_weights(draft, cfg).items()}
    assert not dw["candidate_selector.hidden_projection.weight"].any()
    for i in range(cfg.num_layers):
        assert not dw[f"layers.{i}.self_attn.o_proj.weight"].any()
        assert not dw[f"layers.{i}.mlp.down_proj.weight"].any()
    embed = w["model.language_model.embed_tokens.weight"].float()
    head = w["lm_head.weight"].float()
    g = torch.Generator().manual_seed(0)
    for ctx_len, anchor in ((5, x), (40, 17), (90, 1234)):
        th = torch.randn(ctx_len, cfg.fc_in, generator=g)
        p = ref.forward(cfg, dw, target_hidden=th, block_ids=ref.block_ids_for(cfg, anchor),
                        block_start=ctx_len, embed=embed, lm_head=head)
        assert p.logits.shape[0] == cfg.block_size - 1
        assert (p.logits.argmax(-1) == x).all()
        ids, vals = top_candidates(p.logits, 2)
        assert (ids[:, 0] == x).all() and ((vals[:, 0] - vals[:, 1]) > 10).all()
    # with the selector zeroed the greedy walk is the unary argmax
    from onecard.dflash.select import draft_from_pass

    prop = draft_from_pass(cfg, dw, p.hidden, p.logits, anchor=anchor)
    assert prop.tokens.tolist() == [x] * (cfg.block_size - 1)


def test_ensure_is_idempotent(pair, root):
    from onecard.dflash.agree import ensure_agreeing_pair

    model, draft, x = pair
    before = {p: (p.stat().st_ino, p.stat().st_mtime_ns)
              for d in (model, draft) for p in d.iterdir()}
    again = ensure_agreeing_pair(root)
    assert again == (model, draft, x)
    after = {p: (p.stat().st_ino, p.stat().st_mtime_ns)
             for d in (model, draft) for p in d.iterdir()}
    assert before == after


def test_job_header_and_syntax():
    check_job_contract(JOB, r"python3 tests/gpu/dflash2_lane.py")


def test_dry_run_passes(root, pair, patched_site, tmp_path):
    if not (patched_site / "vllm" / "dflash2_installed.txt").is_file():
        pytest.skip("patches/series does not list 0080-dflash2.patch")
    env = dict(os.environ, MODELS=str(root),
               PYTHONPATH=os.pathsep.join([str(patched_site), str(REPO)]))
    env.pop("GPU_UTIL", None)                      # default: 0.32 / 4 per server
    p = subprocess.run([sys.executable, str(DRIVER), "--dry-run", "--out", str(tmp_path / "out")],
                       env=env, capture_output=True, text=True, timeout=300, cwd=REPO)
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    assert "[lane] dry run PASS" in p.stdout
    lines = dict(re.findall(r"^\[lane\] argv (\S+): (.*)$", p.stdout, re.M))
    assert set(lines) == {"off", "d2k7", "d2k15", "d2k15-nolook"}
    assert all(" serve " + str(pair[0]) + " " in v for v in lines.values())
    for name, line in lines.items():
        assert "--enable-prefix-caching" in line and "--gpu-memory-utilization 0.080" in line
        if name == "off":
            assert "--speculative-config" not in line
            continue
        sc = json.loads(re.search(r"--speculative-config (\S+)", line).group(1).strip("'"))
        assert sc["method"] == "dflash2" and sc["model"].endswith("qwen35-tiny-agree-dflash2")
        assert sc["num_speculative_tokens"] == (7 if name == "d2k7" else 15)
        assert sc["dflash2_lookup"] == (name != "d2k15-nolook")
        assert sc.get("draft_sample_method", "greedy") == "greedy"
