"""The DreamBooth paper's evaluation prompts (Ruiz et al. 2023, the dataset's prompt lists).

25 prompts for objects and 25 for live subjects (animals), each templated with the rare-token
identifier and the class noun ("a sks dog in the jungle"). The paper generates 4 images per
prompt (`evaluate.images_per_prompt`) and scores them against the instance images. The first ten
recontextualisation prompts are shared; objects then get more backgrounds, live subjects get
accessories and outfits; the last five (property changes) are shared again.
"""
from __future__ import annotations

_SHARED_CONTEXT = [
    "a {identifier} {class_name} in the jungle",
    "a {identifier} {class_name} in the snow",
    "a {identifier} {class_name} on the beach",
    "a {identifier} {class_name} on a cobblestone street",
    "a {identifier} {class_name} on top of pink fabric",
    "a {identifier} {class_name} on top of a wooden floor",
    "a {identifier} {class_name} with a city in the background",
    "a {identifier} {class_name} with a mountain in the background",
    "a {identifier} {class_name} with a blue house in the background",
    "a {identifier} {class_name} on top of a purple rug in a forest",
]
_SHARED_PROPERTY = [
    "a red {identifier} {class_name}",
    "a purple {identifier} {class_name}",
    "a shiny {identifier} {class_name}",
    "a wet {identifier} {class_name}",
    "a cube shaped {identifier} {class_name}",
]

OBJECT_PROMPTS = _SHARED_CONTEXT + [
    "a {identifier} {class_name} with a wheat field in the background",
    "a {identifier} {class_name} with a tree and autumn leaves in the background",
    "a {identifier} {class_name} with the Eiffel Tower in the background",
    "a {identifier} {class_name} floating on top of water",
    "a {identifier} {class_name} floating in an ocean of milk",
    "a {identifier} {class_name} on top of green grass with sunflowers around it",
    "a {identifier} {class_name} on top of a mirror",
    "a {identifier} {class_name} on top of the sidewalk in a crowded street",
    "a {identifier} {class_name} on top of a dirt road",
    "a {identifier} {class_name} on top of a white rug",
] + _SHARED_PROPERTY

LIVE_PROMPTS = _SHARED_CONTEXT + [
    "a {identifier} {class_name} wearing a red hat",
    "a {identifier} {class_name} wearing a santa hat",
    "a {identifier} {class_name} wearing a rainbow scarf",
    "a {identifier} {class_name} wearing a black top hat and a monocle",
    "a {identifier} {class_name} in a chef outfit",
    "a {identifier} {class_name} in a firefighter outfit",
    "a {identifier} {class_name} in a police outfit",
    "a {identifier} {class_name} wearing pink glasses",
    "a {identifier} {class_name} wearing a yellow shirt",
    "a {identifier} {class_name} in a purple wizard outfit",
] + _SHARED_PROPERTY

PROMPT_SETS = {"object": OBJECT_PROMPTS, "live": LIVE_PROMPTS}


def prompt_templates(prompt_set: str, custom: list[str], limit: int | None = None) -> list[str]:
    """The templates of `prompt_set` ('object', 'live' or 'custom': `custom`), first `limit`."""
    templates = list(custom) if prompt_set == "custom" else list(PROMPT_SETS[prompt_set])
    return templates[:limit] if limit else templates
