"""The no-vLLM GPU probes (gpu/lib/verify_probe.py, gpu/lib/ncu_launch.py) name only launches the
wide-verify wrapper accepts, so a short lease never spends its minutes on a typo; one arm runs
end to end under the CPU interpreter (tiny shapes)."""
from __future__ import annotations

import inspect
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "gpu" / "lib"))


def _params():
    wv = pytest.importorskip("onecard.kernels.wide_verify")
    return set(inspect.signature(wv.wide_verify_attention).parameters)


def test_probe_arms_and_ncu_labels_are_valid_launches():
    import ncu_launch
    import verify_probe

    params = _params()
    launches = [x for arm in verify_probe.ARMS.values() for x in arm] + list(ncu_launch.LAUNCHES.values())
    for kv, kw in launches:
        assert kv in ("bf16", "int8", "int4"), kv
        assert set(kw) <= params, set(kw) - params
    assert "occupancy" in verify_probe.ARMS and "int8-rs2-flat" in ncu_launch.LAUNCHES
    assert "qkint8" in verify_probe.ARMS and "int8-qk8" in ncu_launch.LAUNCHES
    assert "server" in verify_probe.ARMS and [kv for kv, _ in verify_probe.ARMS["defaults"]] == ["bf16", "int8", "int4"]


def test_probe_rejects_an_unknown_arm(capsys):
    import verify_probe

    with pytest.raises(SystemExit):
        verify_probe.main(["--arms", "nope", "--out", "/nonexistent"])
    assert "valid: flat" in capsys.readouterr().err


@pytest.mark.parametrize("arm, rows, qs", [("occupancy", 8, None), ("qkint8", 4, None), ("server", 2, "1,4")])
def test_next_lease_arms_run_under_the_interpreter(tmp_path, arm, rows, qs):
    pytest.importorskip("triton")
    env = {**os.environ, "TRITON_INTERPRET": "1", "PYTHONPATH": str(REPO)}
    r = subprocess.run([sys.executable, str(REPO / "gpu" / "lib" / "verify_probe.py"), "--smoke",
                        "--arms", arm, "--out", str(tmp_path)] + (["--q", qs] if qs else []),
                       capture_output=True, text=True, env=env, cwd=REPO, timeout=900)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-2000:]
    res = json.loads((tmp_path / "verify_probe.json").read_text())
    assert len(res["correctness"]) == rows and all(x["ok"] for x in res["correctness"])
    n_q = len(qs.split(",")) if qs else 1
    assert len(res["timing"]) == rows * n_q and all("ours_ms" in x for x in res["timing"])
    if qs:  # one row per (q, launch), in the order asked; then the first (q, shape) once more
        assert [x["q_len"] for x in res["timing"]] == [int(q) for q in qs.split(",") for _ in range(rows)]
        assert [(x["q_len"], x["kv"]) for x in res["recheck"]] == [(x["q_len"], x["kv"]) for x in res["timing"][:rows]]
    else:  # one (q, shape): nothing to recheck against
        assert res["recheck"] == []


def test_probe_rejects_a_bad_q_or_shape(capsys):
    import verify_probe

    for args in (["--q", "17"], ["--q", "x"], ["--shapes", "32768"], ["--shapes", "0x1"]):
        with pytest.raises(SystemExit):
            verify_probe.main(["--arms", "server", "--out", "/nonexistent", *args])
        assert "expected e.g. --q 1,4,16" in capsys.readouterr().err


def test_a_launch_that_raises_is_its_own_row(tmp_path):
    """A launch that fails (a new option the device's Triton cannot compile, say) is recorded as an
    error row; the other launches are still checked and timed, and the probe exits 1."""
    pytest.importorskip("triton")
    env = {**os.environ, "TRITON_INTERPRET": "1", "PYTHONPATH": f"{REPO}:{REPO / 'gpu' / 'lib'}"}
    code = ("import sys, verify_probe as vp\n"
            "vp.ARMS['t'] = [('int8', {'row_split': 3}), ('int8', {'tile_n': 16})]\n"
            f"sys.exit(vp.main(['--smoke', '--arms', 't', '--out', {str(tmp_path)!r}]))\n")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, cwd=REPO,
                       timeout=900)
    assert r.returncode == 1, r.stdout[-2000:] + r.stderr[-2000:]
    res = json.loads((tmp_path / "verify_probe.json").read_text())
    bad, good = res["correctness"]
    assert not bad["ok"] and "row_split=3 is not valid" in bad["error"] and good["ok"]
    assert "ours_error" in res["timing"][0] and "ours_ms" in res["timing"][1]


