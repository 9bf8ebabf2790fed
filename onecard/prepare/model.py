"""`onecard prepare model ID|PATH`: fetch a checkpoint, requantize it, build its draft vocabulary.

What ``./install.sh --model ID|PATH`` runs. Steps, each skipped when already done (a second
run prints what is there and changes nothing):

1. **fetch** (Hub id): ``huggingface_hub.snapshot_download`` into the Hugging Face cache
   (resumable, its own progress bars, ``HF_HUB_OFFLINE=1`` respected), then every file is
   hard-linked (copied when linking is impossible) into the destination, default
   ``<models root>/<name>`` (``models/qwen38-27b`` for the default model, the launcher's
   default ``MODEL``). Linking costs no disk: onecard never edits a file in place, it writes
   a new one and renames it over the old, so the cache copy stays pristine. A local path is
   prepared in place, or linked/copied to ``--dest``.
2. **requantize** lm_head / embed_tokens / MTP (int8 by default; ``keep`` skips a step)
   through :mod:`onecard.prepare.requant`, whose journal, backup and ``--restore`` apply
   unchanged. Each step prints its relative error and the peak RSS.
3. **draft vocabulary** ``draft_vocab.json`` beside the weights (when there is a
   ``tokenizer.json``), rebuilt only when the tokenizer changed.
4. **check**: the directory is complete (config, tokenizer, every shard), the layout and config
   agree (``requant.validate``), no half-finished journal, every requested step applied.

Interrupt-safe: fetched files appear by atomic rename or link, the requantization is
journalled, every JSON is written atomically; the next run continues where one stopped.
State (source, revision, per-step reports) is kept in ``DIR/.onecard/prepare.json``; what is
*applied* is always read from the checkpoint itself (:func:`status`), never from that file.
"""
from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import sys
import time
from pathlib import Path

from onecard.prepare import requant, st

DEFAULT_MODEL_ID = "dbirks/Qwen3.8-27B-W4A16-AutoRound"
DRAFT_VOCAB_FILE = "draft_vocab.json"
STATE_FILE = "prepare.json"  # inside requant's state dir (.onecard/)
CHOICES = {"lm_head": ("int8", "int4", "keep"), "embed": ("int8", "keep"), "mtp": ("int8", "int4", "keep")}
# Heavy formats a Hub repository may carry beside its safetensors; vLLM and onecard use neither.
HUB_IGNORE = ["*.bin", "*.pt", "*.pth", "*.ckpt", "*.gguf", "*.onnx", "*.onnx_data", "*.h5", "*.msgpack",
              "*.tflite", "*.ot", "original/*"]
HUB_ID = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]*/[A-Za-z0-9][A-Za-z0-9._-]*$")
SKIP_DIRS = {requant.STATE_DIR, ".cache", ".git"}


class PrepareError(RuntimeError):
    """One line, naming what is valid."""


# --------------------------------------------------------------------------- where


def launcher_default_model() -> str:
    from onecard.profiles import KNOBS

    return KNOBS["MODEL"].default


def dest_name(repo_id: str) -> str:
    """Directory name under the models root: the launcher's default for the default model."""
    if repo_id == DEFAULT_MODEL_ID:
        return Path(launcher_default_model()).name
    return repo_id.split("/", 1)[1].lower()


def classify(model: str) -> tuple[str, Path | None]:
    """``("local", path)`` or ``("hub", None)``; PrepareError for anything else."""
    path = Path(model).expanduser()
    if path.exists():
        if not path.is_dir():
            raise PrepareError(f"{model}: is a file; valid: a checkpoint directory or a Hugging Face id OWNER/NAME")
        return "local", path.absolute()
    if HUB_ID.match(model):
        return "hub", None
    raise PrepareError(f"{model}: no such directory and not a Hugging Face id; "
                       "valid: a local checkpoint directory or OWNER/NAME (e.g. " + DEFAULT_MODEL_ID + ")")


def default_dest(model: str, root: Path | None = None) -> Path:
    """Where ``prepare model MODEL`` leaves the checkpoint when no ``--dest`` is given."""
    kind, path = classify(model)
    if kind == "local":
        return path
    from onecard.prepare.tiny import models_root  # $MODELS, $ONECARD_HOME/models, <repo>/models

    return (models_root(root) / dest_name(model)).absolute()


