"""DreamBooth (Ruiz et al. 2022): the denoiser (and text encoders with train_text_encoder) on a few
subject images with a unique identifier, plus prior preservation on class images; a full pipeline."""
from tasks.train.method_specs.base import MethodSpec

SPEC = MethodSpec(
    name="dreambooth",
    trains="weights",
    output="pipeline",
    trainer="tasks.train.methods.dreambooth:DreamBooth",
)
