"""Build patches/0080-dflash2.patch from pristine vLLM 0.27.1 and onecard/dflash/patch_src/.

The patch is generated, never hand-edited: new vLLM files are copied from ``patch_src/`` and
the few lines changed in existing files are the exact (old -> new) edits in ``EDITS``, each of
which must match the pristine file exactly once. ``python -m onecard.dflash.make_patch
[--vllm-dir DIR] [--out FILE] [--check]`` writes the patch atomically (``--check``: exit 1 if
the committed patch differs). tests/dflash/test_patch.py checks the committed patch equals
this output.
"""
from __future__ import annotations

import argparse
import difflib
import os
import sys
import tempfile
from pathlib import Path

HERE = Path(__file__).resolve().parent
REPO = HERE.parent.parent
PATCH = REPO / "patches" / "0080-dflash2.patch"
SRC = HERE / "patch_src"

HEADER = """\
DFlash2: the DFlash2 block speculator (selector walk + lookup lane) as speculative method "dflash2"

What:     SpeculativeConfig accepts method "dflash2" (served by 0.27.1's DFlash machinery with
          dflash2=True) and the fields dflash2_lookup / dflash2_lookup_key_len /
          dflash2_lookup_max_match, with one-line errors for bad values; registers
          DFlash2DraftModel -> qwen3_dflash2.DFlash2Qwen3ForCausalLM (the DFlash drafter plus
          the two-tap block convolutions and the candidate selector's weights); the V1 runner
          builds v1/spec_decode/dflash2.DFlash2Proposer for it: drafter rows = min(k,
          block_size - 1), lm_head -> top-k -> the selector walk (greedy, or sampled with its q
          rows), positions past the block from the lookup lane (dflash2_lane.py; by default
          on the device with no host sync, its match one Triton kernel in
          dflash2_lane_kernel.py; ONECARD_DFLASH_LANE=host: the CPU lane), all handed to
          vLLM's verify + rejection sampler unchanged. Adds vllm/dflash2_installed.txt (the
          launcher's SPEC=dflash2 marker). qwen3_dflash.py gains two class hooks
          (decoder_layer_cls, model_cls) so the DFlash2 classes reuse it. Ring mode
          (ONECARD_DFLASH_RING=1, the launcher's DFLASH_RING; CTX=huge): the drafter's layers
          get no KV-cache spec and keep their K/V in per-request bf16 rings of their sliding
          window outside vLLM's pool (DFlash2Proposer: slot map, ring block table, -1 for
          context rows the ring cannot hold; docs/dflash2-huge.md section 3).
          dflash2_draft_quant ("fp8_per_block"; the launcher's DRAFT_QUANT=fp8):
          the drafter's fc, o_proj and MLP are quantized to FP8 while they load (vLLM's online
          scheme; qkv_proj stays bf16 for the context K/V precompute) through a third hook,
          draft_quant_config: stock 0.27.1 cannot quantize a drafter online (its draft
          ModelConfig gets a callable hf_overrides, which get_quant_config refuses).
Why:      DFlash2 drafters (architectures DFlash2DraftModel) do not load in stock 0.27.1, and
          DFLASH_TOKENS 8..15 (verify width past the drafter's block) needs the lookup lane;
          the KVarN pool (CTX=huge) cannot hold the drafter's non-causal layers.
Test:     tests/dflash/test_patch.py (applies/reverts on the series, generated == committed,
          config accepts/rejects, the shipped walk/lane/conv equal onecard.dflash's reference on
          CPU); tests/dflash/test_device_lane.py (device lane == CPU lane, no host sync, the
          Triton match == torch under TRITON_INTERPRET=1); gpu/jobs/70-dflash2.sh + tests/gpu/test_dflash2.py (greedy == SPEC=off for
          DFLASH_TOKENS 7 and 15 over 128 prompt-length residues, sampled chi-square, lookup
          tokens/step from /metrics); ring mode: tests/dflash/test_ring_mode.py (float64 ring ==
          dense windowed attention across wraps, slot map, -1 filter) and test_patch.py::test_ring_mode.
Upstream: not upstream (vLLM 0.27.1 has DFlash v1 only). Drop when vLLM loads DFlash2 drafters
          and decouples the verify width from the drafter block.
Generated: python -m onecard.dflash.make_patch (from onecard/dflash/patch_src/)
Applies-To: vllm 0.27.1
"""

