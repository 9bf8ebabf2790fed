"""The bandwidth roofline of a decode step: bytes one step must read / measured copy bandwidth.

Bytes per step (no speculation), for N streams each at context L:
  weights   every tensor of the checkpoint (safetensors headers, ``onecard.memory.weight_bytes``)
            except the vision tower (not loaded with ``--language-model-only``), the MTP module
            (not run without speculation) and ``embed_tokens`` (one row per token is gathered);
  KV        N x L x (K+V bytes per token per attention layer) x full-attention layers;
  GDN state N x GDN layers x state page x 2 (read and written back every step).
A verify step with MTP k drafts adds k x (MTP module + lm_head), the drafter's k passes.

Bandwidth: a device-to-device ``copy_`` of ``nbytes`` timed with CUDA events (median of
``reps``), counted as read + write bytes / time: the same figure ``bench/kernel_verify.py``
reports. It is measured in the run, on the run's GPU, before any server boots. Without CUDA it
measures host memory and says so (``device: cpu``); that figure is only good for tests.

Prefill is compute-bound: this roofline does not bound it, so prefill rows carry none.

    python -m onecard.bench.roofline [--bytes N] [--reps R]     prints the measurement as JSON
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path

WEIGHT_SKIP = ("model.visual.", "visual.", "mtp.", "model.language_model.embed_tokens.",
               "model.embed_tokens.")
MTP_PREFIX = ("mtp.",)
LM_HEAD_PREFIX = ("lm_head.",)


def copy_bandwidth(nbytes: int | None = None, reps: int = 20) -> dict:
    """Median device copy bandwidth in GB/s (read + write), on CUDA when present."""
    import torch

    cuda = torch.cuda.is_available()
    dev = torch.device("cuda" if cuda else "cpu")
    n = int(nbytes or (2 * 2**30 if cuda else 64 * 2**20))
    src = torch.empty(n, dtype=torch.uint8, device=dev)
    src.random_(0, 255)
    dst = torch.empty_like(src)
    times = []
    for i in range(reps + 3):
        if cuda:
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            a.record()
            dst.copy_(src)
            b.record()
            b.synchronize()
            ms = a.elapsed_time(b)
        else:
            t = time.perf_counter()
            dst.copy_(src)
            ms = (time.perf_counter() - t) * 1e3
        if i >= 3:  # first copies warm the allocator and clocks
            times.append(ms)
    ms = statistics.median(times)
    name = torch.cuda.get_device_name(0) if cuda else "cpu"
    del src, dst
    if cuda:
        torch.cuda.empty_cache()
    return {"device": "cuda" if cuda else "cpu", "device_name": name, "bytes": n, "reps": reps,
            "median_ms": ms, "gbps_read_plus_write": 2 * n / (ms * 1e-3) / 1e9,
            "method": "torch copy_ of a uint8 buffer, CUDA events, median; GB/s = 2 x bytes / time",
            "torch": torch.__version__}


@dataclass
class StepBytes:
    weights: int  # read by one target forward (no MTP, no vision, no embedding table)
    mtp: int
    lm_head: int
    attn_bytes_per_token: int  # K+V, one token, all full-attention layers
    gdn_state_bytes: int  # all GDN layers, one sequence, read + write

    def decode(self, streams: int, context: int) -> int:
        return self.weights + streams * (context * self.attn_bytes_per_token + self.gdn_state_bytes)

    def verify(self, streams: int, context: int, k: int) -> int:
        """MTP: the target forward plus k sequential drafter passes, each through lm_head."""
        return self.decode(streams, context) + k * (self.mtp + self.lm_head)

    def verify_block(self, streams: int, context: int, drafter: int) -> int:
        """DFlash2: the target forward plus ONE drafter pass over the whole block (its weights as
        the plan holds them, e.g. FP8) and one lm_head GEMM over the block's rows (the target's
        lm_head, read once however many rows). The drafter's own KV reads are left out (5 layers
        of context KV: small at the reference's ~1k verify context)."""
        return self.decode(streams, context) + drafter + self.lm_head

    def as_dict(self) -> dict:
        return asdict(self)


def step_bytes(model_dir: str | Path, kv: str = "bf16") -> StepBytes:
    """Bytes per step from the checkpoint's safetensors headers and config (no tensor read)."""
    from onecard import memory

    total = memory.weight_bytes(model_dir)
    body = memory.weight_bytes(model_dir, skip_prefixes=WEIGHT_SKIP)
    mtp = total - memory.weight_bytes(model_dir, skip_prefixes=MTP_PREFIX)
    lm = total - memory.weight_bytes(model_dir, skip_prefixes=LM_HEAD_PREFIX)
    try:
        g = memory.ModelGeometry.from_model_dir(model_dir)
        attn = memory.attn_bytes_per_token(g, kv) * g.num_full_attention
        gdn = 2 * g.num_gdn * memory.gdn_state_bytes(g)
    except ValueError:  # not a hybrid config: weights only
        attn, gdn = 0, 0
    return StepBytes(weights=body, mtp=mtp, lm_head=lm, attn_bytes_per_token=attn, gdn_state_bytes=gdn)


def tok_s(bytes_per_step: int, gbps: float, tokens_per_step: int = 1) -> float:
    """Tokens per second at the roofline: tokens_per_step per (bytes / bandwidth)."""
    return tokens_per_step * gbps * 1e9 / bytes_per_step


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m onecard.bench.roofline", description=__doc__.splitlines()[0])
    ap.add_argument("--bytes", type=int, default=None, help="copy buffer size (default 2 GiB on CUDA)")
    ap.add_argument("--reps", type=int, default=20)
    a = ap.parse_args(argv)
    if a.reps < 1:
        print("roofline: --reps must be >= 1", file=sys.stderr)
        return 2
    print(json.dumps(copy_bandwidth(a.bytes, a.reps)))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
