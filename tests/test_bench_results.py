"""Result files are atomic and the run log is append-only."""
import json
import os

import pytest

from onecard.bench import provenance, results


def test_atomic_write_keeps_old_file_on_failure(tmp_path, monkeypatch):
    p = tmp_path / "r.json"
    results.atomic_write_json(p, {"v": 1})
    class Unprintable:
        def __str__(self):
            raise TypeError("cannot serialise")
    with pytest.raises(TypeError):
        results.atomic_write_json(p, {"v": Unprintable()})
    assert json.loads(p.read_text()) == {"v": 1}

    def boom(*a, **k):
        raise OSError("disk full")
    monkeypatch.setattr(os, "replace", boom)
    with pytest.raises(OSError):
        results.atomic_write_json(p, {"v": 2})
    assert json.loads(p.read_text()) == {"v": 1}
    assert sorted(x.name for x in tmp_path.iterdir()) == ["r.json"]  # no temp left


def test_nan_becomes_null(tmp_path):
    p = results.atomic_write_json(tmp_path / "x.json", {"a": float("nan"), "b": [float("inf")]})
    assert json.loads(p.read_text()) == {"a": None, "b": [None]}


def test_jsonl_append_only_and_torn_line_skipped(tmp_path):
    log = tmp_path / "runs.jsonl"
    results.append_jsonl(log, {"i": 1})
    results.append_jsonl(log, {"i": 2})
    with open(log, "a") as fh:
        fh.write('{"i": 3, "trunc')  # a crash mid-append
    assert [r["i"] for r in results.read_jsonl(log)] == [1, 2]


def test_result_file_partial_until_finished(tmp_path):
    rf = results.ResultFile(tmp_path, "ladder", {"provenance": {}})
    on_disk = json.loads(rf.path.read_text())
    assert on_disk["partial"] is True and on_disk["verdict"] == "INVALID"
    rf.abort("server died")
    on_disk = json.loads(rf.path.read_text())
    assert on_disk["verdict_reasons"] == ["server died"]
    rf2 = results.ResultFile(tmp_path, "ladder", {"provenance": {}})
    rf2.finish("VALID", [])
    assert json.loads(rf2.path.read_text())["partial"] is False
    assert [r["verdict"] for r in results.read_jsonl(tmp_path / "runs.jsonl")] == ["INVALID", "VALID"]


def test_provenance_record_fields(tmp_path):
    series = tmp_path / "series"
    (tmp_path / "0001-a.patch").write_text("x")
    series.write_text("0001-a.patch\n")
    rec = provenance.build(argv=["bench", "x"], prompt_set={"id": "p", "hash": "h"},
                           sampling={"temperature": 0}, warmup={"discarded": 1},
                           server={"version": "0.27.1"}, series_path=series,
                           environ={"VLLM_X": "1", "ONECARD_API_KEY": "s3cret", "HOME": "/h"})
    for k in ("date", "git", "vllm_version", "patch_series", "gpu", "argv", "env_knobs",
              "prompt_set", "sampling", "token_count_source", "warmup"):
        assert k in rec
    assert rec["env_knobs"] == {"ONECARD_API_KEY": "<redacted>", "VLLM_X": "1"}
    assert rec["patch_series"]["hash"]
    assert rec["vllm_version"] == "0.27.1"
    # the hash follows the listed patches' bytes
    h1 = provenance.series_hash(series)["hash"]
    (tmp_path / "0001-a.patch").write_text("y")
    assert provenance.series_hash(series)["hash"] != h1
