"""LoRA with peft (LoRA, DoRA, LoKr, LoHa) on the denoiser's attention projections (and the text
encoders' with train_text_encoder), over a frozen, possibly quantized base; adapter files."""
from tasks.common.adapters import DIFFUSERS_FORMAT
from tasks.train.method_specs.base import MethodSpec

SPEC = MethodSpec(
    name="lora",
    trains="adapters",
    output="adapters",
    trainer="tasks.train.methods.lora:LoRA",
    options=("rank", "lora_alpha", "fuse_lora", "lora_type", "lora_dropout", "decompose_factor", "lora_format"),
    option_rules={
        # peft_config builds peft's LoraConfig, the one with a dropout, for these types only
        "lora_dropout": (lambda c: c.method == SPEC.name and c.lora_type in DIFFUSERS_FORMAT,
                         "only method: lora with lora_type lora or dora has LoRA's dropout (peft's LoKr and LoHa "
                         "do not)"),
        "decompose_factor": (lambda c: c.method == SPEC.name and c.lora_type == "lokr",
                             "only method: lora with lora_type: lokr has a Kronecker factor"),
    },
)
