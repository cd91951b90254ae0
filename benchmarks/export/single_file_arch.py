"""The single-file checkpoint on the real SD 1.5, SD 2.1 and SDXL architectures (random weights).

    .venv/bin/python -m benchmarks.export.single_file_arch --work /tmp/single-file-arch \
        --report benchmarks/export/results_single_file.json

For each architecture: builds the pipeline from its published config values in fp16 (no
download; weights from a seed), saves it, writes the single file with the export stage's own
`write_single_file` (fp16), and records tensor count, size, seconds and the peak RSS of the write.
Then checks the file as a user's tool would see it: diffusers' `infer_diffusers_model_type` must
name the architecture (`v1`, `v2`, `xl_base`: it looks at layer counts and widths that the tiny
test models do not have), and `from_single_file`, with the saved folder as config, must give back
every UNet, VAE and text-encoder tensor equal to the saved one.
"""
from __future__ import annotations

import argparse
import json
import logging
import resource
import tempfile
import time
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

from benchmarks.export.sd15_random import build_sd15

log = logging.getLogger("benchmarks.export.single_file")

SD_VAE = dict(
    in_channels=3, out_channels=3, latent_channels=4, layers_per_block=2,
    block_out_channels=(128, 256, 512, 512),
    down_block_types=("DownEncoderBlock2D",) * 4, up_block_types=("UpDecoderBlock2D",) * 4,
)
CLIP_L = dict(vocab_size=49408, hidden_size=768, intermediate_size=3072, num_hidden_layers=12,
              num_attention_heads=12, max_position_embeddings=77, hidden_act="quick_gelu")


def _tokenizer():
    from transformers import CLIPTokenizer

    from tasks.common.families.tiny import write_tokenizer

    with tempfile.TemporaryDirectory() as tmp:
        write_tokenizer(Path(tmp))  # the project's local BPE tokenizer (ids inside 49408 rows)
        return CLIPTokenizer.from_pretrained(tmp)


def build_sd21(out: Path) -> None:
    """stabilityai/stable-diffusion-2-1's configs: OpenCLIP ViT-H text model (23 of 24 layers)."""
    from diffusers import AutoencoderKL, EulerDiscreteScheduler, StableDiffusionPipeline, UNet2DConditionModel
    from transformers import CLIPTextConfig, CLIPTextModel

    unet = UNet2DConditionModel(
        sample_size=96, layers_per_block=2, block_out_channels=(320, 640, 1280, 1280),
        down_block_types=("CrossAttnDownBlock2D",) * 3 + ("DownBlock2D",),
        up_block_types=("UpBlock2D",) + ("CrossAttnUpBlock2D",) * 3,
        cross_attention_dim=1024, attention_head_dim=(5, 10, 20, 20),
        use_linear_projection=True, upcast_attention=True,
    )
    text = CLIPTextModel(CLIPTextConfig(
        vocab_size=49408, hidden_size=1024, intermediate_size=4096, num_hidden_layers=23,
        num_attention_heads=16, max_position_embeddings=77, hidden_act="gelu", projection_dim=512,
    ))
    StableDiffusionPipeline(
        vae=AutoencoderKL(**SD_VAE, sample_size=768), text_encoder=text, tokenizer=_tokenizer(),
        unet=unet, scheduler=EulerDiscreteScheduler(prediction_type="v_prediction"),
        safety_checker=None, feature_extractor=None, requires_safety_checker=False,
    ).save_pretrained(out, safe_serialization=True)


def build_sdxl(out: Path) -> None:
    """stabilityai/stable-diffusion-xl-base-1.0's configs: CLIP ViT-L + OpenCLIP ViT-bigG."""
    from diffusers import AutoencoderKL, EulerDiscreteScheduler, StableDiffusionXLPipeline, UNet2DConditionModel
    from transformers import CLIPTextConfig, CLIPTextModel, CLIPTextModelWithProjection

    unet = UNet2DConditionModel(
        sample_size=128, layers_per_block=2, block_out_channels=(320, 640, 1280),
        down_block_types=("DownBlock2D", "CrossAttnDownBlock2D", "CrossAttnDownBlock2D"),
        up_block_types=("CrossAttnUpBlock2D", "CrossAttnUpBlock2D", "UpBlock2D"),
        attention_head_dim=(5, 10, 20), transformer_layers_per_block=(1, 2, 10),
        cross_attention_dim=2048, use_linear_projection=True, addition_embed_type="text_time",
        addition_time_embed_dim=256, projection_class_embeddings_input_dim=2816,
    )
    text_2 = CLIPTextModelWithProjection(CLIPTextConfig(
        vocab_size=49408, hidden_size=1280, intermediate_size=5120, num_hidden_layers=32,
        num_attention_heads=20, max_position_embeddings=77, hidden_act="gelu",
        projection_dim=1280,
    ))
    tokenizer = _tokenizer()
    StableDiffusionXLPipeline(
        vae=AutoencoderKL(**SD_VAE, sample_size=1024, scaling_factor=0.13025),
        text_encoder=CLIPTextModel(CLIPTextConfig(**CLIP_L, projection_dim=768)),
        text_encoder_2=text_2, tokenizer=tokenizer, tokenizer_2=tokenizer, unet=unet,
        scheduler=EulerDiscreteScheduler(),
    ).save_pretrained(out, safe_serialization=True)


