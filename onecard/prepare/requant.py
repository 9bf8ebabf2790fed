"""Requantize lm_head / embed_tokens / MTP linears of a safetensors checkpoint in place.

Streaming: each target tensor is read in row blocks (plain reads, no mmap), quantized
(symmetric, group 128, int8 by default) and written to a new shard beside the old one; other
tensors are byte-copied. Peak RSS is printed (a few hundred MB for the 27B checkpoint).

Atomic and reversible (the files of the checkpoint keep their names):
1. new shards / index / config are written as ``NAME.onecard-tmp`` and fsynced; the error of
   every tensor is checked (refused above the bound) before anything is swapped;
2. ``.onecard/journal.json`` lists the files to swap; the pristine originals are hard-linked
   into ``.onecard/backup/`` the first time a file is touched (one backup: the state before
   onecard), then each file is swapped with ``os.replace`` (shards, index, config last);
3. the journal is removed. Any later run (or ``--recover``) finishes an interrupted swap
   (roll forward; all new files were complete before the journal was written) and deletes
   half-written ``.onecard-tmp`` files of a run killed while writing — those never touched
   the checkpoint, which stays loadable.
Re-running is a no-op (targets already packed). ``--restore`` puts the backup back.
"""
from __future__ import annotations

import argparse
import json
import os
import re
import resource
import sys
import time
from pathlib import Path

from onecard.prepare import quant, st

TARGETS = ("lm_head", "embed", "mtp")
STATE_DIR = ".onecard"
TMP = ".onecard-tmp"
INDEX = "model.safetensors.index.json"
CONFIG = "config.json"
# Config-group target regexes, matched by vLLM against its own layer names
# (language_model.lm_head, language_model.model.embed_tokens, mtp.fc, mtp.layers.0....).
GROUP_TARGETS = {
    "lm_head": ["re:.*lm_head$"],
    "embed": ["re:.*embed_tokens$"],
    "mtp": ["re:^mtp\\.(.+_proj|fc)$"],   # mtp.fc has no dot before "fc" (vLLM's name)
}


class RequantError(RuntimeError):
    pass


def select(name: str, entry: dict, target: str) -> bool:
    """Is checkpoint tensor ``name`` an unquantized weight of ``target``?"""
    if not name.endswith(".weight") or len(entry["shape"]) != 2:
        return False
    if entry["dtype"] not in ("BF16", "F16", "F32"):
        return False
    if target == "lm_head":
        return name == "lm_head.weight" or name.endswith(".lm_head.weight")
    if target == "embed":
        return name.endswith("embed_tokens.weight")
    if target == "mtp":
        mod = name[: -len(".weight")]
        return name.startswith("mtp.") and "norm" not in mod and "embed" not in mod and \
            re.search(r"(_proj|\.fc)$", mod) is not None
    raise RequantError(f"unknown target {target!r}; valid: {', '.join(TARGETS)}")


def peak_rss_mb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024.0


# ---------------------------------------------------------------- checkpoint layout

def shard_map(ckpt: Path) -> dict[str, str]:
    """tensor name → shard file name (from the index, or the single model.safetensors)."""
    idx = ckpt / INDEX
    if idx.exists():
        return dict(json.loads(idx.read_text())["weight_map"])
    single = ckpt / "model.safetensors"
    if not single.exists():
        raise RequantError(f"{ckpt}: no {INDEX} and no model.safetensors")
    header, _ = st.read_header(single)
    return {k: "model.safetensors" for k in header if k != "__metadata__"}


