"""docs/profiles.md: what each CTX x SPEC profile gives on a 24 GB card, PREDICTED by onecard's memory
model (never measured on a 24 GB card; never edit the file by hand: regenerate it).

For each CTX in fast/long/huge and SPEC in off/mtp/dflash2 it builds the plan that
``CARD_GIB=24 CTX=.. SPEC=.. ./start_qwen.sh --dry-run`` builds (onecard.plan.make_plan: knobs ->
preflight -> prediction) on a machine where KVarN and patch 0080 are installed and the published
27B DFlash2 drafter sits in DRAFT. Here they need not be: while the plans are built, the script
pretends they are, as the tests do (onecard.profiles.pretend_installed: the features' marker files
in a fake vllm package dir that ``importlib.util.find_spec("vllm")`` returns; the drafter: its
config.json from onecard.dflash.tiny_drafter.build_geometry_drafter, as the ``drafter_27b`` fixture
of tests/test_plan_dflash2_ring.py). Nothing outside this process changes. The plans are machine-
independent: no .env, no environment, no checkpoint (the target's weights are the memory model's
prepared 27B layout), no GPU probe. Imports neither vLLM nor Triton (torch, yes: the memory model's
KVarN stage term for CTX=huge imports onecard.kvarn.stage); a second or two.

Usage: python scripts/profile_table.py            write docs/profiles.md (temp file + rename)
       python scripts/profile_table.py --check    exit 1 when docs/profiles.md differs from it
"""
from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from onecard import memory, profiles  # noqa: E402
from onecard import plan as P  # noqa: E402

DOC = REPO / "docs" / "profiles.md"
CTXS = ("fast", "long", "huge")
SPECS = ("off", "mtp", "dflash2")
CARD_GIB = 24
TMP_PREFIX = "onecard-profile-table-"
# notes every --dry-run prints that are not about what the profile gives on the card
LEFT_OUT = ("prefix cache:", "PREFIX_CACHE=1 with SPEC=", "each resident sequence holds")


def published_drafter(tmp: Path) -> Path:
    """The published 27B DFlash2 drafter's config.json (5 layers, 8 x 128, window 2048), no weights:
    all a dry run reads of DRAFT (the same builder as tests' drafter_27b fixture)."""
    from onecard.dflash.tiny_drafter import build_geometry_drafter

    d = tmp / "dflash2-drafter"
    build_geometry_drafter(d, config_only=True, log=lambda *a, **k: None)
    return d


def build_plans(extra: dict | None = None, specs: tuple[str, ...] = SPECS) -> list[tuple[str, str, P.ServePlan | str]]:
    """(CTX, SPEC, plan) for the 9 profiles; a refused plan is its one-line PlanError. ``extra``:
    more knobs for every plan (stock_line: GDN_DEFER=0), ``specs``: the SPEC values."""
    out = []
    with tempfile.TemporaryDirectory(prefix=TMP_PREFIX) as t:
        tmp = Path(t)
        root = tmp / "root"  # no .env, no api_key.txt
        root.mkdir()
        draft = published_drafter(tmp)
        with profiles.pretend_installed(tmp / "fakevllm"):
            for ctx in CTXS:
                for spec in specs:
                    env = {"CARD_GIB": str(CARD_GIB), "CTX": ctx, "SPEC": spec,
                           # no checkpoint here: the memory model's 27B layout, wherever this runs
                           "MODEL": str(root / "models" / "qwen38-27b"), **(extra or {})}
                    if spec == "dflash2":
                        env["DRAFT"] = str(draft)
                    try:
                        out.append((ctx, spec, P.make_plan(env, root, python="python3")))
                    except P.PlanError as e:
                        out.append((ctx, spec, f"refused: {e}"))
    return out


def _gib(n: int) -> str:
    return f"{n / memory.GiB:.2f}"


def stock_line() -> str:
    """The speculative profiles' MAX_LEN and pool with GDN_DEFER=0 (stock vLLM's GDN states), beside
    the table's default GDN_DEFER=auto (1 on one GPU)."""
    cells = []
    for ctx, spec, plan in build_plans({"GDN_DEFER": "0"}, ("mtp", "dflash2")):
        if isinstance(plan, str):
            cells.append(f"`CTX={ctx} SPEC={spec}` refused")
        else:
            cells.append(f"`CTX={ctx} SPEC={spec}` {int(plan.get('MAX_LEN')):,} / "
                         f"{plan.prediction['pool_tokens']:,}")
    return ", ".join(cells)


def _spec_cell(spec: str, plan: P.ServePlan) -> str:
    k = int(plan.get("SPEC_K"))
    cell = {"off": "off", "mtp": f"mtp (k={k})", "dflash2": f"dflash2 ({k} tokens)"}[spec]
    if spec == "dflash2" and plan.get("DRAFT_QUANT") == "fp8":
        cell += ", FP8 drafter"
    return cell