# --------------------------------------------------------------------------- state


def _state_path(d: Path) -> Path:
    return Path(d) / requant.STATE_DIR / STATE_FILE


def read_state(d: Path) -> dict:
    p = _state_path(d)
    try:
        return json.loads(p.read_text()) if p.is_file() else {}
    except ValueError:
        return {}  # a torn write cannot happen (atomic), but never let a bad file stop a run


def write_state(d: Path, state: dict) -> None:
    p = _state_path(d)
    p.parent.mkdir(parents=True, exist_ok=True)
    st.atomic_write_text(p, json.dumps(state, indent=1, sort_keys=True) + "\n")


# --------------------------------------------------------------------------- fetch


def _files(src: Path) -> list[Path]:
    out = []
    for p in sorted(src.rglob("*")):
        rel = p.relative_to(src)
        if rel.parts[0] in SKIP_DIRS or p.is_dir() or p.name.endswith(requant.TMP):
            continue
        out.append(rel)
    return out


def materialize(src: Path, dest: Path, log=print) -> dict:
    """Hard-link (else copy) every file of ``src`` into ``dest``; files already there are kept.

    Each file appears atomically (link or copy to a temp name, then rename), so an interrupted
    run leaves only whole files and the next run adds the rest.
    """
    dest.mkdir(parents=True, exist_ok=True)
    linked = copied = kept = 0
    todo = []
    for rel in _files(src):
        dst = dest / rel
        if dst.exists():
            kept += 1
            continue
        todo.append(rel)
    copy_bytes = 0
    for i, rel in enumerate(todo):
        real = Path(os.path.realpath(src / rel))
        dst = dest / rel
        dst.parent.mkdir(parents=True, exist_ok=True)
        tmp = dst.with_name(dst.name + requant.TMP)
        tmp.unlink(missing_ok=True)
        try:
            os.link(real, tmp)
            linked += 1
        except OSError as e:
            if not copied:  # first file that cannot be linked: will the copies fit?
                need = sum(os.path.getsize(os.path.realpath(src / r)) for r in todo[i:])
                free = shutil.disk_usage(dest).free
                if need > free:
                    raise PrepareError(f"{dest}: cannot hard-link from {src} ({e.strerror}) and copying needs "
                                       f"{need / 2**30:.1f} GiB, {free / 2**30:.1f} GiB free; valid: --dest on the "
                                       "filesystem of the Hugging Face cache (HF_HUB_CACHE), or free disk") from None
                log(f"fetch: cannot hard-link ({e.strerror}); copying {need / 2**30:.2f} GiB (the source keeps its copy)")
            _copy_with_progress(real, tmp)
            copied += 1
            copy_bytes += real.stat().st_size
        os.replace(tmp, dst)
    st.fsync_dir(dest)
    log(f"fetch: {linked} file(s) linked, {copied} copied ({copy_bytes / 2**30:.2f} GiB), {kept} already there -> {dest}")
    return {"linked": linked, "copied": copied, "kept": kept}


def _copy_with_progress(src: Path, dst: Path, chunk: int = 16 << 20) -> None:
    from tqdm import tqdm

    size = src.stat().st_size
    with open(src, "rb") as fi, open(dst, "wb") as fo, \
            tqdm(total=size, unit="B", unit_scale=True, desc=f"copy {src.name}", disable=size < (256 << 20)) as bar:
        while True:
            buf = fi.read(chunk)
            if not buf:
                break
            fo.write(buf)
            bar.update(len(buf))
        fo.flush()
        os.fsync(fo.fileno())


def _offline() -> bool:
    try:
        from huggingface_hub import constants

        return bool(constants.HF_HUB_OFFLINE)
    except Exception:  # noqa: BLE001
        return os.environ.get("HF_HUB_OFFLINE", "").lower() in ("1", "true", "yes", "on")


