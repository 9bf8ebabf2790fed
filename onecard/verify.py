"""`verify.sh`: is this installation (and, live, the server) what onecard says it is?

Each check returns PASS, WARN or FAIL with one line of detail; the run ends with a count and
exits 1 on any FAIL. ``--no-server`` runs the offline checks only; without it the live checks
run too, against ``--url`` (default http://127.0.0.1:$PORT).

Offline checks never import vLLM or torch into this process: versions come from package
metadata, and imports that may touch a GPU run in a subprocess with a timeout. Later issues add
their checks by appending to ``OFFLINE_CHECKS`` / ``LIVE_CHECKS``.
"""
from __future__ import annotations

import importlib.metadata
import importlib.util
import json
import os
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

from onecard import VLLM_PIN

PASS, WARN, FAIL = "PASS", "WARN", "FAIL"


@dataclass
class Result:
    status: str
    name: str
    detail: str


def _version(dist: str) -> str | None:
    try:
        return importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
        return None


def _python_in_subprocess(code: str, timeout: float, what: str) -> tuple[str | None, str | None]:
    """Run `python -c code`: (stdout, None) when it exits 0, else (None, why: its last error
    line, or that ``what`` took longer than ``timeout``)."""
    try:
        out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        return None, f"{what} took longer than {timeout:.0f} s"
    if out.returncode == 0:
        return out.stdout, None
    lines = [l for l in out.stderr.strip().splitlines() if l.strip()]
    return None, lines[-1] if lines else f"exit {out.returncode}"


def _import_in_subprocess(module: str, timeout: float = 120) -> str | None:
    """None if `python -c 'import module'` works, else its last error line."""
    return _python_in_subprocess(f"import {module}", timeout, f"import {module}")[1]


# --------------------------------------------------------------------------- offline checks


def check_python(ctx) -> Result:
    v = sys.version_info
    ok = v >= (3, 11)
    return Result(PASS if ok else FAIL, "python", f"{v.major}.{v.minor}.{v.micro}" + ("" if ok else "; onecard needs Python >= 3.11"))


def check_venv(ctx) -> Result:
    if sys.prefix != sys.base_prefix:
        return Result(PASS, "venv", sys.prefix)
    return Result(WARN, "venv", f"not running in a virtual environment ({sys.prefix}); install.sh creates venv/")


def check_vllm_version(ctx) -> Result:
    found = _version("vllm")
    if found is None:
        return Result(FAIL, "vllm", f"not installed; run ./install.sh (pins vllm=={VLLM_PIN})")
    if found != VLLM_PIN:
        return Result(FAIL, "vllm", f"{found} installed, onecard's patch series is for {VLLM_PIN}; run ./install.sh")
    return Result(PASS, "vllm", found)


def check_patches(ctx) -> Result:
    from onecard import patching

    try:
        vllm_dir = patching.locate_vllm(ctx.get("vllm_dir"))
        report = patching.status(vllm_dir, ctx.get("series", patching.DEFAULT_SERIES))
    except patching.PatchError as exc:
        return Result(FAIL, "patches", str(exc))
    missing = [f"{n} ({s})" for n, s, _ in report.states if s != patching.APPLIED]
    if missing:
        return Result(FAIL, "patches", f"not applied: {', '.join(missing)}; run ./install.sh (or venv/bin/onecard patches apply)")
    return Result(PASS, "patches", f"all {len(report.states)} applied ({patching.series_hash(ctx.get('series', patching.DEFAULT_SERIES))})")


def check_unexpected(ctx) -> Result:
    from onecard import patching

    try:
        vllm_dir = patching.locate_vllm(ctx.get("vllm_dir"))
        problems = patching.audit(vllm_dir, ctx.get("series", patching.DEFAULT_SERIES), extra=_kvarn_series(vllm_dir))
    except patching.PatchError as exc:
        return Result(WARN, "vllm files", str(exc))
    if problems:
        more = f" (+{len(problems) - 3} more)" if len(problems) > 3 else ""
        return Result(FAIL, "vllm files", "; ".join(problems[:3]) + more + "; reinstall vllm and re-run ./install.sh")
    return Result(PASS, "vllm files", "every .py file is the wheel's (RECORD) or its form under the series' patches "
                                      "(the patches line says which are applied)")