def validate(ckpt) -> list[str]:
    """Problems that would stop vLLM loading the checkpoint (empty list = loadable)."""
    ckpt = Path(ckpt)
    problems: list[str] = []
    try:
        cfg = json.loads((ckpt / CONFIG).read_text())
        smap = shard_map(ckpt)
    except Exception as e:  # noqa: BLE001
        return [f"unreadable config/index: {e}"]
    headers = {}
    for shard in sorted(set(smap.values())):
        try:
            headers[shard] = st.read_header(ckpt / shard)[0]
            size = (ckpt / shard).stat().st_size
            h, start = st.read_header(ckpt / shard)
            end = max((v["data_offsets"][1] for k, v in h.items() if k != "__metadata__"), default=0)
            if start + end != size:
                problems.append(f"{shard}: size {size} != header end {start + end}")
        except Exception as e:  # noqa: BLE001
            problems.append(f"{shard}: {e}")
    for name, shard in smap.items():
        if shard in headers and name not in headers[shard]:
            problems.append(f"{name} indexed in {shard} but not in it")
    # every module with a packed weight must be covered by a config group, and vice versa
    qc = cfg.get("quantization_config") or {}
    groups = qc.get("config_groups") or {}
    onecard_groups = {k: v for k, v in groups.items() if k.startswith("onecard_")}
    for gname, g in onecard_groups.items():
        target = gname[len("onecard_"):]
        if target not in TARGETS:
            continue
        for name in smap:
            if name.endswith(".weight") and select(name, {"shape": [1, 1], "dtype": "BF16"}, target):
                problems.append(f"{name} is unquantized but config group {gname} says packed")
    for gname, g in onecard_groups.items():
        target = gname[len("onecard_"):]
        if target in GROUP_TARGETS and list(g.get("targets") or []) != GROUP_TARGETS[target]:
            problems.append(f"config group {gname} targets {g.get('targets')} differ from {GROUP_TARGETS[target]} "
                            "(written by an older onecard; --restore and requantize again)")
    for name in smap:
        if name.endswith(".weight_packed"):
            mod = name[: -len(".weight_packed")]
            for target in TARGETS:
                if select(mod + ".weight", {"shape": [1, 1], "dtype": "BF16"}, target) and \
                        f"onecard_{target}" not in onecard_groups:
                    problems.append(f"{name} packed but no config group onecard_{target}")
    return problems


# ---------------------------------------------------------------- transaction

def _state(ckpt: Path) -> Path:
    return ckpt / STATE_DIR


def _journal(ckpt: Path) -> Path:
    return _state(ckpt) / "journal.json"


def recover(ckpt, log=print) -> str:
    """Finish an interrupted swap or drop half-written temp files. Returns what it did."""
    ckpt = Path(ckpt)
    did = "nothing to recover"
    j = _journal(ckpt)
    if j.exists():
        files = json.loads(j.read_text())["files"]
        for f in files:
            tmp = ckpt / (f + TMP)
            if tmp.exists():
                os.replace(tmp, ckpt / f)
        st.fsync_dir(ckpt)
        j.unlink()
        did = f"finished an interrupted swap of {len(files)} file(s)"
    stray = [p for p in ckpt.iterdir() if p.name.endswith(TMP)]
    for p in stray:
        p.unlink()
    if stray and not j.exists() and did == "nothing to recover":
        did = f"removed {len(stray)} half-written temp file(s) of an interrupted run"
    if did != "nothing to recover":
        log(f"recover: {did}")
    return did


def _backup(ckpt: Path, files: list[str]) -> None:
    bdir = _state(ckpt) / "backup"
    bdir.mkdir(parents=True, exist_ok=True)
    manifest_p = bdir / "manifest.json"
    manifest = json.loads(manifest_p.read_text()) if manifest_p.exists() else {"files": []}
    for f in files:
        if f in manifest["files"]:
            continue  # one backup: the pristine original, kept from the first touch
        dst = bdir / f
        dst.unlink(missing_ok=True)
        try:
            os.link(ckpt / f, dst)
        except OSError:
            import shutil

            shutil.copy2(ckpt / f, dst)
        manifest["files"].append(f)
    st.atomic_write_text(manifest_p, json.dumps(manifest, indent=1))


def restore(ckpt, log=print) -> int:
    ckpt = Path(ckpt)
    recover(ckpt, log)
    bdir = _state(ckpt) / "backup"
    manifest_p = bdir / "manifest.json"
    if not manifest_p.exists():
        log(f"restore: no onecard backup in {ckpt} (nothing to restore)")
        return 0
    files = json.loads(manifest_p.read_text())["files"]
    # config first: the pristine config never declares packed modules, and every pristine
    # shard/index is complete, so each intermediate state is at worst "config says bf16 and a
    # shard still packed" for the instants between renames.
    order = sorted(files, key=lambda f: (f != CONFIG, f != INDEX, f))
    for f in order:
        os.replace(bdir / f, ckpt / f)
    st.fsync_dir(ckpt)
    manifest_p.unlink()
    try:
        bdir.rmdir()
        _state(ckpt).rmdir()
    except OSError:
        pass
    log(f"restore: put back {len(files)} original file(s): {', '.join(order)}")
    return 0