def test_decode_check_runs_under_the_interpreter(tmp_path):
    """--decode-check alone (no arm): one-token and four-token launches with the server's defaults,
    NaN scales and 0xFF codes past every sequence's end; every row matches the reference (session
    30: int4 greedy decoding on the lent H100 returned a NaN log-probability; this is the probe's
    first question next lease)."""
    pytest.importorskip("triton")
    env = {**os.environ, "TRITON_INTERPRET": "1", "PYTHONPATH": str(REPO)}
    r = subprocess.run([sys.executable, str(REPO / "gpu" / "lib" / "verify_probe.py"), "--smoke",
                        "--arms", "", "--decode-check", "--out", str(tmp_path)], capture_output=True,
                       text=True, env=env, cwd=REPO, timeout=900)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-2000:]
    res = json.loads((tmp_path / "verify_probe.json").read_text())
    rows = res["decode_check"]
    assert len(rows) == 12 and all(x["ok"] for x in rows) and not res["timing"]
    assert {x["kv"] for x in rows} == {"bf16", "int8", "int4"} and {x["q_len"] for x in rows} == {1, 4}


def test_poison_reaches_past_the_end_only(gen_seed=30):
    """VerifyCase.poison_past_the_end marks the slots past each end and the unowned blocks (NaN
    scales, 0xFF codes; bf16 NaN), never a live key."""
    torch = pytest.importorskip("torch")
    pytest.importorskip("vllm.v1.attention.ops.int4_per_token_head")

    from onecard.kernels.reference import make_verify_case

    for kv in ("int8", "int4", "bf16"):
        c = make_verify_case(q_lens=[1, 2], seq_lens=[5, 17], num_q_heads=4, num_kv_heads=2, head_dim=32,
                             block_size=16, kv_dtype=kv, generator=torch.Generator().manual_seed(gen_seed))
        want = c.reference()
        c.poison_past_the_end()
        assert torch.equal(c.reference(), want)  # the live keys are untouched
        blk = int(c.block_table[0, 0])
        spare = sorted(set(range(c.key_cache.shape[0])) - set(c.block_table[:, :2].flatten().tolist()))
        for b, slot in ((blk, 5), (blk, 15)) + tuple((s, 0) for s in spare[:1]):
            probe = c.k_scale_cache[b, slot] if kv != "bf16" else c.key_cache[b, slot]
            assert torch.isnan(probe).all()
            if kv != "bf16":
                n = 32 if kv == "int8" else 16
                assert (c.value_cache[b, slot].view(torch.uint8)[..., :n] == 0xFF).all()
        assert not torch.isnan(c.k_scale_cache[blk, 4] if kv != "bf16" else c.key_cache[blk, 4]).any()


@pytest.mark.parametrize("kv,writer,attn", [("int4", "onecard", "ours"), ("int8", "onecard", "ours"),
                                            ("int4", "vllm", "ours"), ("int8", "vllm", "ours"),
                                            ("int4", "vllm", "stock")])