def _kv_cell(plan: P.ServePlan) -> str:
    kv = str(plan.get("KV"))
    arg = memory.kv_cache_dtype_arg(kv)
    return f"`{kv}`" if arg in (None, kv) else f"`{kv}` (`{arg}`)"


def _notes(plan: P.ServePlan) -> list[str]:
    """The plan's notes that matter here: every cap (its reason), every note but LEFT_OUT's."""
    caps = [f"{n} capped to {v.value:,}: {v.reason}" if isinstance(v.value, int) else f"{n} capped: {v.reason}"
            for n, v in plan.values.items() if v.source == "cap"]
    return caps + [n for n in plan.notes if not n.startswith(LEFT_OUT)]


def row(ctx: str, spec: str, plan: P.ServePlan | str) -> tuple[list[str], list[str]]:
    """(the table's cells, the notes) of one profile."""
    if isinstance(plan, str):
        return [ctx, spec] + ["—"] * 8 + ["**refused** (below)"], [plan]
    v, p = plan.values, plan.prediction or {}
    vram = p.get("vram")
    max_len = f"{int(plan.get('MAX_LEN')):,}"
    if v["MAX_LEN"].source == "cap":
        max_len += f" (capped from {profiles.CTX_PROFILES[ctx].max_len:,})"
    pin = plan.get("KV_MEM")
    pin = f"{_gib(pin)} GiB" if isinstance(pin, int) else str(pin)
    if v["KV_MEM"].source == "cap":
        pin += " (lowered to fit)"
    pool = f"{p['pool_tokens']:,} ({p['max_concurrency']:.2f}x)" if "pool_tokens" in p else "—"
    notes = _notes(plan)
    short = [f"{n} capped" for n, x in v.items() if x.source == "cap"]
    if vram is None:
        total = fits = certain = "—"
    else:
        card = vram["card_bytes"]
        total = f"{_gib(vram['total'])} / {_gib(card)}"
        fits = "yes" if vram["fits"] else "**NO**"
        certain = f"{'yes' if vram['certain'] <= card else '**NO**'} ({_gib(vram['certain'])})"
        if any("does NOT fit" in n for n in notes):
            short.append("does NOT fit" + (f" (KV_MEM <= {vram['kv_max'] // memory.MiB}M would)"
                                           if vram["kv_max"] > 0 else ""))
    cells = [ctx, _spec_cell(spec, plan), _kv_cell(plan), max_len, str(plan.get("MAX_SEQS")), pin, pool,
             total, fits, certain, "; ".join(short) or "—"]
    return cells, notes


HEADER = """\
# What each CTX x SPEC profile gives on a 24 GB card (PREDICTED)

<!-- Generated by `python scripts/profile_table.py`; do not edit by hand. tests/test_profile_table.py
fails when this file differs from the script's output: regenerate it after a change to the profiles
or the memory model. -->

Generated by `python scripts/profile_table.py` from onecard's memory model: for each profile it
builds the plan that `CARD_GIB={card} CTX=... SPEC=... ./start_qwen.sh --dry-run` builds (the
launcher's knobs, preflight and prediction; `--dry-run` prints every value, note and the argv).
`python scripts/profile_table.py --check` says whether this file is current.

- **Every figure is PREDICTED** for a {card} GiB card at the profiles' 3090 `KV_MEM` pins. None was
  measured on an RTX 3090 or any other 24 GB card.
- What was checked on a GPU (an NVIDIA H200 or H100, with the 3090 pins and the 27B geometry): for
  several of these profiles, vLLM's own KV pool ("GPU KV cache size") against the predicted pool,
  and each server's GPU memory against the VRAM total (job 41). Which profiles, when, and how they
  compared: [measurements.md](measurements.md). The {reserves} GiB of reserves (CUDA graphs,
  activations, CUDA context) are estimates, except where job 41 measured the profile at the
  launcher's 2,048-token prefill chunk with the torch allocator capped at a 24 GiB card's share
  (H100, 2026-12-05): `CTX=long SPEC=dflash2` (2.46 GiB: the estimate was 0.04 GiB high), the same
  with `GDN_DEFER=0` (2.20) and `CTX=huge SPEC=dflash2` (1.94). Those plans count the measured
  reserves (the note says so); each server booted, prefilled MAX_LEN/2 tokens and served its batch
  under the cap, with 0.23-0.52 GiB to spare by the 3090 estimate (the H100's CUDA context swapped
  for the 512 MiB estimate; a 3090's own context and kernel modules were not measured). The first
  measurement (H200, job 41, session 19: 1.2-2.0 GiB above these totals) prefilled in vLLM's H200
  chunk of 8,192 tokens; at that chunk the estimate now counts 3.75 GiB more.
- The plans assume what a full install has: KVarN (`./install.sh --kvarn`, for `CTX=huge`), patch
  0080 (`SPEC=dflash2`), the prepared 27B checkpoint (its weights as the memory model lays them
  out: int8 lm_head/embed/MTP) and the published 27B DFlash2 drafter in `DRAFT` (its config's
  shape, bf16 weights; "FP8 drafter": `DRAFT_QUANT=auto` quantizes its fc, o_proj and MLP to FP8
  while it loads, because with bf16 the plan does not fit the card: weights 3.58 -> 2.14 GiB, plus
  DFlash's 0.10 GiB bf16 K/V copy either way; on an H200 it loaded 2.33 GiB against the 2.24 predicted and its greedy
  output equalled `SPEC=off` on the tiny model, job 70; acceptance with the real weights not yet measured). **`SPEC=dflash2` needs that
  drafter checkpoint**: `./install.sh --drafter` (or `onecard prepare drafter`) fetches it into
  `models/dflash2-drafter` (`DRAFT=DIR` points elsewhere); without one the launcher refuses
  `SPEC=dflash2`.
- The speculative plans (`SPEC=mtp|dflash2`) run the default `GDN_DEFER=auto`, 1 on one GPU (patch
  0085, [gdn-defer.md](gdn-defer.md)): one GDN state block per sequence instead of one per draft
  position, so the pool holds more KV at the same pin, plus a small verify scratch beside it (on an
  H100, 2026-12-05: greedy output equal to `SPEC=off`, and the `CTX=long SPEC=dflash2` pool as
  predicted). With `GDN_DEFER=0` (stock vLLM's GDN states) the same pins give, as MAX_LEN / KV pool
  tokens: {stock}.

Columns: **MAX_LEN** after the preflight's caps; **KV_MEM pin** the profile's pin (the preflight
lowers it only when even the certain part does not fit); **KV pool** the predicted pool in tokens
(and how many sequences of MAX_LEN it holds); **VRAM** everything one GPU holds at the pin
(weights, drafter, KVarN stage, drafter rings, GDN_DEFER verify scratch, reserves, KV pin) against
the card, in GiB;
**fits** that total against the card; **without reserves** the same without the estimated
CUDA-graph and activation reserves (the CUDA context stays), which the preflight counts as
certain (over the card only by the reserves, the pin stays and a note names a smaller `KV_MEM`
to set if the boot runs out of GPU memory).

"""