def _kvarn_series(vllm_dir) -> tuple:
    """kvarn/series when its patch is on this vLLM (then the audit unwinds it too)."""
    from onecard import patching
    from onecard.kvarn import installer as kin

    try:
        applied = patching.status(vllm_dir, kin.SERIES).all_applied
    except patching.PatchError:
        return ()
    return (kin.SERIES,) if applied else ()


def check_kvarn(ctx) -> Result:
    """KVarN (CTX=huge): not installed, installed (patch + files equal to this checkout's +
    marker), or half-installed / stale (FAIL with the fix)."""
    from onecard import patching
    from onecard.kvarn import installer as kin

    try:
        vllm_dir = patching.locate_vllm(ctx.get("vllm_dir"))
        st = kin.state(vllm_dir)
    except patching.PatchError as exc:
        return Result(WARN, "kvarn", str(exc))
    files = st["files"].values()
    if st["patch"] != patching.APPLIED and st["marker"] == "missing" and all(f == "missing" for f in files):
        return Result(PASS, "kvarn", "not installed (CTX=huge needs ./install.sh --kvarn)")
    bad = kin.problems(st)
    if not bad:
        return Result(PASS, "kvarn", f"installed: kvarn_k4v2_g128/k4v4_g128/k4v2_g64, {len(st['files'])} files "
                                     f"equal to this checkout, patch applied, marker ok")
    return Result(FAIL, "kvarn", "half-installed or stale: " + ", ".join(bad)
                  + "; run kvarn/install.sh (or kvarn/install.sh --uninstall)")


def check_flashinfer(ctx) -> Result:
    pinned = _vllm_requirement("flashinfer-python")
    found = _version("flashinfer-python")
    if found is None:
        return Result(WARN, "flashinfer", "not installed: sampled requests use vLLM's PyTorch sampler fallback (greedy and "
                      "DFlash2's drafting are unaffected)")
    err = _import_in_subprocess("flashinfer")
    if err:
        return Result(WARN, "flashinfer", f"{found} installed but not importable ({err}); slower fallbacks will be used")
    if pinned and found != pinned:
        return Result(WARN, "flashinfer", f"{found} installed, vLLM {VLLM_PIN} pins {pinned}")
    return Result(PASS, "flashinfer", found)


_FA_PROBE = """
import json, torch
info = {"cuda": torch.cuda.is_available()}
if info["cuda"]:
    info["cap"] = list(torch.cuda.get_device_capability())
    from vllm.vllm_flash_attn import flash_attn_interface as f
    info["fa"] = {str(v): [bool(f.is_fa_version_supported(v)), f.fa_version_unsupported_reason(v)]
                  for v in (2, 3)}
print(json.dumps(info))
"""


def flash_attention_verdict(info: dict) -> Result | None:
    """What vLLM's FlashAttention backend will do on this GPU (``info``: _FA_PROBE's answer).
    None when no CUDA GPU is visible (nothing to say offline)."""
    if not info.get("cuda"):
        return None
    major, minor = info["cap"]
    fa = info.get("fa", {})
    fa2_ok, fa2_why = fa.get("2", [False, "unknown"])
    fa3_ok, fa3_why = fa.get("3", [False, "unknown"])
    sm = f"sm_{major}{minor}"
    if major == 9:
        if fa3_ok:
            return Result(PASS, "flash-attn", f"{sm}: FA3")
        return Result(WARN, "flash-attn",
                      f"{sm}: FA3 does not load ({fa3_why}), so vLLM uses FA2, whose sm_80 kernels the "
                      "driver compiles from PTX at first use (~2 min per kernel module, 107.8 s measured "
                      "on an H200), cached afterwards (the launcher sets CUDA_CACHE_MAXSIZE=4 GiB); "
                      "reinstall with ./install.sh to get the torch vLLM was built for")
    if not fa2_ok:
        return Result(WARN, "flash-attn", f"{sm}: FA2 unavailable ({fa2_why}); vLLM picks another attention backend")
    if major == 8:
        return Result(PASS, "flash-attn", f"{sm}: FA2 (its sm_80 kernels run here as built)")
    return Result(PASS, "flash-attn", f"{sm}: FA2 available; FA3 {'available' if fa3_ok else 'not available'}")


