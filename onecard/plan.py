"""Environment knobs + flags -> ServePlan (argv, child env, and why each value is what it is).

The only place the launcher knobs are read. Order: built-in default < CTX/SPEC profile <
``.env`` file < process environment; the preflight then may cap a value (source ``cap``) with a
reason. Bad input raises :class:`PlanError` with one line naming the valid values.
Never imports vllm or torch.
"""
from __future__ import annotations

import json
import os
import shlex
import shutil
import stat
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Mapping

from onecard import memory, profiles

LOOPBACK = {"127.0.0.1", "localhost", "::1"}
# variables onecard reads besides its knobs (a near-miss of a knob name that is not a typo)
NOT_KNOBS = {"MODELS"}
# the quantized KV caches stock vLLM serves on TRITON_ATTN only, and the wide-verify kernel reads
PER_TOKEN_HEAD_KV = ("int8_per_token_head", "int4_per_token_head")
SERVE_PREFIX = ["-m", "vllm.entrypoints.cli.main", "serve"]
SERVER_KEEP_ALIVE_S = 30  # VLLM_HTTP_TIMEOUT_KEEP_ALIVE when unset (make_plan: longer than clients keep idle)


def is_loopback(host: str) -> bool:
    """localhost, or an address in 127.0.0.0/8 or ::1 (what a non-keyed server may bind)."""
    import ipaddress

    if host in LOOPBACK:
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


class PlanError(ValueError):
    """A bad knob or an impossible configuration: str(e) is one line for the user."""


@dataclass
class Value:
    value: object
    source: str  # default | profile | .env | env | cap
    reason: str = ""


@dataclass
class ServePlan:
    values: dict[str, Value] = field(default_factory=dict)
    argv: list[str] = field(default_factory=list)
    child_env: dict[str, str] = field(default_factory=dict)  # added to the child's environment
    notes: list[str] = field(default_factory=list)
    prediction: dict | None = None
    api_key: str | None = field(default=None, repr=False)
    # DFLASH_RING=1: the drafter's ring geometry, read from DRAFT once in resolve (the preflight
    # sizes the rings from it)
    ring_geometry: memory.RingDrafter | None = None
    # bytes other processes held on the GPU at launch, left out of CARD_GIB (card_for_plan)
    card_used_by_others: int = 0

    def get(self, name: str):
        return self.values[name].value

    def set(self, name: str, value, source: str, reason: str = "") -> None:
        self.values[name] = Value(value, source, reason)

    def cap(self, name: str, value, reason: str) -> None:
        old = self.values.get(name)
        if old is not None and old.source not in ("default", "profile", "cap") and old.value != value:
            # the user asked for this value: say so in a note, not only in the table's source column
            self.notes.append(f"{name}={old.value} (from {old.source}) is lowered to {value}: {reason}")
        self.values[name] = Value(value, "cap", reason)

    def to_json(self) -> dict:
        return {
            "values": {k: {"value": v.value, "source": v.source, "reason": v.reason} for k, v in self.values.items()},
            "argv": self.argv,
            "child_env": sorted(self.child_env),  # names only: values may be secret
            "notes": self.notes,
            "prediction": self.prediction,
            "api_key_set": self.api_key is not None,
        }


# ------------------------------------------------------------------ environment sources

def read_dotenv(path: Path) -> dict[str, str]:
    """``.env`` as a dict: python-dotenv when installed, else a small KEY=VALUE reader."""
    if not path.is_file():
        return {}
    try:
        from dotenv import dotenv_values
    except ImportError:
        return _parse_dotenv(path.read_text())
    return {k: v for k, v in dotenv_values(path).items() if v is not None}


def _parse_dotenv(text: str) -> dict[str, str]:
    out: dict[str, str] = {}
    for n, line in enumerate(text.splitlines(), 1):
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        line = line.removeprefix("export ").strip()
        key, sep, val = line.partition("=")
        if not sep or not key.strip().replace("_", "").isalnum():
            raise PlanError(f".env line {n} is not KEY=VALUE; valid: KEY=VALUE, # comments, export KEY=VALUE")
        val = val.strip()
        if len(val) >= 2 and val[0] == val[-1] and val[0] in "'\"":
            val = val[1:-1]
        elif " #" in val:
            val = val.split(" #", 1)[0].rstrip()
        out[key.strip()] = val
    return out


# vLLM serve flags the plan owns: the listening address and the key (the server never listens
# beyond loopback without an API key) and the figures the preflight sized. EXTRA_ARGS may not carry
# them in any spelling vLLM's parser accepts: --flag / --flag=v, underscores for dashes, dotted
# sub-keys (--speculative-config.method), and unique prefixes (argparse's allow_abbrev: --ho).
# --config (a YAML file of flags) could set any of them, so it is refused too.
OWNED_FLAGS = {
    "--host": "HOST=... (a non-loopback HOST needs VLLM_API_KEY)",
    "--port": "PORT=...",
    "--uds": "HOST / PORT (the server listens on TCP, on loopback unless an API key is set)",
    "--api-key": "VLLM_API_KEY in the environment, .env or api_key.txt mode 600 (a flag shows in the process list)",
    "--config": "knobs and other flags in EXTRA_ARGS (a config file could set the host or the key)",
    "--max-model-len": "MAX_LEN=...",
    "--max-num-seqs": "MAX_SEQS=...",
    "--max-num-batched-tokens": "PREFILL_CHUNK=...",
    "--kv-cache-memory-bytes": "KV_MEM=...",
    "--kv-cache-dtype": "KV=... or CTX=fast|long|huge",
    "--speculative-config": "SPEC=off|mtp|dflash2 with SPEC_K / DFLASH_TOKENS / DRAFT",
    "--served-model-name": "SERVED_NAME=...",
}


def owned_flag(word: str) -> str | None:
    """The OWNED_FLAGS flag that vLLM's parser would read ``word`` as, else None."""
    if not word.startswith("--") or word == "--":
        return None
    name = word.split("=", 1)[0].split(".", 1)[0].replace("_", "-")
    if name in OWNED_FLAGS:
        return name
    hits = [f for f in OWNED_FLAGS if f.startswith(name)] if len(name) > 3 else []
    return hits[0] if len(hits) == 1 else None


def read_api_key(env: Mapping[str, str], dotenv: Mapping[str, str], root: Path) -> tuple[str | None, str]:
    """(key, where it came from). api_key.txt must be mode 0600. Surrounding whitespace is not part
    of a key; a key of whitespace only is refused (it would open a non-loopback HOST behind ' ')."""
    for where, src in (("env", env), (".env", dotenv)):
        raw = src.get("VLLM_API_KEY")
        if raw and not raw.strip():
            raise PlanError(f"VLLM_API_KEY in {where} is blank (whitespace only); valid: a non-empty key, or unset")
        if raw:
            return raw.strip(), where
    kf = root / "api_key.txt"
    if kf.is_file():
        mode = stat.S_IMODE(kf.stat().st_mode)
        if mode & 0o077:
            raise PlanError(f"api_key.txt has mode {mode:o}; valid: 600 (chmod 600 api_key.txt)")
        key = kf.read_text().strip()
        if key:
            return key, "api_key.txt"
    return None, ""


def parse_bytes(text: str, name: str) -> int:
    t = text.strip().upper().removesuffix("B").removesuffix("I")
    mult = {"K": 1024, "M": 1024**2, "G": 1024**3}.get(t[-1:] if t else "", 1)
    num = t[:-1] if mult != 1 else t
    try:
        v = float(num)
    except ValueError:
        raise PlanError(f"{name}={text!r} is not a size; valid: bytes, or a number with K/M/G (e.g. 5.2G), or 'auto'") from None
    if v <= 0 or v > 1024**4:
        raise PlanError(f"{name}={text!r} out of range; valid: 1 byte .. 1T, or 'auto'")
    return int(v * mult)


def parse_int(text: str, name: str, lo: int, hi: int) -> int:
    try:
        v = int(text.replace("_", "").replace(",", ""))
    except ValueError:
        raise PlanError(f"{name}={text!r} is not an integer; valid: {lo}..{hi}") from None
    if not lo <= v <= hi:
        raise PlanError(f"{name}={text!r} out of range; valid: {lo}..{hi}")
    return v


