"""`onecard service install|uninstall|status`: run the server as a systemd user service.

The unit runs ./start_qwen.sh from this checkout, so the launcher does what it does by hand: it
reads the knobs from the checkout's .env (and the unit's own Environment= lines), runs the
preflight, and execs vLLM; the server listens where the plan says (127.0.0.1 unless an API key is
configured). Restart policy: a crash restarts after 15 s, at most 3 starts in 15 minutes; a plan
the preflight refuses (exit 2) is not restarted, since it would be refused again. The API key
never goes into the unit: it stays in api_key.txt (mode 0600) or .env, where the launcher reads it.

    onecard service install [--env CTX=long --env SPEC=dflash2] [--name onecard] [--dry-run]
    systemctl --user enable --now onecard        # start now and at every login
    loginctl enable-linger "$USER"               # ... and at boot, without a login
    journalctl --user -u onecard -f              # the server's log

Standard library only (install.sh runs it under the system Python too).
"""
from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
NAME_RE = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.@-]{0,63}")
SECRET_KEYS = ("VLLM_API_KEY", "HF_TOKEN", "HUGGING_FACE_HUB_TOKEN")
# variables beside the launcher's knobs that a service may need (which GPU, where the Hub cache is)
# VENV: read by start_qwen.sh itself (which Python runs the launcher), for a venv made with
# ./install.sh --venv DIR
PASS_THROUGH = ("CUDA_VISIBLE_DEVICES", "HF_HOME", "HF_HUB_OFFLINE", "VLLM_LOGGING_LEVEL", "VENV")


class ServiceError(ValueError):
    """A bad argument: one line naming what is valid."""


def unit_dir(environ=None) -> Path:
    env = os.environ if environ is None else environ
    base = env.get("XDG_CONFIG_HOME") or str(Path(env.get("HOME") or Path.home()) / ".config")
    return Path(base) / "systemd" / "user"


def parse_env(words: list[str]) -> dict[str, str]:
    """--env KNOB=VALUE words -> {knob: value}; a name that is neither a launcher knob nor one of
    PASS_THROUGH (e.g. CUDA_VISIBLE_DEVICES=1 on a machine whose GPU 0 drives the display), an
    empty value, or a secret: ServiceError (one line). The values themselves are the launcher's to
    check (./start_qwen.sh --dry-run with the same environment shows the plan)."""
    from onecard.profiles import KNOBS

    out: dict[str, str] = {}
    for word in words:
        key, sep, value = word.partition("=")
        key = key.strip()
        if key in SECRET_KEYS:
            raise ServiceError(f"--env {key}=...: a secret does not go into a unit file (other users may read it); "
                               "valid: put it in api_key.txt (mode 0600) or .env in the checkout")
        if not sep or (key not in KNOBS and key not in PASS_THROUGH) or not value.strip():
            raise ServiceError(f"--env {word!r} is not valid; valid: KNOB=VALUE with KNOB one of "
                               f"{', '.join([*KNOBS, *PASS_THROUGH])}")
        if any(c in value for c in "\n\"\\%$"):
            raise ServiceError(f"--env {key}: the value may not contain a newline, quote, backslash, % or $ "
                               "(systemd would read them); valid: put such a value in .env")
        out[key] = value.strip()
    return out


EXAMPLE_REPO = Path("%h/onecard")   # single-user/onecard.service: a checkout at ~/onecard (%h: the home)


def render_unit(repo: Path, env: dict[str, str], name: str = "onecard") -> str:
    head = ("# An example (single-user/onecard.service): what `onecard service install` writes for a checkout\n"
            "# at ~/onecard (%h is your home). Running that command writes the unit for where your checkout is."
            if repo == EXAMPLE_REPO else
            "# Written by `onecard service install`; re-run it to change this file (a hand edit is replaced).")
    lines = [
        head,
        "[Unit]",
        f"Description=onecard: Qwen3.8-27B on one GPU through patched vLLM ({repo})",
        "After=network.target",
        "StartLimitIntervalSec=900",
        "StartLimitBurst=3",
        "",
        "[Service]",
        "Type=exec",
        f"WorkingDirectory={repo}",
        f"ExecStart={repo / 'start_qwen.sh'}",
        "# the knobs: the checkout's .env (read by the launcher), then these lines",
        *[f'Environment="{k}={v}"' for k, v in sorted(env.items())],
        "Restart=on-failure",
        "RestartSec=15",
        "# 2 = the preflight refused the plan: restarting would not change that",
        "RestartPreventExitStatus=2",
        "KillMode=mixed",
        "TimeoutStopSec=90",
        "",
        "[Install]",
        "WantedBy=default.target",
        "",
    ]
    return "\n".join(lines)