def check_flash_attention(ctx) -> Result | None:
    if _version("vllm") is None:
        return None   # check_vllm_version says so
    stdout, why = _python_in_subprocess(_FA_PROBE, 180, "the probe")
    if why is not None:
        return Result(WARN, "flash-attn", f"could not probe vLLM's FlashAttention ({why})")
    try:
        info = json.loads(stdout.strip().splitlines()[-1])
    except (ValueError, IndexError):
        return Result(WARN, "flash-attn", "could not probe vLLM's FlashAttention (no answer)")
    return flash_attention_verdict(info)


def check_triton(ctx) -> Result:
    found = _version("triton")
    if found is None:
        return Result(FAIL, "triton", "not installed; vLLM's Triton attention and GDN kernels need it")
    err = _import_in_subprocess("triton")
    return Result(FAIL, "triton", f"{found}: {err}") if err else Result(PASS, "triton", found)


def _vllm_requirement(dist: str) -> str | None:
    try:
        reqs = importlib.metadata.requires("vllm") or []
    except importlib.metadata.PackageNotFoundError:
        return None
    for req in reqs:
        name, _, rest = req.partition("==")
        if name.strip().lower() == dist and rest:
            return rest.split(";")[0].strip()
    return None


def model_dir_problems(path: Path) -> list[str]:
    """What is missing from a local Hugging Face model directory (empty list: complete)."""
    problems = []
    if not (path / "config.json").is_file():
        problems.append("config.json missing")
    if not ((path / "tokenizer.json").is_file() or (path / "tokenizer.model").is_file()):
        problems.append("no tokenizer.json / tokenizer.model")
    index = path / "model.safetensors.index.json"
    if index.is_file():
        try:
            shards = set(json.loads(index.read_text())["weight_map"].values())
        except (ValueError, KeyError) as exc:
            return problems + [f"{index.name} unreadable ({exc})"]
        missing = sorted(s for s in shards if not (path / s).is_file())
        if missing:
            problems.append(f"{len(missing)} of {len(shards)} shards missing (first: {missing[0]})")
    elif not list(path.glob("*.safetensors")):
        problems.append("no *.safetensors weights")
    return problems


def resolve_model_dir(model: str) -> Path | None:
    """A local directory for MODEL: a path, or an already downloaded Hub snapshot."""
    path = Path(model).expanduser()
    if path.is_dir():
        return path
    if model.count("/") == 1:
        try:  # prepared by `onecard prepare model ID` (install.sh --model ID): models/<name>
            from onecard.prepare.model import default_dest

            dest = default_dest(model)
            if (dest / "config.json").is_file():
                return dest
        except Exception:  # noqa: BLE001 - not a valid id: fall through
            pass
        try:
            from huggingface_hub import snapshot_download

            return Path(snapshot_download(model, local_files_only=True))
        except Exception:  # noqa: BLE001 - not downloaded yet
            return None
    return None


def _launcher_default_model() -> tuple[str, Path]:
    """(MODEL as ./start_qwen.sh would take it without --model/$MODEL: .env, else the knob's
    default, and its directory relative to the repository)."""
    from onecard import plan, profiles

    repo = Path(__file__).resolve().parents[1]
    model = plan.read_dotenv(repo / ".env").get("MODEL") or profiles.KNOBS["MODEL"].default
    path = Path(model).expanduser()
    return model, path if path.is_absolute() else repo / path


def check_model(ctx) -> Result | None:
    model = ctx.get("model") or os.environ.get("MODEL")
    if not model:
        from onecard.prepare.model import DEFAULT_MODEL_ID

        model, path = _launcher_default_model()
        if model != "tiny" and not (path / "config.json").is_file():
            return Result(WARN, "model", f"no model at {model} (the launcher's MODEL): ./start_qwen.sh refuses until "
                                         f"./install.sh --model {DEFAULT_MODEL_ID} (or MODEL=DIR|tiny)")
    if model == "tiny":
        return Result(PASS, "model", "tiny (built on first start)")
    path = resolve_model_dir(model)
    if path is None:
        return Result(FAIL, "model", f"{model}: not a directory and not in the Hugging Face cache; run ./install.sh --model {model}")
    problems = model_dir_problems(path)
    if problems:
        return Result(FAIL, "model", f"{path}: " + "; ".join(problems))
    return Result(PASS, "model", str(path))


