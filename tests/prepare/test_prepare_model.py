"""`onecard prepare model ID|PATH`: local and (faked) Hub sources, idempotence, offline error,
the install.sh model step, and the verify.sh checks of a prepared model."""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from test_requant import load_all, make_ckpt  # tests/prepare is on sys.path (rootdir-less test dirs)

from onecard import verify
from onecard.prepare import model as prep
from onecard.prepare import quant, requant, tiny

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def tok_json(tmp_path_factory) -> Path:
    p = tmp_path_factory.mktemp("tok") / "tokenizer.json"
    tiny.build_tokenizer(512).save(str(p))
    return p


@pytest.fixture()
def corpus(tmp_path) -> list[Path]:
    d = tmp_path / "corpus"
    d.mkdir()
    for i in range(12):  # 12 documents: every 10th is held out
        (d / f"{i:02d}.txt").write_text(f"def f{i}(x):\n    return x + {i}  # think about tools\n" * 20)
    return [d]


def make_model(d: Path, tok_json: Path, shards: int = 2) -> dict:
    t = make_ckpt(d, shards)
    shutil.copy(tok_json, d / "tokenizer.json")
    return t


def tree(d: Path) -> dict:
    """Every file under d (the lock file aside) with its bytes and mtime."""
    return {str(p.relative_to(d)): (p.read_bytes(), p.stat().st_mtime_ns)
            for p in sorted(d.rglob("*")) if p.is_file() and p.name != "prepare.lock"}


def test_local_path_end_to_end_then_noop(tmp_path, tok_json, corpus):
    d = tmp_path / "ck"
    orig = make_model(d, tok_json)
    logs: list[str] = []
    s = prep.prepare(str(d), draft_corpus=corpus, log=logs.append)
    text = "\n".join(logs)
    assert s["steps"] == {"lm_head": "int8", "embed": "int8", "mtp": "int8"}, text
    for target in ("lm_head", "embed", "mtp"):
        assert f"{target}: int8 done" in text and "max rel.err 0.00" in text and "peak RSS" in text
    assert "check: complete" in text and f"next: MODEL={d}" in text
    t = load_all(d)
    assert "lm_head.weight" not in t and t["lm_head.weight_packed"].dtype == torch.int32
    w = quant.dequantize(t["lm_head.weight_packed"], t["lm_head.weight_scale"], 8, t["lm_head.weight_shape"].tolist())
    assert quant.relative_error(orig["lm_head.weight"], w) < 0.01
    assert requant.validate(d) == [] and not (d / ".onecard" / "journal.json").exists()
    dv = json.loads((d / prep.DRAFT_VOCAB_FILE).read_text())
    assert dv["size"] == 512 and dv["coverage_heldout"] == 1.0
    state = prep.read_state(d)
    assert state["steps"]["mtp"]["tensors"] == 3 and state["steps"]["lm_head"]["max_rel_error"] < 0.01
    # verify.sh sees a prepared model
    ctx = {"model": str(d)}
    assert verify.check_model(ctx).status == verify.PASS
    r = verify.check_model_requant(ctx)
    assert (r.status, r.detail) == (verify.PASS, "lm_head int8, embed int8, mtp int8")
    assert verify.check_draft_vocab(ctx).status == verify.PASS
    # a second run (CLI) changes nothing and says so
    before = tree(d)
    assert prep.main([str(d), "--draft-corpus", *map(str, corpus)]) == 0
    assert tree(d) == before
    logs2: list[str] = []
    prep.prepare(str(d), draft_corpus=corpus, log=logs2.append)
    assert sum("already int8 (no-op" in line for line in logs2) == 3 and "draft vocab: already built" in "\n".join(logs2)
    assert tree(d) == before


