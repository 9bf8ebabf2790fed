"""`install.sh`: venv + pinned vLLM + the patch series (+ optional steps) + verify --no-server.

Runs under the system Python with the standard library only (the venv does not exist yet when
it starts). Idempotent: every step first looks at what is there and does nothing when it is
already right, so a second run changes nothing. Each failure names its step and the fix.
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

from onecard import VLLM_PIN

REPO = Path(__file__).resolve().parent.parent
FLASHINFER_PIN = "0.6.16.post3"  # vLLM 0.27.1's own pin (its METADATA: flashinfer-python==0.6.16.post3)
# Wheels vLLM 0.27.1 pins that are built for a different torch than the one a CPU machine gets;
# where they fail to import beside the installed torch they are removed (text serving does not
# use them, and a broken one makes `import vllm` fail).
TORCH_COMPANIONS = ("torchvision", "torchaudio", "torchcodec")
# Free space the package step needs where the venv and pip's temporary unpacking go. Measured
# (2026-12-06, a clean clone's tests/run.sh, the disk's used space sampled every 5 s): a CPU
# machine's venv (vLLM 0.27.1 on the local CPU torch) ends at 5.5 GB and the disk's use peaked
# 7.5 GB above its start while pip unpacked beside it. With 6.0 here a CI machine with ~7 GB free
# passed the check and pip stopped at `[Errno 28]`. A CUDA machine adds the CUDA torch and the
# NVIDIA wheels (several GB more; not measured).
MIN_FREE_GB = {"cpu": 8.0, "cuda": 12.0}


def free_gb(path: Path) -> tuple[Path, float]:
    """Free space (GB) on the filesystem that holds `path` (its nearest existing parent)."""
    path = path.absolute()
    while not path.exists() and path != path.parent:
        path = path.parent
    return path, shutil.disk_usage(path).free / 1e9


class StepFailed(Exception):
    def __init__(self, step: str, what: str, fix: str):
        super().__init__(f"{step}: {what}")
        self.step, self.what, self.fix = step, what, fix


@dataclass
class Installer:
    venv: Path
    wheelhouse: Path | None = None
    model: str | None = None
    kvarn: bool = False
    verify: bool = True
    extras: str = ""  # e.g. "test": installs onecard[test]
    pristine: bool = False  # leave vLLM unpatched (the test environment: tests patch a view of it)
    summary: list[tuple[str, str, str]] = field(default_factory=list)  # step, outcome, detail
    model_dir: Path | None = None  # where step_model left the prepared checkpoint
    drafter: str | None = None  # --drafter: the DFlash2 drafter (Hub id or path) for SPEC=dflash2
    drafter_dir: Path | None = None  # where step_drafter left it
    service: bool = False  # --service: a systemd user unit that runs ./start_qwen.sh (onecard.service)

    @property
    def py(self) -> Path:
        return self.venv / "bin" / "python"

    def note(self, step: str, outcome: str, detail: str = "") -> None:
        self.summary.append((step, outcome, detail))
        print(f"[{len(self.summary)}] {step}: {outcome}" + (f" - {detail}" if detail else ""), flush=True)

    def sh(self, step: str, cmd: list[str], fix: str, env: dict | None = None) -> None:
        started = time.monotonic()
        proc = subprocess.run([str(c) for c in cmd], env={**os.environ, **(env or {})})
        if proc.returncode != 0:
            raise StepFailed(step, f"`{' '.join(map(str, cmd[:6]))} ...` exited {proc.returncode} after {time.monotonic() - started:.0f} s", fix)

    def installed(self) -> dict[str, str]:
        out = subprocess.run([str(self.py), "-m", "pip", "list", "--format=json", "--disable-pip-version-check"],
                             capture_output=True, text=True)
        if out.returncode != 0:
            return {}
        return {p["name"].lower().replace("_", "-"): p["version"] for p in json.loads(out.stdout)}

    # ------------------------------------------------------------------ steps

    def step_python(self) -> None:
        v = sys.version_info
        if v < (3, 11):
            raise StepFailed("python", f"{sys.executable} is {v.major}.{v.minor}", "run with Python >= 3.11: PYTHON=python3.12 ./install.sh")
        self.note("python", "ok", f"{v.major}.{v.minor}.{v.micro} ({sys.executable})")

    def step_venv(self) -> None:
        if self.py.exists():
            self.note("venv", "already present", str(self.venv))
            return
        self.sh("venv", [sys.executable, "-m", "venv", self.venv], f"check that {self.venv.parent} is writable and python3-venv is installed")
        self.note("venv", "created", str(self.venv))

    def step_packages(self) -> None:
        have = self.installed()
        want = {"vllm": VLLM_PIN, "flashinfer-python": FLASHINFER_PIN}
        wrong = {n: v for n, v in want.items() if have.get(n) != v}
        deps_ok = all(n in have for n in ("huggingface-hub", "unidiff", "safetensors", "onecard")) and (
            self.extras != "test" or "pytest" in have)
        if not wrong and deps_ok:
            self.note("packages", "already installed", f"vllm {VLLM_PIN}, flashinfer-python {FLASHINFER_PIN}")
            return
        # Offline: no index, and no isolated build env for the editable onecard (its build backend,
        # setuptools, then comes from the venv instead of the index).
        source = ["--no-index", "--find-links", self.wheelhouse, "--no-build-isolation"] if self.wheelhouse else []
        if self.wheelhouse:  # the editable build needs setuptools >= 68, which a new venv may lack
            self.sh("packages", [self.py, "-m", "pip", "install", "-q", "--disable-pip-version-check",
                                 "--no-index", "--find-links", self.wheelhouse, "setuptools>=68"],
                    f"add a setuptools>=68 wheel to {self.wheelhouse} (pip download -d DIR setuptools)")
        self.check_disk()
        print(f"    installing vllm=={VLLM_PIN} and its companions (about 2 GB on a CUDA machine; pip's progress follows)", flush=True)
        self.sh("packages", [self.py, "-m", "pip", "install", "--disable-pip-version-check", *source,
                             f"vllm=={VLLM_PIN}", f"flashinfer-python=={FLASHINFER_PIN}", "huggingface_hub",
                             "-e", f"{REPO}[{self.extras}]" if self.extras else REPO],
                "read pip's error above; offline machines: ./install.sh --wheelhouse DIR")
        self.note("packages", "installed", ", ".join(f"{n} {v}" for n, v in want.items()))

    def check_disk(self) -> None:
        """Refuse before pip starts when the disk cannot hold the install (pip would stop half-way
        with `[Errno 28] No space left on device`, leaving a half-installed venv)."""
        kind = "cuda" if shutil.which("nvidia-smi") else "cpu"
        raw = os.environ.get("ONECARD_MIN_FREE_GB", str(MIN_FREE_GB[kind]))
        try:
            need = float(raw)
        except ValueError:
            raise StepFailed("packages", f"ONECARD_MIN_FREE_GB={raw!r} is not valid",
                             "valid: a number of GB, e.g. ONECARD_MIN_FREE_GB=4") from None
        for what, where in (("the venv", self.venv), ("pip's temporary files (TMPDIR)", Path(tempfile.gettempdir()))):
            at, free = free_gb(where)
            if free < need:
                raise StepFailed("packages", f"only {free:.1f} GB free on the disk of {what} ({at}); "
                                 f"the pinned vLLM and its companions need about {need:.0f} GB ({kind} machine)",
                                 "free disk space, or put the venv on a larger disk (--venv DIR; TMPDIR=DIR for pip's "
                                 "unpacking); ONECARD_MIN_FREE_GB=N lowers the check")

    def step_companions(self) -> None:
        have = self.installed()
        removed = []
        for name in TORCH_COMPANIONS:
            if name not in have:
                continue
            probe = subprocess.run([str(self.py), "-c", f"import {name}"], capture_output=True, text=True)
            if probe.returncode != 0:
                self.sh("torch companions", [self.py, "-m", "pip", "uninstall", "-y", "-q", name],
                        f"remove it by hand: {self.py} -m pip uninstall {name}")
                removed.append(name)
        if removed:
            self.note("torch companions", "removed", f"{', '.join(removed)} (built for another torch; text serving does not use them)")
        else:
            self.note("torch companions", "ok", "nothing to remove")

    def step_patches(self) -> None:
        if self.pristine:
            self.note("patches", "skipped", "--pristine: vLLM left as the wheel installed it")
            return
        out = subprocess.run([str(self.py), "-m", "onecard", "patches", "apply"], capture_output=True, text=True, cwd=REPO)
        if out.returncode != 0:
            raise StepFailed("patches", (out.stderr or out.stdout).strip().splitlines()[-1],
                             "reinstall the pinned vLLM (`venv/bin/pip install --force-reinstall vllm==0.27.1`) and re-run")
        last = out.stdout.strip().splitlines()[-1]
        self.note("patches", "already applied" if last.startswith("already") else "applied", last)

    def kvarn_present(self) -> bool:
        """Whether the venv's vLLM carries the KVarN marker (a KVarN install from before)."""
        probe = ("import importlib.util, pathlib; s = importlib.util.find_spec('vllm'); "
                 "print(bool(s) and any((pathlib.Path(p) / 'kvarn_installed.txt').is_file() "
                 "for p in (s.submodule_search_locations or [])))")
        try:
            out = subprocess.run([str(self.py), "-c", probe], capture_output=True, text=True, timeout=60)
        except (OSError, subprocess.TimeoutExpired):
            return False
        return out.returncode == 0 and out.stdout.strip() == "True"

    def step_kvarn(self) -> None:
        script = REPO / "kvarn" / "install.sh"
        if not self.kvarn and not self.pristine and script.is_file() and self.kvarn_present():
            # installed before: bring the copy in vLLM up to this checkout (an update of onecard
            # changes the copied files; the launcher refuses CTX=huge with a stale copy)
            self.sh("kvarn", ["bash", script], "see kvarn/README.md; kvarn/install.sh --uninstall restores stock",
                    env={"VENV": str(self.venv)})
            self.note("kvarn", "kept up to date", "it was installed before; kvarn/install.sh --uninstall removes it")
            return
        if not self.kvarn:
            self.note("kvarn", "skipped", "add --kvarn for CTX=huge")
            return
        if not script.is_file():
            raise StepFailed("kvarn", "the KVarN cache is not part of this release yet", "run without --kvarn (CTX=fast|long work without it)")
        self.sh("kvarn", ["bash", script], "see kvarn/README.md; kvarn/install.sh --uninstall restores stock",
                env={"VENV": str(self.venv)})
        self.note("kvarn", "installed", "idempotent; state: kvarn/install.sh --status")

    def step_model(self) -> None:
        if not self.model:
            self.note("model", "skipped", "add --model ID|PATH to download and prepare one")
            return
        self.sh("model", [self.py, "-m", "onecard", "prepare", "model", self.model],
                "read the error line above; re-running resumes (download, requantization and draft vocab "
                "are each skipped once done); HF_HUB_OFFLINE=1 uses only the local Hugging Face cache")
        from onecard.prepare.model import default_dest  # stdlib-only at import: fine under the system Python

        self.model_dir = default_dest(self.model)
        self.note("model", "prepared", f"{self.model} -> {self.model_dir}")

    def step_drafter(self) -> None:
        if not self.drafter:
            self.note("drafter", "skipped", "add --drafter for SPEC=dflash2 (the published DFlash2 drafter)")
            return
        cmd = [self.py, "-m", "onecard", "prepare", "drafter", self.drafter]
        if self.model_dir:
            cmd += ["--target", str(self.model_dir)]
        self.sh("drafter", cmd,
                "read the error line above; re-running resumes the download; HF_HUB_OFFLINE=1 uses only the "
                "local Hugging Face cache; SPEC=off|mtp need no drafter")
        from onecard.prepare.drafter import launcher_default_draft  # stdlib-only at import
        from onecard.prepare.model import classify

        kind, src = classify(self.drafter)
        self.drafter_dir = src if kind == "local" else launcher_default_draft().absolute()
        self.note("drafter", "prepared", f"{self.drafter} -> {self.drafter_dir}")

    def step_verify(self) -> None:
        if not self.verify:
            self.note("verify", "skipped")
            return
        env = {"VENV": str(self.venv)}
        if self.model:
            env["MODEL"] = str(self.model_dir or self.model)
        if self.drafter_dir:
            env["DRAFT"] = str(self.drafter_dir)
        self.sh("verify", ["bash", REPO / "verify.sh", "--no-server"], "fix the FAIL lines above, then ./verify.sh --no-server", env=env)
        self.note("verify", "passed")

    def venv_word(self) -> str:
        """``VENV=DIR`` for a venv other than ./venv (start_qwen.sh and verify.sh look there
        otherwise), else empty."""
        return f"VENV={self.venv.absolute()}" if self.venv.absolute() != (REPO / "venv").absolute() else ""

    def service_env(self) -> list[str]:
        """MODEL / DRAFT for the service when this install put them elsewhere than the launcher's defaults."""
        from onecard.prepare.drafter import launcher_default_draft
        from onecard.prepare.model import launcher_default_model

        env = [self.venv_word()] if self.venv_word() else []
        if self.model_dir and self.model_dir != (REPO / launcher_default_model()).absolute():
            env.append(f"MODEL={self.model_dir}")
        if self.drafter_dir and self.drafter_dir != launcher_default_draft().absolute():
            env.append(f"DRAFT={self.drafter_dir}")
        return env

    def step_service(self) -> None:
        if not self.service:
            self.note("service", "skipped", "add --service for a systemd user service (onecard service install)")
            return
        cmd = [self.py, "-m", "onecard", "service", "install"]
        for word in self.service_env():
            cmd += ["--env", word]
        self.sh("service", cmd, "read the error line above; `onecard service install --dry-run` shows the unit")
        self.note("service", "written", "systemctl --user enable --now onecard starts it")

    def run(self) -> int:
        steps = [self.step_python, self.step_venv, self.step_packages, self.step_companions,
                 self.step_patches, self.step_kvarn, self.step_model, self.step_drafter, self.step_verify,
                 self.step_service]
        try:
            for step in steps:
                step()
        except StepFailed as exc:
            self.note(exc.step, "FAILED", exc.what)
            print(f"\ninstall.sh stopped at step '{exc.step}': {exc.what}\n  fix: {exc.fix}", file=sys.stderr)
            return 1
        width = max(len(s) for s, _, _ in self.summary)
        print("\nonecard install summary")
        for step, outcome, detail in self.summary:
            print(f"  {step:<{width}}  {outcome}")
        model = ""
        if self.model_dir:
            from onecard.prepare.model import launcher_default_model

            if self.model_dir != (REPO / launcher_default_model()).absolute():
                model = f"MODEL={self.model_dir} "  # not where the launcher looks by default
        spec = ""
        if self.drafter_dir:
            from onecard.prepare.drafter import launcher_default_draft

            spec = "SPEC=dflash2 " + ("" if self.drafter_dir == launcher_default_draft().absolute()
                                      else f"DRAFT={self.drafter_dir} ")
        venv = self.venv_word() + " " if self.venv_word() else ""
        print(f"venv: {self.venv}   next: {venv}{model}CTX=long {spec}./start_qwen.sh   "
              f"({venv}./start_qwen.sh --dry-run shows the plan)")
        return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="install.sh", description=__doc__.splitlines()[0])
    parser.add_argument("--venv", default=os.environ.get("VENV", str(REPO / "venv")), help="virtual environment (default: venv/, or $VENV)")
    parser.add_argument("--wheelhouse", type=Path, help="install from this folder of wheels only (no index)")
    parser.add_argument("--model", default=os.environ.get("INSTALL_MODEL"), help="download (huggingface_hub) and prepare this model id or path")
    from onecard.prepare.drafter import DEFAULT_DRAFTER_ID  # stdlib-only at import

    parser.add_argument("--drafter", nargs="?", const=DEFAULT_DRAFTER_ID, default=os.environ.get("INSTALL_DRAFTER"),
                        help="download (huggingface_hub) and check the DFlash2 drafter SPEC=dflash2 needs: a Hub "
                             f"id (default {DEFAULT_DRAFTER_ID}) goes into models/dflash2-drafter; a local PATH is "
                             "checked in place (start with DRAFT=PATH)")
    parser.add_argument("--kvarn", action="store_true", help="also install the KVarN 4/2-bit KV cache (CTX=huge)")
    parser.add_argument("--no-verify", action="store_true", help="skip the final ./verify.sh --no-server")
    parser.add_argument("--service", action="store_true",
                        help="last: write a systemd user service that runs ./start_qwen.sh (onecard service install; "
                             "with MODEL / DRAFT when installed elsewhere than the launcher's defaults)")
    parser.add_argument("--extras", default="", help=argparse.SUPPRESS)  # tests/run.sh: onecard[test]
    parser.add_argument("--pristine", action="store_true", help=argparse.SUPPRESS)  # tests/run.sh
    args = parser.parse_args(argv)
    if args.wheelhouse and not args.wheelhouse.is_dir():
        parser.error(f"--wheelhouse {args.wheelhouse}: not a directory")
    return Installer(Path(args.venv).expanduser().absolute(), args.wheelhouse, args.model, args.kvarn,
                     not args.no_verify, args.extras, args.pristine, drafter=args.drafter, service=args.service).run()


if __name__ == "__main__":
    raise SystemExit(main())