def download(repo_id: str, revision: str | None = None) -> Path:
    """The snapshot directory of ``repo_id`` in the Hugging Face cache (downloads what is missing)."""
    import huggingface_hub

    try:
        path = huggingface_hub.snapshot_download(repo_id, revision=revision, ignore_patterns=HUB_IGNORE)
    except Exception as e:  # noqa: BLE001 - every failure becomes one line naming what is valid
        name = type(e).__name__
        if _offline():
            raise PrepareError(f"{repo_id} is not in the Hugging Face cache and HF_HUB_OFFLINE=1 forbids downloading; "
                               "valid: unset HF_HUB_OFFLINE, or a local checkpoint directory") from None
        if name == "LocalEntryNotFoundError":  # the Hub could not be reached and the cache has no copy
            cause = e.__cause__ or e.__context__
            why = f"{type(cause).__name__}: {cause}" if cause else "no connection"
            raise PrepareError(f"{repo_id}: the Hugging Face Hub could not be reached ({why.splitlines()[0]}) and the "
                               "cache has no copy; valid: network access to the Hub (or HF_ENDPOINT), a cached copy, "
                               "or a local checkpoint directory") from None
        if name in ("RepositoryNotFoundError", "GatedRepoError", "RevisionNotFoundError"):
            raise PrepareError(f"{repo_id}{'@' + revision if revision else ''}: {name} on the Hugging Face Hub; "
                               "valid: an existing model id you can access (gated: `hf auth login`), "
                               "or a local checkpoint directory") from None
        first = (str(e).strip().splitlines() or [name])[0]
        raise PrepareError(f"download of {repo_id} failed ({name}: {first}); re-run to resume, "
                           "or use a local checkpoint directory / HF_HUB_OFFLINE=1 with a cached copy") from None
    return Path(path)


def fetch(model: str, dest: Path, revision: str | None = None, log=print, locks: list | None = None) -> dict:
    """Bring ``model`` (Hub id or local directory) into ``dest``; no-op once done.

    ``dest`` is locked from the moment files land (the open lock file is appended to ``locks``;
    the caller closes it). Nothing is created under ``dest`` before the download succeeded.
    """
    locks = [] if locks is None else locks
    kind, src = classify(model)
    source = model if kind == "hub" else str(src)
    state = read_state(dest)
    if state.get("fetched") and state.get("source") == source:
        log(f"fetch: already done ({source}{' @ ' + state['revision'][:12] if state.get('revision') else ''})")
        locks.append(_lock(dest))
        return state
    if state.get("source") not in (None, source):
        raise PrepareError(f"{dest} holds {state['source']} (its .onecard/{STATE_FILE}); "
                           f"valid: another --dest for {model}, or delete {dest}")
    if not state and dest.exists() and any(p.name not in SKIP_DIRS for p in dest.iterdir()):
        raise PrepareError(f"{dest} exists and was not fetched by onecard; valid: an empty or new --dest, "
                           f"or prepare that directory in place: onecard prepare model {dest}")
    if kind == "local":
        if (src / requant.STATE_DIR / "journal.json").exists():
            raise PrepareError(f"{src} has a half-finished requantization; valid: finish it first "
                               f"(onecard prepare model {src}) or point at a clean checkpoint")
        snap, revision = src, None
    else:
        log(f"fetch: {model} via huggingface_hub (resumable; HF_HUB_OFFLINE={'1' if _offline() else '0'})")
        snap = download(model, revision)
        revision = snap.name
    if not (snap / "config.json").is_file():
        raise PrepareError(f"{model}: no config.json in {snap}; valid: a Hugging Face model checkpoint")
    locks.append(_lock(dest))
    state = {"source": source, "kind": kind, "revision": revision, "fetched": False, "steps": {}}
    write_state(dest, state)  # claims dest for this source before the first file lands
    state["materialized"] = materialize(snap, dest, log)
    state["fetched"] = True
    state["fetched_at"] = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
    write_state(dest, state)
    return state


def _lock(d: Path):
    """An exclusive lock on ``d`` (two prepares of one directory would race on its files)."""
    import fcntl

    (d / requant.STATE_DIR).mkdir(parents=True, exist_ok=True)
    f = open(d / requant.STATE_DIR / "prepare.lock", "a")
    try:
        fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:
        f.close()
        raise PrepareError(f"another `onecard prepare model` is working on {d}; valid: wait for it, "
                           "or another --dest") from None
    return f