def parse_prefill_launch(text: str) -> str:
    """PREFILL_LAUNCH: 'auto', 'stock' or BLOCK_M:TILE:WARPS:STAGES (the rules of patch 0083's
    onecard_parse_prefill_launch, checked here before the boot)."""
    text = text.strip()
    if text in ("auto", "stock"):
        return text
    valid = ("valid: auto, stock, or BLOCK_M:TILE:WARPS:STAGES with BLOCK_M and TILE powers of two "
             "in 16..256, WARPS 2|4|8|16, STAGES 1..5 (e.g. 64:64:8:2)")
    try:
        bm, tile, warps, stages = (int(x) for x in text.split(":"))
    except ValueError:
        raise PlanError(f"PREFILL_LAUNCH={text!r} is not valid; {valid}") from None
    pow2 = lambda x: 16 <= x <= 256 and x & (x - 1) == 0  # noqa: E731
    if not (pow2(bm) and pow2(tile) and warps in (2, 4, 8, 16) and 1 <= stages <= 5):
        raise PlanError(f"PREFILL_LAUNCH={text!r} is not valid; {valid}")
    return text


def parse_choice(text: str, knob: profiles.Knob) -> str:
    if text not in knob.choices:
        shown = "|".join(c if c else "''" for c in knob.choices)
        raise PlanError(f"{knob.name}={text!r} is not valid; valid: {shown}")
    return text


# ------------------------------------------------------------------ the plan

