"""Replayed forward calls (numba_kernels/replay.py) against whole ones, bitwise, on a GPU.

    python scripts/dev/replay_check.py

For each case: a first call records its layout, a second call with new inputs of that layout
replays it, then the records are dropped and a third call with the second's inputs takes the
whole path; the second and third results must be bitwise equal, and the second must have
been replayed (strided inputs: must not have been). Prints one line a case and exits 1 on any
failure.
"""
import os
import sys

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", ".."))
from numba_kernels import api, replay  # noqa: E402

# (name, B, Hq, Hk, Nq, Nk, D, Dv, dtype, options, replayed)
CASES = [
    ("bf16 causal", 2, 4, 4, 200, 200, 128, 128, torch.bfloat16, dict(causal="top_left"), True),
    ("bf16 full lse", 1, 3, 3, 65, 129, 128, 128, torch.bfloat16, dict(return_lse=True), True),
    ("bf16 gqa window", 2, 8, 2, 97, 300, 64, 64, torch.bfloat16,
     dict(window=(40, 3), causal="bottom_right", scale=0.3), True),
    ("bf16 decode (split-KV)", 4, 8, 8, 1, 4096, 128, 128, torch.bfloat16, {}, True),
    ("fp32 simt", 2, 2, 2, 70, 70, 64, 64, torch.float32, dict(causal="top_left"), True),
    ("bf16 strided q", 1, 2, 2, 64, 64, 64, 64, torch.bfloat16, dict(strided=True), False),
    ("bf16 q is k", 1, 2, 2, 64, 64, 64, 64, torch.bfloat16, dict(same=True), True),
]


def inputs(b, hq, hk, nq, nk, d, dv, dtype, strided=False, same=False):
    q = torch.randn(b, hq, nq, d, device="cuda", dtype=dtype)
    if strided:
        q = torch.randn(b, nq, hq, d, device="cuda", dtype=dtype).transpose(1, 2)
    k = q if same else torch.randn(b, hk, nk, d, device="cuda", dtype=dtype)
    return q, k, torch.randn(b, hk, nk, dv, device="cuda", dtype=dtype)


def check(name, b, hq, hk, nq, nk, d, dv, dtype, options, replayed):
    layout = {x: options.pop(x) for x in ("strided", "same") if x in options}
    api.flash_attention(*inputs(b, hq, hk, nq, nk, d, dv, dtype, **layout), **options)
    second = inputs(b, hq, hk, nq, nk, d, dv, dtype, **layout)
    before = replay.REPLAYED[0]
    got = api.flash_attention(*second, **options)
    did = replay.REPLAYED[0] - before
    replay._CALLS.clear()
    want = api.flash_attention(*second, **options)
    got, want = (got, want) if isinstance(got, tuple) else ((got,), (want,))
    equal = all(torch.equal(g, w) for g, w in zip(got, want)) and len(got) == len(want)
    ok = equal and did == int(replayed)
    print(f"{'ok  ' if ok else 'FAIL'} {name:26s} replayed={did} bitwise equal={equal}",
          flush=True)
    return ok


def main():
    torch.cuda.synchronize()
    results = [check(*case) for case in CASES]
    stream = torch.cuda.Stream()
    with torch.cuda.stream(stream):  # another stream: another layout, recorded there
        results.append(check(*CASES[0][:9], dict(causal="top_left"), True))
    stream.synchronize()
    print(f"{sum(results)}/{len(results)} cases ok")
    return 0 if all(results) else 1


if __name__ == "__main__":
    sys.exit(main())