def test_kv_decode_probe_tiny_under_the_interpreter(tmp_path, kv, writer, attn):
    """gpu/lib/kv_decode_probe.py end to end on a random 2-layer Llama at SmolLM2's attention
    shape: prefill on the reference, every decode step through the kernel and checked; the JSON
    has the tokens and no bad step. The caches are written token by token, by the reference
    quantizers or by vLLM's own write op."""
    pytest.importorskip("triton")
    pytest.importorskip("transformers")
    if writer == "vllm" or attn == "stock":
        pytest.importorskip("vllm.v1.attention.ops.triton_reshape_and_cache_flash")
    env = {**os.environ, "TRITON_INTERPRET": "1", "PYTHONPATH": str(REPO)}
    r = subprocess.run([sys.executable, str(REPO / "gpu" / "lib" / "kv_decode_probe.py"), "--tiny", "--kv", kv,
                        "--gen", "2", "--texts", "code-02", "--writer", writer, "--attn", attn,
                        "--out", str(tmp_path)],
                       capture_output=True,
                       text=True, env=env, cwd=REPO, timeout=600)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-2000:]
    res = json.loads((tmp_path / "kv_decode_probe.json").read_text())
    row = res["texts"]["code-02"]
    assert res["kv"] == kv and res["writer"] == writer and res["attn"] == attn and len(row["tokens"]) == 2
    assert row["first_bad"] is None and row["first_bad_write"] is None
    assert 0 < row["max_rel_err"] < 3e-2 and set(row["step_err"]) == {"0", "1"}


@pytest.mark.parametrize("kv", ["int8", "int4"])
def test_kv_decode_probe_checks_written_values(tmp_path, kv):
    """kv_decode_probe's write check compares every written (token, head) row, dequantized, with
    the key / value written: a correct write passes with the quantization's error, a row whose
    codes came from other data (as a hadacore call on the wrong input would write) is reported
    with its position and head."""
    torch = pytest.importorskip("torch")
    pytest.importorskip("vllm.v1.attention.ops.int4_per_token_head")
    import kv_decode_probe
    from onecard.kernels.reference import case_from_tokens

    g = torch.Generator().manual_seed(32)
    q, k, v = (torch.randn(7, n, 64, generator=g).to(torch.bfloat16) for n in (9, 3, 3))
    case = case_from_tokens(q, k, v, kv_dtype=kv, softmax_scale=0.125, generator=g)
    chk = kv_decode_probe.Checker(kv, "kernel", 0.1, tmp_path)
    chk.text, chk.step = "t", -1
    chk._check_write(case, 0, 0, k, v)
    assert chk.first_bad_write is None and 0 < chk.max_write_err < kv_decode_probe.WRITE_TOL[kv]
    chk._check_write(case, 0, 0, k, torch.roll(v, 1, dims=1))  # head h's row holds head h-1's value
    bad = chk.first_bad_write
    assert bad is not None and bad["kind"] == "values" and bad["half"] == "v" and bad["rel_l2"] > 0.5
    assert 0 in bad["positions"] and set(bad["heads"]) <= {0, 1, 2}


def test_kv_decode_probe_rejects_bad_arguments(capsys):
    import kv_decode_probe

    for argv, valid in ((["--kv", "fp8"], "valid: bf16, int8, int4"), (["--follow", "x"], "valid: kernel, ref"),
                        (["--gen", "0"], "valid: 1 or more"), (["--writer", "x"], "valid: onecard, vllm"),
                        (["--attn", "x"], "valid: ours, stock"),
                        (["--attn", "stock", "--kv", "int8"], "valid: --attn stock with --kv int4")):
        with pytest.raises(SystemExit):
            kv_decode_probe.main(argv + ["--out", "/nonexistent"])
        assert valid in capsys.readouterr().err


