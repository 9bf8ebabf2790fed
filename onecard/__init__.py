"""onecard: a patched-vLLM serving distribution for Qwen3.8-27B on one 24 GB GPU."""

__version__ = "0.1.0"

#: The one vLLM release the patch series is written against.
VLLM_PIN = "0.27.1"