def resolve(environ: Mapping[str, str], root: Path | str = ".", check_paths: bool = False,
            probe_gpus: bool = False) -> ServePlan:
    """Resolve every knob to a value with its source (no preflight, no argv yet). ``probe_gpus``:
    at TP>1 without CUDA_VISIBLE_DEVICES, ask nvidia-smi (a real launch only: plans stay
    machine-independent in --dry-run and tests)."""
    root = Path(root)
    dot = read_dotenv(root / ".env")
    plan = ServePlan()

    def raw(name: str) -> tuple[str | None, str]:
        if name in environ and environ[name] != "":
            return environ[name], "env"
        if name in dot and dot[name] != "":
            return dot[name], ".env"
        return None, ""

    for name in profiles.KNOBS:
        if name == "VLLM_API_KEY":
            continue
        v, src = raw(name)
        k = profiles.KNOBS[name]
        if v is None:
            plan.set(name, k.default, "default")
        else:
            plan.set(name, v.strip(), src)
            if k.choices:
                parse_choice(v.strip(), k)
            elif name == "PREFILL_LAUNCH":
                parse_prefill_launch(v)
    # a misspelt knob in the environment (MAXLEN=...) would otherwise be ignored without a word
    import difflib

    for name in sorted(n for n in environ if n.isupper() and n not in profiles.KNOBS and n not in NOT_KNOBS):
        near = difflib.get_close_matches(name, list(profiles.KNOBS), n=1, cutoff=0.85)
        if near:
            plan.notes.append(f"{name} is set in the environment but is not a launcher knob (ignored); did you mean {near[0]}?")
    unknown = sorted(n for n in dot if n not in profiles.KNOBS and n.isupper() and not n.startswith(("HF_", "VLLM_", "CUDA_")))
    if unknown:
        plan.notes.append(f".env sets {', '.join(unknown)}, which is not a launcher knob (valid: {', '.join(profiles.KNOBS)})")

    ctx = profiles.CTX_PROFILES[plan.get("CTX")]
    spec = profiles.SPEC_PROFILES[plan.get("SPEC")]
    for feat in (ctx.needs, spec.needs):
        if feat and not profiles.vllm_importable():
            raise PlanError(f"{'CTX=huge' if feat == 'kvarn' else 'SPEC=dflash2'}: {profiles.no_vllm_message()}")
        if feat and not profiles.feature_installed(feat):
            which = "CTX=huge" if feat == "kvarn" else "SPEC=dflash2"
            # what this vLLM can serve now, by the features that are installed
            ctxs = "|".join(n for n, c in profiles.CTX_PROFILES.items() if not c.needs or profiles.feature_installed(c.needs))
            specs = "|".join(n for n, p in profiles.SPEC_PROFILES.items() if not p.needs or profiles.feature_installed(p.needs))
            raise PlanError(f"{which}: {profiles.FEATURE_INSTALL[feat]}; valid now: CTX={ctxs}, SPEC={specs}")
    if ctx.needs == "kvarn" and (stale := profiles.feature_stale("kvarn")):
        raise PlanError(f"CTX=huge: the KVarN code installed in this vLLM is older than this checkout ({stale} "
                        f"changed); run kvarn/install.sh (or ./install.sh --kvarn) to update it; valid now: CTX=fast|long")

    # KV dtype
    if plan.values["KV"].source == "default":
        plan.set("KV", ctx.kv, "profile", f"CTX={ctx.name}")
    if plan.values["KV"].source != "profile" and ctx.name == "huge":
        raise PlanError("KV cannot be overridden with CTX=huge (KVarN); valid: KV with CTX=fast|long")
    preset = str(plan.get("KVARN_PRESET"))
    if plan.get("KV") == "kvarn":
        if preset != profiles.KNOBS["KVARN_PRESET"].default:
            plan.set("KV", f"kvarn_{preset}", plan.values["KVARN_PRESET"].source, f"KVARN_PRESET={preset}")
    else:
        _note_kvarn_only(plan, "KVARN_PRESET")

    # k
    if spec.name == "off":
        k = 0
        for n in ("SPEC_K", "DFLASH_TOKENS"):
            if plan.values[n].source != "default":
                raise PlanError(f"{n} needs SPEC=mtp|dflash2; valid with SPEC=off: unset")
        plan.set("SPEC_K", 0, "profile", "SPEC=off")
    elif spec.name == "mtp":
        if plan.values["DFLASH_TOKENS"].source != "default":
            raise PlanError("DFLASH_TOKENS needs SPEC=dflash2; valid with SPEC=mtp: SPEC_K=1..7")
        if plan.values["SPEC_K"].source == "default":
            plan.set("SPEC_K", spec.k_default[ctx.name], "profile", f"SPEC=mtp CTX={ctx.name}")
        else:
            plan.values["SPEC_K"].value = parse_int(plan.get("SPEC_K"), "SPEC_K", *spec.k_range)
    else:  # dflash2
        if plan.values["SPEC_K"].source != "default":
            raise PlanError("SPEC_K is for SPEC=mtp; valid with SPEC=dflash2: DFLASH_TOKENS=7..15")
        if plan.values["DFLASH_TOKENS"].source == "default":
            plan.set("SPEC_K", spec.k_default[ctx.name], "profile", "SPEC=dflash2")
        else:
            plan.set("SPEC_K", parse_int(plan.get("DFLASH_TOKENS"), "DFLASH_TOKENS", *spec.k_range),
                     plan.values["DFLASH_TOKENS"].source, "DFLASH_TOKENS")
    if plan.values["LOOKUP"].source != "default" and plan.get("LOOKUP") == "1" and spec.name != "dflash2":
        raise PlanError("LOOKUP=1 needs SPEC=dflash2; valid otherwise: LOOKUP=0")
    if plan.values["LOOKUP_LANE"].source != "default" and spec.name != "dflash2":
        raise PlanError(f"LOOKUP_LANE={plan.get('LOOKUP_LANE')} needs SPEC=dflash2 (the DFlash2 lookup lane); "
                        "valid otherwise: leave LOOKUP_LANE unset")
    if ctx.needs == "kvarn" and spec.name != "off" and 1 + int(plan.get("SPEC_K")) > KVARN_SMALL_VERIFY_ROWS:
        # KVarN's verify kernel at 9..16 query tokens (128 query rows x 256) needs 152 KiB of shared
        # memory per block (Triton 3.9, compiled for sm_86 on the CPU, session 23); none of its
        # launch settings fits the 99 KiB of an RTX 3090 / 4090 block (143-156 KiB, and ptxas caps
        # it at 128 registers with ~9-13 KB of spills there). Up to 8 query tokens: 86 KiB.
        k = int(plan.get("SPEC_K"))
        cap, why = card_capability(environ, probe=probe_gpus)
        need = (f"KVarN's verify kernel at {k + 1} query tokens needs {KVARN_WIDE_VERIFY_SHARED_KIB} KiB of "
                f"shared memory per block (an H100 / H200 or A100 has it; an RTX 3090 / 4090 has 99 KiB)")
        have = SHARED_KIB_PER_BLOCK.get(cap) if cap else None
        if have is not None and have < KVARN_WIDE_VERIFY_SHARED_KIB:
            raise PlanError(f"DFLASH_TOKENS={k} with CTX=huge: {need}, and this GPU ({why}) has {have} KiB; "
                            f"valid: DFLASH_TOKENS=7 with CTX=huge, or DFLASH_TOKENS={k} with CTX=long|fast")
        if have is None:
            plan.notes.append(f"DFLASH_TOKENS={k} with CTX=huge: {need}; a real launch on a card with less refuses "
                              f"it ({why})")
    if spec.name == "dflash2" and int(plan.get("SPEC_K")) > DFLASH2_DRAFTER_ROWS and plan.get("LOOKUP") == "0":
        plan.notes.append(f"DFLASH_TOKENS={plan.get('SPEC_K')} with LOOKUP=0: positions {DFLASH2_DRAFTER_ROWS + 1}.."
                          f"{plan.get('SPEC_K')} repeat the last draft (verified, rarely accepted); LOOKUP=1 fills them")

    # sizes
    for name, default, lo, hi in (("MAX_LEN", ctx.max_len, 256, 1_048_576), ("MAX_SEQS", ctx.max_seqs, 1, 256)):
        if plan.values[name].source == "default":
            plan.set(name, default, "profile", f"CTX={ctx.name}")
        else:
            plan.values[name].value = parse_int(plan.get(name), name, lo, hi)
    if plan.get("GDN_DEFER") == "1" and spec.name == "off":
        plan.notes.append("GDN_DEFER=1 has no effect with SPEC=off (no draft positions, so no per-draft GDN "
                          "states to drop); not passed to the server")
    if spec.name == "off" and plan.get("GDN_DEFER") == "auto":
        plan.set("GDN_DEFER", "0", "profile", "auto with SPEC=off: no draft positions")
    if plan.get("EMBED_HOST") == "1" and in_wsl():
        raise PlanError("EMBED_HOST=1 needs pinned host memory, which CUDA does not give under WSL; valid on WSL: "
                        "EMBED_HOST=0")
    # the prefill chunk: one decode step of every sequence (each with its draft tokens) must fit it
    k_step = 1 + (int(plan.get("SPEC_K")) if spec.name != "off" else 0)
    need = int(plan.get("MAX_SEQS")) * k_step
    chunk = parse_int(str(plan.get("PREFILL_CHUNK")), "PREFILL_CHUNK", 256, 65536)
    if chunk < need:
        raise PlanError(f"PREFILL_CHUNK={chunk} is below MAX_SEQS x (1 + draft tokens) = {plan.get('MAX_SEQS')} x "
                        f"{k_step} = {need} tokens, what one decode step schedules; valid: {max(need, 256)}..65536")
    plan.values["PREFILL_CHUNK"].value = chunk
    plan.values["PORT"].value = parse_int(str(plan.get("PORT")), "PORT", 1, 65535)
    try:
        util = float(plan.get("GPU_UTIL"))
    except ValueError:
        raise PlanError(f"GPU_UTIL={plan.get('GPU_UTIL')!r} is not a number; valid: 0.10..0.99") from None
    if not 0.10 <= util <= 0.99:
        raise PlanError(f"GPU_UTIL={plan.get('GPU_UTIL')!r} out of range; valid: 0.10..0.99")
    plan.values["GPU_UTIL"].value = util

    # the card the preflight fits the plan into (step 9): CARD_GIB, else nvidia-smi at a real launch
    if plan.values["CARD_GIB"].source == "default":
        card, used, why = card_for_plan(environ, probe=probe_gpus)
        if used:
            # what others hold now is not the plan's: it must fit what is left (a card driving a
            # desktop; the headline leaves ~0.2 GiB of 24 GiB by its measurement)
            plan.card_used_by_others = used
            plan.notes.append(f"GPU memory in use before the boot: {used // memory.MiB:,} MiB of this GPU's "
                              f"{(card + used) // memory.MiB:,} MiB is held by other processes (nvidia-smi: a desktop, "
                              f"another server), so the plan is fitted into the {card // memory.MiB:,} MiB "
                              f"left (CARD_GIB={(card + used) / memory.GiB:.0f} fits it into the whole card)")
        plan.set("CARD_GIB", round(card / memory.GiB, 2) if card else "", "nvidia-smi" if card else "default", why)
    else:
        try:
            gib = float(plan.get("CARD_GIB"))
        except ValueError:
            raise PlanError(f"CARD_GIB={plan.get('CARD_GIB')!r} is not a number; valid: 1..2048 (GiB), "
                            f"or unset to ask nvidia-smi") from None
        if not 1 <= gib <= 2048:
            raise PlanError(f"CARD_GIB={plan.get('CARD_GIB')!r} out of range; valid: 1..2048 (GiB)")
        plan.values["CARD_GIB"].value = gib

    kv_mem_raw = plan.get("KV_MEM")
    if plan.values["KV_MEM"].source == "default":
        pin = spec.kv_mem.get(ctx.name, ctx.kv_mem)
        plan.set("KV_MEM", pin, "profile", f"3090 pin for CTX={ctx.name}" + (f" SPEC={spec.name}" if ctx.name in spec.kv_mem else ""))
    elif str(kv_mem_raw).lower() == "auto":
        plan.values["KV_MEM"].value = "auto"
    else:
        plan.values["KV_MEM"].value = parse_bytes(str(kv_mem_raw), "KV_MEM")

    # model + drafter
    model = plan.get("MODEL")
    if model == "tiny":
        plan.set("MODEL", "tiny", plan.values["MODEL"].source, "resolved at launch by ensure_tiny_model()")
    elif check_paths and not (Path(model) / "config.json").is_file():
        raise PlanError(f"MODEL={model} has no config.json; valid: a prepared checkpoint directory "
                        f"(install.sh prepares models/qwen38-27b) or MODEL=tiny")
    if spec.name == "dflash2" and model == "tiny" and plan.values["DRAFT"].source == "default":
        plan.set("DRAFT", TINY_DRAFT, "profile", "MODEL=tiny: the tiny DFlash2 drafter, resolved at launch by ensure_tiny_drafter()")
    elif spec.name == "dflash2":
        draft = Path(plan.get("DRAFT"))
        if not (draft / "config.json").is_file():
            raise PlanError(f"SPEC=dflash2 needs a drafter: DRAFT={draft} has no config.json; valid: ./install.sh --drafter "
                            f"(fetches the published DFlash2 drafter into {profiles.KNOBS['DRAFT'].default}), "
                            f"DRAFT=<drafter dir with config.json>, or SPEC=mtp|off")
        if check_paths:
            check_drafter(draft, int(plan.get("SPEC_K")), None if model == "tiny" else Path(model))
    if plan.values["DRAFT"].source != "default" and spec.name != "dflash2":
        plan.notes.append(f"DRAFT is ignored with SPEC={spec.name}")

    # host + key
    host = plan.get("HOST")
    key, key_src = read_api_key(environ, dot, root)
    if not is_loopback(host) and key is None:
        raise PlanError(f"HOST={host} binds beyond loopback; set VLLM_API_KEY (env, .env, or api_key.txt mode 600) "
                        f"or use a valid loopback HOST=127.0.0.1|localhost|::1")
    plan.api_key = key
    if key:
        plan.set("VLLM_API_KEY", "***", key_src)
    try:
        extra = shlex.split(plan.get("EXTRA_ARGS"))
    except ValueError as e:
        raise PlanError(f"EXTRA_ARGS is not valid shell words ({e}); valid: e.g. EXTRA_ARGS='--seed 1'") from None
    for word in extra:
        flag = owned_flag(word)
        if flag:
            raise PlanError(f"EXTRA_ARGS must not carry {word.split('=', 1)[0]} (the launcher sets {flag}); "
                            f"valid: {OWNED_FLAGS[flag]}")
    plan.set("EXTRA_ARGS", extra, plan.values["EXTRA_ARGS"].source)
    _resolve_dflash_ring(plan, ctx, spec)
    rq = plan.values["DRAFT_QUANT"]
    if spec.name != "dflash2":
        if rq.source != "default":
            raise PlanError(f"DRAFT_QUANT={rq.value} needs SPEC=dflash2 (the DFlash2 drafter's weights); "
                            "valid otherwise: leave DRAFT_QUANT unset")
        plan.set("DRAFT_QUANT", "bf16", "profile", f"SPEC={spec.name}: no DFlash2 drafter")
    # DRAFT_QUANT=auto with SPEC=dflash2 is decided by the preflight (onecard.preflight._draft_quant),
    # which knows whether the plan fits the card

    # tensor parallel: the TP knob or --tensor-parallel-size/-tp in EXTRA_ARGS, decided here only
    valid_tp = "|".join(profiles.KNOBS["TP"].choices)
    in_extra = _tp_in_extra(extra)
    if in_extra is not None:
        if str(in_extra) not in profiles.KNOBS["TP"].choices:
            raise PlanError(f"--tensor-parallel-size {in_extra} in EXTRA_ARGS is not valid; valid: {valid_tp}")
        if plan.values["TP"].source != "default" and int(plan.get("TP")) != in_extra:
            raise PlanError(f"TP={plan.get('TP')} and --tensor-parallel-size {in_extra} in EXTRA_ARGS disagree; "
                            f"valid: set one of them (TP={valid_tp})")
        plan.set("TP", in_extra, plan.values["EXTRA_ARGS"].source, "--tensor-parallel-size in EXTRA_ARGS")
    else:
        plan.values["TP"].value = int(plan.get("TP"))
    if plan.get("TP") > 1:
        n, why = visible_gpus(environ, probe=probe_gpus)
        plan.set("GPUS", n if n is not None else "unknown", "env" if n is not None else "default", why)
    if plan.get("GDN_DEFER") == "auto":
        # patch 0085 ran exact on one GPU (jobs 75 and 31, 2026-12-05); its TP>1 path never ran
        one = plan.get("TP") == 1
        plan.set("GDN_DEFER", "1" if one else "0", "profile",
                 f"auto with SPEC={spec.name}" + ("" if one else f" at TP={plan.get('TP')}: not yet run on two GPUs"))
    return plan