# ---------------------------------------------------------------- config update

def updated_config(cfg: dict, target: str, bits: int, group: int, modules: list[str]) -> dict:
    cfg = json.loads(json.dumps(cfg))
    qc = cfg.get("quantization_config")
    if qc is None:
        qc = cfg["quantization_config"] = {
            "config_groups": {}, "format": "pack-quantized", "ignore": [],
            "quant_method": "compressed-tensors", "quantization_status": "compressed",
            "kv_cache_scheme": None,
        }
    if qc.get("quant_method") != "compressed-tensors":
        raise RequantError(f"checkpoint quantization {qc.get('quant_method')!r} is not compressed-tensors; "
                           "valid: a bf16 or compressed-tensors checkpoint")
    qc.setdefault("config_groups", {})[f"onecard_{target}"] = quant.config_group(GROUP_TARGETS[target], bits, group)
    # vLLM names of these modules (checkpoint → vLLM: model.language_model.X → language_model.model.X)
    names = set(modules)
    for m in modules:
        if m.startswith("model.language_model."):
            names.add("language_model.model." + m[len("model.language_model."):])
            names.add(m[len("model."):])
        if m == "lm_head":
            names.add("language_model.lm_head")
    keep = []
    for ig in qc.get("ignore") or []:
        hit = any((re.match(ig[3:], n) if ig.startswith("re:") else ig == n) for n in names)
        if not hit:
            keep.append(ig)
    qc["ignore"] = keep
    return cfg


# ---------------------------------------------------------------- main step