NEW_FILES = {
    "vllm/v1/spec_decode/dflash2_lane.py": "dflash2_lane.py",
    "vllm/v1/spec_decode/dflash2_lane_kernel.py": "dflash2_lane_kernel.py",
    "vllm/v1/spec_decode/dflash2.py": "dflash2.py",
    "vllm/model_executor/models/qwen3_dflash2.py": "qwen3_dflash2.py",
    "vllm/dflash2_installed.txt": "dflash2_installed.txt",
}

_FIELDS = '''
    # onecard 0080: DFlash2 (method="dflash2" is served as "dflash" with dflash2=True)
    dflash2: bool = False
    """Set by method="dflash2": the DFlash2 proposer (selector walk + lookup lane)."""
    dflash2_lookup: bool = True
    """DFlash2: fill the verify positions past the drafter's block (num_speculative_tokens >
    block_size - 1) from suffix matches in the request's prompt + generated text; False
    repeats the last draft there."""
    dflash2_lookup_key_len: int = 2
    """DFlash2 lookup lane: tokens that must match before an occurrence counts (1..8)."""
    dflash2_lookup_max_match: int = 16
    """DFlash2 lookup lane: longest backwards match examined per occurrence (key_len..64)."""
    dflash2_draft_quant: str | None = None
    """DFlash2: quantize the bf16 drafter's linear layers to FP8 while it loads, with vLLM's
    online scheme of that name ("fp8_per_block": a scale per 128 x 128 block; W8A16 Marlin on
    GPUs without FP8 units); qkv_proj stays bf16 (DFlash's context K/V precompute reads its weight). Drafts
    only: the target verifies every token. None: the drafter as stored."""
'''

_METHODS = '''
    # onecard 0080: DFlash2 ------------------------------------------------------------
    _DFLASH2_DEFAULTS = {
        "dflash2_lookup": True,
        "dflash2_lookup_key_len": 2,
        "dflash2_lookup_max_match": 16,
        "dflash2_draft_quant": None,
    }
    _DFLASH2_DRAFT_QUANT = ("fp8_per_block",)
    _DFLASH2_KEYS = (
        "block_size",
        "mask_token_id",
        "target_layer_ids",
        "conv_kernel_size",
        "conv_group_size",
        "selector_rank",
        "selector_top_k",
    )

    def _onecard_dflash2_pre(self) -> None:
        """method "dflash2" -> "dflash" + dflash2=True; the dflash2_* fields checked."""
        if self.method == "dflash2":
            self.method = "dflash"
            self.dflash2 = True
            if self.model is None:
                raise ValueError(
                    "speculative_config: method 'dflash2' needs model=<drafter dir>; "
                    'valid: a directory whose config.json has architectures '
                    '["DFlash2DraftModel"]'
                )
        elif self.dflash2 and self.method not in (None, "dflash"):
            raise ValueError(
                f"speculative_config: dflash2=true with method {self.method!r}; "
                "valid: method 'dflash2'"
            )
        if not self.dflash2:
            for key, default in self._DFLASH2_DEFAULTS.items():
                if getattr(self, key) != default:
                    raise ValueError(
                        f"speculative_config: {key} needs method 'dflash2'; valid with "
                        f"method {self.method!r}: leave it unset"
                    )
            return
        if self.method is None:
            self.method = "dflash"
        kl, mm = self.dflash2_lookup_key_len, self.dflash2_lookup_max_match
        if not 1 <= kl <= 8:
            raise ValueError(
                f"speculative_config: dflash2_lookup_key_len={kl}; valid: 1..8"
            )
        if not kl <= mm <= 64:
            raise ValueError(
                f"speculative_config: dflash2_lookup_max_match={mm}; valid: {kl}..64"
            )
        dq = self.dflash2_draft_quant
        if dq is not None and dq not in self._DFLASH2_DRAFT_QUANT:
            raise ValueError(
                f"speculative_config: dflash2_draft_quant={dq!r}; valid: "
                f"{' | '.join(self._DFLASH2_DRAFT_QUANT)}, or unset (bf16)"
            )

    def _onecard_dflash2_post(self) -> None:
        """The drafter must be a DFlash2 one; k within rows + 8; blocks non-causal."""
        hf = self.draft_model_config.hf_config
        archs = list(getattr(hf, "architectures", None) or [])
        if "DFlash2DraftModel" not in archs:
            raise ValueError(
                f"speculative_config: method 'dflash2' needs a DFlash2 drafter, but "
                f"{self.model} has architectures {archs}; valid: "
                '["DFlash2DraftModel"] (DFlash v1 drafters: method \\'dflash\\')'
            )
        dc = dict(getattr(hf, "dflash_config", None) or {})
        for key in self._DFLASH2_KEYS:
            if key not in dc:
                raise ValueError(
                    f"speculative_config: the DFlash2 drafter's dflash_config lacks "
                    f"{key}; valid: {', '.join(self._DFLASH2_KEYS)} all present"
                )
        rows = int(dc["block_size"]) - 1
        if self.num_speculative_tokens is None:
            self.num_speculative_tokens = rows
        k = self.num_speculative_tokens
        if not 1 <= k <= rows + 8:
            raise ValueError(
                f"speculative_config: method 'dflash2' with num_speculative_tokens={k}; "
                f"valid: 1..{rows + 8} (the drafter's {rows} rows + up to 8 lookup "
                "positions)"
            )
        dc["causal"] = False  # a DFlash2 block is non-causal in every layer
        hf.dflash_config = dc
'''

