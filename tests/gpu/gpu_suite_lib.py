"""Pure helpers of the GPU suite (no GPU, no server): the greedy-exactness rule, the 128-residue
prompt builder, and the report table. CPU-tested in tests/test_gpu_suite_exactness.py.

The exactness rule (SPEC=mtp output against SPEC=off output, same prompts, greedy):

- ``float32`` (strict mode): token-for-token equality. Any divergence fails.
- ``bfloat16``: compare up to the first divergence. A divergence at position p is accepted only
  where it is a rounding near-tie of SPEC=off's own logits there: the token the other server
  chose has, in SPEC=off's raw logits at p, a value within ``TIE_ULPS`` units in the last place
  of bf16 of off's top logit (the ulp is derived from the values' magnitude; raw logits come
  from a server started with ``--logprobs-mode raw_logits``, ``TOP_K`` top logprobs per
  position). Any rank counts (a three-way tie is a tie); a chosen token outside off's top
  ``TOP_K`` has an unknown logit and fails (its rank is reported as ``> k``). Everything else
  fails.
"""
from __future__ import annotations

import math
import re
from dataclasses import asdict, dataclass

# Mantissa bits (without the implicit one) and the smallest normal exponent per float format.
FLOAT_FORMATS = {"bfloat16": (7, -126), "float16": (10, -14), "float32": (23, -126)}
TIE_ULPS = 2
# Top logprobs the SPEC=off servers are asked for per position (vLLM 0.27.1's --max-logprobs
# default is 20, so no server flag is needed; tests/test_gpu_suite_argv.py checks it).
TOP_K = 8


def ulp(x: float, dtype: str = "bfloat16") -> float:
    """Spacing of the ``dtype`` grid at |x|: 2**(e - mantissa_bits) for |x| in [2**e, 2**(e+1)),
    the subnormal spacing below the smallest normal."""
    if dtype not in FLOAT_FORMATS:
        raise ValueError(f"unknown float format {dtype!r}; valid: {', '.join(FLOAT_FORMATS)}")
    mant, emin = FLOAT_FORMATS[dtype]
    if not math.isfinite(x):
        raise ValueError(f"ulp of a non-finite value {x!r}; valid: a finite float")
    e = math.frexp(abs(x))[1] - 1 if x != 0 else emin
    return 2.0 ** (max(e, emin) - mant)


def top_entries(entry: dict | None) -> list[tuple[int, float]]:
    """One position of an OpenAI ``top_logprobs`` entry (keys ``token_id:N`` from
    ``return_tokens_as_token_ids``) as [(token id, value)] sorted by value, best first (all of
    them: vLLM returns the top ``logprobs`` plus the sampled token)."""
    out = []
    for key, val in (entry or {}).items():
        if val is None:
            continue
        tok = key.split(":", 1)[1] if key.startswith("token_id:") else key
        try:
            out.append((int(tok), float(val)))
        except ValueError:
            continue
    out.sort(key=lambda tv: (-tv[1], tv[0]))
    return out


def top2(entry: dict | None) -> list[tuple[int, float]]:
    """The best two of ``top_entries``."""
    return top_entries(entry)[:2]


@dataclass
class Divergence:
    position: int | None          # first differing position (None: identical)
    ref_token: int | None = None
    got_token: int | None = None
    top1: float | None = None     # SPEC=off's top raw logit there
    top2: float | None = None     # and its second best (report)
    got_logit: float | None = None   # SPEC=off's raw logit of the chosen token (None: not in top-k)
    got_rank: int | str | None = None   # its 1-based rank in off's top-k, or "> k"
    top_k: int | None = None      # how many of off's logits were there
    gap: float | None = None      # top1 - got_logit
    ulp: float | None = None
    gap_ulps: float | None = None
    accepted: bool = True
    why: str = "identical"

    def as_dict(self) -> dict:
        return asdict(self)