def _resolve_dflash_ring(plan: ServePlan, ctx: profiles.CtxProfile, spec: profiles.SpecProfile) -> None:
    """DFLASH_RING: auto -> "1" exactly with CTX=huge SPEC=dflash2, else "0"; "1" needs SPEC=dflash2
    and a drafter that is sliding-window on every layer (ring_drafter).

    Why CTX=huge needs the rings: the DFlash2 drafter's attention is non-causal and the KVARN
    backend has none, so its layers cannot live in KVarN; keeping them in bf16 in the pool
    (--kv-cache-dtype-skip-layers) dies in vLLM 0.27.1's KV-cache setup (unify_kv_cache_spec_page_size:
    the bf16 drafter page is not a multiple of KVarN's and KVarN pages cannot be padded), and with
    that fixed the bf16 drafter outweighs all 16 KVarN layers and the CTX=huge pin holds ~74k tokens
    (docs/results/2026-12-03-huge-dflash2-cpu). In rings (patch 0080's proposer reads
    ONECARD_DFLASH_RING) the drafter's layers hand vLLM no KV-cache spec at all: the pool is the
    target's alone and the drafter keeps bf16 FLASH_ATTN (docs/dflash2-huge.md section 3)."""
    rv = plan.values["DFLASH_RING"]
    if spec.name != "dflash2":
        if rv.value == "1":
            raise PlanError(f"DFLASH_RING=1 needs SPEC=dflash2; valid with SPEC={spec.name}: DFLASH_RING=auto|0")
        plan.set("DFLASH_RING", "0", rv.source, f"SPEC={spec.name}: no DFlash2 drafter")
        return
    if rv.value == "auto":
        plan.set("DFLASH_RING", "1" if ctx.name == "huge" else "0", "profile", f"auto with CTX={ctx.name} SPEC=dflash2")
    if plan.get("DFLASH_RING") == "0":
        if ctx.name == "huge":
            raise PlanError("CTX=huge with SPEC=dflash2 needs DFLASH_RING=1: the DFlash2 drafter's attention is "
                            "non-causal and KVarN has none, and keeping its layers in bf16 in the pool fails at "
                            "vLLM 0.27.1's KV-cache setup (docs/results/2026-12-03-huge-dflash2-cpu); valid: "
                            "DFLASH_RING=auto|1 with CTX=huge, or DFLASH_RING=0 with CTX=fast|long")
        return
    rd = plan.ring_geometry = ring_drafter(str(plan.get("DRAFT")))
    rv = plan.values["DFLASH_RING"]
    geometry = f"{rd.layers} drafter layers, window {rd.window} ({rd.source})"
    rv.reason = f"{rv.reason}; {geometry}" if rv.reason else geometry
    if ctx.name != "huge":
        plan.notes.append(f"DFLASH_RING=1 with CTX={ctx.name}: the drafter's K/V in rings outside the KV pool "
                          f"(docs/dflash2-huge.md section 3 step 5); CPU-tested only, not yet run on a GPU")


def ring_drafter(draft: str) -> memory.RingDrafter:
    """The ring geometry of DRAFT (DFLASH_RING=1): its config.json, or the tiny drafter's spec for
    DRAFT=tiny (built at launch with onecard.dflash.tiny_drafter.DEFAULT_DRAFTER). PlanError (one
    line) when the config does not parse or a layer is full attention."""
    from onecard.dflash.config import DrafterConfig, DrafterConfigError

    if draft == TINY_DRAFT:
        from onecard.dflash.tiny_drafter import DEFAULT_DRAFTER as t

        return memory.RingDrafter(t.layers, t.sliding_window, t.kv_heads, t.head_dim,
                                  "the tiny DFlash2 drafter's spec")
    try:
        cfg = DrafterConfig.load(draft)
        raw = json.loads((Path(draft) / "config.json" if Path(draft).is_dir() else Path(draft)).read_text())
        return memory.ring_drafter(cfg, raw, "DRAFT config.json")
    except DrafterConfigError as e:
        raise PlanError(f"DFLASH_RING=1 reads the drafter's layer_types / sliding_window, but DRAFT={draft}: "
                        f"{e}") from None
    except ValueError as e:
        raise PlanError(f"DFLASH_RING=1 with DRAFT={draft}: {e}, or DFLASH_RING=0 with CTX=fast|long") from None


def _tp_in_extra(extra: list[str]) -> int | None:
    """The value of --tensor-parallel-size / -tp in EXTRA_ARGS, None when absent."""
    for i, a in enumerate(extra):
        for flag in ("--tensor-parallel-size", "-tp"):
            text = extra[i + 1] if a == flag and i + 1 < len(extra) else a.split("=", 1)[1] if a.startswith(flag + "=") else None
            if text is not None:
                try:
                    return int(text)
                except ValueError:
                    raise PlanError(f"{flag} {text!r} in EXTRA_ARGS is not an integer; "
                                    f"valid: {'|'.join(profiles.KNOBS['TP'].choices)}") from None
    return None


DFLASH2_DRAFTER_ROWS = 7  # the published DFlash2 drafters: block_size 8 = anchor + 7 drafts
KVARN_SMALL_VERIFY_ROWS = 8       # KVarN verify blocks up to 8 tokens fit 99 KiB of shared memory
KVARN_WIDE_VERIFY_SHARED_KIB = 152  # 155,648 B at 9..16 tokens (onecard.kvarn.kernels, sm_86)
TINY_DRAFT = "tiny"  # DRAFT value: the tiny drafter beside the tiny model (MODEL=tiny)


