"""GPU jobs only: cap and watch the torch caching allocator of every Python process of a job's
server (installed by this directory's sitecustomize, which gpu/run.sh puts first on PYTHONPATH).

Why: on a 140 GiB H200 the caching allocator never runs short, so it keeps every block it ever
reserved; nvidia-smi then shows its high-water mark, not what a 24 GiB card needs (there the
allocator frees cached blocks and retries before it raises an out-of-memory error). Job 41
(gpu/lib/fit.py, FIT_TORCH_CAP) caps the allocator at what a 3090 would leave it and reads
how much it really needed.

ONECARD_TORCH_CAP_MIB=N  at CUDA's lazy initialization (never earlier: importing this does not
                         create a CUDA context), torch.cuda.set_per_process_memory_fraction(
                         N MiB / the device's total): the allocator may reserve at most N MiB
                         (CUDA graph pools included); past that it frees its cache, retries,
                         then raises torch.OutOfMemoryError.
ONECARD_TORCH_STATS_DIR=D  a daemon thread writes D/torch-<pid>.json once a second (atomically):
                         the allocator's peak / current allocated and reserved MiB, its retries
                         (cache flushes forced by the cap) and OOMs, the cap.

Neither set: nothing happens (torch is not even imported). torch is imported only when it is
first imported by the process itself: a post-import hook on the module ``torch``.
"""
import json
import os
import sys
import threading
import time

MiB = 1 << 20


def _settings() -> tuple[int | None, str | None]:
    cap = os.environ.get("ONECARD_TORCH_CAP_MIB", "").strip()
    stats = os.environ.get("ONECARD_TORCH_STATS_DIR", "").strip() or None
    if cap in ("", "0", "off"):
        return None, stats
    try:
        value = int(float(cap))
    except ValueError:
        print(f"onecard-torch-mem: ONECARD_TORCH_CAP_MIB={cap!r} is not a number of MiB; no cap",
              file=sys.stderr, flush=True)
        return None, stats
    return (value if value > 0 else None), stats


def snapshot(torch, dev: int, cap_mib: int | None, total: int) -> dict:
    s = torch.cuda.memory_stats(dev)
    g = lambda k: round(s.get(k, 0) / MiB, 1)  # noqa: E731
    return {"pid": os.getpid(), "time": time.time(), "cap_mib": cap_mib, "total_mib": round(total / MiB),
            "allocated_peak_mib": g("allocated_bytes.all.peak"), "reserved_peak_mib": g("reserved_bytes.all.peak"),
            "allocated_mib": g("allocated_bytes.all.current"), "reserved_mib": g("reserved_bytes.all.current"),
            "alloc_retries": int(s.get("num_alloc_retries", 0)), "ooms": int(s.get("num_ooms", 0)),
            "argv": " ".join(sys.argv)[:200]}


def _write(path: str, rec: dict) -> None:
    tmp = f"{path}.tmp"
    with open(tmp, "w") as f:
        json.dump(rec, f)
    os.replace(tmp, path)


def _at_cuda_init(torch, cap_mib: int | None, stats_dir: str | None) -> None:
    """Queued with torch.cuda._lazy_call: runs inside torch's lazy CUDA initialization."""
    try:
        dev = torch.cuda.current_device()
        total = torch.cuda.get_device_properties(dev).total_memory
        if cap_mib:
            torch.cuda.set_per_process_memory_fraction(min(1.0, cap_mib * MiB / total), dev)
            print(f"onecard-torch-mem: pid {os.getpid()}: torch caching allocator capped at {cap_mib:,} MiB "
                  f"of {total / MiB:,.0f}", file=sys.stderr, flush=True)
        if stats_dir:
            os.makedirs(stats_dir, exist_ok=True)
            path = os.path.join(stats_dir, f"torch-{os.getpid()}.json")

            def loop():
                while True:
                    try:
                        _write(path, snapshot(torch, dev, cap_mib, total))
                    except Exception:  # noqa: BLE001 - a watcher must never stop the server
                        pass
                    time.sleep(1.0)
            threading.Thread(target=loop, name="onecard-torch-mem", daemon=True).start()
    except Exception as e:  # noqa: BLE001
        print(f"onecard-torch-mem: not installed in pid {os.getpid()}: {e!r}", file=sys.stderr, flush=True)


def _after_torch(torch) -> None:
    cap_mib, stats_dir = _settings()
    torch.cuda._lazy_call(lambda: _at_cuda_init(torch, cap_mib, stats_dir))


class _TorchHook:
    """A meta-path finder that lets ``torch`` import as usual, then queues _at_cuda_init."""

    def find_spec(self, name, path=None, target=None):
        if name != "torch":
            return None
        import importlib.machinery

        sys.meta_path.remove(self)
        spec = importlib.machinery.PathFinder.find_spec(name, path)
        if spec is None or spec.loader is None:
            return spec
        loader = spec.loader
        exec_module = loader.exec_module

        def exec_and_hook(module):
            exec_module(module)
            try:
                _after_torch(module)
            except Exception as e:  # noqa: BLE001
                print(f"onecard-torch-mem: hook failed: {e!r}", file=sys.stderr, flush=True)
        loader.exec_module = exec_and_hook
        return spec


def install() -> bool:
    """True when a cap or a stats directory is asked for (the hook is then in place)."""
    cap_mib, stats_dir = _settings()
    if cap_mib is None and stats_dir is None:
        return False
    if "torch" in sys.modules:
        _after_torch(sys.modules["torch"])
    else:
        sys.meta_path.insert(0, _TorchHook())
    return True
