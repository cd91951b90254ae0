"""Evaluation encoders: offline built-ins `builtin:tiny-clip` / `builtin:tiny-dino`, or real ones.

The DreamBooth paper measures subject fidelity with DINO ViT-S/16 and CLIP ViT-B/32 image
embeddings and prompt fidelity with CLIP text-image similarity. Online, name the real models
(`openai/clip-vit-base-patch32`, `facebook/dino-vits16`); offline, the built-ins are the same
transformers classes (CLIPModel, ViTModel) at toy sizes with weights drawn from a seed, saved and
loaded through the very `from_pretrained` path the real ones take. Their numbers are only useful
for checking the machinery: a random encoder does not know what a toy is.

A name is one of: `builtin:tiny-clip` / `builtin:tiny-dino`, a local folder saved with
`save_pretrained`, or a hub id (downloaded with huggingface_hub, safetensors preferred).
"""
from __future__ import annotations

import logging
import re
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from tasks.common.errors import UserError

log = logging.getLogger(__name__)

BUILTIN_CLIP = "builtin:tiny-clip"
BUILTIN_DINO = "builtin:tiny-dino"
BUILTIN_ENCODERS = (BUILTIN_CLIP, BUILTIN_DINO)

#: Built-in sizes: 32 px inputs in 8 px patches, 32-wide transformers, 2 layers.
TINY_IMAGE_SIZE = 32
TINY_PATCH = 8
TINY_HIDDEN = 32
TINY_PROJECTION = 32

_HUB_ID = re.compile(r"^[\w.-]+/[\w.-]+$")


@dataclass
class LoadedEncoder:
    """A loaded encoder (eval mode) and what prepares its inputs; embeddings are L2-normalised.

    `kind` is "clip" (image and text embeddings: the projected pooled outputs, as CLIP scores
    them) or "dino" (image embeddings: the last layer's CLS token, as the DINO paper uses it).
    """

    name: str
    kind: str
    model: Any
    image_processor: Any
    tokenizer: Any = None
    batch_size: int = 32

    @property
    def embedding_dim(self) -> int:
        cfg = self.model.config
        return int(cfg.projection_dim if self.kind == "clip" else cfg.hidden_size)

    def embed_images(self, images: list[Any]) -> np.ndarray:
        """(N, D) unit vectors for N PIL images, computed in batches."""
        import torch

        from tasks.common.images import to_rgb

        chunks = []
        for i in range(0, len(images), self.batch_size):
            batch = [to_rgb(im) for im in images[i : i + self.batch_size]]
            pixels = self.image_processor(images=batch, return_tensors="pt")["pixel_values"]
            with torch.inference_mode():
                if self.kind == "clip":
                    emb = self.model.get_image_features(pixel_values=pixels).pooler_output
                else:
                    emb = self.model(pixel_values=pixels).last_hidden_state[:, 0]
            chunks.append(emb.float().numpy())
        return _normalise(np.concatenate(chunks) if chunks else np.zeros((0, self.embedding_dim)))

    def embed_texts(self, texts: list[str]) -> np.ndarray:
        """(N, D) unit vectors for N prompts (CLIP only)."""
        import torch

        if self.kind != "clip":
            raise TypeError(f"{self.name} is an image-only encoder")
        chunks = []
        for i in range(0, len(texts), self.batch_size):
            tokens = self.tokenizer(
                texts[i : i + self.batch_size], padding=True, truncation=True, return_tensors="pt"
            )
            with torch.inference_mode():
                emb = self.model.get_text_features(
                    input_ids=tokens["input_ids"], attention_mask=tokens["attention_mask"]
                ).pooler_output
            chunks.append(emb.float().numpy())
        return _normalise(np.concatenate(chunks) if chunks else np.zeros((0, self.embedding_dim)))


def _normalise(x: np.ndarray) -> np.ndarray:
    norm = np.linalg.norm(x, axis=1, keepdims=True)
    return (x / np.where(norm == 0, 1.0, norm)).astype(np.float64)


def build_tiny_clip(seed: int, out: Path) -> Path:
    """Save a tiny CLIPModel (vision + text towers), its image processor and tokenizer to `out`."""
    import torch
    from transformers import CLIPConfig, CLIPImageProcessorPil, CLIPModel, CLIPTokenizer

    from tasks.common.families.tiny import write_tokenizer

    out = Path(out)
    vocab_size = write_tokenizer(out)
    tower = dict(
        hidden_size=TINY_HIDDEN, intermediate_size=37, num_attention_heads=4, num_hidden_layers=2
    )
    config = CLIPConfig(
        text_config=dict(
            vocab_size=vocab_size,
            max_position_embeddings=77,
            bos_token_id=vocab_size - 2,
            eos_token_id=vocab_size - 1,
            pad_token_id=vocab_size - 1,
            **tower,
        ),
        vision_config=dict(image_size=TINY_IMAGE_SIZE, patch_size=TINY_PATCH, **tower),
        projection_dim=TINY_PROJECTION,
    )
    torch.manual_seed(seed)
    CLIPModel(config).save_pretrained(out)
    CLIPImageProcessorPil(
        size={"shortest_edge": TINY_IMAGE_SIZE},
        crop_size={"height": TINY_IMAGE_SIZE, "width": TINY_IMAGE_SIZE},
    ).save_pretrained(out)
    CLIPTokenizer.from_pretrained(out).save_pretrained(out)  # tokenizer_config.json too
    return out