def _model_path(ctx) -> tuple[Path | None, str]:
    """The local directory of MODEL when it has a config (None: no MODEL, tiny, or not there),
    and the `onecard prepare model ...` command that prepares it."""
    model = ctx.get("model") or os.environ.get("MODEL")
    if not model or model == "tiny":
        return None, ""
    path = resolve_model_dir(model)
    if path is None or not (path / "config.json").is_file():
        return None, ""
    return path, f"onecard prepare model {model if not Path(model).expanduser().is_dir() else path}"


def check_model_requant(ctx) -> Result | None:
    """Which requantization steps the checkpoint carries (its quantization_config), and no
    half-finished journal (onecard.prepare.requant)."""
    path, fix = _model_path(ctx)
    if path is None:
        return None
    from onecard.prepare import model as prep

    s = prep.status(path)
    if s["journal"]:
        return Result(FAIL, "requant", f"{path}: half-finished requantization (.onecard/journal.json); run `{fix}` to finish it")
    if s["problems"]:
        more = f" (+{len(s['problems']) - 3} more)" if len(s["problems"]) > 3 else ""
        return Result(FAIL, "requant", "; ".join(s["problems"][:3]) + more + f"; `onecard prepare requant {path} --check`")
    steps = ", ".join(f"{t} {v}" for t, v in s["steps"].items())
    raw = [t for t, v in s["steps"].items() if v != "absent" and not v.startswith("int")]
    if raw:
        return Result(WARN, "requant", f"{steps}: {', '.join(raw)} not requantized (their bytes go to the KV pool once "
                                       f"they are: `{fix}`)")
    if s["stray_tmp"]:
        return Result(WARN, "requant", f"{steps}; {len(s['stray_tmp'])} half-written temp file(s) of an interrupted run "
                                       f"(`{fix}` removes them)")
    return Result(PASS, "requant", steps)


def check_draft_vocab(ctx) -> Result | None:
    """The MTP drafter's reduced vocabulary (draft_vocab.json) is there and matches the tokenizer."""
    path, fix = _model_path(ctx)
    if path is None or not (path / "tokenizer.json").is_file():
        return None
    from onecard.prepare import model as prep

    dv = prep.status(path)["draft_vocab"]
    if dv is None:
        return Result(WARN, "draft vocab", f"no {prep.DRAFT_VOCAB_FILE} in {path}; `{fix}` builds it")
    if dv.get("error"):
        return Result(WARN, "draft vocab", f"{prep.DRAFT_VOCAB_FILE} unreadable ({dv['error']}); `{fix}` rebuilds it")
    if dv.get("stale"):
        return Result(WARN, "draft vocab", f"{prep.DRAFT_VOCAB_FILE} was built for another tokenizer; `{fix}` rebuilds it")
    cov = dv.get("coverage_heldout")
    return Result(PASS, "draft vocab", f"{dv['size']} of {dv['vocab_size']} ids"
                                       + (f", held-out coverage {cov:.4f}" if cov is not None else ""))


