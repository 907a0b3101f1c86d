"""The smallest reproducers of what verify found in FlexAttention
(torch.nn.attention.flex_attention, compiled) on the GPU, each printed with what it shows.
Needs torch with CUDA.

    python docs/findings/flex_repro.py

1. A NaN in V at a key that a block mask hides reaches rows that do not see it (the rows of
   the key's whole 128-row query block), as in PyTorch's SDPA backends: a convention.
2. The backward once q and k are large: gradients against float64 truth from torch's math
   backend on the CPU, with q and k times 2^e (one head, 40 query rows, 48 keys, D = 16).
"""
import torch
import torch.nn.functional as F
from torch.nn.attention.flex_attention import create_block_mask, flex_attention

torch.manual_seed(0)
FLEX = torch.compile(flex_attention)


def causal(b, h, q_idx, kv_idx):
    return q_idx >= kv_idx


def hidden_nan_in_values():
    """Causal block mask; V NaN at one key: which rows come back NaN."""
    for n, at in ((4, 3), (256, 200)):
        q, k, v = (torch.randn(1, 1, n, 16, device="cuda") for _ in range(3))
        v[0, 0, at] = float("nan")
        blocks = create_block_mask(causal, None, None, n, n, device="cuda")
        out = FLEX(q, k, v, block_mask=blocks)
        rows = out[0, 0].isnan().any(-1).nonzero().flatten().tolist()
        print(f"  N = {n}, v[{at}] NaN: rows that see key {at}: {at}..{n - 1}; NaN rows: "
              f"{rows[0] if rows else '-'}..{rows[-1] if rows else '-'} ({len(rows)} rows)")


def truth(q, k, v, dout):
    """float64 output and gradients from the math backend on the CPU."""
    xs = [x.detach().cpu().double().requires_grad_(True) for x in (q, k, v)]
    out = F.scaled_dot_product_attention(*xs)
    return [out] + list(torch.autograd.grad(out, xs, dout.cpu().double()))


def backward_large_scores():
    print(f"  {'dtype':9s} {'e':>3s} {'max |dq| truth':>15s} {'max |dq| err':>13s} "
          f"{'max |dv| truth':>15s} {'max |dv| err':>13s} {'non-finite':>10s}")
    for dtype in (torch.float32, torch.bfloat16):
        for e in (8, 16, 24, 32, 40, 52):
            q, k, v, dout = (torch.randn(1, 1, n, 16, device="cuda") for n in (40, 48, 48, 40))
            q, k = q * 2.0**e, k * 2.0**e
            xs = [x.to(dtype).requires_grad_(True) for x in (q, k, v)]
            out = FLEX(*xs)
            got = [out] + list(torch.autograd.grad(out, xs, dout.to(dtype)))
            want = truth(*xs, dout.to(dtype))
            bad = sum(int((~g.isfinite()).sum()) for g in got)
            err = [(g.cpu().double() - w).abs().nan_to_num(float("inf")).max().item()
                   for g, w in zip(got, want)]
            print(f"  {str(dtype)[6:]:9s} {e:3d} {want[1].abs().max().item():15.4g} "
                  f"{err[1]:13.4g} {want[3].abs().max().item():15.4g} {err[3]:13.4g} "
                  f"{bad:10d}")


if __name__ == "__main__":
    print(f"torch {torch.__version__}, {torch.cuda.get_device_name()}")
    print("1. NaN in V at a hidden key (forward):")
    hidden_nan_in_values()
    print("2. the backward with q and k times 2^e:")
    backward_large_scores()