def judge(ref: list[int], got: list[int], ref_top: list[list[tuple[int, float]]] | None,
          dtype: str, tie_ulps: int = TIE_ULPS) -> Divergence:
    """First divergence of ``got`` from ``ref`` and whether the rule above accepts it.
    ``ref_top[p]`` is SPEC=off's top-k (token, raw logit) at position p (any order)."""
    if dtype not in FLOAT_FORMATS:
        raise ValueError(f"unknown float format {dtype!r}; valid: {', '.join(FLOAT_FORMATS)}")
    p = next((i for i, (a, b) in enumerate(zip(ref, got)) if a != b), None)
    if p is None:
        if len(ref) == len(got):
            return Divergence(None)
        return Divergence(min(len(ref), len(got)), accepted=False,
                          why=f"length differs: {len(ref)} vs {len(got)} tokens")
    d = Divergence(p, ref[p], got[p], accepted=False)
    raw = ref_top[p] if ref_top is not None and p < len(ref_top) else None
    # By value, best first; among equal values off's own token first, then the given order
    # (vLLM's), so a chosen token's rank in an exact tie is its place after off's pick.
    top = [(int(t), float(v)) for t, v in (raw or []) if v is not None]
    top = sorted(top, key=lambda tv: (-tv[1], tv[0] != ref[p]))
    d.top_k = len(top)
    if top:
        d.top1 = top[0][1]
        d.top2 = top[1][1] if len(top) > 1 else None
        rank = next((i for i, (t, _) in enumerate(top) if t == got[p]), None)
        if rank is None:
            d.got_rank = f"> {len(top)}"
        else:
            d.got_rank = rank + 1
            d.got_logit = top[rank][1]
            d.gap = d.top1 - d.got_logit
            d.ulp = ulp(max(abs(d.top1), abs(d.got_logit)), dtype)
            d.gap_ulps = d.gap / d.ulp
    if dtype == "float32":
        d.why = "strict mode (float32): any divergence fails"
    elif not top:
        d.why = "no top-k logits from SPEC=off at this position"
    elif d.got_logit is None:
        d.why = (f"token {got[p]} is not among SPEC=off's top {len(top)} "
                 f"{[t for t, _ in top]} (rank > {len(top)})")
    elif d.gap > tie_ulps * d.ulp:
        d.why = (f"token {got[p]} (rank {d.got_rank}): gap {d.gap:.6g} > {tie_ulps} {dtype} "
                 f"ulps ({tie_ulps * d.ulp:.6g})")
    else:
        d.accepted = True
        d.why = (f"near-tie: token {got[p]} rank {d.got_rank} of off's top {len(top)}, gap "
                 f"{d.gap_ulps:g} ulp(s) of {dtype} at |logit| "
                 f"{max(abs(d.top1), abs(d.got_logit)):.4g}")
    return d


def judge_all(refs: list[list[int]], gots: list[list[int]], ref_tops: list | None, dtype: str,
              labels: list | None = None) -> dict:
    """{label: Divergence} over aligned prompt lists."""
    if len(refs) != len(gots):
        raise ValueError(f"{len(refs)} reference outputs but {len(gots)} compared outputs")
    labels = labels if labels is not None else list(range(len(refs)))
    return {lab: judge(r, g, ref_tops[i] if ref_tops else None, dtype)
            for i, (lab, r, g) in enumerate(zip(labels, refs, gots))}


def summarize(name: str, verdicts: dict, width: int = 96) -> tuple[list[str], list]:
    """A compact report: one count line; the accepted near-ties packed as ``label@position
    gap-in-ulps``, plus ``rN`` where the chosen token was off's N-th (N > 2), wrapped at
    ``width``; one full row per failing divergence (label, position, off's token, the other
    token, its rank in off's top-k, gap, ulps, why). Returns (lines, failing labels)."""
    div = {k: v for k, v in verdicts.items() if v.position is not None}
    bad = [k for k, v in div.items() if not v.accepted]
    lines = [f"{name}: {len(verdicts)} compared, {len(verdicts) - len(div)} identical, "
             f"{len(div) - len(bad)} near-tie divergence(s) accepted, {len(bad)} failing"]
    ties = [f"{k}@{v.position} {v.gap_ulps:g}u"
            + (f" r{v.got_rank}" if isinstance(v.got_rank, int) and v.got_rank > 2 else "")
            for k, v in div.items() if v.accepted]
    line = "  near-ties (prompt@position gap in ulps):"
    for t in ties:
        if len(line) + len(t) + 2 > width:
            lines.append(line)
            line = "   "
        line += f" {t},"
    if ties:
        lines.append(line.rstrip(","))
    for k in bad:
        v = div[k]
        gap = f"{v.gap:.6g}" if v.gap is not None else "-"
        ulps = f"{v.gap_ulps:g}" if v.gap_ulps is not None else "-"
        rank = f" (rank {v.got_rank} in off's top {v.top_k})" if v.got_rank is not None else ""
        lines.append(f"  FAIL prompt {k} position {v.position}: off token {v.ref_token}, got "
                     f"{v.got_token}{rank}, gap {gap} ({ulps} ulps): {v.why}")
    return lines, bad


