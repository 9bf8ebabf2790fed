"""config.json-only 27B-geometry target ($MODELS/qwen38-27b-geom, tokenizer files from the tiny
model) and its DFlash2 geometry drafter ($MODELS/qwen38-27b-geom-dflash2): what gpu job 20
builds, without weights (vLLM's config path reads only config.json and the tokenizer).
Run from /work/main with the venv python after ensure_tiny_model() (MODELS=/tmp/helper-models)."""
import json
import os
import shutil
from pathlib import Path

from tokenizers import Tokenizer

from onecard.dflash.tiny_drafter import build_geometry_drafter
from onecard.prepare import geometry as G
from onecard.prepare import tiny

root = Path(os.environ.get("MODELS", "/tmp/helper-models"))
src, out = root / "qwen35-tiny", root / "qwen38-27b-geom"
out.mkdir(parents=True, exist_ok=True)
spec = G.spec_for("27b")
tok = Tokenizer.from_file(str(src / "tokenizer.json"))
ids = {t: tok.token_to_id(t) for t in tiny.SPECIAL_TOKENS + tiny.PLAIN_ADDED_TOKENS + tiny.VISION_TOKENS}
cfg = G.make_config(spec, ids, "27b", min(tok.get_vocab_size(with_added_tokens=True), spec.padded_vocab))
for f in G.TOKENIZER_FILES:
    if (src / f).is_file():
        shutil.copy2(src / f, out / f)
G._set_tokenizer_max_length(out, G.MAX_POSITION_EMBEDDINGS["27b"])
(out / "config.json").write_text(json.dumps(cfg, indent=2, sort_keys=True) + "\n")
print(build_geometry_drafter(root / "qwen38-27b-geom-dflash2", "27b", target_dir=out, config_only=True))
