"""AdamW over bf16 weights with stochastic rounding (`train.full_bf16`), as kohya's `--full_bf16`,
OneTrainer's bf16 weights and SimpleTuner's `adamw_bf16` train.

The denoiser's weights and gradients stay in bf16: no float32 copy of the weights for autocast to
cast from every step, no float32 gradients, half the weights' memory. The moments stay in float32
and the update is computed in float32; writing it back to bf16 by rounding to nearest would drop
every update smaller than half a bf16 step (at a learning rate of 5e-6, nearly all of them), so it
is rounded stochastically: up with probability equal to the remainder's share of the step, which
makes the rounded weight equal the float32 one on average.

The random bits are a counter-based hash of (element index, step, tensor index), not a random
generator's stream: the same step rounds the same way after a resume (exact resume needs no RNG
state of its own), and torch.compile fuses the hash, the AdamW update and the rounding into one
pass over each tensor (about the cost of torch's fused float32 AdamW; eager PyTorch needs a dozen
passes and torch.randint alone costs more than the whole fused update). torch.compile needs a C++
compiler: without one, `full_bf16: true` is an error naming the fix and `null` stays off.
"""
from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from tasks.common.errors import UserError


def _hash_bits(index: torch.Tensor, salt: torch.Tensor) -> torch.Tensor:
    """16 pseudo-random bits per element from its index and a per-step salt: an integer hash in
    int32 (multiplications wrap; a finaliser of the murmur3 kind), which torch.compile vectorises."""
    x = index + salt
    x = x ^ (x >> 15)
    x = x * 0x2C1B3C6D
    x = x ^ (x >> 12)
    x = x * 0x297A2D39
    x = x ^ (x >> 15)
    return x & 0xFFFF


def adamw_sr_update(p: torch.Tensor, g: torch.Tensor, m: torch.Tensor, v: torch.Tensor, hyper: torch.Tensor,
                    salt: torch.Tensor) -> None:
    """One AdamW step on flat tensors: `p`, `g` bf16; `m`, `v` float32 (updated in place); `hyper` =
    [lr, beta1, beta2, eps, weight_decay, bias_correction1, bias_correction2]; `salt`: int32 scalar."""
    lr, beta1, beta2, eps, wd, bc1, bc2 = hyper.unbind()
    g32 = g.float()
    m.lerp_(g32, 1 - beta1)
    v.mul_(beta2).addcmul_(g32, g32, value=1 - beta2)
    update = p.float() * (1 - lr * wd) - (lr / bc1) * m / ((v / bc2).sqrt() + eps)
    noise = _hash_bits(torch.arange(p.numel(), device=p.device, dtype=torch.int32), salt)
    # float32 bits (sign and magnitude) plus 16 uniform bits carry into bf16's last bit with the
    # probability of the remainder's share; cutting the low 16 bits then rounds, in either sign
    # (finite weights: the sum stays inside int32)
    p.copy_(((update.view(torch.int32) + noise) & -65536).view(torch.float32))


