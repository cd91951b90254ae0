"""The UNet's costliest attention alone, forward and backward, against what might replace SDPA's kernel.

    .venv/bin/python -m benchmarks.train.attention                       # SD 1.5's 64x64 level at 512 px
    .venv/bin/python -m benchmarks.train.attention --shape 1 8 1024 80   # its 32x32 level

Variants (bf16, one self-attention of shape batch x heads x tokens x head dim):
- `flash`: `scaled_dot_product_attention` as the UNet calls it (PyTorch's CPU flash kernel);
- `pad16`, `pad32`: the head dim zero-padded to a multiple of 16 or 32 (40 to 48 or 64; the same
  result, wider GEMMs);
- `chunked`: attention built from bf16 batched matmuls over blocks of queries, softmax in fp32, the
  backward recomputing each block's probabilities from the saved log-sum-exp (what the flash kernel
  does, with oneDNN's GEMMs instead of its own blocks).

Each round times every variant `--reps` times (after one untimed call) and keeps the median;
rounds alternate the variants, so a drift of the machine's speed reaches all of them alike.
"""
from __future__ import annotations

import argparse
import math
import statistics
import time

import torch
import torch.nn.functional as F


class ChunkedAttention(torch.autograd.Function):
    """softmax(q k^T / sqrt(d)) v over blocks of `chunk` queries; saves q, k, v, the output and the
    log-sum-exp of each row, not the probabilities."""

    @staticmethod
    def forward(ctx, q, k, v, chunk: int):
        scale = 1 / math.sqrt(q.shape[-1])
        out, lse = torch.empty_like(q), torch.empty(q.shape[:-1], dtype=torch.float32)
        for s in range(0, q.shape[-2], chunk):
            scores = torch.matmul(q[..., s:s + chunk, :], k.transpose(-1, -2)).float().mul_(scale)
            rows = torch.logsumexp(scores, -1, keepdim=True)
            out[..., s:s + chunk, :] = torch.matmul(scores.sub_(rows).exp_().to(q.dtype), v)
            lse[..., s:s + chunk] = rows.squeeze(-1)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.chunk, ctx.scale = chunk, scale
        return out

    @staticmethod
    def backward(ctx, grad_out):
        q, k, v, out, lse = ctx.saved_tensors
        grad_out = grad_out.contiguous()
        grad_q = torch.empty_like(q)
        grad_k, grad_v = torch.zeros(k.shape), torch.zeros(v.shape)
        delta = (grad_out.float() * out.float()).sum(-1, keepdim=True)
        for s in range(0, q.shape[-2], ctx.chunk):
            rows = slice(s, s + ctx.chunk)
            scores = torch.matmul(q[..., rows, :], k.transpose(-1, -2)).float().mul_(ctx.scale)
            probs = scores.sub_(lse[..., rows, None]).exp_()
            g = grad_out[..., rows, :]
            grad_v += torch.matmul(probs.to(q.dtype).transpose(-1, -2), g).float()
            grad_p = torch.matmul(g, v.transpose(-1, -2)).float()
            grad_s = probs.mul_(grad_p.sub_(delta[..., rows, :])).mul_(ctx.scale).to(q.dtype)
            grad_q[..., rows, :] = torch.matmul(grad_s, k)
            grad_k += torch.matmul(grad_s.transpose(-1, -2), q[..., rows, :]).float()
        return grad_q, grad_k.to(k.dtype), grad_v.to(v.dtype), None


def padded(multiple: int):
    def attend(q, k, v):
        d = q.shape[-1]
        pad = [F.pad(t, (0, -d % multiple)) for t in (q, k, v)]
        return F.scaled_dot_product_attention(*pad, scale=1 / math.sqrt(d))[..., :d]
    return attend


VARIANTS = {
    "flash": F.scaled_dot_product_attention,
    "pad16": padded(16),
    "pad32": padded(32),
    "chunked": lambda q, k, v: ChunkedAttention.apply(q, k, v, 256),
}


def timed(attend, shape: list[int], reps: int) -> tuple[float, float]:
    """Median forward and backward seconds over `reps` calls, after one untimed call."""
    fwd, bwd = [], []
    for _ in range(reps + 1):
        q, k, v = (torch.randn(shape, dtype=torch.bfloat16, requires_grad=True) for _ in range(3))
        start = time.perf_counter()
        out = attend(q, k, v)
        mid = time.perf_counter()
        out.backward(torch.ones_like(out))
        fwd.append(mid - start)
        bwd.append(time.perf_counter() - mid)
    return statistics.median(fwd[1:]), statistics.median(bwd[1:])


def agree(shape: list[int]) -> float:
    """Largest relative difference of the chunked variant's gradients from SDPA's."""
    q, k, v = (torch.randn(shape, dtype=torch.bfloat16, requires_grad=True) for _ in range(3))
    grad = torch.randn(shape, dtype=torch.bfloat16)
    reference = torch.autograd.grad(F.scaled_dot_product_attention(q, k, v), (q, k, v), grad)
    chunked = torch.autograd.grad(VARIANTS["chunked"](q, k, v), (q, k, v), grad)
    return max(((a - b).abs().max() / a.abs().max()).item() for a, b in zip(reference, chunked))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shape", type=int, nargs=4, default=[1, 8, 4096, 40])
    parser.add_argument("--variants", nargs="+", choices=list(VARIANTS), default=list(VARIANTS))
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--reps", type=int, default=5)
    args = parser.parse_args()
    torch.manual_seed(0)
    print(f"shape {args.shape}, bf16, {torch.get_num_threads()} threads; chunked gradients differ from SDPA's "
          f"by at most {agree(args.shape):.3f} (relative to the largest)")
    totals: dict[str, list[float]] = {name: [] for name in args.variants}
    for round_ in range(args.rounds):
        for name in args.variants:
            fwd, bwd = timed(VARIANTS[name], args.shape, args.reps)
            totals[name].append(fwd + bwd)
            print(f"round {round_} {name:8s} forward {fwd:.3f} s, backward {bwd:.3f} s, together {fwd + bwd:.3f} s")
    for name, seconds in totals.items():
        print(f"{name:8s} forward + backward: median {statistics.median(seconds):.3f} s "
              f"({', '.join(f'{s:.3f}' for s in seconds)})")


if __name__ == "__main__":
    main()