def check_drafter(draft: Path, k: int, model: Path | None) -> None:
    """At launch (not in --dry-run): the drafter config parses, DFLASH_TOKENS fits its block
    (drafter rows + up to 8 lookup positions), its safetensors headers hold every tensor the
    config implies (a half-copied drafter fails here, not minutes into the boot) and it matches
    the target's text config."""
    from onecard.dflash.config import DrafterConfig, DrafterConfigError, check_layout

    try:
        cfg = DrafterConfig.load(draft)
        if cfg.version != 2:
            raise PlanError(f"DRAFT={draft} is a DFlash (v1) drafter; valid with SPEC=dflash2: a DFlash2DraftModel drafter")
        lane = cfg.check_tokens(k)
        if lane > 8:
            raise PlanError(f"DFLASH_TOKENS={k} needs {lane} lookup positions past the drafter's {cfg.draft_tokens}; "
                            f"valid: {cfg.draft_tokens}..{cfg.draft_tokens + 8}")
        if model is not None and (model / "config.json").is_file():
            cfg.check_target(json.loads((model / "config.json").read_text()))
    except DrafterConfigError as e:
        raise PlanError(f"DRAFT={draft}: {e}") from None
    if not any(draft.glob("*.safetensors")):
        raise PlanError(f"DRAFT={draft} has no *.safetensors; valid: ./install.sh --drafter (the published "
                        f"DFlash2 drafter), or a complete drafter directory")
    try:
        check_layout({n: tuple(m["shape"]) for n, m in memory.tensor_headers(draft).items()}, cfg)
    except (DrafterConfigError, ValueError) as e:
        raise PlanError(f"DRAFT={draft}: {e}; valid: the complete drafter (./install.sh --drafter resumes "
                        f"a download and checks it)") from None


def draft_path(plan: ServePlan, model_path: str | None) -> str:
    """DRAFT as passed to vLLM. MODEL=tiny: the drafter beside the tiny model, built (once)
    when the model path is known (launch), else where it will be (dry run)."""
    draft = str(plan.get("DRAFT"))
    if draft != TINY_DRAFT:
        return draft
    from onecard.dflash import tiny_drafter
    from onecard.prepare.tiny import tiny_model_dir

    if model_path is not None:
        return str(tiny_drafter.ensure_tiny_drafter(Path(model_path)))
    return str(tiny_drafter.tiny_drafter_dir(tiny_model_dir()))


def tensor_parallel(extra: list[str]) -> int:
    """Tensor-parallel size named in EXTRA_ARGS (1 when absent). The plan's decision is plan.get('TP')."""
    return _tp_in_extra(extra) or 1


def _nvidia_smi(args: list[str]) -> tuple[str | None, str]:
    """(nvidia-smi's stdout, "") or (None, why it gave none): never raises."""
    import subprocess

    smi = shutil.which("nvidia-smi")
    if smi is None:
        return None, "no nvidia-smi"
    try:
        return subprocess.run([smi, *args], capture_output=True, text=True, timeout=10).stdout, ""
    except (OSError, subprocess.SubprocessError) as e:
        return None, f"nvidia-smi {args[0]} failed ({e.__class__.__name__})"


def visible_gpus(environ: Mapping[str, str], probe: bool = True) -> tuple[int | None, str]:
    """(GPUs this process would see, how that was found); None = unknown (never a failure):
    CUDA_VISIBLE_DEVICES when set (entries up to the first invalid '-1'), else `nvidia-smi -L`
    when ``probe``."""
    cvd = environ.get("CUDA_VISIBLE_DEVICES")
    if cvd is not None:
        ids = []
        for e in (x.strip() for x in cvd.split(",")):
            if not e or e.startswith("-"):
                break
            ids.append(e)
        return len(ids), f"CUDA_VISIBLE_DEVICES={cvd!r}"
    if not probe:
        return None, "CUDA_VISIBLE_DEVICES unset; nvidia-smi is asked at launch, not in a dry run"
    out, why = _nvidia_smi(["-L"])
    if out is None:
        return None, f"no CUDA_VISIBLE_DEVICES and {why}: not checked"
    n = sum(1 for ln in out.splitlines() if ln.startswith("GPU "))
    return (n, "nvidia-smi -L") if n else (None, "nvidia-smi -L listed no GPU: not checked")


IN_USE_COUNTED = 64 * memory.MiB   # below this, memory.used is the driver's own bookkeeping (ignored)


def _smi_gpus(field: str, parse: Callable[[str], object]) -> tuple[list[tuple[str, str, object]] | None, str]:
    """nvidia-smi's ``index,uuid,<field>`` per GPU as (index, uuid, parse(value)), rows whose value
    does not parse (None) left out; (None, why) without an answer."""
    out, why = _nvidia_smi([f"--query-gpu=index,uuid,{field}", "--format=csv,noheader,nounits"])
    if out is None:
        return None, why
    gpus = []
    for ln in out.splitlines():
        parts = [x.strip() for x in ln.split(",")]
        if len(parts) == 3 and (value := parse(parts[2])) is not None:
            gpus.append((parts[0], parts[1], value))
    return gpus, ""


def _visible(gpus: list, environ: Mapping[str, str]) -> tuple[list, str]:
    """(the rows of the GPU this process would use first, CUDA_VISIBLE_DEVICES's first entry): that
    entry as an index or a UUID prefix; every row when it is unset (the first is GPU 0)."""
    first = (environ.get("CUDA_VISIBLE_DEVICES") or "").split(",")[0].strip()
    return [g for g in gpus if not first or g[0] == first or (first.startswith("GPU-") and g[1].startswith(first))], first


def _mib(v: str) -> int | None:
    return int(v) * memory.MiB if v.isdigit() else None


def card_memory(environ: Mapping[str, str], probe: bool = True) -> tuple[int | None, str]:
    """(bytes of the first GPU this process would use, how that was found); None = unknown (never a
    failure). Asks ``nvidia-smi --query-gpu=index,uuid,memory.total`` only when ``probe`` (a real
    launch); the GPU is CUDA_VISIBLE_DEVICES's first entry (an index or a UUID prefix), else GPU 0."""
    if not probe:
        return None, "not asked in a dry run: the note compares with a 24 GiB card (set CARD_GIB to check)"
    gpus, why = _smi_gpus("memory.total", _mib)
    if gpus is None:
        return None, f"{why}: the note compares with a 24 GiB card (set CARD_GIB to check)"
    if not gpus:
        return None, "nvidia-smi listed no GPU: the note compares with a 24 GiB card"
    match, first = _visible(gpus, environ)
    if not match:
        small = min(gpus, key=lambda g: g[2])
        return small[2], (f"nvidia-smi: CUDA_VISIBLE_DEVICES={first!r} not matched, the smallest GPU "
                          f"({small[0]}: {small[2] // memory.MiB:,} MiB)")
    return match[0][2], f"nvidia-smi: GPU {match[0][0]}, {match[0][2] // memory.MiB:,} MiB"


def card_in_use(environ: Mapping[str, str], probe: bool = True) -> tuple[int | None, str]:
    """(bytes that processes already hold on the GPU card_memory picks, how that was found): nvidia-
    smi's memory.used at launch (a desktop's X server and compositor, a browser, another server);
    None = unknown (never a failure). Asked only when ``probe`` (a real launch)."""
    if not probe:
        return None, "not asked in a dry run"
    gpus, why = _smi_gpus("memory.used", _mib)
    if gpus is None:
        return None, why
    match, _ = _visible(gpus, environ)
    if not match:
        return None, "nvidia-smi listed no memory.used for the GPU"
    return match[0][2], f"nvidia-smi: GPU {match[0][0]}, {match[0][2] // memory.MiB:,} MiB in use"


def card_for_plan(environ: Mapping[str, str], probe: bool = True,
                  count_in_use: bool = True) -> tuple[int | None, int, str]:
    """(bytes the plan may fit into, bytes other processes hold there and that were left out, how
    that was found): card_memory, less card_in_use when it is IN_USE_COUNTED or more and
    ``count_in_use`` (not while the server being checked is running: part of it is that server's).
    None = unknown; asked only when ``probe`` (a real launch)."""
    card, why = card_memory(environ, probe=probe)
    if not card or not count_in_use:
        return card, 0, why
    used, _ = card_in_use(environ, probe=probe)
    if not used or used < IN_USE_COUNTED:
        return card, 0, why
    return card - used, used, f"{why}, {used // memory.MiB:,} MiB of it in use by other processes at launch"