def check_drafter(ctx) -> Result:
    """The DFlash2 drafter SPEC=dflash2 reads (DRAFT: the environment, .env, else the launcher's
    default): a DFlash2 config, every tensor with its shape, and it fits the target when that is
    there (onecard.prepare.drafter.check, headers only). None there: a WARN naming the fix."""
    from onecard import plan
    from onecard.prepare import drafter as prep_drafter
    from onecard.prepare.model import PrepareError

    repo = Path(__file__).resolve().parents[1]
    raw = os.environ.get("DRAFT") or plan.read_dotenv(repo / ".env").get("DRAFT")
    d = Path(raw).expanduser() if raw else prep_drafter.launcher_default_draft()
    d = d if d.is_absolute() else repo / d
    if not (d / "config.json").is_file():
        return Result(WARN, "drafter", f"no DFlash2 drafter at {d}: SPEC=dflash2 (the headline CTX=long SPEC=dflash2) "
                                       f"refuses until ./install.sh --drafter (or DRAFT=DIR); SPEC=mtp|off need none")
    model = ctx.get("model") or os.environ.get("MODEL")
    target = resolve_model_dir(model) if model and model != "tiny" else (
        None if model == "tiny" else _launcher_default_model()[1])
    try:
        s = prep_drafter.check(d, target)
    except PrepareError as e:
        return Result(FAIL, "drafter", f"{e}; `onecard prepare drafter {d}` re-checks it")
    gib = 1 << 30
    return Result(PASS, "drafter", f"{d}: DFlash2, {s['layers']} layers, {s['bytes'] / gib:.2f} GiB as stored "
                                   f"({s['bytes_fp8'] / gib:.2f} with DRAFT_QUANT=fp8)"
                                   + (f", fits {s['target']}" if s["target"] else ""))


def _plan_doc(ctx) -> tuple[dict | None, dict, str, str]:
    """The launcher's plan for this environment (``python -m onecard.launch --json``, no boot) on
    the card a real launch would see: (the JSON or None, the environment, where the card size came
    from, why there is no plan). Computed once per run (ctx["plan_doc"])."""
    if "plan_doc" in ctx:
        return ctx["plan_doc"]
    from onecard.plan import card_for_plan

    env = dict(os.environ)
    card_src = "CARD_GIB" if env.get("CARD_GIB") else ""
    if not card_src:
        # --no-server: less what other processes hold now, as at a real launch
        card, used, _ = card_for_plan(env, probe=True, count_in_use="url" not in ctx)
        if card:
            env["CARD_GIB"] = f"{card / 2**30:.2f}"
            card_src = "nvidia-smi" + (f", less {used // 2**20:,} MiB in use by other processes" if used else "")
    if ctx.get("model"):
        env["MODEL"] = ctx["model"]
    doc, why = None, ""
    try:
        # from where start_qwen.sh runs it (it cds to its own directory: .env and api_key.txt there)
        repo = Path(__file__).resolve().parents[1]
        cwd = repo if (repo / "start_qwen.sh").is_file() else Path.cwd()
        out = subprocess.run([sys.executable, "-m", "onecard.launch", "--json"], capture_output=True,
                             text=True, env=env, timeout=120, cwd=cwd)
        if out.returncode != 0:
            why = (out.stderr.strip().splitlines() or [f"exit {out.returncode}"])[-1].removeprefix("onecard launch: ")
        else:
            doc = json.loads(out.stdout)
    except (OSError, subprocess.SubprocessError) as e:
        why = f"onecard.launch --json did not run ({type(e).__name__}: {e})"
    ctx["plan_doc"] = (doc, env, card_src, why)
    return ctx["plan_doc"]


