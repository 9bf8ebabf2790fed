"""The vLLM patch series: apply, check, revert and report it on any vLLM install directory.

A *series* is a text file (``patches/series``) naming patch files in order, one per line,
``#`` starting a comment. A *patch* is a unified diff whose paths are relative to the directory
that holds the ``vllm`` package (``--- a/vllm/x.py`` / ``+++ b/vllm/x.py``), preceded by a free
text header with at least ``What:``, ``Why:``, ``Test:`` and ``Upstream:`` lines.

Rules this module enforces (DESIGN.md, "Conventions"):

* **All or nothing.** Every patch still to apply is applied in memory first, in series order
  (later patches see the result of earlier ones); only if every hunk of every patch fits is
  anything written, and a failed write puts back what was written before it.
* **"Applied" means the reverse patch applies cleanly.** No marker files are trusted.
* **An update replaces an older series.** When a patch of the series changed since it was
  applied (a ``git pull``), the old texts are unwound first: the copy :func:`apply` keeps in
  ``vllm/.onecard-applied/`` (else earlier versions from the checkout's git history), accepted only
  if the unwound files equal the wheel's ``RECORD`` and every file a patch created is gone; then
  the whole new series goes on, in the same all-or-nothing write.
* **Exactly what is installed.** Unwinding the series in memory must give back files whose
  hashes equal the wheel's ``RECORD``; every other ``.py`` file of the package must equal
  ``RECORD`` too (see :func:`audit`).

Hunks are matched exactly (no fuzz); a hunk may sit at a different line than its header says
(an offset), which is accepted. The diff text is parsed with ``unidiff``.
"""
from __future__ import annotations

import base64
import csv
import hashlib
import os
import re
import sys
import tempfile
from dataclasses import dataclass, field
from pathlib import Path

from onecard import VLLM_PIN

REPO = Path(__file__).resolve().parent.parent
DEFAULT_SERIES = REPO / "patches" / "series"
HEADER_FIELDS = ("What", "Why", "Test", "Upstream")

APPLIED = "applied"
NOT_APPLIED = "not applied"
DOES_NOT_FIT = "does not fit"


class PatchError(Exception):
    """A one-line, user-facing error about the series or the target directory."""


# --------------------------------------------------------------------------- parsing


@dataclass
class Hunk:
    old: list[str]  # context + removed lines, with their line endings
    new: list[str]  # context + added lines
    old_start: int  # 1-based line of the first old line, as the header says (0 for new files)
    new_start: int  # the same for the new side


@dataclass
class FileDiff:
    path: str  # relative to the site dir, e.g. "vllm/x.py"
    created: bool
    deleted: bool
    hunks: list[Hunk]


@dataclass
class Patch:
    name: str
    path: Path
    header: dict[str, str]
    files: list[FileDiff]

    @property
    def paths(self) -> list[str]:
        return [f.path for f in self.files]


def _strip_prefix(name: str) -> str:
    name = name.split("\t")[0].strip()
    for prefix in ("a/", "b/"):
        if name.startswith(prefix):
            return name[len(prefix):]
    return name


def parse_patch(path: Path) -> Patch:
    import unidiff

    text = path.read_text(encoding="utf-8")
    head, sep, _ = text.partition("\n--- ")
    if not sep:
        raise PatchError(f"{path.name}: no unified diff found (expected '--- a/vllm/...' lines)")
    header: dict[str, str] = {}
    for line in head.splitlines():
        m = re.match(r"^([A-Z][A-Za-z-]*):\s*(.*)$", line)
        if m:
            header[m.group(1)] = m.group(2).strip()
    try:
        patch_set = unidiff.PatchSet(text)
    except unidiff.UnidiffParseError as exc:
        raise PatchError(f"{path.name}: malformed diff: {exc}") from None
    files = []
    for pf in patch_set:
        created, deleted = pf.is_added_file, pf.is_removed_file
        rel = _strip_prefix(pf.target_file if not deleted else pf.source_file)
        if rel.startswith("/") or ".." in Path(rel).parts or not rel.startswith("vllm/"):
            raise PatchError(f"{path.name}: path {rel!r} is outside the vllm package")
        hunks = []
        for h in pf:
            old: list[str] = []
            new: list[str] = []
            last = None
            for line in h:
                if line.line_type == " ":
                    old.append(line.value)
                    new.append(line.value)
                elif line.line_type == "-":
                    old.append(line.value)
                elif line.line_type == "+":
                    new.append(line.value)
                elif line.line_type == "\\":  # "\ No newline at end of file"
                    for side in ((old,) if last == "-" else (new,) if last == "+" else (old, new)):
                        side[-1] = side[-1].rstrip("\n")
                last = line.line_type
            hunks.append(Hunk(old, new, h.source_start, h.target_start))
        files.append(FileDiff(rel, created, deleted, hunks))
    if not files:
        raise PatchError(f"{path.name}: the diff touches no file")
    return Patch(path.name, path, header, files)