COLUMNS = ["CTX", "SPEC", "KV dtype", "MAX_LEN", "MAX_SEQS", "KV_MEM pin", "KV pool, tokens (x MAX_LEN)",
           "VRAM / card, GiB", f"fits {CARD_GIB} GiB", "without reserves (GiB)", "notes"]


def render(plans: list | None = None) -> str:
    plans = build_plans() if plans is None else plans
    text = HEADER.format(card=CARD_GIB, reserves=_gib(memory.RESERVES), stock=stock_line())
    lines = ["| " + " | ".join(COLUMNS) + " |", "|" + "---|" * len(COLUMNS)]
    sections = []
    for ctx, spec, plan in plans:
        cells, notes = row(ctx, spec, plan)
        lines.append("| " + " | ".join(c.replace("|", "\\|") for c in cells) + " |")
        sections.append(f"### CTX={ctx} SPEC={spec}\n\n" + "".join(f"- {n}\n" for n in notes))
    text += "\n".join(lines) + "\n\n"
    text += ("## The plans' notes\n\nPer profile, as `--dry-run` prints them (the prefix-cache notes and the GDN "
             "state blocks per sequence left out).\n\n")
    text += "\n".join(sections)
    if TMP_PREFIX in text:  # nothing of this run's temp dirs (the drafter's path) may reach the file
        raise RuntimeError("the table shows this run's temp dir; it would differ at every run")
    return text


def write_atomic(path: Path, text: str) -> None:
    """Temp file beside ``path``, then rename: a reader sees the old file or the new one."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.NamedTemporaryFile("w", encoding="utf-8", dir=path.parent, prefix=f".{path.name}.",
                                     suffix=".tmp", delete=False) as fh:
        fh.write(text)
    try:
        Path(fh.name).chmod(0o644)
        Path(fh.name).replace(path)
    except BaseException:
        Path(fh.name).unlink(missing_ok=True)
        raise


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--check", action="store_true", help="exit 1 when the file differs from what would be generated")
    ap.add_argument("--out", type=Path, default=DOC, help="the file (default: docs/profiles.md)")
    args = ap.parse_args(argv)
    text = render()
    out = args.out.resolve()
    shown = out.relative_to(REPO) if out.is_relative_to(REPO) else out
    if args.check:
        have = out.read_text(encoding="utf-8") if out.is_file() else None
        if have != text:
            print(f"{shown} is out of date with the memory model: run python scripts/profile_table.py")
            return 1
        print(f"{shown} is up to date")
        return 0
    write_atomic(out, text)
    print(f"wrote {shown} ({len(CTXS) * len(SPECS)} profiles)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
