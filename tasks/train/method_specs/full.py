"""Full fine-tune on a captioned dataset (diffusers' train_text_to_image.py): every denoiser weight on
each image's own caption; a full pipeline."""
from tasks.train.method_specs.base import MethodSpec

SPEC = MethodSpec(
    name="full",
    trains="weights",
    output="pipeline",
    trainer="tasks.train.methods.full:FullFineTune",
    default_caption_column="text",
)