def _systemctl(args: list[str]) -> tuple[int | None, str]:
    exe = shutil.which("systemctl")
    if exe is None:
        return None, "no systemctl on PATH"
    try:
        p = subprocess.run([exe, "--user", *args], capture_output=True, text=True, timeout=60)
    except (OSError, subprocess.SubprocessError) as e:
        return None, f"systemctl --user {' '.join(args)}: {type(e).__name__}: {e}"
    return p.returncode, (p.stdout + p.stderr).strip()


def install(name: str, env: dict[str, str], dry_run: bool = False, repo: Path = REPO, out=sys.stdout) -> int:
    path = unit_dir() / f"{name}.service"
    text = render_unit(repo, env, name)
    if dry_run:
        print(f"would write {path}:\n{text}", file=out)
        return 0
    old = path.read_text() if path.is_file() else None
    if old == text:
        print(f"{path}: unchanged", file=out)
    else:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(path.name + ".tmp")
        tmp.write_text(text)
        os.replace(tmp, path)
        print(f"{path}: {'updated' if old is not None else 'written'}", file=out)
        rc, msg = _systemctl(["daemon-reload"])
        if rc not in (0, None):
            print(f"warning: systemctl --user daemon-reload failed: {msg.splitlines()[-1] if msg else rc}", file=out)
    print(f"next: systemctl --user enable --now {name}   (start it now and at login; "
          f"`loginctl enable-linger $USER` also starts it at boot without a login)\n"
          f"      journalctl --user -u {name} -f   (its log);   ./verify.sh   (checks the running server)", file=out)
    return 0


def uninstall(name: str, dry_run: bool = False, out=sys.stdout) -> int:
    path = unit_dir() / f"{name}.service"
    if not path.is_file():
        print(f"{path}: not installed, nothing to do", file=out)
        return 0
    if dry_run:
        print(f"would stop and disable {name}, then remove {path}", file=out)
        return 0
    rc, msg = _systemctl(["disable", "--now", f"{name}.service"])
    if rc not in (0, None):
        print(f"warning: systemctl --user disable --now {name} failed: {msg.splitlines()[-1] if msg else rc}", file=out)
    path.unlink()
    _systemctl(["daemon-reload"])
    print(f"{path}: removed", file=out)
    return 0


def status(name: str, out=sys.stdout) -> int:
    path = unit_dir() / f"{name}.service"
    if not path.is_file():
        print(f"{path}: not installed (onecard service install writes it)", file=out)
        return 1
    rc, msg = _systemctl(["is-active", f"{name}.service"])
    state = msg.splitlines()[-1] if msg else "unknown"
    print(f"{path}: installed; {name} is {state if rc is not None else 'unknown (' + msg + ')'}", file=out)
    return 0


def configure(parser) -> None:
    parser.add_argument("action", choices=("install", "uninstall", "status"))
    parser.add_argument("--name", default="onecard", help="the unit's name (default onecard)")
    parser.add_argument("--env", action="append", default=[], metavar="KNOB=VALUE",
                        help="a launcher knob for the service (repeatable); the checkout's .env is read too")
    parser.add_argument("--dry-run", action="store_true", help="print what would be written or removed")


def run(args) -> int:
    try:
        if not NAME_RE.fullmatch(args.name):
            raise ServiceError(f"--name {args.name!r} is not valid; valid: letters, digits, '_', '.', '@', '-' "
                               "(up to 64, starting with a letter or digit)")
        env = parse_env(args.env)
        if args.action != "install" and env:
            raise ServiceError(f"--env is for install; valid with {args.action}: --name, --dry-run")
    except ServiceError as e:
        print(f"onecard service: {e}", file=sys.stderr)
        return 2
    if args.action == "install":
        return install(args.name, env, args.dry_run)
    if args.action == "uninstall":
        return uninstall(args.name, args.dry_run)
    return status(args.name)