# --------------------------------------------------------------------------- residue prompts

def corpus_text() -> str:
    """Deterministic prose on any CPython: the pydoc topic texts (the tiny tokenizer's corpus)."""
    from pydoc_data.topics import topics

    return "\n\n".join(topics[k] for k in sorted(topics))


def residue_prompts(encode, decode, text: str, base: int = 512, modulus: int = 128,
                    stride: int = 389) -> list[tuple[int, str, int]]:
    """One text prompt per residue r in 0..modulus-1 with exactly ``base + r`` tokens under
    ``encode`` (so the token lengths cover every residue mod ``modulus``), each cut from its own
    start offset in ``text`` (prompts do not share a long prefix: each one's second pass, not a
    neighbour, is what hits the prefix cache). Returns [(r, text, n_tokens)].

    A slice of token ids decodes to text that usually re-encodes to the same count; where the
    boundary re-merges, the next start offset is tried."""
    if base < 1 or modulus < 1:
        raise ValueError(f"base {base} and modulus {modulus} invalid; valid: both >= 1")
    ids = encode(text)
    span = base + modulus
    if len(ids) < span + modulus * 4:
        raise ValueError(f"text has {len(ids)} tokens; valid: at least {span + modulus * 4}")
    room = len(ids) - span
    out = []
    for r in range(modulus):
        n = base + r
        start = (r * stride) % room
        for attempt in range(64):
            s = (start + attempt) % room
            t = decode(ids[s:s + n])
            if len(encode(t)) == n:
                out.append((r, t, n))
                break
        else:
            raise ValueError(f"no prompt of exactly {n} tokens near offset {start}")
    return out


def ideal_prefix_hit(L: int, block: int, spec: bool) -> int:
    """Prefix-cache hit tokens a resend of a prompt of L tokens can get in vLLM 0.27.1 align mode
    with nothing evicted (docs/prefix-cache.md). Full attention matches floor((L-1)/B) blocks (the
    last prompt token is always recomputed: kv_cache_manager.get_computed_blocks,
    max_cache_hit_length = num_tokens - 1); speculation (EAGLE/MTP/DFlash) drops one more. The GDN
    state exists at one prompt boundary only: (floor(L/B) - spec) * B
    (scheduler._mamba_block_aligned_split, last_cache_position). A hit needs both to agree.
    Checked against vLLM's own manager on CPU: tests/test_prefix_cache.py."""
    attn = ((L - 1) // block - int(spec)) * block
    state = (L // block - int(spec)) * block
    return attn if attn > 0 and attn == state else 0


def attention_block_in_log(text: str) -> int | None:
    """The attention block size vLLM chose, from a server log ("Setting attention block size to N
    tokens"); None when the log does not say."""
    m = re.search(r"Setting attention block size to (\d+) tokens", text)
    return int(m.group(1)) if m else None


def predicted_hit_tokens(lengths, block: int | None, spec: bool) -> int | None:
    """Prefix-cache hit tokens a second pass of prompts of these lengths can get with nothing
    evicted (ideal_prefix_hit per prompt). None without a block size."""
    if not block:
        return None
    return sum(ideal_prefix_hit(n, block, spec) for n in lengths)
