"""onecard.bench.config: where a bench looks for the server and its key by default."""
from __future__ import annotations


def test_default_server_is_the_launchers_and_its_key():
    """Without flags a bench talks to ./start_qwen.sh's server (PORT, default 18020) with the
    launcher's VLLM_API_KEY when ONECARD_API_KEY is unset."""
    from onecard.bench.config import api_key_from, default_url

    assert default_url({}) == "http://127.0.0.1:18020"
    assert default_url({"PORT": "9001"}) == "http://127.0.0.1:9001"
    assert default_url({"ONECARD_BENCH_URL": "http://h:1", "PORT": "9001"}) == "http://h:1"
    assert api_key_from("ONECARD_API_KEY", {"VLLM_API_KEY": " k1 "}) == "k1"
    assert api_key_from("ONECARD_API_KEY", {"ONECARD_API_KEY": "k2", "VLLM_API_KEY": "k1"}) == "k2"
    assert api_key_from("MY_KEY", {"VLLM_API_KEY": "k1"}) is None
    assert api_key_from(None, {"VLLM_API_KEY": "k1"}) is None