def check_plan(ctx) -> Result:
    """Would ./start_qwen.sh start with this environment and .env? The launcher's own plan and
    preflight (``python -m onecard.launch --json``, no boot) on the card a real launch would see:
    CARD_GIB, else nvidia-smi's (plan.card_memory). FAIL on a refusal (its one line), WARN when
    the card made the preflight lower the profile's KV_MEM pin or the plan is over the card by
    the estimated reserves only (the plan's vram prediction; the pin that fits is named), PASS otherwise."""
    doc, env, card_src, why = _plan_doc(ctx)
    if doc is None:
        return Result(FAIL, "plan", why)
    values = doc["values"]
    val = {k: v["value"] for k, v in values.items()}
    kv = val.get("KV_MEM")
    kv_s = f"{kv // 2**20}M" if isinstance(kv, int) else str(kv)
    card = f"on a {float(env['CARD_GIB']):g} GiB card ({card_src})" if card_src else "card not known: set CARD_GIB to check it"
    detail = (f"CTX={val.get('CTX')} SPEC={val.get('SPEC')}: MAX_LEN {val.get('MAX_LEN'):,}, "
              f"KV_MEM {kv_s}, MAX_SEQS {val.get('MAX_SEQS')}, {card}")
    if values.get("KV_MEM", {}).get("source") == "cap" and "does not fit" in values["KV_MEM"].get("reason", ""):
        return Result(WARN, "plan", f"{detail}; the profile's KV pin does not fit this card and was lowered "
                                    f"(VRAM_CHECK=0 keeps it; ./start_qwen.sh --dry-run shows why)")
    vram = (doc.get("prediction") or {}).get("vram")
    if card_src and vram and not vram["fits"] and vram["certain"] <= vram["card_bytes"]:
        embed = (doc.get("prediction") or {}).get("embed_bytes") or 0
        alt = (f", or EMBED_HOST=1 ({embed / 2**30:.2f} GiB less; not yet run on a GPU)"
               if embed and val.get("EMBED_HOST") == "0" and vram["total"] - embed <= vram["card_bytes"] else "")
        # GDN_DEFER=1 at the lower pin that keeps the same pool (the preflight's prediction["gdn_defer"])
        defer = (doc.get("prediction") or {}).get("gdn_defer") or {}
        pin = defer.get("kv_mem_same_pool")
        if (pin and isinstance(kv, int) and val.get("GDN_DEFER") == "0"
                and vram["total"] - (kv - pin) + defer.get("scratch_bytes", 0) <= vram["card_bytes"]):
            alt += f", or GDN_DEFER=1 with KV_MEM={pin // 2**20}M (the same pool; the default with speculation on one GPU)"
        return Result(WARN, "plan", f"{detail}; over this card by the estimated reserves only: it boots at "
                                    f"the pin, and if it runs out of GPU memory, KV_MEM <= {vram['kv_max'] // 2**20}M"
                                    + alt)
    return Result(PASS, "plan", detail)


OFFLINE_CHECKS: list[Callable[[dict], Result | None]] = [
    check_python,
    check_venv,
    check_vllm_version,
    check_patches,
    check_unexpected,
    check_kvarn,
    check_flashinfer,
    check_flash_attention,
    check_triton,
    check_model,
    check_model_requant,
    check_draft_vocab,
    check_drafter,
    check_plan,
]


# --------------------------------------------------------------------------- live checks


def check_live_models(ctx) -> Result:
    import httpx

    try:
        r = httpx.get(f"{ctx['url']}/v1/models", headers=ctx["headers"], timeout=10)
        r.raise_for_status()
        ids = [m["id"] for m in r.json().get("data", [])]
    except httpx.ConnectError as exc:
        return Result(FAIL, "server", f"{ctx['url']}/v1/models: {exc}; no server there: start one with ./start_qwen.sh, "
                                      "or pass --url URL, or --no-server for the offline checks")
    except Exception as exc:  # noqa: BLE001
        return Result(FAIL, "server", f"{ctx['url']}/v1/models: {exc}")
    ctx["served_model"] = ids[0] if ids else None
    return Result(PASS if ids else FAIL, "server", f"{ctx['url']} serves {', '.join(ids) or 'no model'}")


def check_live_completion(ctx) -> Result:
    import httpx

    if not ctx.get("served_model"):
        return Result(FAIL, "completion", "skipped: no model served")
    body = {
        "model": ctx["served_model"],
        "messages": [{"role": "user", "content": "Say hello in one word."}],
        "max_tokens": 16,
        "temperature": 0,
    }
    try:
        r = httpx.post(f"{ctx['url']}/v1/chat/completions", json=body, headers=ctx["headers"], timeout=120)
        r.raise_for_status()
        data = r.json()
    except Exception as exc:  # noqa: BLE001
        return Result(FAIL, "completion", str(exc))
    usage = data.get("usage") or {}
    n = usage.get("completion_tokens")
    if not n:
        return Result(FAIL, "completion", "no completion tokens in usage")
    return Result(PASS, "completion", f"{n} tokens (usage.completion_tokens)")


# fewer drafts than this say nothing about a drafter (the launcher's warm-up alone sends a few)
SPEC_MIN_DRAFTS = 32


def _live_metrics(ctx):
    """The server's /metrics parsed (onecard.bench.metrics.Snapshot), fetched once per verify run;
    a one-line reason (str) when unreadable."""
    if "_metrics" not in ctx:
        from onecard.bench import metrics

        try:
            ctx["_metrics"] = metrics.scrape(ctx["url"], timeout=10, headers=ctx["headers"])
        except Exception as exc:  # noqa: BLE001
            ctx["_metrics"] = f"{ctx['url']}/metrics unreadable ({type(exc).__name__}: {exc})"
    return ctx["_metrics"]