def build_tiny_dino(seed: int, out: Path) -> Path:
    """Save a tiny ViTModel (DINO ViT-S/16 is a plain ViT; no pooling head) and its processor."""
    import torch
    from transformers import ViTConfig, ViTImageProcessorPil, ViTModel

    out = Path(out)
    config = ViTConfig(
        image_size=TINY_IMAGE_SIZE,
        patch_size=TINY_PATCH,
        hidden_size=TINY_HIDDEN,
        intermediate_size=37,
        num_attention_heads=4,
        num_hidden_layers=2,
    )
    torch.manual_seed(seed)
    ViTModel(config, add_pooling_layer=False).save_pretrained(out)
    ViTImageProcessorPil(
        size={"height": TINY_IMAGE_SIZE, "width": TINY_IMAGE_SIZE},
        image_mean=[0.485, 0.456, 0.406],  # ImageNet statistics, as facebook/dino-vits16 uses
        image_std=[0.229, 0.224, 0.225],
    ).save_pretrained(out)
    return out


def hub_snapshot(repo_id: str, revision: str | None, key: str) -> Path:
    """Download (or find in the cache) a hub model's config, processor and weights files."""
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import HfHubHTTPError

    patterns = ["*.json", "*.txt"]
    try:
        st_patterns = [*patterns, "*.safetensors"]
        path = Path(snapshot_download(repo_id, revision=revision, allow_patterns=st_patterns))
        if not any(path.glob("*.safetensors")):
            # Older repos hold PyTorch weights only; transformers reads them with weights_only=True.
            bin_patterns = [*patterns, "pytorch_model.bin"]
            path = Path(snapshot_download(repo_id, revision=revision, allow_patterns=bin_patterns))
    except (OSError, HfHubHTTPError, ValueError) as err:
        first = str(err).strip().splitlines()[0] if str(err).strip() else ""
        rev = f" --revision {revision}" if revision else ""
        raise UserError(
            f"{key}: could not get {repo_id!r} from the Hugging Face Hub ({type(err).__name__}: "
            f"{first}). This machine looks offline (or the id is wrong). Either use the built-in "
            f"encoder ({BUILTIN_CLIP if 'clip' in key else BUILTIN_DINO}) for an offline run, or "
            f"download it where there is network (huggingface-cli download {repo_id}{rev} "
            f"--local-dir DIR), copy DIR here and set {key}: DIR"
        ) from err
    return path


def resolve_encoder(
    name: str, key: str, seed: int, workdir: Path, revision: str | None = None
) -> Path:
    """A local folder holding the encoder `name` (building a built-in into `workdir`)."""
    if name.startswith("builtin:"):
        builders = {BUILTIN_CLIP: build_tiny_clip, BUILTIN_DINO: build_tiny_dino}
        if name not in builders:
            choices = ", ".join(builders)
            raise UserError(f"{key}: unknown built-in encoder {name!r}; choose one of {choices}")
        return builders[name](seed, workdir / name.split(":", 1)[1])
    local = Path(name).expanduser()
    if local.exists() or name.startswith((".", "/", "~")):
        if not (local / "config.json").is_file():
            raise UserError(
                f"{key}: {local} is not a model folder saved with save_pretrained (no config.json)"
            )
        return local
    if _HUB_ID.match(name):
        return hub_snapshot(name, revision, key)
    raise UserError(
        f"{key}: {name!r} is neither a built-in encoder, a local folder nor a hub id (org/name)"
    )


def check_encoder(name: str, key: str, revision: str | None = None) -> None:
    """Refuse now (UserError) an encoder `resolve_encoder` would refuse, loading no weights: so a
    stage that loads its encoders last (evaluate, after its pipelines) fails before generating."""
    if name.startswith("builtin:"):
        if name not in (BUILTIN_CLIP, BUILTIN_DINO):
            raise UserError(f"{key}: unknown built-in encoder {name!r}; choose one of {BUILTIN_CLIP}, {BUILTIN_DINO}")
        return
    with tempfile.TemporaryDirectory(prefix="encoder-") as tmp:
        resolve_encoder(name, key, 0, Path(tmp), revision)


def _load(name: str, key: str, seed: int, revision: str | None, kind: str) -> LoadedEncoder:
    from transformers import (
        AutoTokenizer,
        CLIPImageProcessorPil,
        CLIPModel,
        ViTImageProcessorPil,
        ViTModel,
    )

    with tempfile.TemporaryDirectory(prefix="encoder-") as tmp:
        folder = resolve_encoder(name, key, seed, Path(tmp), revision)
        try:
            # PIL image processors: AutoImageProcessor needs torchvision, which we keep out.
            if kind == "clip":
                model = CLIPModel.from_pretrained(folder)
                tokenizer = AutoTokenizer.from_pretrained(folder)
                processor = CLIPImageProcessorPil.from_pretrained(folder)
            else:  # facebook/dino-vits16 has no pooler weights: build the ViT without one
                model = ViTModel.from_pretrained(folder, add_pooling_layer=False)
                tokenizer = None
                processor = ViTImageProcessorPil.from_pretrained(folder)
        except (OSError, ValueError, KeyError, TypeError) as err:
            raise UserError(f"{key}: could not load {name!r} from {folder}: {err}") from err
    model.eval()
    log.info("loaded %s %s (%s)", key, name, type(model).__name__)
    return LoadedEncoder(name, kind, model, processor, tokenizer)


def load_clip(
    name: str, seed: int = 0, revision: str | None = None, key: str = "clip_model"
) -> LoadedEncoder:
    """CLIP (image and text towers with projections) by built-in name, folder or hub id."""
    return _load(name, key, seed, revision, "clip")


def load_dino(
    name: str, seed: int = 0, revision: str | None = None, key: str = "dino_model"
) -> LoadedEncoder:
    """A DINO ViT (embedding: the last layer's CLS token) by built-in name, folder or hub id."""
    return _load(name, key, seed, revision, "dino")