def requantize(ckpt, target: str, bits: int = 8, group: int = quant.GROUP_SIZE,
               max_rel_error: float | None = None, block_bytes: int = 64 << 20, log=print,
               device: str = "cpu") -> dict:
    """Quantize every unquantized ``target`` tensor of ``ckpt``. Returns a report dict."""
    import torch

    ckpt = Path(ckpt)
    if target not in TARGETS:
        raise RequantError(f"unknown target {target!r}; valid: {', '.join(TARGETS)}")
    quant.check_bits(bits)
    if max_rel_error is not None and not 0 < max_rel_error < 1:
        raise RequantError(f"--max-rel-error {max_rel_error}: valid: a fraction between 0 and 1 "
                           f"(default {quant.MAX_REL_ERROR}; int4 needs {quant.INT4_MAX_REL_ERROR})")
    bound = quant.MAX_REL_ERROR if max_rel_error is None else max_rel_error
    if not (ckpt / CONFIG).exists():
        raise RequantError(f"{ckpt}: no {CONFIG}; valid: a Hugging Face checkpoint directory")
    recover(ckpt, log)
    t0 = time.time()
    cfg = json.loads((ckpt / CONFIG).read_text())
    tied = cfg.get("tie_word_embeddings") or (cfg.get("text_config") or {}).get("tie_word_embeddings")
    if tied and target in ("embed", "lm_head"):
        raise RequantError(f"{ckpt}: tie_word_embeddings is set; quantizing a tied {target} is not supported "
                           "(valid: checkpoints with a separate lm_head, as Qwen3.8-27B)")
    smap = shard_map(ckpt)
    headers = {s: st.read_header(ckpt / s)[0] for s in sorted(set(smap.values()))}
    todo = [n for n, s in smap.items() if select(n, headers[s][n], target)]
    report = {"target": target, "bits": bits, "group_size": group, "device": device, "tensors": {}, "bytes_before": 0,
              "bytes_after": 0, "files": []}
    if not todo:
        already = [n for n in smap if n.endswith(".weight_packed") and
                   select(n[: -len("_packed")], {"shape": [1, 1], "dtype": "BF16"}, target)]
        log(f"{target}: nothing to do ({'already quantized: ' + str(len(already)) + ' tensor(s)' if already else 'no matching tensors'})")
        report["noop"] = True
        return report
    for n in todo:
        cols = headers[smap[n]][n]["shape"][1]
        if cols % group:
            raise RequantError(f"{n}: input dim {cols} not a multiple of group size {group}")
    shards = sorted({smap[n] for n in todo})
    tmp_files: list[Path] = []
    try:
        new_map = dict(smap)
        for shard in shards:
            hdr = headers[shard]
            specs = []
            for name, e in hdr.items():
                if name == "__metadata__":
                    continue
                if name in todo:
                    mod = name[: -len(".weight")]
                    rows, cols = e["shape"]
                    specs += [(mod + ".weight_packed", "I32", [rows, quant.packed_cols(cols, bits)]),
                              (mod + ".weight_scale", e["dtype"] if e["dtype"] != "F32" else "BF16", [rows, cols // group]),
                              (mod + ".weight_shape", "I64", [2])]
                    del new_map[name]
                    for suffix in ("weight_packed", "weight_scale", "weight_shape"):
                        new_map[f"{mod}.{suffix}"] = shard
                else:
                    specs.append((name, e["dtype"], e["shape"]))
            out = ckpt / (shard + TMP)
            tmp_files.append(out)
            w = st.Writer(out, specs, metadata=hdr.get("__metadata__"))
            with st.Reader(ckpt / shard) as r:
                for name in (k for k in hdr if k != "__metadata__"):
                    if name not in todo:
                        w.copy_from(r, name)
                        continue
                    mod = name[: -len(".weight")]
                    rows, cols = hdr[name]["shape"]
                    step = max(1, block_bytes // (cols * 4))
                    acc = quant.ErrorAccumulator()
                    scale_dtype = st.torch_dtype(w.header[mod + ".weight_scale"]["dtype"])
                    for r0 in range(0, rows, step):
                        r1 = min(rows, r0 + step)
                        block = r.rows(name, r0, r1).to(device)
                        q, scale = quant.quantize_sym(block, bits, group, scale_dtype)
                        packed = quant.pack(q, bits)
                        if r0 == 0 and not torch.equal(quant.unpack(packed, bits, cols), q):
                            raise RequantError(f"{name}: packing round trip failed")  # cheap guard, 1st block
                        acc.add(block, quant.dequantize_q(q, scale))
                        w.put_rows(mod + ".weight_packed", r0, packed)
                        w.put_rows(mod + ".weight_scale", r0, scale)
                        del block, q, scale, packed
                        _maybe_slow()
                    w.put(mod + ".weight_shape", torch.tensor([rows, cols], dtype=torch.int64))
                    err = acc.rel
                    before = st.nbytes(hdr[name])
                    after = sum(st.nbytes(w.header[mod + s]) for s in (".weight_packed", ".weight_scale", ".weight_shape"))
                    report["tensors"][name] = {"rel_error": err, "bytes_before": before, "bytes_after": after,
                                               "shape": [rows, cols]}
                    report["bytes_before"] += before
                    report["bytes_after"] += after
                    log(f"  {name} [{rows}x{cols}] int{bits} rel.err {err:.5f}  {before / 2**20:.1f} -> {after / 2**20:.1f} MiB")
                    if err > bound:
                        raise RequantError(refusal(name, target, bits, err, bound, max_rel_error is None))
            w.finish()
        files = list(shards)
        if (ckpt / INDEX).exists():
            idx = json.loads((ckpt / INDEX).read_text())
            idx["weight_map"] = dict(sorted(new_map.items()))
            meta = idx.setdefault("metadata", {})
            if "total_size" in meta:
                meta["total_size"] = int(meta["total_size"]) - report["bytes_before"] + report["bytes_after"]
            p = ckpt / (INDEX + TMP)
            tmp_files.append(p)
            _write_synced(p, json.dumps(idx, indent=2))
            files.append(INDEX)
        modules = [n[: -len(".weight")] for n in todo]
        p = ckpt / (CONFIG + TMP)
        tmp_files.append(p)
        _write_synced(p, json.dumps(updated_config(cfg, target, bits, group, modules), indent=2))
        files.append(CONFIG)
    except BaseException:
        for p in tmp_files:
            p.unlink(missing_ok=True)
        raise
    # ---- commit
    st.fsync_dir(ckpt)
    _backup(ckpt, files)
    _state(ckpt).mkdir(exist_ok=True)
    st.atomic_write_text(_journal(ckpt), json.dumps({"target": target, "files": files}))
    for i, f in enumerate(files):
        os.replace(ckpt / (f + TMP), ckpt / f)
        if os.environ.get("ONECARD_REQUANT_CRASH") == "swap" and i == 0:
            os._exit(137)  # test hook: die between two renames
    st.fsync_dir(ckpt)
    _journal(ckpt).unlink()
    report["files"] = files
    report["seconds"] = round(time.time() - t0, 2)
    report["peak_rss_mb"] = round(peak_rss_mb(), 1)
    freed = report["bytes_before"] - report["bytes_after"]
    log(f"{target}: {len(todo)} tensor(s), freed {freed / 2**20:.1f} MiB, {report['seconds']} s, "
        f"peak RSS {report['peak_rss_mb']:.0f} MB; backup in {_state(ckpt) / 'backup'}")
    return report


def refusal(name: str, target: str, bits: int, err: float, bound: float, default: bool) -> str:
    """The one-line refusal: the measured error, the bound it broke and how to accept it."""
    if not default:
        return (f"{name}: int{bits} relative Frobenius error {err:.5f} exceeds --max-rel-error {bound:.4f}; "
                "nothing was changed")
    line = (f"{name}: int{bits} relative Frobenius error {err:.5f} exceeds the default bound {bound:.2f} "
            f"(1 %, every scheme); nothing was changed")
    if bits == 4:
        line += (f"; int4/group-128 lands ~0.1 by nature: to accept it pass --max-rel-error "
                 f"{quant.INT4_MAX_REL_ERROR} (scripts/quant_{target}.py or onecard prepare requant; "
                 "onecard prepare model then keeps the int4)")
    return line


def _write_synced(path: Path, text: str) -> None:
    with open(path, "w") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())


def _maybe_slow() -> None:
    s = os.environ.get("ONECARD_REQUANT_SLOW")  # test hook: seconds to sleep per row block
    if s:
        time.sleep(float(s))


# ---------------------------------------------------------------- CLI

def configure(parser: argparse.ArgumentParser, target: str | None = None) -> None:
    parser.add_argument("checkpoint", help="checkpoint directory (config.json + safetensors)")
    if target is None:
        parser.add_argument("--target", required=True, choices=TARGETS, help="which tensors to requantize")
    parser.add_argument("--bits", type=int, default=8, choices=quant.SUPPORTED_BITS, help="int8 (default) or int4")
    parser.add_argument("--group-size", type=int, default=quant.GROUP_SIZE)
    parser.add_argument("--max-rel-error", type=float, default=None,
                        help=f"refuse above this relative Frobenius error (default {quant.MAX_REL_ERROR}, i.e. 1 %%, for "
                             f"every scheme; int4 lands ~0.09-0.10, so --bits 4 needs --max-rel-error "
                             f"{quant.INT4_MAX_REL_ERROR})")
    parser.add_argument("--block-mb", type=int, default=64, help="row block size in MiB of float32")
    parser.add_argument("--device", default="cpu", help="where to quantize the row blocks: cpu (default) or cuda")
    parser.add_argument("--report", help="write the JSON report here")
    parser.add_argument("--restore", action="store_true", help="put the pristine backup back and exit")
    parser.add_argument("--recover", action="store_true", help="finish/clean an interrupted run and exit")
    parser.add_argument("--check", action="store_true", help="validate the checkpoint layout and exit")
    if target is not None:
        parser.set_defaults(target=target)


def run(args) -> int:
    try:
        if args.restore:
            return restore(args.checkpoint)
        if args.recover:
            recover(args.checkpoint)
            return 0
        if args.check:
            problems = validate(args.checkpoint)
            for p in problems:
                print(f"problem: {p}")
            print("checkpoint OK" if not problems else f"{len(problems)} problem(s)")
            return 1 if problems else 0
        if args.target == "embed" and args.bits != 8:
            print("note: int4 embeddings are supported by vLLM's embedding method but untested here", file=sys.stderr)
        rep = requantize(args.checkpoint, args.target, args.bits, args.group_size, args.max_rel_error,
                         block_bytes=args.block_mb << 20, device=args.device)
        if args.report:
            st.atomic_write_text(args.report, json.dumps(rep, indent=2))
        return 0
    except (RequantError, quant.QuantError, ValueError, FileNotFoundError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2


def main(argv: list[str] | None = None, target: str | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog=f"quant_{target}" if target else "requant",
        description=f"requantize {target or 'lm_head / embed_tokens / MTP'} (compressed-tensors pack-quantized)")
    configure(parser, target)
    return run(parser.parse_args(argv))


if __name__ == "__main__":
    raise SystemExit(main())
