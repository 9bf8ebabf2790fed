"""DFlash2 block speculation, the parts that need no GPU and no vLLM (docs/dflash2.md).

- ``config``: parse and validate a DFlash/DFlash2 drafter ``config.json`` (one-line errors);
- ``drafter``: the drafter forward in plain torch (reference; float64-testable);
- ``select``: per-position top-k candidates and the DFlash2 selector walk, greedy and sampled;
- ``lookup``: the lookup lane (suffix match over prompt + generated ids, bounded cost);
- ``rejection``: a torch re-statement of vLLM 0.27.1's rejection-sampling rule (tests, docs);
- ``tiny_drafter``: a tiny DFlash2-format drafter for the tiny Qwen3.5 test model.

Nothing here imports vllm; the vLLM wiring lives in the patch series (see docs/dflash2.md).
"""
