"""verify.sh's KVarN check on a patched view: not installed -> PASS 'not installed';
installed -> PASS and the file audit unwinds the kvarn series too; half-installed -> FAIL."""
from __future__ import annotations

from onecard import patching, verify
from onecard.kvarn import installer as kin


def _site(vllm_dir, tmp_path):
    also = tuple({p for patch in patching.read_series(kin.SERIES) for p in patch.paths}
                 | set(kin.sources()) | {kin.MARKER})
    return patching.overlay(vllm_dir, tmp_path / "site", also=also)


def test_kvarn_check_states(vllm_dir, tmp_path):
    site = _site(vllm_dir, tmp_path)
    ctx = {"vllm_dir": str(site / "vllm")}
    r = verify.check_kvarn(ctx)
    assert r.status == verify.PASS and "not installed" in r.detail
    kin.install(site / "vllm")
    r = verify.check_kvarn(ctx)
    assert r.status == verify.PASS and r.detail.startswith("installed")
    assert verify.check_unexpected(ctx).status == verify.PASS  # audit knows kvarn/series
    assert verify.check_patches(ctx).status == verify.PASS  # main series still exactly applied
    (site / kin.MARKER).unlink()
    (site / kin.BACKEND).write_text("# edited\n")
    r = verify.check_kvarn(ctx)
    assert r.status == verify.FAIL and "marker missing" in r.detail and "kvarn_attn.py differs" in r.detail
    assert "kvarn/install.sh" in r.detail and len(r.detail.splitlines()) == 1
    kin.install(site / "vllm")  # repairs
    assert verify.check_kvarn(ctx).status == verify.PASS
    kin.uninstall(site / "vllm")
    assert "not installed" in verify.check_kvarn(ctx).detail