# --------------------------------------------------------------------------- status


def _bits(cfg: dict, target: str) -> int | None:
    g = ((cfg.get("quantization_config") or {}).get("config_groups") or {}).get(f"onecard_{target}")
    return int(g["weights"]["num_bits"]) if g else None


def _tied(cfg: dict) -> bool:
    return bool(cfg.get("tie_word_embeddings") or (cfg.get("text_config") or {}).get("tie_word_embeddings"))


def status(d) -> dict:
    """What the checkpoint in ``d`` is, read from its own files (used by the run and verify.sh)."""
    d = Path(d)
    out: dict = {"path": str(d), "journal": (d / requant.STATE_DIR / "journal.json").exists(),
                 "stray_tmp": sorted(p.name for p in d.glob("*" + requant.TMP)), "steps": {}, "draft_vocab": None}
    try:
        cfg = json.loads((d / requant.CONFIG).read_text())
        smap = requant.shard_map(d)
        headers = {s: st.read_header(d / s)[0] for s in sorted(set(smap.values())) if (d / s).is_file()}
    except Exception as e:  # noqa: BLE001
        out["problems"] = [f"unreadable checkpoint: {e}"]
        return out
    out["problems"] = requant.validate(d)
    out["tied"] = _tied(cfg)
    for target in requant.TARGETS:
        bits = _bits(cfg, target)
        if bits:
            out["steps"][target] = f"int{bits}"
            continue
        todo = [n for n, s in smap.items() if s in headers and n in headers[s] and requant.select(n, headers[s][n], target)]
        out["steps"][target] = headers[smap[todo[0]]][todo[0]]["dtype"].lower() if todo else "absent"
    dv = d / DRAFT_VOCAB_FILE
    if dv.is_file():
        try:
            meta = json.loads(dv.read_text())
            info = {k: meta.get(k) for k in ("size", "vocab_size", "tokenizer_sha256", "coverage_heldout")}
        except ValueError as e:
            info = {"error": str(e)}
        tok = d / "tokenizer.json"
        info["stale"] = tok.is_file() and info.get("tokenizer_sha256") != _sha256(tok)
        out["draft_vocab"] = info
    return out


def _sha256(path: Path) -> str:
    import hashlib

    h = hashlib.sha256()
    with open(path, "rb") as f:
        for buf in iter(lambda: f.read(1 << 20), b""):
            h.update(buf)
    return h.hexdigest()


# --------------------------------------------------------------------------- steps


def _want(choice: str, target: str) -> int | None:
    if choice not in CHOICES[target]:
        raise PrepareError(f"--{target.replace('_', '-')} {choice}: valid: {', '.join(CHOICES[target])}")
    return None if choice == "keep" else int(choice[3:])