EDITS: list[tuple[str, str, str]] = [
    ("vllm/config/speculative.py",
     'DFlashModelTypes = Literal["dflash"]\n',
     'DFlashModelTypes = Literal["dflash", "dflash2"]\n'),
    ("vllm/config/speculative.py",
     '    during rejection sampling. This comes at the cost of additional GPU memory\n'
     '    usage."""\n',
     '    during rejection sampling. This comes at the cost of additional GPU memory\n'
     '    usage."""\n' + _FIELDS),
    ("vllm/config/speculative.py",
     "        # infer method from user args\n"
     "        if self.method is None and SpeculativeConfig._is_custom_proposer_path(\n",
     "        self._onecard_dflash2_pre()\n"
     "        # infer method from user args\n"
     "        if self.method is None and SpeculativeConfig._is_custom_proposer_path(\n"),
    ("vllm/config/speculative.py",
     '                if self.method in ("dflash", "dspark"):\n'
     "                    self.parallel_drafting = True\n",
     '                if self.method in ("dflash", "dspark"):\n'
     "                    self.parallel_drafting = True\n"
     "                if self.dflash2:\n"
     "                    self._onecard_dflash2_post()\n"),
    ("vllm/config/speculative.py",
     "    def _validate_suffix_decoding(self):\n",
     _METHODS.lstrip("\n") + "\n    def _validate_suffix_decoding(self):\n"),
    ("vllm/config/speculative.py",
     "                factors.append(tuple(layer_ids))\n"
     "\n"
     "        hash_str = safe_hash(str(factors).encode(), usedforsecurity=False).hexdigest()\n",
     "                factors.append(tuple(layer_ids))\n"
     "\n"
     "        if self.dflash2:\n"
     "            # onecard 0080: the DFlash2 drafter's classes, its FP8 layers and ring mode\n"
     "            # change its compiled graph (the compile cache is keyed by this hash)\n"
     "            import os\n"
     "\n"
     "            factors.append((\"dflash2\", self.dflash2_draft_quant,\n"
     "                            os.environ.get(\"ONECARD_DFLASH_RING\", \"0\")))\n"
     "\n"
     "        hash_str = safe_hash(str(factors).encode(), usedforsecurity=False).hexdigest()\n"),
    ("vllm/model_executor/models/registry.py",
     '    "DFlashDraftModel": ("qwen3_dflash", "DFlashQwen3ForCausalLM"),\n',
     '    "DFlashDraftModel": ("qwen3_dflash", "DFlashQwen3ForCausalLM"),\n'
     '    "DFlash2DraftModel": ("qwen3_dflash2", "DFlash2Qwen3ForCausalLM"),\n'),
    ("vllm/model_executor/models/qwen3_dflash.py",
     '            ".up_proj": (".gate_up_proj", 1),\n'
     "        },\n"
     "    )\n"
     "\n"
     "    def __init__(\n",
     '            ".up_proj": (".gate_up_proj", 1),\n'
     "        },\n"
     "    )\n"
     "    # onecard 0080: DFlash2 (qwen3_dflash2.py) substitutes its layer class\n"
     "    decoder_layer_cls = DFlashQwen3DecoderLayer\n"
     "    # ... and its drafter's quantization (online FP8, dflash2_draft_quant)\n"
     "    draft_quant_config = staticmethod(get_draft_quant_config)\n"
     "\n"
     "    def __init__(\n"),
    ("vllm/model_executor/models/qwen3_dflash.py",
     "        self.quant_config = get_draft_quant_config(vllm_config)\n",
     "        self.quant_config = self.draft_quant_config(vllm_config)\n"),
    ("vllm/model_executor/models/qwen3_dflash.py",
     "                DFlashQwen3DecoderLayer(\n"
     "                    current_vllm_config,\n",
     "                self.decoder_layer_cls(\n"
     "                    current_vllm_config,\n"),
    ("vllm/model_executor/models/qwen3_dflash.py",
     "class DFlashQwen3ForCausalLM(Qwen3ForCausalLM):\n"
     "    def __init__(self, *, vllm_config: VllmConfig, prefix: str = \"\"):\n",
     "class DFlashQwen3ForCausalLM(Qwen3ForCausalLM):\n"
     "    # onecard 0080: DFlash2 (qwen3_dflash2.py) substitutes its model class\n"
     "    model_cls = DFlashQwen3Model\n"
     "\n"
     "    def __init__(self, *, vllm_config: VllmConfig, prefix: str = \"\"):\n"),
    ("vllm/model_executor/models/qwen3_dflash.py",
     "        self.model = DFlashQwen3Model(\n",
     "        self.model = self.model_cls(\n"),
    ("vllm/v1/worker/gpu_model_runner.py",
     "            elif self.speculative_config.use_dflash():\n"
     "                self.drafter = DFlashProposer(self.vllm_config, self.device, self)\n",
     "            elif self.speculative_config.use_dflash():\n"
     "                if getattr(self.speculative_config, \"dflash2\", False):\n"
     "                    # onecard 0080: DFlash2 (selector walk + lookup lane)\n"
     "                    from vllm.v1.spec_decode.dflash2 import DFlash2Proposer\n"
     "\n"
     "                    self.drafter = DFlash2Proposer(\n"
     "                        self.vllm_config, self.device, self\n"
     "                    )\n"
     "                else:\n"
     "                    self.drafter = DFlashProposer(\n"
     "                        self.vllm_config, self.device, self\n"
     "                    )\n"),
]


