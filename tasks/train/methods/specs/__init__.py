"""The built-in methods' specs, one module each (no torch); tasks/train/methods/spec.py registers
them in this order (the order they are documented in)."""
from tasks.train.methods.specs import dreambooth, full, lora, textual_inversion

BUILTIN = (dreambooth.SPEC, textual_inversion.SPEC, lora.SPEC, full.SPEC)