def read_series(series: Path = DEFAULT_SERIES) -> list[Patch]:
    """Parse the series file and every patch it names, checking that they agree."""
    if not series.is_file():
        raise PatchError(f"series file {series} not found")
    names: list[str] = []
    for raw in series.read_text(encoding="utf-8").splitlines():
        line = raw.split("#", 1)[0].strip()
        if not line:
            continue
        if line in names:
            raise PatchError(f"{series}: {line} is listed twice")
        names.append(line)
    patches = []
    for name in names:
        path = series.parent / name
        if not path.is_file():
            raise PatchError(f"{series}: lists {name}, which does not exist in {series.parent}")
        patches.append(parse_patch(path))
    return patches


def lint_series(series: Path = DEFAULT_SERIES) -> list[str]:
    """Problems with the series as a set of files: unlisted patches, bad names, missing headers."""
    problems = []
    patches = read_series(series)
    listed = {p.name for p in patches}
    for path in sorted(series.parent.glob("*.patch")):
        if path.name not in listed:
            problems.append(f"{path.name} is in {series.parent} but not listed in {series.name}")
    numbers = []
    for p in patches:
        m = re.fullmatch(r"(\d{4})-[a-z0-9][a-z0-9-]*\.patch", p.name)
        if not m:
            problems.append(f"{p.name}: name must be NNNN-short-name.patch")
        else:
            numbers.append(int(m.group(1)))
        missing = [f for f in HEADER_FIELDS if not p.header.get(f)]
        if missing:
            problems.append(f"{p.name}: header lacks {', '.join(f + ':' for f in missing)}")
    if numbers != sorted(numbers):
        problems.append(f"{series.name}: patches are not listed in number order")
    return problems


def series_hash(series: Path = DEFAULT_SERIES) -> str:
    """A short hash of the series file and every patch it lists (for result provenance)."""
    h = hashlib.sha256(series.read_bytes())
    for patch in read_series(series):
        h.update(patch.name.encode())
        h.update(patch.path.read_bytes())
    return h.hexdigest()[:16]


# --------------------------------------------------------------------------- in-memory tree


class Conflict(Exception):
    pass


class Tree:
    """Files under a site directory, read lazily, changed only in memory."""

    def __init__(self, site: Path):
        self.site = site
        self.files: dict[str, list[str] | None] = {}

    def get(self, rel: str) -> list[str] | None:
        if rel not in self.files:
            path = self.site / rel
            self.files[rel] = (
                path.read_text(encoding="utf-8").splitlines(keepends=True) if path.is_file() else None
            )
        return self.files[rel]

    def copy(self) -> "Tree":
        other = Tree(self.site)
        other.files = {k: (list(v) if v is not None else None) for k, v in self.files.items()}
        return other


def _find(lines: list[str], block: list[str], hint: int) -> int:
    """Index where `block` occurs in `lines`, nearest to `hint`; -1 if nowhere."""
    n = len(block)
    if n == 0:
        return min(max(hint, 0), len(lines))
    limit = len(lines) - n
    for delta in range(0, max(hint, limit - hint) + 1):
        for pos in (hint - delta, hint + delta) if delta else (hint,):
            if 0 <= pos <= limit and lines[pos:pos + n] == block:
                return pos
    return -1