# Shared memory a thread block may opt into, KiB, by compute capability (CUDA C++ Programming
# Guide, "Technical Specifications per Compute Capability"): what a Triton kernel's launch needs
# to fit. 8.6 / 8.9 / 12.x: RTX 30 / 40 / 50 series.
SHARED_KIB_PER_BLOCK = {(7, 0): 96, (7, 5): 64, (8, 0): 163, (8, 6): 99, (8, 7): 163, (8, 9): 99, (9, 0): 227,
                        (10, 0): 227, (10, 3): 227, (12, 0): 99, (12, 1): 99}


def _cap(v: str) -> tuple[int, int] | None:
    major, _, minor = v.partition(".")
    return (int(major), int(minor)) if major.isdigit() and minor.isdigit() else None


def card_capability(environ: Mapping[str, str], probe: bool = True) -> tuple[tuple[int, int] | None, str]:
    """((major, minor) compute capability of the first GPU this process would use, how that was
    found); None = unknown (never a failure). ``nvidia-smi --query-gpu=index,uuid,compute_cap``
    only when ``probe`` (a real launch); the GPU picked as card_memory picks it."""
    if not probe:
        return None, "not asked in a dry run"
    gpus, why = _smi_gpus("compute_cap", _cap)
    if gpus is None:
        return None, why
    if not gpus:
        return None, "nvidia-smi listed no compute capability"
    match, first = _visible(gpus, environ)
    if not match:
        return None, f"nvidia-smi: CUDA_VISIBLE_DEVICES={first!r} not matched"
    cap = match[0][2]
    return cap, f"nvidia-smi: GPU {match[0][0]}, compute capability {cap[0]}.{cap[1]}"


def build_argv(plan: ServePlan, python: str = sys.executable, model_path: str | None = None) -> list[str]:
    v = plan.get
    kv_arg = memory.kv_cache_dtype_arg(str(v("KV")))
    argv = [python, *SERVE_PREFIX, model_path or str(v("MODEL")),
            "--served-model-name", v("SERVED_NAME"),
            "--host", v("HOST"), "--port", str(v("PORT")),
            "--max-model-len", str(v("MAX_LEN")), "--max-num-seqs", str(v("MAX_SEQS")),
            "--max-num-batched-tokens", str(v("PREFILL_CHUNK"))]
    if v("KV_MEM") == "auto" or v("KV_MEM") is None:
        argv += ["--gpu-memory-utilization", str(v("GPU_UTIL"))]
    else:
        argv += ["--kv-cache-memory-bytes", str(v("KV_MEM"))]
        if plan.values["GPU_UTIL"].source != "default":
            # with a byte pin vLLM uses gpu_memory_utilization only to refuse a boot when less
            # than that fraction of the card is free: an explicit GPU_UTIL lowers that bar
            # (a desktop holding VRAM, or several servers sharing one GPU in a test lease)
            argv += ["--gpu-memory-utilization", str(v("GPU_UTIL"))]
    tp = int(plan.values["TP"].value) if "TP" in plan.values else 1
    if tp > 1 and _tp_in_extra(list(v("EXTRA_ARGS"))) is None:
        argv += ["--tensor-parallel-size", str(tp)]
    if kv_arg is not None:
        argv += ["--kv-cache-dtype", kv_arg]
    ctx = profiles.CTX_PROFILES[v("CTX")]
    if ctx.attention_backend and v("KV") == ctx.kv:
        argv += ["--attention-backend", ctx.attention_backend]
    elif v("KV") in PER_TOKEN_HEAD_KV:
        argv += ["--attention-backend", "TRITON_ATTN"]
    if v("SSM_DTYPE") != "auto":
        argv += ["--mamba-ssm-cache-dtype", v("SSM_DTYPE")]
    if v("PREFIX_CACHE") == "1":
        argv += ["--enable-prefix-caching", "--mamba-cache-mode", "align"]
    else:
        argv += ["--no-enable-prefix-caching"]
    spec = profiles.SPEC_PROFILES[v("SPEC")]
    if spec.method:
        sc: dict = {"method": spec.method, "num_speculative_tokens": v("SPEC_K")}
        if spec.name == "dflash2":
            # fields of patches/0080-dflash2.patch's SpeculativeConfig
            sc["model"] = draft_path(plan, model_path)
            sc["dflash2_lookup"] = v("LOOKUP") == "1"
            if v("DRAFT_QUANT") == "fp8":
                sc["dflash2_draft_quant"] = "fp8_per_block"
        argv += ["--speculative-config", json.dumps(sc, separators=(",", ":"))]
    if "CUDAGRAPH_SIZES" in plan.values:
        argv += ["-cc", json.dumps({"cudagraph_capture_sizes": plan.get("CUDAGRAPH_SIZES")}, separators=(",", ":"))]
    if v("VISION") == "0":
        argv += ["--language-model-only"]
    if v("TOOLS") == "1":
        argv += ["--enable-auto-tool-choice", "--tool-call-parser", v("TOOL_PARSER")]
    if v("REASONING_PARSER") != "none":
        argv += ["--reasoning-parser", v("REASONING_PARSER")]
    argv += ["--default-chat-template-kwargs", json.dumps({"enable_thinking": v("THINKING") == "1"})]
    if v("GDN_PREFILL"):
        argv += ["--additional-config", json.dumps({"gdn_prefill_backend": v("GDN_PREFILL")})]
    argv += list(v("EXTRA_ARGS"))
    return argv