class LazyFile(Mapping):
    """A safetensors file as a read-only mapping that loads a tensor only when asked for."""

    def __init__(self, path: Path):
        from safetensors import safe_open

        self._fh = safe_open(str(path), "pt")
        self._keys = list(self._fh.keys())

    def __getitem__(self, key: str) -> Any:
        if key not in self._keys:
            raise KeyError(key)
        return self._fh.get_tensor(key)

    def __iter__(self) -> Iterator[str]:
        return iter(self._keys)

    def __len__(self) -> int:
        return len(self._keys)


def saved_components(folder: Path, parts: tuple[str, ...]) -> Iterator[tuple[str, str, Any]]:
    """(component, key, tensor) for every weight the diffusers folder holds, one file at a time."""
    from safetensors import safe_open

    for part in parts:
        for file in sorted((folder / part).glob("*.safetensors")):
            with safe_open(str(file), "pt") as fh:
                for key in fh.keys():  # noqa: SIM118 (safe_open is not a dict)
                    yield part, key, fh.get_tensor(key)


def build_case(name: str, folder: Path) -> float:
    """Seconds to build and save `name` in fp16 (SDXL's UNet alone is 10 GB in fp32)."""
    import torch

    start = time.perf_counter()
    torch.manual_seed(0)
    torch.set_default_dtype(torch.float16)
    CASES[name][0](folder)
    return time.perf_counter() - start


def write_case(folder: Path, path: Path) -> dict:
    """The export stage's writer, timed, with the peak RSS of a process that did nothing else."""
    from tasks.export.single_file import write_single_file

    start = time.perf_counter()
    info = write_single_file(folder, path, dtype="fp16")
    return {**info, "write_s": round(time.perf_counter() - start, 1),
            "write_peak_rss_gb": round(
                resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20, 2)}


def in_child(fn, *args):
    """`fn(*args)` in a fresh process, so that each step's peak RSS is its own."""
    import multiprocessing
    from concurrent.futures import ProcessPoolExecutor

    with ProcessPoolExecutor(1, mp_context=multiprocessing.get_context("spawn")) as pool:
        return pool.submit(fn, *args).result()


def check(name: str, work: Path) -> dict:
    import diffusers
    import torch
    from diffusers.loaders.single_file_utils import infer_diffusers_model_type

    _, pipeline_cls, parts = CASES[name]
    folder, path = work / name, work / f"{name}.safetensors"
    build_s = None
    if not (folder / "model_index.json").is_file():
        build_s = round(in_child(build_case, name, folder), 1)
    info = in_child(write_case, folder, path)
    model_type = infer_diffusers_model_type(LazyFile(path))

    cls = getattr(diffusers, pipeline_cls)
    back = cls.from_single_file(str(path), config=str(folder), local_files_only=True,
                                torch_dtype=torch.float16)
    checked, mismatched = 0, []
    states = {part: getattr(back, part).state_dict() for part in parts}
    for part, key, value in saved_components(folder, parts):
        got = states[part].get(key)
        if got is None or not torch.equal(value, got.reshape(value.shape)):
            mismatched.append(f"{part}.{key}")
        checked += 1
    result = {
        **info,
        "diffusers_model_type": model_type,
        "tensors_compared": checked,
        "tensors_different": len(mismatched),
        "first_different": mismatched[:5],
        "build_s": build_s,
        "file_size_gb": round(path.stat().st_size / 1e9, 2),
    }
    log.info("%s: %s", name, result)
    return result


CASES = {  # name: (builder, pipeline class, components compared)
    "sd15": (build_sd15, "StableDiffusionPipeline", ("unet", "vae", "text_encoder")),
    "sd21": (build_sd21, "StableDiffusionPipeline", ("unet", "vae", "text_encoder")),
    "sdxl": (build_sdxl, "StableDiffusionXLPipeline",
             ("unet", "vae", "text_encoder", "text_encoder_2")),
}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--work", type=Path,
                        default=Path(tempfile.gettempdir()) / "single-file-arch")
    parser.add_argument("--report", type=Path,
                        default=Path("benchmarks/export/results_single_file.json"))
    parser.add_argument("--only", choices=["sd15", "sd21", "sdxl"], action="append")
    args = parser.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")

    args.work.mkdir(parents=True, exist_ok=True)
    report = {name: check(name, args.work) for name in (args.only or CASES)}
    args.report.parent.mkdir(parents=True, exist_ok=True)
    args.report.write_text(json.dumps(report, indent=2) + "\n")
    print(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