def _apply_file(tree: Tree, fd: FileDiff, reverse: bool) -> None:
    created, deleted = (fd.deleted, fd.created) if reverse else (fd.created, fd.deleted)
    lines = tree.get(fd.path)
    if created:
        if lines is not None:
            raise Conflict(f"{fd.path} already exists")
        lines = []
    elif lines is None:
        raise Conflict(f"{fd.path} does not exist")
    lines = list(lines)
    offset = 0
    for i, h in enumerate(fd.hunks, 1):
        old, new, start = (h.new, h.old, h.new_start) if reverse else (h.old, h.new, h.old_start)
        base = max(start - 1, 0) if old else max(start, 0)
        pos = _find(lines, old, base + offset)
        if pos < 0:
            raise Conflict(f"{fd.path}: hunk {i} does not match")
        lines[pos:pos + len(old)] = new
        offset = pos - base + len(new) - len(old)
    if deleted:
        if lines:
            raise Conflict(f"{fd.path}: file to delete still has content")
        tree.files[fd.path] = None
    else:
        tree.files[fd.path] = lines


def _try(tree: Tree, patch: Patch, reverse: bool) -> str | None:
    """Apply one patch to `tree` in place if it fits entirely; return why not otherwise."""
    trial = tree.copy()
    try:
        for fd in (reversed(patch.files) if reverse else patch.files):
            _apply_file(trial, fd, reverse)
    except Conflict as exc:
        return str(exc)
    tree.files = trial.files
    return None


# --------------------------------------------------------------------------- target directory


def locate_vllm(vllm_dir: str | Path | None = None) -> Path:
    """The vllm package directory: the one given, or the one this Python would import."""
    if vllm_dir is not None:
        path = Path(vllm_dir).expanduser().resolve()
        if path.name != "vllm" and (path / "vllm" / "__init__.py").is_file():
            path = path / "vllm"
        if not (path / "__init__.py").is_file():
            raise PatchError(f"{vllm_dir} is not a vllm package directory (no __init__.py)")
        return path
    import importlib.util

    spec = importlib.util.find_spec("vllm")
    if spec is None or not spec.submodule_search_locations:
        raise PatchError("vllm is not installed in this Python; pass --vllm-dir DIR")
    return Path(list(spec.submodule_search_locations)[0]).resolve()


def vllm_version(vllm_dir: Path) -> str:
    text = (vllm_dir / "_version.py").read_text() if (vllm_dir / "_version.py").is_file() else ""
    m = re.search(r"__version__\s*=\s*(?:version\s*=\s*)?['\"]([^'\"]+)['\"]", text)
    return m.group(1) if m else "unknown"


@dataclass
class Report:
    vllm_dir: Path
    version: str
    states: list[tuple[str, str, str]] = field(default_factory=list)  # (patch, state, detail)
    replaced: list[str] = field(default_factory=list)  # apply(): an older series unwound first
    replaced_from: str = ""

    @property
    def all_applied(self) -> bool:
        return all(s == APPLIED for _, s, _ in self.states)

    def lines(self) -> list[str]:
        out = [f"vllm {self.version} at {self.vllm_dir}"]
        for name, state, detail in self.states:
            out.append(f"  {state:<13} {name}" + (f"  ({detail})" if detail else ""))
        if self.replaced:
            out.append(f"an older version of the series is applied ({len(self.replaced)} patches, "
                       f"{self.replaced_from}): `onecard patches apply` (./install.sh) replaces it")
        return out


def _analyse(site: Path, patches: list[Patch], version: str) -> tuple[Report, Tree, Tree]:
    """Per-patch state, the tree with every patch unwound, and the tree with every patch on."""
    report = Report(site / "vllm", version)
    tree = Tree(site)
    applied = set()
    for patch in reversed(patches):  # unwind what is applied, last first
        if _try(tree, patch, reverse=True) is None:
            applied.add(patch.name)
    pristine = tree.copy()
    mismatch = version != VLLM_PIN
    for patch in patches:  # then walk forward, as applying would
        if patch.name in applied:
            _try(tree, patch, reverse=False)
            report.states.append((patch.name, APPLIED, ""))
            continue
        why = _try(tree, patch, reverse=False)
        if why is None:
            report.states.append((patch.name, NOT_APPLIED, ""))
        else:
            detail = why + (f"; series is written for vllm {VLLM_PIN}" if mismatch else "")
            report.states.append((patch.name, DOES_NOT_FIT, detail))
    return report, pristine, tree


