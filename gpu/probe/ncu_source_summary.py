"""Summarize an Nsight Compute source-page export (SASS, CSV) of one kernel launch.

  ncu ... --section SourceCounters --section WarpStateStats --page source --print-source sass \
      --csv python3 ... > src.csv
  python3 gpu/probe/ncu_source_summary.py src.csv [--top 25] [> summary.txt]

Prints: the warp-stall samples by reason (share of all samples), the instructions with the most
excess shared-memory wavefronts (bank conflicts: wavefronts vs the ideal count), and the
instructions with the most stall samples with their two largest reasons. The CSV is large (~1 MB);
the summary is what gpu/lib/ncu_probe.sh brings back.
"""
from __future__ import annotations

import argparse
import csv
import io
import sys


def _num(x: str) -> float:
    try:
        return float(x.replace(",", ""))
    except ValueError:
        return 0.0


def load(path: str) -> tuple[list[str], list[dict]]:
    text = open(path, encoding="utf-8", errors="replace").read()
    start = text.find('"Kernel Name"')
    if start < 0:
        raise SystemExit(f"{path}: no ncu source-page CSV in it (no \"Kernel Name\" line)")
    lines = text[start:].splitlines()[1:]  # the kernel-name line, then the header
    rows = list(csv.reader(io.StringIO("\n".join(lines))))
    hdr = rows[0]
    return hdr, [dict(zip(hdr, r)) for r in rows[1:] if len(r) == len(hdr)]


def summarize(path: str, top: int = 25) -> str:
    hdr, data = load(path)
    out = []
    stalls = [h for h in hdr if h.startswith("stall_") and "Not Issued" not in h]
    tot = {s: sum(_num(d[s]) for d in data) for s in stalls}
    total = sum(tot.values()) or 1.0
    out.append(f"warp-stall samples: {total:.0f}")
    for s, v in sorted(tot.items(), key=lambda x: -x[1])[:10]:
        out.append(f"  {s:25s} {v:10.0f} {100 * v / total:5.1f}%")
    key_ex, key_wf, key_id = ("L1 Wavefronts Shared Excessive", "L1 Wavefronts Shared",
                              "L1 Wavefronts Shared Ideal")
    if key_ex in hdr:
        ex = sorted(((_num(d[key_ex]), _num(d[key_wf]), _num(d[key_id]), d["Source"].strip())
                     for d in data), key=lambda x: -x[0])
        out.append(f"shared wavefronts: {sum(e[1] for e in ex):.0f}, excess "
                   f"{sum(e[0] for e in ex):.0f}; top instructions (excess / all / ideal):")
        out += [f"  {e[0]:10.0f} {e[1]:10.0f} {e[2]:10.0f}  {e[3][:72]}" for e in ex[:top] if e[0] > 0]
    st = sorted(((_num(d["Warp Stall Sampling (All Samples)"]), d["Source"].strip(),
                  sorted(((s, _num(d[s])) for s in stalls), key=lambda x: -x[1])[:2])
                 for d in data), key=lambda x: -x[0])
    out.append("top stalled instructions (samples, reasons):")
    out += [f"  {s[0]:7.0f}  {s[1][:60]:60s} "
            + ", ".join(f"{k[6:]} {v:.0f}" for k, v in s[2]) for s in st[:top]]
    return "\n".join(out)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("csv")
    ap.add_argument("--top", type=int, default=25)
    a = ap.parse_args(argv)
    print(summarize(a.csv, a.top))
    return 0


if __name__ == "__main__":
    sys.exit(main())