def requant_steps(d: Path, wants: dict[str, int | None], state: dict, log=print, device: str = "cpu") -> dict:
    cfg = json.loads((d / requant.CONFIG).read_text())
    now = status(d)["steps"]
    for target in requant.TARGETS:
        bits = wants[target]
        have = now.get(target)
        prev = (state.get("steps") or {}).get(target) or {}
        if bits is None:
            log(f"{target}: kept as it is ({have}; --{target.replace('_', '-')} keep)")
            continue
        if have == "absent":
            log(f"{target}: no such tensors in this checkpoint (skipped)")
            continue
        if have and have.startswith("int"):
            err = prev.get("max_rel_error")
            extra = f", max rel.err {err:.5f}, peak RSS {prev.get('peak_rss_mb', 0):.0f} MB when applied" if err is not None else ""
            if have != f"int{bits}":
                log(f"{target}: already {have}, int{bits} requested - left as {have} "
                    f"(to change it: onecard prepare requant {d} --restore, which undoes every step, then re-run)")
            else:
                log(f"{target}: already {have} (no-op{extra})")
            continue
        if _tied(cfg) and target in ("lm_head", "embed"):
            log(f"{target}: skipped (tie_word_embeddings: a tied {target} stays {have})")
            continue
        log(f"{target}: requantizing to int{bits}")
        rep = requant.requantize(d, target, bits, log=lambda s: log("  " + s.strip()), device=device)
        if rep.get("noop"):
            continue
        errs = [t["rel_error"] for t in rep["tensors"].values()]
        rec = {"bits": bits, "tensors": len(errs), "max_rel_error": max(errs), "freed_bytes": rep["bytes_before"] - rep["bytes_after"],
               "peak_rss_mb": rep["peak_rss_mb"], "seconds": rep["seconds"],
               "at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}
        state.setdefault("steps", {})[target] = rec
        write_state(d, state)
        log(f"{target}: int{bits} done - {rec['tensors']} tensor(s), max rel.err {rec['max_rel_error']:.5f}, "
            f"freed {rec['freed_bytes'] / 2**20:.1f} MiB, peak RSS {rec['peak_rss_mb']:.0f} MB")
    return state


def draft_vocab_step(d: Path, state: dict, size: int, corpus: list[Path] | None, log=print) -> dict:
    from onecard.prepare import draft_vocab

    tok = d / "tokenizer.json"
    if not tok.is_file():
        log("draft vocab: skipped (no tokenizer.json)")
        return state
    info = status(d)["draft_vocab"]
    if info and not info.get("stale") and not info.get("error") and info.get("size") == min(size, info.get("vocab_size") or size):
        cov = info.get("coverage_heldout")
        log(f"draft vocab: already built ({info['size']} of {info['vocab_size']} ids"
            + (f", held-out coverage {cov:.4f})" if cov is not None else ")"))
        return state
    t0 = time.monotonic()
    docs = draft_vocab.read_corpus(corpus) if corpus else draft_vocab.builtin_corpus()
    res = draft_vocab.build(d, docs, size)
    draft_vocab.write(res, d / DRAFT_VOCAB_FILE)
    cov = res["coverage_heldout"]
    log(f"draft vocab: {res['size']} of {res['vocab_size']} ids ({res['always_included']} always included), held-out "
        f"coverage {'n/a' if cov is None else f'{cov:.4f}'}, {time.monotonic() - t0:.1f} s -> {DRAFT_VOCAB_FILE}")
    state["draft_vocab"] = {"size": res["size"], "coverage_heldout": cov, "corpus": "given" if corpus else "builtin"}
    write_state(d, state)
    return state


def check(d: Path, wants: dict[str, int | None], want_draft: bool) -> tuple[list[str], dict]:
    """Problems that make the prepared checkpoint incomplete (empty: complete) and its status."""
    from onecard.verify import model_dir_problems

    s = status(d)
    problems = list(model_dir_problems(d)) + list(s["problems"])
    if s["journal"]:
        problems.append(f"half-finished requantization ({requant.STATE_DIR}/journal.json)")
    for target, bits in wants.items():
        have = s["steps"].get(target, "absent")
        if bits and not (have.startswith("int") or have == "absent" or (s.get("tied") and target != "mtp")):
            problems.append(f"{target} is still {have}")
    if want_draft and (d / "tokenizer.json").is_file():
        dv = s["draft_vocab"]
        if not dv or dv.get("stale") or dv.get("error"):
            problems.append(f"{DRAFT_VOCAB_FILE} {'missing' if not dv else 'stale'}")
    return problems, s


def prepare(model: str, dest: Path | None = None, *, lm_head: str = "int8", embed: str = "int8", mtp: str = "int8",
            build_draft_vocab: bool = True, draft_size: int | None = None, draft_corpus: list[Path] | None = None,
            revision: str | None = None, device: str = "cpu", log=print) -> dict:
    """The whole preparation; returns the final status. Raises PrepareError (one line)."""
    from onecard.prepare import draft_vocab

    wants = {"lm_head": _want(lm_head, "lm_head"), "embed": _want(embed, "embed"), "mtp": _want(mtp, "mtp")}
    kind, src = classify(model)
    d = Path(dest).expanduser().absolute() if dest else default_dest(model)
    t0 = time.monotonic()
    locks: list = []  # open lock files: one prepare per directory at a time
    try:
        if kind == "local" and src.resolve() == d.resolve():
            links = [f.name for f in d.iterdir() if f.is_symlink()]
            if links:  # e.g. a Hugging Face cache snapshot: renaming over its links would alter the cache
                raise PrepareError(f"{d}: {len(links)} file(s) are symbolic links (first: {links[0]}), so it cannot be "
                                   "prepared in place; valid: --dest DIR (links or copies the files first), or the Hub id")
            locks.append(_lock(d))
            state = read_state(d)
            state.setdefault("source", str(d))
            state.setdefault("kind", "local")
            log(f"model: {d} (prepared in place)")
        else:
            log(f"model: {model} -> {d}")
            state = fetch(model, d, revision, log, locks)
        if not (d / requant.CONFIG).is_file():
            raise PrepareError(f"{d}: no config.json; valid: a Hugging Face checkpoint directory")
        requant.recover(d, log=lambda s: log(s))  # finish an interrupted requantization first
        state = requant_steps(d, wants, state, log, device)
        if build_draft_vocab:
            state = draft_vocab_step(d, state, draft_size or draft_vocab.DEFAULT_SIZE, draft_corpus, log)
        else:
            log("draft vocab: skipped (--no-draft-vocab)")
        problems, s = check(d, wants, build_draft_vocab)
        if problems:
            raise PrepareError(f"{d} is not complete: {'; '.join(problems)}; valid: re-run (interrupted steps resume); "
                               f"if files are missing, delete {d} and prepare it again")
        steps = ", ".join(f"{t} {v}" for t, v in s["steps"].items())
        dv = s["draft_vocab"]
        log(f"check: complete - {steps}; draft vocab {dv['size'] if dv else 'none'}; "
            f"{time.monotonic() - t0:.1f} s, peak RSS {requant.peak_rss_mb():.0f} MB")
        default = (Path(__file__).resolve().parents[2] / launcher_default_model()).absolute()
        log("next: ./start_qwen.sh" if d == default else f"next: MODEL={d} ./start_qwen.sh")
        return s
    finally:
        for f in locks:
            f.close()


# --------------------------------------------------------------------------- CLI


def configure(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("model", nargs="?", default=DEFAULT_MODEL_ID,
                        help=f"Hugging Face id or a local checkpoint directory (default {DEFAULT_MODEL_ID})")
    parser.add_argument("--dest", type=Path, default=None,
                        help="where the prepared checkpoint goes (default: a local path in place; a Hub id in "
                             "<models root>/<name>, models/qwen38-27b for the default model; $MODELS moves the root)")
    parser.add_argument("--revision", default=None, help="Hub revision (branch, tag or commit) to download")
    parser.add_argument("--lm-head", default="int8", choices=CHOICES["lm_head"], help="lm_head (default int8)")
    parser.add_argument("--embed", default="int8", choices=CHOICES["embed"], help="embed_tokens (default int8)")
    parser.add_argument("--mtp", default="int8", choices=CHOICES["mtp"], help="MTP linears (default int8)")
    parser.add_argument("--device", default="cpu", help="where the requantization runs its row blocks: cpu (default) or cuda")
    parser.add_argument("--draft-vocab", action=argparse.BooleanOptionalAction, default=True,
                        help=f"build {DRAFT_VOCAB_FILE} for the MTP drafter (default on)")
    parser.add_argument("--draft-vocab-size", type=int, default=None, help="ids in the draft vocabulary (default 40960)")
    parser.add_argument("--draft-corpus", type=Path, nargs="+", default=None,
                        help="text/.jsonl files or directories for the token frequencies (default: text shipped with Python)")


def run(args) -> int:
    from onecard.prepare import quant

    try:
        prepare(args.model, args.dest, lm_head=args.lm_head, embed=args.embed, mtp=args.mtp,
                build_draft_vocab=args.draft_vocab, draft_size=args.draft_vocab_size, draft_corpus=args.draft_corpus,
                revision=args.revision, device=args.device)
        return 0
    except (PrepareError, requant.RequantError, quant.QuantError, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    except OSError as e:
        print(f"error: {e.filename or ''}: {e.strerror or e}; valid: a writable destination with free disk "
              "(the requantized shards need their new size once)", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("interrupted: nothing half-done is left in use; re-run the same command to resume", file=sys.stderr)
        return 130


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="onecard prepare model", description=__doc__.splitlines()[0])
    configure(parser)
    return run(parser.parse_args(argv))


if __name__ == "__main__":
    raise SystemExit(main())
