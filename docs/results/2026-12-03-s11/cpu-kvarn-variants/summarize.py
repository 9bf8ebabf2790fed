import json, math, sys
D = __import__("os").path.dirname(__import__("os").path.abspath(__file__)) + "/"
rows, cost = {}, {}
for f in ("variants.json", "extras.json"):
    try: r = json.load(open(D + f))
    except FileNotFoundError: continue
    for x in r["rows"]:
        rows.setdefault(x["config"], {})[x["text"]] = ((x["tokens"] - 1) * x["nll"]["all"], x["tokens"] - 1)
    for c in r.get("window_cost", []): cost[c["config"]] = c
none = rows["none"]
out = {}
for cfg, t in rows.items():
    d = {k: 100 * (math.exp((t[k][0] - none[k][0]) / t[k][1]) - 1) for k in t}
    S = sum(t[k][0] - none[k][0] for k in t); N = sum(t[k][1] for k in t)
    d["pooled"] = 100 * (math.exp(S / N) - 1)
    c = cost.get(cfg)
    print(f"{cfg:34s} README {d['doc-README']:+.3f}  wv {d['doc-wide-verify']:+.3f}  pooled {d['pooled']:+.3f}  "
          + (f"tiles+{c['extra_tiles_per_seq']} {c['extra_bytes_per_seq']/2**20:.0f}MiB/seq outside {c['extra_outside_pin']/2**20:.0f}MiB pool {c['pool_tokens_base']}->{c['pool_tokens']} card {c['card_total_pin_kept']/2**30:.2f}" if c else ""))
    out[cfg] = {"delta_pct": d, "cost": c}
json.dump(out, open(D + "summary.json", "w"), indent=1)