def status(vllm_dir: Path, series: Path = DEFAULT_SERIES) -> Report:
    patches = read_series(series)
    report = _analyse(vllm_dir.parent, patches, vllm_version(vllm_dir))[0]
    if any(s == DOES_NOT_FIT for _, s, _ in report.states):
        found = _earlier_series(vllm_dir, series, patches)   # an update: say that apply replaces it
        if found is not None:
            report.replaced, report.replaced_from = [p.name for p in found[1]], found[2]
    return report


def _write(site: Path, tree: Tree, touched: set[str]) -> None:
    """Write the changed files atomically; on any failure restore what was written."""
    done: list[tuple[Path, bytes | None]] = []
    try:
        for rel in sorted(touched):
            path = site / rel
            before = path.read_bytes() if path.is_file() else None
            lines = tree.files[rel]
            if lines is None:
                if before is not None:
                    path.unlink()
                    done.append((path, before))
                continue
            data = "".join(lines).encode("utf-8")
            if data == before:
                continue
            path.parent.mkdir(parents=True, exist_ok=True)
            mode = path.stat().st_mode & 0o777 if before is not None else 0o644
            fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
            try:
                with os.fdopen(fd, "wb") as fh:
                    fh.write(data)
                os.chmod(tmp, mode)
                os.replace(tmp, path)
            except BaseException:
                Path(tmp).unlink(missing_ok=True)
                raise
            done.append((path, before))
            _drop_bytecode(path)
    except BaseException:
        for path, before in reversed(done):
            if before is None:
                path.unlink(missing_ok=True)
            else:
                path.write_bytes(before)
            _drop_bytecode(path)
        raise


def _drop_bytecode(path: Path) -> None:
    if path.suffix == ".py":
        for pyc in (path.parent / "__pycache__").glob(f"{path.stem}.*.pyc"):
            pyc.unlink(missing_ok=True)


def apply(vllm_dir: Path, series: Path = DEFAULT_SERIES, dry_run: bool = False) -> tuple[Report, list[str]]:
    """Apply every patch not yet applied, in order, all or nothing.

    Returns the report before applying and the names applied (or that would be). Raises
    PatchError, writing nothing, when any patch does not fit.
    """
    patches = read_series(series)
    site = vllm_dir.parent
    report, _, _ = _analyse(site, patches, vllm_version(vllm_dir))
    bad = [(n, d) for n, s, d in report.states if s == DOES_NOT_FIT]
    if bad:
        found = _earlier_series(vllm_dir, series, patches)
        if found is None:
            name, detail = bad[0]
            raise PatchError(f"{name} does not fit vllm {report.version} at {vllm_dir}: {detail}; nothing was written")
        pristine, old, source = found
        tree = pristine.copy()
        for patch in patches:
            why = _try(tree, patch, reverse=False)
            if why:
                raise PatchError(f"{patch.name}: {why} (on the wheel's files, after unwinding the series applied "
                                 f"before); nothing was written")
        report.replaced, report.replaced_from = [p.name for p in old], source
        if not dry_run:
            _write(site, tree, {p for patch in old + patches for p in patch.paths})
            save_applied(vllm_dir, series, patches)
        return report, [p.name for p in patches]
    todo = [p for p, (_, s, _) in zip(patches, report.states) if s == NOT_APPLIED]
    if not todo:
        if not dry_run and report.all_applied:
            save_applied(vllm_dir, series, patches)  # installs from before the record existed get one
        return report, []
    # An applied patch that sits after a missing one would be re-stacked: refuse that order.
    first_todo = patches.index(todo[0])
    late = [n for n, s, _ in report.states[first_todo:] if s == APPLIED]
    if late:
        raise PatchError(
            f"{late[0]} is applied but an earlier patch ({todo[0].name}) is not: revert first; nothing was written"
        )
    tree = Tree(site)  # the applied prefix is on disk already: stack the rest on it
    for patch in todo:
        why = _try(tree, patch, reverse=False)
        if why:
            raise PatchError(f"{patch.name}: {why}; nothing was written")
    if not dry_run:
        _write(site, tree, {p for patch in todo for p in patch.paths})
        save_applied(vllm_dir, series, patches)
    return report, [p.name for p in todo]