def check_live_preemptions(ctx) -> Result | None:
    """vLLM's preemptions since the server started (vllm:num_preemptions_total): a preempted request
    gave its KV blocks back and re-prefills, so any is a pool too small for what was asked at once
    (long prompts together, or one longer than the pool runs alone). None when /metrics is unreadable
    (the speculation line says so). The reference run of 2026-12-05 found them on CTX=fast from a vLLM
    leak that patch 0086 fixes."""
    from onecard.bench import metrics

    snap = _live_metrics(ctx)
    if isinstance(snap, str):
        return None
    n = snap.get(metrics.COUNTERS["preemptions"])
    if n <= 0:
        return Result(PASS, "preemptions", "none since the start (vllm:num_preemptions_total)")
    return Result(WARN, "preemptions", f"vLLM preempted {n:.0f} time(s) since the start: the KV pool ran out and "
                                       f"those requests prefilled again; fewer long requests at once (MAX_SEQS), "
                                       f"or a profile with a larger pool (CTX=long|huge; ./start_qwen.sh --dry-run "
                                       f"prints the pool and what one sequence may hold)")


def check_live_spec(ctx) -> Result | None:
    """What speculative decoding has done since the server started, from its /metrics (vLLM's
    spec_decode counters, parsed by onecard.bench.metrics): tokens per verify step (1 + accepted
    / drafts, the step's own token included) and the acceptance of the first positions. None
    when the server speculates not at all (no such counters). A WARN when enough drafts went by
    and none was accepted: a drafter that does not belong to this model (DRAFT), or a broken one
    (DRAFT_QUANT=bf16 tells an FP8 problem from the rest)."""
    from onecard.bench import metrics

    snap = _live_metrics(ctx)
    if isinstance(snap, str):
        return Result(WARN, "speculation", snap)
    if metrics.COUNTERS["spec_drafts"] not in snap.values:
        return None
    drafts = snap.get(metrics.COUNTERS["spec_drafts"])
    accepted = snap.get(metrics.COUNTERS["spec_accepted"])
    if drafts <= 0:
        return Result(PASS, "speculation", "on; no drafts yet (no request since the start)")
    per_pos = ", ".join(f"{snap.per_pos.get(i, 0.0) / drafts:.2f}" for i in range(min(4, len(snap.per_pos))))
    detail = (f"{1 + accepted / drafts:.2f} tokens per verify step over {drafts:.0f} drafts since the start "
              f"(acceptance by position: {per_pos or 'not exported'}; /metrics, all requests incl. warm-up)")
    if accepted == 0 and drafts >= SPEC_MIN_DRAFTS:
        return Result(WARN, "speculation", f"no draft token accepted in {drafts:.0f} drafts: the drafter does not "
                                           f"fit this model (DRAFT), or it is broken (DRAFT_QUANT=bf16 rules out "
                                           f"FP8); SPEC=mtp|off serve without it")
    return Result(PASS, "speculation", detail)


LOCAL_HOSTS = ("127.0.0.1", "localhost", "::1", "[::1]")


def _smi_rows(args: list[str]) -> list[list[str]] | None:
    from onecard.plan import _nvidia_smi

    out, _ = _nvidia_smi([*args, "--format=csv,noheader,nounits"])
    if out is None:
        return None
    return [[c.strip() for c in line.split(",")] for line in out.splitlines() if line.strip()]