def _diff(path: str, old: str, new: str) -> str:
    a = old.splitlines(keepends=True)
    b = new.splitlines(keepends=True)
    src = "/dev/null" if not old else f"a/{path}"
    lines = list(difflib.unified_diff(a, b, src, f"b/{path}", n=3))
    if not lines:
        return ""
    if not old:  # difflib writes "@@ -0,0 +1,N @@" already
        pass
    out = "".join(line if line.endswith("\n") else line + "\n\\ No newline at end of file\n"
                  for line in lines)
    return out


def edited_diffs(site: Path, edits: list[tuple[str, str, str]], base: str = "pristine vLLM 0.27.1",
                 prog: str = "make_patch") -> list[str]:
    """One unified diff per file of ``edits`` (path, old, new), in path order: the file under
    ``site`` with its edits applied in turn, each old text matching exactly once (else one error
    naming the file, the anchor's first line and ``base``). Shared by the generated patches."""
    by_file: dict[str, list[tuple[str, str]]] = {}
    for path, old, new in edits:
        by_file.setdefault(path, []).append((old, new))
    parts = []
    for path in sorted(by_file):
        text = (Path(site) / path).read_text(encoding="utf-8")
        orig = text
        for old, new in by_file[path]:
            n = text.count(old)
            if n != 1:
                raise SystemExit(f"{prog}: {path}: edit anchor found {n} times (valid: "
                                 f"exactly once in {base}): {old.splitlines()[0]!r}")
            text = text.replace(old, new)
        parts.append(_diff(path, orig, text))
    return parts


def build(vllm_dir: Path) -> str:
    parts = [HEADER, "\n", *edited_diffs(Path(vllm_dir).parent, EDITS)]
    for path, name in sorted(NEW_FILES.items()):
        parts.append(_diff(path, "", (SRC / name).read_text(encoding="utf-8")))
    return "".join(parts)


def write_atomic(path: Path, text: str) -> None:
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.")
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            f.write(text)
        os.chmod(tmp, 0o644)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="make_patch", description=__doc__.splitlines()[0])
    ap.add_argument("--vllm-dir", type=Path, default=None,
                    help="a PRISTINE vllm 0.27.1 package dir (default: the importable vllm)")
    ap.add_argument("--out", type=Path, default=PATCH)
    ap.add_argument("--check", action="store_true", help="exit 1 if --out differs")
    args = ap.parse_args(argv)
    from onecard.patching import locate_vllm

    text = build(locate_vllm(args.vllm_dir))
    if args.check:
        same = args.out.is_file() and args.out.read_text(encoding="utf-8") == text
        print(f"{args.out}: {'up to date' if same else 'DIFFERS from the generated patch'}")
        return 0 if same else 1
    write_atomic(args.out, text)
    print(f"wrote {args.out} ({text.count(chr(10))} lines)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