class StochasticAdamW(torch.optim.Optimizer):
    """AdamW for bf16 parameters: float32 moments, float32 update, stochastic rounding into the weights.

    State keys as torch's AdamW (`step`, `exp_avg`, `exp_avg_sq`), so checkpoints save and load it alike."""

    def __init__(self, params: Any, lr: float = 1e-3, betas: tuple[float, float] = (0.9, 0.999), eps: float = 1e-8,
                 weight_decay: float = 1e-2, fused: bool = True) -> None:
        super().__init__(params, dict(lr=lr, betas=betas, eps=eps, weight_decay=weight_decay))
        self._update: Callable[..., None] = _compiled() if fused else adamw_sr_update

    @torch.no_grad()
    def step(self, closure: Callable[[], float] | None = None) -> float | None:  # type: ignore[override]
        loss = closure() if closure is not None else None
        for group_index, group in enumerate(self.param_groups):
            beta1, beta2 = group["betas"]
            for index, p in enumerate(group["params"]):
                if p.grad is None:
                    continue
                if p.dtype != torch.bfloat16:
                    raise TypeError(f"StochasticAdamW trains bf16 parameters, got {p.dtype}")
                state = self.state[p]
                if not state:
                    state["step"] = torch.tensor(0.0)
                    state["exp_avg"] = torch.zeros_like(p, dtype=torch.float32)
                    state["exp_avg_sq"] = torch.zeros_like(p, dtype=torch.float32)
                state["step"] += 1
                step = int(state["step"])
                hyper = torch.tensor([group["lr"], beta1, beta2, group["eps"], group["weight_decay"],
                                      1 - beta1 ** step, 1 - beta2 ** step], dtype=torch.float32)
                salt = torch.tensor((step * 40503 + group_index * 7919 + index * 104729) % 2**31, dtype=torch.int32)
                flat = _Flat(p)
                self._update(flat.view(p), flat.read(p.grad), flat.view(state["exp_avg"]),
                             flat.view(state["exp_avg_sq"]), hyper.to(p.device), salt.to(p.device))
        return loss

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """As torch's, but the moments stay float32: torch casts every state tensor to its parameter's
        dtype (bf16 here), which would round the moments on every resume."""
        moments = {pid: {k: v for k, v in s.items() if k in _MOMENTS} for pid, s in state_dict["state"].items()}
        rest = {pid: {k: v for k, v in s.items() if k not in _MOMENTS} for pid, s in state_dict["state"].items()}
        super().load_state_dict({**state_dict, "state": rest})
        ids = [pid for g in state_dict["param_groups"] for pid in g["params"]]
        params = dict(zip(ids, [p for g in self.param_groups for p in g["params"]], strict=True))
        for pid, values in moments.items():
            p = params[pid]  # in the parameter's layout (channels_last too), as step() reads them
            self.state[p].update({k: torch.empty_like(p, dtype=torch.float32).copy_(v) for k, v in values.items()})


class _Flat:
    """One parameter's elements as a flat tensor in memory order, whatever its layout (channels_last:
    a permuted view is contiguous); its moments share the layout (empty_like), its gradient may not."""

    def __init__(self, p: torch.Tensor) -> None:
        self.order = sorted(range(p.dim()), key=lambda d: (-p.stride(d), d))

    def view(self, t: torch.Tensor) -> torch.Tensor:
        moved = t.permute(self.order)
        if not moved.is_contiguous():
            raise TypeError("StochasticAdamW needs dense parameters and moments in the parameter's layout")
        return moved.view(-1)

    def read(self, t: torch.Tensor) -> torch.Tensor:
        moved = t.permute(self.order)
        return moved.view(-1) if moved.is_contiguous() else moved.reshape(-1)


_MOMENTS = ("exp_avg", "exp_avg_sq")
_COMPILED: Callable[..., None] | None = None


def _compiled() -> Callable[..., None]:
    """The update through torch.compile (one fused loop per tensor, any length), built once per
    process on a small tensor. Without it the eager update costs seconds a step over a UNet's
    weights, more than bf16 weights save, so that is an error naming the fix, not a fallback
    (`full_bf16: null` only turns itself on where a compiler is found)."""
    global _COMPILED
    if _COMPILED is None:
        fn = torch.compile(adamw_sr_update, dynamic=True)
        try:
            p = torch.zeros(64, dtype=torch.bfloat16)
            fn(p, p.clone(), torch.zeros(64), torch.zeros(64), torch.tensor([0.0, 0.9, 0.999, 1e-8, 0.0, 0.1, 0.001]),
               torch.tensor(0, dtype=torch.int32))
        except Exception as err:
            raise UserError(f"train.full_bf16: torch.compile cannot build the fused bf16 update here "
                            f"({str(err).splitlines()[0][:200]}). Install a C++ compiler (apt-get install g++), "
                            "or set train.full_bf16: false") from err
        _COMPILED = fn
    return _COMPILED
