"""Triton kernels with plain-torch references (see reference.py)."""
