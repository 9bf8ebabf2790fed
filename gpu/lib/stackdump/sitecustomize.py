"""GPU jobs only (gpu/run.sh puts this directory first on PYTHONPATH): SIGUSR2 makes any Python
process of a job (vLLM's API server, its engine core, compile workers) write every thread's
stack to its stderr - the server log - and carry on. A driver sends it to a server's process
group when a request is slow (tests/gpu/test_dflash2.py ``Server.dump_stacks``), so a stall
says where it is instead of only that it happened.

Python imports one ``sitecustomize``: after registering, this one runs the next
``sitecustomize.py`` found on sys.path (e.g. tests/gpu/fp32_shim's or the distribution's), so
nothing that relied on it is lost. ONECARD_STACK_SIGNAL=0 turns the handler off.
ONECARD_HOST_TIMING=1 also installs onecard_host_timing (per-step host timing of vLLM's runner).
ONECARD_TORCH_CAP_MIB / ONECARD_TORCH_STATS_DIR install onecard_torch_mem (the torch caching
allocator capped and watched: job 41's FIT_TORCH_CAP).
"""
import os
import sys


def _register() -> None:
    if os.environ.get("ONECARD_STACK_SIGNAL", "1") == "0":
        return
    import faulthandler
    import signal

    try:
        faulthandler.register(signal.SIGUSR2, file=sys.stderr, all_threads=True, chain=False)
    except (AttributeError, ValueError, RuntimeError, OSError):
        pass  # no SIGUSR2 here, or no usable stderr: run without the handler


def _chain() -> None:
    """Run the sitecustomize found after this directory on sys.path (only after it: a shim placed
    before this one chains here itself, and chaining back to it would loop)."""
    import importlib.machinery
    import importlib.util

    here = os.path.dirname(os.path.abspath(__file__))
    paths = [os.path.abspath(p or os.curdir) for p in sys.path]
    if here not in paths:
        return
    rest = sys.path[paths.index(here) + 1:]
    spec = importlib.machinery.PathFinder.find_spec("sitecustomize", rest)
    if spec is not None and spec.loader is not None:
        try:
            spec.loader.exec_module(importlib.util.module_from_spec(spec))
        except Exception as e:  # noqa: BLE001 - a broken shadowed hook must not stop the job
            print(f"onecard-stackdump: shadowed sitecustomize {spec.origin} raised {e!r}",
                  file=sys.stderr, flush=True)


def _host_timing() -> None:
    """ONECARD_HOST_TIMING=1: per-step host timing of vLLM's runner (onecard_host_timing.py)."""
    if os.environ.get("ONECARD_HOST_TIMING", "0") != "1":
        return
    try:
        import onecard_host_timing

        onecard_host_timing.install()
    except Exception as e:  # noqa: BLE001 - a probe must never stop a job
        print(f"onecard-stackdump: host timing not installed: {e!r}", file=sys.stderr, flush=True)


def _torch_mem() -> None:
    """ONECARD_TORCH_CAP_MIB / ONECARD_TORCH_STATS_DIR: onecard_torch_mem.py."""
    if not (os.environ.get("ONECARD_TORCH_CAP_MIB") or os.environ.get("ONECARD_TORCH_STATS_DIR")):
        return
    try:
        import onecard_torch_mem

        onecard_torch_mem.install()
    except Exception as e:  # noqa: BLE001 - a probe must never stop a job
        print(f"onecard-stackdump: torch memory hook not installed: {e!r}", file=sys.stderr, flush=True)


_register()
_host_timing()
_torch_mem()
_chain()