def revert(vllm_dir: Path, series: Path = DEFAULT_SERIES, dry_run: bool = False) -> list[str]:
    """Unwind every applied patch, last first, all or nothing. Returns the names reverted."""
    patches = read_series(series)
    site = vllm_dir.parent
    report, pristine, _ = _analyse(site, patches, vllm_version(vllm_dir))
    if any(s == DOES_NOT_FIT for _, s, _ in report.states):
        found = _earlier_series(vllm_dir, series, patches)   # an older series is on: unwind that one
        if found is not None:
            pristine, old, _ = found
            if not dry_run:
                _write(site, pristine, {p for patch in old for p in patch.paths})
                _drop_applied(vllm_dir, series)
            return [p.name for p in reversed(old)]
    names = [n for n, s, _ in report.states if s == APPLIED]
    if names and not dry_run:
        _write(site, pristine, {p for patch in patches if patch.name in names for p in patch.paths})
        _drop_applied(vllm_dir, series)
    return list(reversed(names))


# --------------------------------------------------------------------------- updates


APPLIED_DIR = ".onecard-applied"   # under the vllm package: per series, the texts last applied


def applied_dir(vllm_dir: Path, series: Path) -> Path:
    """Where apply() keeps the texts of ``series`` it applied: vllm/.onecard-applied/<the series
    file's folder> ("patches" for patches/series, "kvarn" for kvarn/series)."""
    return vllm_dir / APPLIED_DIR / series.resolve().parent.name


def save_applied(vllm_dir: Path, series: Path, patches: list[Patch]) -> None:
    """Keep the texts of the series just applied (a series file + the patch files), replaced
    whole; what an update unwinds when one of its patches has changed since."""
    import shutil

    dest = applied_dir(vllm_dir, series)
    listing = "".join(p.name + "\n" for p in patches)
    if (dest / "series").is_file() and (dest / "series").read_text(encoding="utf-8") == listing and all(
            (dest / p.name).is_file() and (dest / p.name).read_bytes() == p.path.read_bytes() for p in patches):
        return
    dest.parent.mkdir(exist_ok=True)
    tmp, old = dest.with_name(dest.name + ".tmp"), dest.with_name(dest.name + ".old")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir()
    for p in patches:
        shutil.copyfile(p.path, tmp / p.name)
    (tmp / "series").write_text(listing, encoding="utf-8")
    shutil.rmtree(old, ignore_errors=True)
    if dest.exists():
        dest.rename(old)
    tmp.rename(dest)
    shutil.rmtree(old, ignore_errors=True)


def _drop_applied(vllm_dir: Path, series: Path) -> None:
    import shutil

    dest = applied_dir(vllm_dir, series)
    shutil.rmtree(dest, ignore_errors=True)
    try:
        dest.parent.rmdir()   # the last series reverted: nothing of ours stays in the package
    except OSError:
        pass


def _git_series(series: Path, limit: int = 40):
    """Earlier versions of ``series`` from this checkout's git history, newest first: one list of
    Patch per commit that touched its folder (none outside a git checkout)."""
    import subprocess

    try:
        rel = series.resolve().relative_to(REPO.resolve())
    except ValueError:
        return

    def git(*args) -> subprocess.CompletedProcess:
        return subprocess.run(["git", "-C", str(REPO), *args], capture_output=True, timeout=60)

    try:
        revs = git("log", f"-n{limit}", "--format=%H", "--", str(rel.parent)).stdout.decode().split()
    except (OSError, subprocess.SubprocessError):
        return
    for rev in revs:
        with tempfile.TemporaryDirectory() as td:
            try:
                listing = git("show", f"{rev}:{rel.as_posix()}")
                if listing.returncode:
                    continue
                (Path(td) / "series").write_bytes(listing.stdout)
                for raw in listing.stdout.decode().splitlines():
                    name = raw.split("#", 1)[0].strip()
                    if name:
                        (Path(td) / name).parent.mkdir(parents=True, exist_ok=True)
                        (Path(td) / name).write_bytes(git("show", f"{rev}:{(rel.parent / name).as_posix()}").stdout)
                yield read_series(Path(td) / "series"), f"git {rev[:8]}"
            except (OSError, subprocess.SubprocessError, PatchError):
                continue


