import json

import pytest

from onecard.prepare import draft_vocab, tiny


@pytest.fixture(scope="module")
def tok_file(tmp_path_factory):
    d = tmp_path_factory.mktemp("tok")
    tiny.build_tokenizer(2048).save(str(d / "tokenizer.json"))
    return d


def test_build_includes_specials_and_reports_coverage(tok_file, tmp_path):
    docs = draft_vocab.builtin_corpus()[:120]
    res = draft_vocab.build(tok_file, docs, size=600)
    assert res["size"] == 600 and res["ids"] == sorted(set(res["ids"]))
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(tok_file / "tokenizer.json"))
    for t in tiny.SPECIAL_TOKENS + tiny.PLAIN_ADDED_TOKENS:
        assert tok.token_to_id(t) in res["ids"]
    assert 0.5 < res["coverage_heldout"] <= 1.0
    bigger = draft_vocab.build(tok_file, docs, size=1500)
    assert bigger["coverage_heldout"] >= res["coverage_heldout"]
    out = tmp_path / "dv.json"
    assert draft_vocab.main([str(tok_file), "--size", "600", "--out", str(out),
                             "--corpus", str(tmp_path / "c.txt")]) == 2  # missing corpus file
    (tmp_path / "c.txt").write_text("def f(x):\n    return x + 1\n" * 50)
    assert draft_vocab.main([str(tok_file), "--size", "600", "--out", str(out), "--holdout-every", "0",
                             "--corpus", str(tmp_path / "c.txt")]) == 0
    assert json.loads(out.read_text())["size"] == 600


def test_bad_inputs(tok_file, tmp_path):
    with pytest.raises(ValueError, match="valid:"):
        draft_vocab.build(tmp_path, ["x"], size=10)
    with pytest.raises(ValueError, match="valid:"):
        draft_vocab.build(tok_file, [], size=10)
