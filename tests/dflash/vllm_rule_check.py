"""Run vLLM 0.27.1's own rejection-sampling kernels (Triton interpreter, CPU) against
onecard.dflash.rejection.rejection_sample on random cases with identical random inputs.

Run as a script with TRITON_INTERPRET=1 (test_vllm_rule.py does); prints "OK <cases>".
vLLM disables its Triton wrapper without a GPU driver, so the kernels are re-jitted here with
the real ``triton.language`` in their globals (the body is vLLM's, unchanged).
"""
from __future__ import annotations

import os
import sys
import types

assert os.environ.get("TRITON_INTERPRET") == "1"

import torch  # noqa: E402
import triton  # noqa: E402
import triton.language as tl  # noqa: E402
from vllm.v1.sample import rejection_sampler as rs  # noqa: E402

from onecard.dflash.rejection import rejection_sample  # noqa: E402


def rejit(fn):
    fn = getattr(fn, "fn", fn)
    g = dict(fn.__globals__)
    g["tl"], g["triton"] = tl, triton
    f = types.FunctionType(fn.__code__, g, fn.__name__, fn.__defaults__, fn.__closure__)
    f.__module__, f.__qualname__ = fn.__module__, fn.__qualname__
    return triton.jit(f)


RANDOM = rejit(rs.rejection_random_sample_kernel)
GREEDY = rejit(rs.rejection_greedy_sample_kernel)
RECOVER = rejit(rs.sample_recovered_tokens_kernel)


def vllm_one(draft, draft_probs, target_probs, bonus, greedy, u, exp_noise):
    """rejection_sample()'s glue for one request, calling vLLM's kernels."""
    k, v = target_probs.shape
    out = torch.full((1, k + 1), -1, dtype=torch.int32)
    cu = torch.tensor([k], dtype=torch.int32)
    d = draft.to(torch.int32).contiguous()
    b = torch.tensor([bonus], dtype=torch.int32)
    if greedy:
        GREEDY[(1,)](out, cu, d, target_probs.argmax(-1), b, torch.tensor([True]), k, None, None,
                     SYNTHETIC_MODE=False)
    else:
        rec = torch.empty_like(d)
        inv_q = exp_noise.reciprocal().view(1, v).to(torch.float32).contiguous()
        RECOVER[(1, k)](rec, cu, d, draft_probs, target_probs, inv_q, v, 8192,
                        NO_DRAFT_PROBS=draft_probs is None, USE_FP64_GUMBEL=False)
        RANDOM[(1,)](out, cu, d, draft_probs, target_probs, b, rec, u.to(torch.float32),
                     torch.tensor([False]), k, v, None, NO_DRAFT_PROBS=draft_probs is None,
                     SYNTHETIC_MODE=False)
    row = out[0].tolist()
    return [t for t in row if t != -1]


def main(n_cases: int) -> int:
    g = torch.Generator().manual_seed(0)
    v = 8
    for case in range(n_cases):
        k = 1 + case % 4
        greedy = case % 5 == 0
        with_q = case % 3 != 0
        target = torch.softmax(2 * torch.randn(k, v, generator=g), -1).contiguous()
        if case % 7 == 3:
            target[0, :4] = 0                        # forbidden tokens
            target = (target / target.sum(-1, keepdim=True)).contiguous()
        q = torch.softmax(2 * torch.randn(k, v, generator=g), -1).contiguous() if with_q else None
        draft = torch.randint(0, v, (k,), generator=g)
        if case % 2:                                 # drafts that often match
            draft = torch.multinomial(target, 1, generator=g).flatten()
        if case % 11 == 4 and k > 1:
            draft[-1] = -1                           # a padded slot
            if q is not None:
                q[-1] = 0
        u = torch.rand(k, generator=g).clamp_min(1e-6)
        e = torch.empty(v).exponential_(generator=g)
        bonus = int(torch.randint(0, v, (1,), generator=g))
        ours = rejection_sample(draft, q, target, bonus, greedy=greedy, uniforms=u, exp_noise=e)
        theirs = vllm_one(draft, q, target, bonus, greedy, u, e)
        if ours != theirs:
            print(f"MISMATCH case {case}: ours {ours} vllm {theirs}")
            return 1
    print(f"OK {n_cases}")
    return 0


if __name__ == "__main__":
    sys.exit(main(int(sys.argv[1]) if len(sys.argv) > 1 else 60))