def test_case_from_tokens_is_the_written_cache():
    """reference.case_from_tokens: the given keys / values come back from the paged cache (int8 /
    int4 within their quantization), the query is the last rows, the unwritten slots are poisoned,
    and the kernel agrees with the reference on it."""
    torch = pytest.importorskip("torch")
    pytest.importorskip("vllm.v1.attention.ops.int4_per_token_head")
    from onecard.kernels import reference as R

    g = torch.Generator().manual_seed(3)
    k = torch.randn(37, 2, 32, generator=g).to(torch.bfloat16)
    v = torch.randn(37, 2, 32, generator=g).to(torch.bfloat16)
    q = torch.randn(1, 6, 32, generator=g).to(torch.bfloat16)
    for kv, tol in (("bf16", 0.0), ("int8", 0.02), ("int4", 0.5)):
        c = R.case_from_tokens(q, k, v, kv_dtype=kv, softmax_scale=32 ** -0.5, generator=g)
        pos = torch.arange(37)
        blk, slot = c.block_table[0, pos // 16].long(), pos % 16
        ks = c.k_scale_cache[blk, slot] if kv != "bf16" else None
        back = R.dequant_tokens(c.key_cache[blk, slot], ks, kv, 32)
        assert (back - k.double()).abs().max() <= tol * k.abs().max()
        assert int(c.seq_lens[0]) == 37 and c.max_query_len == 1
        last = int(c.block_table[0, 2])
        probe = c.k_scale_cache[last, 5] if kv != "bf16" else c.key_cache[last, 5]
        assert torch.isnan(probe).all()  # slot 37 = page 2, slot 5: past the end
    with pytest.raises(ValueError, match="valid: k, v"):
        R.case_from_tokens(q, k, v[:3], kv_dtype="int8", softmax_scale=1.0)


def test_vllm_writer_matches_the_reference_writer_token_by_token():
    """VerifyCase.append_tokens: vLLM's own write op (its Triton kernel under the interpreter, its
    torch rotation on the CPU) and the reference quantizers write the same int8 / int4 cache,
    whether the tokens come at once or one by one (a prompt, then decode steps)."""
    pytest.importorskip("torch")
    pytest.importorskip("vllm.v1.attention.ops.triton_reshape_and_cache_flash")
    script = r'''
import torch
from onecard.kernels import reference as R
R.interpreted_vllm_triton()
g = torch.Generator().manual_seed(31)
k = (3 * torch.randn(21, 2, 32, generator=g)).to(torch.bfloat16)
v = torch.randn(21, 2, 32, generator=g).to(torch.bfloat16)
q = torch.randn(1, 4, 32, generator=g).to(torch.bfloat16)
for kv in ("int8", "int4"):
    cases = {}
    for writer in ("onecard", "vllm"):
        c = R.case_from_tokens(q, k[:17], v[:17], kv_dtype=kv, softmax_scale=0.2, capacity=21,
                               writer=writer, generator=torch.Generator().manual_seed(5))
        for t in range(17, 21):
            c.append_tokens(k[t:t + 1], v[t:t + 1], writer)
        assert int(c.seq_lens[0]) == 21 and c.max_seq_len == 21
        cases[writer] = c
    a, b = cases["onecard"], cases["vllm"]
    pos = torch.arange(21)
    blk, slot = a.block_table[0, pos // 16].long(), pos % 16
    n = 32 if kv == "int8" else 16
    for x, y in ((a.key_cache, b.key_cache), (a.value_cache, b.value_cache)):
        xa, ya = x[blk, slot][..., :n].view(torch.uint8).int(), y[blk, slot][..., :n].view(torch.uint8).int()
        if kv == "int4":  # nibbles
            xa = torch.stack([xa & 15, xa >> 4], -1)
            ya = torch.stack([ya & 15, ya >> 4], -1)
        diff = (xa - ya).abs()
        assert diff.max() <= 1 and (diff > 0).float().mean() < 0.02, (kv, diff.max(), (diff > 0).float().mean())
    for x, y in ((a.k_scale_cache, b.k_scale_cache), (a.v_scale_cache, b.v_scale_cache)):
        xs, ys = x[blk, slot], y[blk, slot]
        if kv == "int4":
            xs, ys = R._split_scale_bits(xs)[0], R._split_scale_bits(ys)[0]
        assert torch.allclose(xs, ys, rtol=1e-5), kv
    assert torch.isnan(b.k_scale_cache[int(b.block_table[0, 1]), 5]).all()  # slot 21: never written
print("ok")
'''
    env = {**os.environ, "TRITON_INTERPRET": "1", "PYTHONPATH": str(REPO)}
    r = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, env=env, cwd=REPO,
                       timeout=600)
    assert r.returncode == 0 and "ok" in r.stdout, r.stdout[-2000:] + r.stderr[-3000:]