def _earlier_series(vllm_dir: Path, series: Path, patches: list[Patch]):
    """(the wheel's files as a tree, the older series that is applied, where it came from), or
    None: for an install whose patches do not all reverse with today's texts. Candidates: the
    record apply() kept, then earlier versions in git. One is accepted only if unwinding it leaves
    every file it or today's series touches equal to the wheel's RECORD (a file only a patch
    creates: absent)."""
    site = vllm_dir.parent
    try:
        record = _record(vllm_dir)
    except PatchError:
        return None
    touched_now = {p for patch in patches for p in patch.paths}

    def candidates():
        kept = applied_dir(vllm_dir, series) / "series"
        if kept.is_file():
            try:
                yield read_series(kept), f"vllm/{APPLIED_DIR}/{kept.parent.name}"
            except PatchError:
                pass
        yield from _git_series(series)

    for old, source in candidates():
        tree = Tree(site)
        if any(_try(tree, p, reverse=True) is not None for p in reversed(old)):
            continue
        ok = True
        for rel in touched_now | {p for patch in old for p in patch.paths}:
            lines = tree.get(rel)
            data = None if lines is None else "".join(lines).encode("utf-8")
            if (rel in record and (data is None or _digest(data) != record[rel])) or (rel not in record and data is not None):
                ok = False
                break
        if ok:
            return tree, old, source
    return None


# --------------------------------------------------------------------------- RECORD audit


def _record(vllm_dir: Path) -> dict[str, str]:
    site = vllm_dir.parent
    infos = sorted(site.glob("vllm-*.dist-info"))
    if not infos:
        raise PatchError(f"no vllm-*.dist-info beside {vllm_dir}: cannot audit against the wheel's RECORD")
    with open(infos[-1] / "RECORD", newline="", encoding="utf-8") as fh:
        return {row[0]: row[1] for row in csv.reader(fh) if len(row) >= 2 and row[1].startswith("sha256=")}


def _digest(data: bytes) -> str:
    return "sha256=" + base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=").decode()


def audit(vllm_dir: Path, series: Path = DEFAULT_SERIES, extra: tuple[Path, ...] = ()) -> list[str]:
    """Differences between the installed package and 'pristine wheel + applied patches'.

    Checks every ``.py`` file the wheel's RECORD lists: a file the series touches must equal its
    RECORD hash once the series is unwound in memory; every other file must equal RECORD as is.
    ``extra``: series applied after ``series`` (kvarn/series), unwound with it.
    """
    patches = read_series(series) + [p for s in extra for p in read_series(s)]
    record = _record(vllm_dir)
    site = vllm_dir.parent
    _, pristine, _ = _analyse(site, patches, vllm_version(vllm_dir))
    touched = {p for patch in patches for p in patch.paths}
    problems = []
    for rel, digest in record.items():
        if not (rel.startswith("vllm/") and rel.endswith(".py")):
            continue
        if rel in touched:
            lines = pristine.get(rel)
            data = None if lines is None else "".join(lines).encode("utf-8")
        else:
            path = site / rel
            data = path.read_bytes() if path.is_file() else None
        if data is None:
            problems.append(f"{rel}: missing")
        elif _digest(data) != digest:
            problems.append(f"{rel}: differs from the wheel" + (" after unwinding the series" if rel in touched else ""))
    for rel in touched - record.keys():  # files the series creates
        if pristine.get(rel) is not None:
            problems.append(f"{rel}: exists though only the series creates it")
    return problems


# --------------------------------------------------------------------------- overlay (tests)