def make_plan(environ: Mapping[str, str] | None = None, root: Path | str = ".", python: str = sys.executable,
              model_path: str | None = None, geometry: memory.ModelGeometry | None = None,
              check_paths: bool = False) -> ServePlan:
    """resolve -> preflight -> argv. The one entry point for launch, tests and jobs."""
    from onecard import preflight

    environ = dict(os.environ if environ is None else environ)
    if check_paths and not profiles.vllm_importable():  # a real launch would exec into ModuleNotFoundError
        raise PlanError(profiles.no_vllm_message())
    plan = resolve(environ, root, check_paths and model_path is None, probe_gpus=check_paths)
    preflight.run_checks(plan, geometry or memory.QWEN38_27B, environ)
    plan.argv = build_argv(plan, python, model_path)
    if plan.api_key:
        plan.child_env["VLLM_API_KEY"] = plan.api_key
    # read by patch 0002 (vllm/v1/engine/core.py): logged after an out-of-memory error (not a
    # knob's value, so not in profiles.SERVER_ENV)
    plan.child_env[OOM_HINT_ENV] = oom_hint(plan)
    if "TP" in plan.values and int(plan.get("TP")) > 1:
        plan.child_env.update(profiles.TP_CHILD_ENV)  # NVLink multicast off (profiles.TP_CHILD_ENV says why)
    # EMBED_HOST's only reader is patch 0013 (qwen3_5.py, after the target's weights load)
    _to_server(plan, "EMBED_HOST")
    # WIDE_VERIFY's only reader in the server is patch 0070 (triton_attn.py, ONECARD_WIDE_VERIFY)
    _to_server(plan, "WIDE_VERIFY")
    # WIDE_DECODE's only reader is patch 0070 too (ONECARD_WIDE_DECODE: decode batches marked)
    _to_server(plan, "WIDE_DECODE")
    kv, wide_off = plan.get("KV"), plan.get("WIDE_VERIFY") != "1"
    wide_off_why = "WIDE_VERIFY=0 (the wide-verify kernel is off)"
    if plan.get("WIDE_DECODE") == "1" and plan.values["WIDE_DECODE"].source != "default":
        _note_no_effect(plan, "WIDE_DECODE", [
            (kv not in PER_TOKEN_HEAD_KV, f"KV={kv} (only TRITON_ATTN with int8 / int4 per-token-head KV "
                                          f"routes decode to the wide-verify kernel: CTX=long, or KV=...)"),
            (wide_off, wide_off_why)])
    # (Sessions 31-32 warned here that WIDE_DECODE=0 / WIDE_VERIFY=0 left int4 decode on stock, whose
    # NaN patch 0021 removed: 8 of 8 SmolLM2 texts on an H100, docs/measurements.md session 32.)
    # MTP_DRAFT_WIDE's only reader is patch 0087 (llm_base_proposer.py, ONECARD_MTP_DRAFT_WIDE)
    _to_server(plan, "MTP_DRAFT_WIDE")
    if plan.values["MTP_DRAFT_WIDE"].source != "default":
        _note_no_effect(plan, "MTP_DRAFT_WIDE", [
            (plan.get("SPEC") != "mtp", f"SPEC={plan.get('SPEC')} (it concerns the MTP drafter)"),
            (wide_off, wide_off_why),
            (kv not in PER_TOKEN_HEAD_KV, f"KV={kv} (only TRITON_ATTN with int8 / int4 per-token-head KV runs "
                                          f"the wide-verify kernel)")])
    # VERIFY_ROW_SPLIT's only reader is the wide-verify kernel (patch 0070's copy of
    # onecard/kernels/wide_verify.py, ONECARD_VERIFY_ROW_SPLIT, read at import)
    _to_server(plan, "VERIFY_ROW_SPLIT")
    if plan.get("VERIFY_ROW_SPLIT") == "2" and not _note_no_effect(plan, "VERIFY_ROW_SPLIT", [
            (wide_off, wide_off_why),
            (plan.get("SPEC") == "off", "SPEC=off (no verify blocks of 9..16 tokens)")]):
        plan.notes.append("VERIFY_ROW_SPLIT=2: verify blocks of 9..16 tokens in two programs of half the rows "
                          "(docs/wide-verify.md \"row split\"); measured slower in the kernel on an H100 "
                          "(int8 32k: 243 vs 183 us), kept as an A/B")
    # VERIFY_FLAT_WORDS: the same reader (ONECARD_VERIFY_FLAT_WORDS, read at import)
    _to_server(plan, "VERIFY_FLAT_WORDS")
    if plan.get("VERIFY_FLAT_WORDS") in ("0", "1"):
        _note_no_effect(plan, "VERIFY_FLAT_WORDS", [
            (wide_off, wide_off_why),
            (kv not in PER_TOKEN_HEAD_KV, f"KV={kv} (it changes how int8 / int4 KV tiles are loaded)")])
    # VERIFY_QK_INT8: the same reader (ONECARD_VERIFY_QK_INT8, read at import)
    _to_server(plan, "VERIFY_QK_INT8")
    if plan.get("VERIFY_QK_INT8") == "1" and not _note_no_effect(plan, "VERIFY_QK_INT8", [
            (wide_off, wide_off_why),
            (kv != "int8_per_token_head", f"KV={kv} (it concerns int8 KV: the key tile's bytes are the int8 dot's "
                                          f"operand)")]):
        plan.notes.append("VERIFY_QK_INT8=1: the wide-verify kernel's Q.K^T is an int8 dot of the query quantized "
                          "per row on any GPU (auto: on Hopper-class GPUs only; docs/wide-verify.md \"int8 Q.K^T\"); "
                          "no 3090 (sm_86) has timed it, where this is the A/B to run; a second quantization error, "
                          "so greedy text may differ from VERIFY_QK_INT8=0")
    # GDN_SHARED_META's only reader is patch 0082 (gdn_attn.py, ONECARD_GDN_SHARED_META)
    _to_server(plan, "GDN_SHARED_META")
    # PREFILL_LAUNCH's only reader is patch 0083 (triton_unified_attention.py), checked in resolve
    _to_server(plan, "PREFILL_LAUNCH")
    # GDN_DEFER's reader is the GDN verify path (no per-draft GDN state; the accepted state committed
    # after the rejection sampler); the preflight sized the pool and the scratch beside the pin for it.
    # Without speculation there is nothing to defer: not sent (resolve notes an explicit 1)
    if plan.get("SPEC") != "off":
        _to_server(plan, "GDN_DEFER")
    # DFLASH_RING's reader is patch 0080's DFlash2 drafter (the drafter's K/V in rings outside the
    # pool); the preflight sized the pool without the drafter's layers and the rings beside the pin
    if plan.get("SPEC") == "dflash2":
        _to_server(plan, "DFLASH_RING")
        # LOOKUP_LANE's reader is patch 0080's DFlash2Proposer (dflash2_lane.lane_mode)
        _to_server(plan, "LOOKUP_LANE")
    # KVARN_WINDOW's reader is the KVarN backend (onecard.kvarn.format.window_from_env); the
    # preflight sized the stage for the same value
    if str(plan.get("KV")).startswith("kvarn"):
        _to_server(plan, "KVARN_WINDOW")
        # KVARN_SINKS's reader is the KVarN backend too (onecard.kvarn.format.sinks_from_env)
        _to_server(plan, "KVARN_SINKS")
        # KVARN_GRAPHS's reader is the KVarN backend's builder (get_cudagraph_support)
        _to_server(plan, "KVARN_GRAPHS")
        # KVARN_DRAFT_HOST's reader is the KVarN builder's build_for_drafting (SPEC=mtp drafter)
        _to_server(plan, "KVARN_DRAFT_HOST")
    else:
        _note_kvarn_only(plan, "KVARN_WINDOW")
        _note_kvarn_only(plan, "KVARN_SINKS")
        _note_kvarn_only(plan, "KVARN_GRAPHS")
        _note_kvarn_only(plan, "KVARN_DRAFT_HOST")
    # The GDN (FLA) Triton kernels are @triton.autotune'd and retune at every boot: on the H200
    # (2026-12-02) each tiny server's profiling run took 80-91 s even with warm compile caches.
    # With this Triton keeps the winners in its cache dir, so only a machine's first boot pays
    # (how much of those 80 s it saves is still to be measured). An explicit value (0 too) wins.
    if environ.get("TRITON_CACHE_AUTOTUNING", "") == "":
        plan.child_env["TRITON_CACHE_AUTOTUNING"] = "1"
    # ...but the winners only help if every boot looks in the same place. vLLM 0.27.1's AOT compile
    # points TORCHINDUCTOR_CACHE_DIR at a directory per configuration hash
    # (compilation/decorators.py: torch_compile_cache/torch_aot_compile/<hash>/inductor_cache), and
    # torch then sets TRITON_CACHE_DIR beneath it when unset (_inductor/runtime/
    # triton_heuristics.py). So each CTX/SPEC/KV combination compiled and autotuned every Triton
    # kernel again in a cache of its own (H200, 2026-12-03: a dflash2 server retuned the FLA
    # kernel its SPEC=off sibling had tuned minutes before, 35 s for that kernel alone). Triton's
    # cache is content-addressed, so one directory serves all of them: Triton's own default,
    # named explicitly. An explicit TRITON_CACHE_DIR is the user's.
    if environ.get("TRITON_CACHE_DIR", "") == "":
        plan.child_env["TRITON_CACHE_DIR"] = str(Path.home() / ".triton" / "cache")
    # Where vLLM runs FlashAttention-2 on a GPU its sm_80 kernels do not fit (Hopper when FA3 does
    # not load), the CUDA driver compiles each kernel module from PTX at first use: 107.8 s for one
    # on an H200 (2026-12-03), then 0.12 s from the driver's JIT cache. A handful of modules can
    # outgrow the cache's default size and be compiled again at every boot; 4 GiB (the driver's
    # maximum) keeps them. Nothing changes on an RTX 3090, whose sm_86 runs the sm_80 kernels as
    # they are. An explicit CUDA_CACHE_MAXSIZE is the user's.
    if environ.get("CUDA_CACHE_MAXSIZE", "") == "":
        plan.child_env["CUDA_CACHE_MAXSIZE"] = str(4 << 30)
    # vLLM's HTTP server (uvicorn) closes a keep-alive connection after VLLM_HTTP_TIMEOUT_KEEP_ALIVE
    # idle seconds, 5 by default, and httpx (under OpenAI's Python client) keeps an idle one for 5 s
    # too. With equal timers a request can leave on a connection the server is closing at that
    # moment and fail with "Server disconnected without sending a response" (job 71, 2026-12-07: one
    # request in ~1,500, the server healthy). A server that waits longer than its clients lets them
    # drop idle connections first: 30 s is above httpx's 5, Node's 4-5 and aiohttp's 15. An explicit
    # value is the user's.
    if environ.get("VLLM_HTTP_TIMEOUT_KEEP_ALIVE", "") == "":
        plan.child_env["VLLM_HTTP_TIMEOUT_KEEP_ALIVE"] = str(SERVER_KEEP_ALIVE_S)
    if check_paths:  # a real launch: look at this machine (dry runs stay machine-independent)
        if plan.get("CTX") == "huge":
            problem = kvarn_install_problem()
            if problem:
                raise PlanError(f"CTX=huge: the KVarN install in this vLLM does not match this checkout "
                                f"({problem}); valid: run ./install.sh --kvarn (kvarn/install.sh) again")
        env, note = flashinfer_sampler(environ)
        plan.child_env.update(env)
        if note:
            plan.notes.append(note)
    return plan