def test_options_keep_int4_no_draft_then_defaults(tmp_path, tok_json, corpus, capsys):
    d = tmp_path / "ck"
    make_model(d, tok_json, shards=1)
    # int4 misses the 1 % default bound by nature: refused in one line that names the flag ...
    args = [str(d), "--lm-head", "int4", "--embed", "keep", "--mtp", "keep", "--no-draft-vocab"]
    assert prep.main(args) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "exceeds the default bound 0.01 (1 %" in err[0] and "--max-rel-error 0.12" in err[0]
    assert prep.status(d)["steps"]["lm_head"] == "bf16"
    # ... which the requant script takes; prepare model then keeps the int4
    from onecard.prepare import requant
    assert requant.main([str(d), "--bits", "4", "--max-rel-error", "0.12"], target="lm_head") == 0
    capsys.readouterr()
    assert prep.main(args) == 0
    out = capsys.readouterr().out
    assert "lm_head: already int4 (no-op" in out
    assert "embed: kept as it is (bf16" in out and "draft vocab: skipped (--no-draft-vocab)" in out
    assert prep.status(d)["steps"] == {"lm_head": "int4", "embed": "bf16", "mtp": "bf16"}
    ctx = {"model": str(d)}
    r = verify.check_model_requant(ctx)
    assert r.status == verify.WARN and "embed, mtp not requantized" in r.detail
    assert verify.check_draft_vocab(ctx).status == verify.WARN
    # defaults now: embed and MTP get int8, lm_head stays int4 (changing it needs --restore)
    prep.prepare(str(d), draft_corpus=corpus, log=print)
    out = capsys.readouterr().out
    assert "lm_head: already int4, int8 requested - left as int4" in out and "--restore" in out
    assert prep.status(d)["steps"] == {"lm_head": "int4", "embed": "int8", "mtp": "int8"}
    assert verify.check_model_requant(ctx).status == verify.PASS
    # one prepare per directory at a time
    held = prep._lock(d)
    with pytest.raises(prep.PrepareError, match="another `onecard prepare model` is working"):
        prep.prepare(str(d), log=lambda s: None)
    held.close()
    # bad choices: one line naming what is valid
    with pytest.raises(prep.PrepareError, match="valid: int8, keep"):
        prep.prepare(str(d), embed="int4")
    with pytest.raises(SystemExit):
        prep.main([str(d), "--mtp", "int2"])
    assert prep.main([str(tmp_path / "nope")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err[-1].startswith("error: ") and "valid:" in err[-1]


def test_half_finished_journal_fails_verify_then_is_finished(tmp_path, tok_json, corpus):
    d = tmp_path / "ck"
    make_model(d, tok_json, shards=1)
    prep.prepare(str(d), draft_corpus=corpus, log=lambda s: None)
    # a swap that stopped before its last rename: the new config is still beside the old one
    (d / ("config.json" + requant.TMP)).write_text((d / "config.json").read_text())
    (d / ".onecard" / "journal.json").write_text(json.dumps({"target": "lm_head", "files": ["config.json"]}))
    r = verify.check_model_requant({"model": str(d)})
    assert r.status == verify.FAIL and "half-finished" in r.detail
    logs: list[str] = []
    prep.prepare(str(d), draft_corpus=corpus, log=logs.append)
    assert any("finished an interrupted swap" in line for line in logs)
    assert verify.check_model_requant({"model": str(d)}).status == verify.PASS


def test_offline_hub_id_not_cached_is_one_line(tmp_path):
    env = {**os.environ, "PYTHONPATH": str(REPO), "HF_HUB_OFFLINE": "1", "HF_HOME": str(tmp_path / "hf"),
           "HF_HUB_CACHE": str(tmp_path / "hf" / "hub"), "MODELS": str(tmp_path / "models")}
    out = subprocess.run([sys.executable, "-m", "onecard", "prepare", "model", prep.DEFAULT_MODEL_ID],
                         env=env, capture_output=True, text=True, timeout=120)
    assert out.returncode == 2
    err = out.stderr.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error: ") and "HF_HUB_OFFLINE=1" in err[0] and "valid:" in err[0], out.stderr
    assert not (tmp_path / "models").exists()  # nothing created before the download succeeded
    # online but the Hub cannot be reached: one line too, not the offline message
    env = {**env, "HF_HUB_OFFLINE": "0", "HF_ENDPOINT": "http://127.0.0.1:9"}
    out = subprocess.run([sys.executable, "-m", "onecard", "prepare", "model", "Owner/Nothing"],
                         env=env, capture_output=True, text=True, timeout=120)
    err = out.stderr.strip().splitlines()
    assert out.returncode == 2 and len(err) == 1 and "could not be reached" in err[0] and "valid:" in err[0], out.stderr


def test_default_dest_is_the_launcher_default(monkeypatch):
    from onecard.profiles import KNOBS

    for k in ("MODELS", "ONECARD_HOME"):
        monkeypatch.delenv(k, raising=False)
    assert prep.default_dest(prep.DEFAULT_MODEL_ID) == (REPO / KNOBS["MODEL"].default).absolute()
    assert prep.default_dest("Someone/Other-Model").name == "other-model"
    with pytest.raises(prep.PrepareError, match="valid:"):
        prep.default_dest("not an id")


def test_fake_hub_download_links_resumes_and_is_idempotent(tmp_path, monkeypatch, tok_json, corpus):
    import huggingface_hub

    src = tmp_path / "src"
    make_model(src, tok_json)
    pristine = {p.name: p.read_bytes() for p in src.iterdir() if p.is_file()}
    cache = tmp_path / "hf" / "hub"
    calls = []

    def fake_snapshot_download(repo_id, *, revision=None, ignore_patterns=None, **kw):
        calls.append((repo_id, revision, tuple(ignore_patterns or ())))
        snap = cache / f"models--{repo_id.replace('/', '--')}" / "snapshots" / "0123456789abcdef"
        if not snap.exists():
            shutil.copytree(src, snap)
        return str(snap)

    monkeypatch.setattr(huggingface_hub, "snapshot_download", fake_snapshot_download)
    monkeypatch.setenv("MODELS", str(tmp_path / "models"))
    dest = tmp_path / "models" / "tiny-w4a16"
    # an interrupted earlier fetch: claimed, one file linked
    dest.mkdir(parents=True)
    prep.write_state(dest, {"source": "Owner/Tiny-W4A16", "kind": "hub", "revision": None, "fetched": False, "steps": {}})
    logs: list[str] = []
    s = prep.prepare("Owner/Tiny-W4A16", draft_corpus=corpus, log=logs.append)
    text = "\n".join(logs)
    assert len(calls) == 1 and "*.bin" in calls[0][2]
    assert "linked" in text and s["steps"] == {"lm_head": "int8", "embed": "int8", "mtp": "int8"}
    snap = Path(fake_snapshot_download("Owner/Tiny-W4A16"))
    links = tmp_path / "links"  # a directory of symlinks (as a cache snapshot) is not prepared in place
    links.mkdir()
    for f in src.iterdir():
        (links / f.name).symlink_to(f)
    with pytest.raises(prep.PrepareError, match="symbolic links.*valid: --dest"):
        prep.prepare(str(links), log=lambda s: None)
    calls.clear()
    # the cache copy is untouched (files are replaced, never edited) and untouched files share its inode
    assert {p.name: p.read_bytes() for p in snap.iterdir() if p.is_file()} == pristine
    assert (dest / "tokenizer.json").stat().st_ino == (snap / "tokenizer.json").stat().st_ino
    assert prep.read_state(dest)["revision"] == "0123456789abcdef" and prep.read_state(dest)["fetched"]
    assert verify.resolve_model_dir("Owner/Tiny-W4A16") == dest  # verify.sh MODEL=ID finds the prepared copy
    # second run: no download, nothing changes
    before = tree(dest)
    logs.clear()
    prep.prepare("Owner/Tiny-W4A16", draft_corpus=corpus, log=logs.append)
    assert calls == [] and tree(dest) == before and "fetch: already done" in "\n".join(logs)
    # another model into the same directory is refused
    with pytest.raises(prep.PrepareError, match="holds Owner/Tiny-W4A16"):
        prep.prepare("Owner/Other", dest=dest, log=lambda s: None)
    # a local path to --dest on another filesystem (no hard links): copied, after a free-space check
    def no_link(a, b, **kw):
        raise OSError(18, "Invalid cross-device link")

    monkeypatch.setattr(os, "link", no_link)
    monkeypatch.setattr(shutil, "disk_usage", lambda p: shutil._ntuple_diskusage(1 << 40, 1 << 40, 1000))
    out = tmp_path / "copy"
    with pytest.raises(prep.PrepareError, match="GiB free; valid:"):
        prep.prepare(str(src), dest=out, log=lambda s: None)
    monkeypatch.undo()
    monkeypatch.setattr(os, "link", no_link)
    logs.clear()
    prep.prepare(str(src), dest=out, build_draft_vocab=False, log=logs.append)
    assert any("cannot hard-link" in line for line in logs) and prep.status(out)["steps"]["embed"] == "int8"
    assert {p.name: p.read_bytes() for p in src.iterdir() if p.is_file()} == pristine
    assert (out / "tokenizer.json").stat().st_ino != (src / "tokenizer.json").stat().st_ino


def test_install_model_step_reaches_prepare(tmp_path, tok_json):
    from onecard.install import Installer, StepFailed

    venv = tmp_path / "venv"
    (venv / "bin").mkdir(parents=True)
    py = venv / "bin" / "python"
    py.write_text(f'#!/bin/sh\nPYTHONPATH="{REPO}" exec "{sys.executable}" "$@"\n')
    py.chmod(0o755)
    d = tmp_path / "ck"
    make_model(d, tok_json, shards=1)
    inst = Installer(venv, model=str(d), verify=False)
    inst.step_model()
    assert inst.summary[-1][:2] == ("model", "prepared") and inst.model_dir == d
    assert prep.status(d)["steps"] == {"lm_head": "int8", "embed": "int8", "mtp": "int8"}
    assert (d / prep.DRAFT_VOCAB_FILE).is_file()
    bad = Installer(venv, model=str(tmp_path / "missing"), verify=False)
    with pytest.raises(StepFailed) as e:
        bad.step_model()
    assert e.value.step == "model"
    assert Installer(venv, model=None).step_model() is None