def overlay(vllm_dir: Path, dest: Path, series: Path = DEFAULT_SERIES, also: tuple[str, ...] = ()) -> Path:
    """Make `dest/vllm` a patched view of `vllm_dir` without touching it.

    Directories the series does not touch are symlinked, touched files are real copies, and the
    series is then applied to the view. Returns `dest` (put it first on PYTHONPATH). Used by the
    tests so that the test environment's vLLM stays pristine. ``also``: more site-relative paths
    to make real (copied files, real directories down to them; they need not exist), for a
    later installer that writes there (kvarn/install.sh).
    """
    touched = {p for patch in read_series(series) for p in patch.paths} | set(also)
    site = vllm_dir.parent

    def build(src: Path, rel: str) -> None:
        out = dest / rel
        out.mkdir(parents=True, exist_ok=True)
        for entry in src.iterdir():
            sub = f"{rel}/{entry.name}"
            if entry.name == "__pycache__":
                continue
            if entry.is_dir() and any(t.startswith(sub + "/") for t in touched):
                build(entry, sub)
            elif sub in touched:
                out.joinpath(entry.name).write_bytes(entry.read_bytes())
            else:
                out.joinpath(entry.name).symlink_to(entry)

    build(vllm_dir, "vllm")
    for info in site.glob("vllm-*.dist-info"):
        (dest / info.name).symlink_to(info)
    apply(dest / "vllm", series)
    return dest


# --------------------------------------------------------------------------- CLI


def configure(parser) -> None:
    parser.add_argument("action", choices=["apply", "check", "revert", "status", "audit", "lint", "hash"])
    parser.add_argument("--vllm-dir", help="the vllm package directory (default: the one this Python imports)")
    parser.add_argument("--series", default=str(DEFAULT_SERIES), help="series file (default: patches/series)")
    parser.add_argument("--dry-run", action="store_true", help="apply/revert: report only, write nothing")
    parser.add_argument("--also-series", action="append", default=[], metavar="PATH",
                        help="audit: a series applied after --series (e.g. kvarn/series); repeatable")


def run(args) -> int:
    series = Path(args.series)
    try:
        if args.action == "lint":
            problems = lint_series(series)
            for p in problems:
                print(f"FAIL {p}")
            print(f"{len(read_series(series))} patches listed, {len(problems)} problems")
            return 1 if problems else 0
        if args.action == "hash":
            print(series_hash(series))
            return 0
        vllm_dir = locate_vllm(args.vllm_dir)
        if args.action == "status":
            report = status(vllm_dir, series)
            print("\n".join(report.lines()))
            return 0 if report.all_applied else 1
        if args.action in ("apply", "check"):
            dry = args.dry_run or args.action == "check"
            report, names = apply(vllm_dir, series, dry_run=dry)
            if report.replaced:
                verb = "would update" if dry else "updated"
                print(f"{verb}: unwound the {len(report.replaced)} patches applied before ({report.replaced_from}; "
                      f"the files equal the wheel's RECORD after it), then applied all {len(names)} of {series.name} "
                      f"to {vllm_dir}")
                return 0
            if not names:
                print(f"already applied: all {len(report.states)} patches of {series.name} are on {vllm_dir}; nothing to do")
            else:
                verb = "would apply" if dry else "applied"
                for n in names:
                    print(f"{verb} {n}")
                print(f"{verb} {len(names)} of {len(report.states)} patches to {vllm_dir}")
            return 0
        if args.action == "revert":
            names = revert(vllm_dir, series, dry_run=args.dry_run)
            verb = "would revert" if args.dry_run else "reverted"
            for n in names:
                print(f"{verb} {n}")
            print(f"{verb} {len(names)} patches" if names else "nothing applied; nothing to revert")
            return 0
        if args.action == "audit":
            problems = audit(vllm_dir, series, extra=tuple(Path(p) for p in args.also_series))
            for p in problems:
                print(f"FAIL {p}")
            print(f"audit of {vllm_dir}: {len(problems)} unexpected differences from wheel + series")
            return 1 if problems else 0
    except PatchError as exc:
        print(f"onecard patches: {exc}", file=sys.stderr)
        return 2
    return 2