OOM_HINT_ENV = "ONECARD_OOM_HINT"


def in_wsl() -> bool:
    """Running under Windows' WSL (vLLM's own test: its kernel release names Microsoft)."""
    import platform

    return "microsoft" in " ".join(platform.uname()).lower()


def oom_hint(plan: ServePlan) -> str:
    """One line for the server log after an out-of-memory error (patch 0002): the plan that ran
    out, the preflight's prediction, and what to lower first, in the knobs' own words."""
    v = plan.get
    kv = v("KV_MEM")
    sizes = (f"CTX={v('CTX')} SPEC={v('SPEC')} KV_MEM={'auto' if kv in ('auto', None) else f'{int(kv) // memory.MiB}M'} "
             f"MAX_LEN={v('MAX_LEN')} MAX_SEQS={v('MAX_SEQS')} PREFILL_CHUNK={v('PREFILL_CHUNK')}")
    if "DRAFT_QUANT" in plan.values and v("SPEC") == "dflash2":
        sizes += f" DRAFT_QUANT={v('DRAFT_QUANT')}"
    vram = (plan.prediction or {}).get("vram") or {}
    pred = (f"; the preflight predicted {vram['total'] / memory.GiB:.2f} GiB of {vram['card_bytes'] / memory.GiB:.2f} "
            "GiB, its CUDA-graph and activation reserves estimated" if vram.get("total") and vram.get("card_bytes")
            else "")
    tries = []
    if kv in ("auto", None):
        tries.append(f"GPU_UTIL={max(0.10, float(v('GPU_UTIL')) - 0.04):.2f}")
    else:
        lower = max(int(kv) - 512 * memory.MiB, 256 * memory.MiB) // (64 * memory.MiB) * 64
        tries.append(f"KV_MEM={lower}M (MAX_LEN is capped to what it holds)")
    if int(v("PREFILL_CHUNK")) > memory.PREFILL_CHUNK:
        tries.append(f"PREFILL_CHUNK={memory.PREFILL_CHUNK}")
    embed = (plan.prediction or {}).get("embed_bytes") or 0
    if v("EMBED_HOST") == "0" and embed:
        tries.append(f"EMBED_HOST=1 (frees {embed / memory.GiB:.2f} GiB)")
    if v("SPEC") == "dflash2" and v("DRAFT_QUANT") == "bf16":
        tries.append("DRAFT_QUANT=fp8")
    if int(v("MAX_SEQS")) > 1:
        tries.append(f"MAX_SEQS={max(1, int(v('MAX_SEQS')) // 2)}")
    if v("SPEC") == "dflash2":
        tries.append("SPEC=mtp")
    return (f"onecard: the GPU ran out of memory with {sizes}{pred}. Try, one at a time: {', '.join(tries)}; and "
            "check that no other process holds GPU memory (nvidia-smi). ./start_qwen.sh --dry-run shows a plan "
            "before it boots")


def _to_server(plan: ServePlan, knob: str) -> None:
    """The knob's value into the server's environment under its variable (profiles.SERVER_ENV)."""
    plan.child_env[profiles.SERVER_ENV[knob]] = str(plan.get(knob))


def _note_no_effect(plan: ServePlan, knob: str, reasons: list[tuple[bool, str]]) -> bool:
    """A knob value that does nothing in this plan: a note naming the first reason that holds
    ("KNOB=VALUE has no effect with WHY"); True if one did."""
    for holds, why in reasons:
        if holds:
            plan.notes.append(f"{knob}={plan.get(knob)} has no effect with {why}")
            return True
    return False


def _note_kvarn_only(plan: ServePlan, knob: str) -> None:
    """A KVarN-only knob set explicitly with another KV: a note, not an error."""
    if plan.values[knob].source != "default":
        plan.notes.append(f"{knob}={plan.get(knob)} has no effect with KV={plan.get('KV')} "
                          f"(valid with KVarN KV: CTX=huge)")


def kvarn_install_problem(vllm_dir=None) -> str | None:
    """What is stale or missing in this vLLM's KVarN install against this checkout's kvarn/
    (patch, copied files, marker; onecard.kvarn.installer.state), None when it matches. A `git
    pull` that changes kvarn/ leaves the old kernels installed until kvarn/install.sh runs again."""
    from onecard import patching
    from onecard.kvarn import installer as kin

    try:
        return ", ".join(kin.problems(kin.state(patching.locate_vllm(vllm_dir)))) or None
    except patching.PatchError as exc:
        return str(exc)


def flashinfer_sampler(environ: Mapping[str, str], which=shutil.which, find_spec=None) -> tuple[dict, str | None]:
    """vLLM 0.27.1 samples top-k/top-p with FlashInfer on CUDA, and FlashInfer builds that kernel
    with nvcc at the server's first sampler warm-up (minutes on a bare machine, then cached under
    ~/.cache/flashinfer). Without nvcc and without the prebuilt `flashinfer_jit_cache` package the
    build cannot happen, so the server would die in its warm-up: use vLLM's PyTorch sampler
    instead, and say so. An explicit VLLM_USE_FLASHINFER_SAMPLER is always respected."""
    if environ.get("VLLM_USE_FLASHINFER_SAMPLER", "") != "":
        return {}, None
    if find_spec is None:
        import importlib.util
        find_spec = importlib.util.find_spec
    try:
        prebuilt = find_spec("flashinfer_jit_cache") is not None
    except (ImportError, ValueError):
        prebuilt = False
    if prebuilt:
        return {}, None
    cuda_home = environ.get("CUDA_HOME") or environ.get("CUDA_PATH") or "/usr/local/cuda"
    if which("nvcc") or Path(cuda_home, "bin", "nvcc").is_file():
        return {}, ("FlashInfer builds its sampling kernel with nvcc at the first boot of this machine "
                    "(minutes, once; cached in ~/.cache/flashinfer)")
    return ({"VLLM_USE_FLASHINFER_SAMPLER": "0"},
            "no nvcc and no flashinfer-jit-cache: FlashInfer's sampler cannot be built here, so vLLM's "
            "PyTorch top-k/top-p sampler is used (VLLM_USE_FLASHINFER_SAMPLER=1 forces FlashInfer)")


def format_table(plan: ServePlan) -> str:
    rows = [("knob", "value", "source", "reason")]
    for name, val in plan.values.items():
        shown = " ".join(map(str, val.value)) if isinstance(val.value, list) else str(val.value)
        if name == "KV_MEM" and isinstance(val.value, int):
            shown += f" ({val.value / 1024**3:.2f} GiB)"
        rows.append((name, shown, val.source, val.reason))
    w = [max(len(r[i]) for r in rows) for i in range(3)]
    out = [f"{r[0]:<{w[0]}}  {r[1]:<{w[1]}}  {r[2]:<{w[2]}}  {r[3]}".rstrip() for r in rows]
    p = plan.prediction
    if p and p.get("tp", 1) > 1:
        w = f"{p['weights_per_gpu'] / 1024**3:.2f} GiB/GPU" if p.get("weights_per_gpu") else "unknown"
        out.append(f"predicted at TP={p['tp']} on {p['card_bytes'] / 1024**3:.0f} GiB cards, GPU_UTIL {p['gpu_util']}: "
                   f"weights {w} ({p.get('weights_source') or '-'}), KV {p['kv_bytes_per_gpu'] / 1024**3:.2f} GiB/GPU "
                   f"({p['kv_bytes_total'] / 1024**3:.2f} GiB over {p['tp']} GPUs, each holding 1/{p['tp']} of every token)")
    if p:
        out.append(f"predicted pool: {p['pool_tokens']:,} tokens (block {p['block_size']}, {p['num_blocks']} blocks, "
                   f"max concurrency {p['max_concurrency']:.2f}x at {p['max_len']:,})")
    out += [f"note: {n}" for n in plan.notes]
    return "\n".join(out)
