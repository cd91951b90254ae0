"""A training method written as one module and nothing else: BitFit (Ben Zaken et al. 2021), the
denoiser's bias terms only, saved as a full pipeline. Its spec and its trainer are both here; it is
registered at test time (`spec.register(SPEC)`), and no other file of the project knows it."""
from __future__ import annotations

from tasks.train.method_specs import MethodSpec
from tasks.train.methods.base import TrainingMethod


class BitFit(TrainingMethod):
    name = "bitfit"

    def configure(self) -> None:
        """Freeze everything, then train the denoiser's biases alone."""
        for module in self.components.modules.values():
            module.requires_grad_(False)
            module.eval()
        denoiser = self.components.denoiser
        for name, param in denoiser.named_parameters():
            param.requires_grad_(name.endswith(".bias"))
        denoiser.train()


SPEC = MethodSpec(name="bitfit", trains="weights", output="pipeline", trainer=BitFit)