def _is_vllm(pid: int, proc: Path = Path("/proc")) -> bool:
    try:
        cmd = (proc / str(pid) / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
    except OSError:
        return False
    return "vllm" in cmd.lower()


def check_live_memory(ctx, proc: Path = Path("/proc")) -> Result | None:
    """How much GPU memory the running server holds (nvidia-smi, summed over the processes whose
    command line names vLLM: the API server and its engine core), against the card and the
    launcher's prediction for this environment. The figure a 24 GB card gives here is the one
    onecard's memory model most needs (its CUDA-graph and activation reserves are estimates:
    docs/profiles.md). None when the server is not on this machine or there is no nvidia-smi."""
    from urllib.parse import urlparse

    host = urlparse(ctx["url"]).hostname or ""
    if host not in LOCAL_HOSTS:
        return None
    gpus = _smi_rows(["--query-gpu=uuid,index,name,memory.total,memory.used"])
    apps = _smi_rows(["--query-compute-apps=gpu_uuid,pid,used_memory"])
    if not gpus or apps is None:
        return None
    held: dict[str, list[int]] = {}
    for row in apps:
        try:
            uuid, pid, mib = row[0], int(row[1]), int(row[2])
        except (IndexError, ValueError):
            continue  # "[N/A]" where the driver does not say (containers, WSL)
        if _is_vllm(pid, proc):
            held.setdefault(uuid, []).append(mib)
    if not held:
        return Result(WARN, "gpu memory", "nvidia-smi shows no vLLM process with a memory figure (another PID "
                                          "namespace, or not on this machine's GPUs): not measured")
    parts = []
    for uuid, mibs in held.items():
        gpu = next((g for g in gpus if g[0] == uuid), None)
        if gpu is None or len(gpu) < 5:
            continue
        total, used = int(float(gpu[3])), int(float(gpu[4]))
        parts.append(f"GPU {gpu[1]} ({gpu[2]}, {total:,} MiB): vLLM holds {sum(mibs):,} MiB in {len(mibs)} "
                     f"process(es), {total - used:,} MiB free on the card")
    doc, _, _, _ = _plan_doc(ctx)
    vram = ((doc or {}).get("prediction") or {}).get("vram") or {}
    pred = (f"; the plan for this environment predicts {vram['total'] / 2**20:,.0f} MiB (its CUDA-graph and "
            f"activation reserves estimated)" if vram.get("total") else "")
    return Result(PASS, "gpu memory", "; ".join(parts) + pred + " (nvidia-smi; this figure from a 24 GB card "
                                      "calibrates docs/profiles.md)")


LIVE_CHECKS: list[Callable[[dict], Result | None]] = [check_live_models, check_live_completion, check_live_spec,
                                                     check_live_preemptions, check_live_memory]


# --------------------------------------------------------------------------- runner


def run_checks(checks, ctx, out=sys.stdout) -> list[Result]:
    results = []
    for check in checks:
        try:
            res = check(ctx)
        except Exception as exc:  # noqa: BLE001 - a broken check is a failure, not a crash
            res = Result(FAIL, check.__name__.removeprefix("check_"), f"check crashed: {type(exc).__name__}: {exc}")
        if res is None:
            continue
        results.append(res)
        print(f"{res.status} {res.name:<12} {res.detail}", file=out, flush=True)
    return results


def configure(parser) -> None:
    parser.add_argument("--no-server", action="store_true", help="offline checks only")
    parser.add_argument("--url", help="server base URL (default http://127.0.0.1:$PORT, PORT default 18020)")
    parser.add_argument("--vllm-dir", help="vllm package directory to check (default: the one this Python imports)")
    parser.add_argument("--model", help="model id or path to check (default: $MODEL)")


def run(args) -> int:
    ctx: dict = {"vllm_dir": args.vllm_dir, "model": args.model}
    results = run_checks(OFFLINE_CHECKS, ctx)
    if not args.no_server:
        port = os.environ.get("PORT", "18020")
        ctx["url"] = (args.url or f"http://127.0.0.1:{port}").rstrip("/")
        key = os.environ.get("VLLM_API_KEY")
        ctx["headers"] = {"Authorization": f"Bearer {key}"} if key else {}
        results += run_checks(LIVE_CHECKS, ctx)
    counts = {s: sum(r.status == s for r in results) for s in (PASS, WARN, FAIL)}
    print(f"{counts[PASS]} passed, {counts[WARN]} warnings, {counts[FAIL]} failed")
    return 1 if counts[FAIL] else 0


def main(argv: list[str] | None = None) -> int:
    import argparse

    parser = argparse.ArgumentParser(prog="verify.sh", description=__doc__.splitlines()[0])
    configure(parser)
    return run(parser.parse_args(argv))


if __name__ == "__main__":
    raise SystemExit(main())
