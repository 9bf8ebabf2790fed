"""KVarN: a 4/2-bit paged KV cache (issue 9). See kvarn/README.md.

``format`` is pure Python (the memory model imports it without torch); ``reference`` is the
torch (float64-capable) reference; ``kernels`` holds the Triton kernels. This package imports
nothing at import time so that ``onecard.kvarn.format`` stays torch-free, and it uses only
relative imports so that kvarn/install.sh can copy the folder into vLLM unchanged.
"""
