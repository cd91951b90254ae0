"""The base model's evaluation images, kept on disk so that the next fine-tune of the same base
does not generate them again (`evaluate.base_cache_dir`; null: off).

An entry is `<base_cache_dir>/<key>/`: `manifest.json` and one PNG per image (`<job>/<row>-<j>.png`,
lossless, so the images read back are the ones generated, bit for bit). The key is a SHA-256 of
everything the base's images depend on:

- the base's files (tasks/common/fingerprint.py folder_fingerprint: paths and contents);
- every job's arguments: the prompts, drift class prompts, held-out captions, the edit set's and the
  image-to-video first frames' content hashes; the call shape, seed, steps, guidance and images per prompt;
- the precision the base is generated in (on a quantized denoiser, also the code that loads it:
  QUANTIZED_CODE);
- the versions of torch, diffusers and transformers, and the source of the project's generation
  code (tasks/evaluate/generate.py, edits.py and image_to_video.py, tasks/common/families/, finetune_runtime's
  call, size and load (the first-frame pipeline)): a
  change to any of them changes the images, so it is a miss.

An entry is written in a temporary folder beside it and renamed into place in one step: an
interrupted run leaves no entry (its `.tmp-*` folder is removed, or ignored by the next run).
"""
from __future__ import annotations

import hashlib
import json
import logging
import os
import shutil
import tempfile
from dataclasses import dataclass
from importlib.metadata import version
from pathlib import Path
from typing import Any

from PIL import Image

from tasks.common.fingerprint import folder_fingerprint

log = logging.getLogger(__name__)

FORMAT = 1
MANIFEST = "manifest.json"
_ROOT = Path(__file__).resolve().parents[2]
GENERATION_CODE = ("tasks/evaluate/generate.py", "tasks/evaluate/edits.py", "tasks/evaluate/image_to_video.py",
                   "tasks/common/families", "finetune_runtime/pipeline_call.py", "finetune_runtime/convention.py",
                   "finetune_runtime/size.py", "finetune_runtime/load.py")
#: also hashed when the base is generated on a quantized denoiser (its precision names a `denoiser`)
QUANTIZED_CODE = ("tasks/common/quantize.py", "tasks/common/quantized_pipeline.py")
LIBRARIES = ("torch", "diffusers", "transformers")


def code_hash(root: Path = _ROOT, code: tuple[str, ...] = GENERATION_CODE) -> str:
    """SHA-256 of the generation code's source files (`code`), paths and contents."""
    digest = hashlib.sha256()
    for rel in code:
        path = root / rel
        files = sorted(path.rglob("*.py")) if path.is_dir() else [path]
        for file in files:
            digest.update(file.relative_to(root).as_posix().encode() + b"\0" + file.read_bytes() + b"\0")
    return digest.hexdigest()


def cache_key(base: Path, jobs: dict[str, Any], precision: dict[str, str]) -> tuple[str, dict[str, Any]]:
    """(key, what it hashes) for the base's images of `jobs` (phases.Jobs.settings) in `precision`."""
    code = GENERATION_CODE + (QUANTIZED_CODE if "denoiser" in precision else ())
    settings = {"format": FORMAT, "base": folder_fingerprint(base), "precision": precision, "jobs": jobs,
                "libraries": {name: version(name) for name in LIBRARIES}, "code": code_hash(code=code)}
    text = json.dumps(settings, sort_keys=True, separators=(",", ":"))
    return hashlib.sha256(text.encode()).hexdigest(), settings


@dataclass
class BaseImageCache:
    """One entry of the cache: `load` it (None: absent) or `store` the base's images in it."""

    path: Path
    settings: dict[str, Any]

    @classmethod
    def open(cls, cache_dir: str | None, base: Path, jobs: dict[str, Any],
             precision: dict[str, str]) -> BaseImageCache | None:
        """The entry for these images, or None when the cache is off (cache_dir null)."""
        if not cache_dir:
            return None
        key, settings = cache_key(base, jobs, precision)
        return cls(Path(cache_dir) / key, settings)

    def load(self) -> dict[str, Any] | None:
        """{job: (images[row][j], 0.0)} as `Jobs.run` returns them, or None when there is no entry."""
        manifest = self.path / MANIFEST
        if not manifest.is_file():
            return None
        counts = json.loads(manifest.read_text())["jobs"]
        out = {}
        for job, rows in counts.items():
            images = [[_read(self.path / job / f"{r}-{j}.png") for j in range(n)] for r, n in enumerate(rows)]
            out[job] = (images, 0.0)
        return out

    def store(self, made: dict[str, Any]) -> None:
        """Write `made` ({job: (images, seconds)}) as this entry, whole or not at all."""
        self.path.parent.mkdir(parents=True, exist_ok=True)
        tmp = Path(tempfile.mkdtemp(prefix=".tmp-", dir=self.path.parent))
        try:
            counts = {}
            for job, (images, _) in made.items():
                (tmp / job).mkdir()
                counts[job] = [len(row) for row in images]
                for r, row in enumerate(images):
                    for j, image in enumerate(row):
                        image.save(tmp / job / f"{r}-{j}.png")
            seconds = {job: round(s, 3) for job, (_, s) in made.items()}
            (tmp / MANIFEST).write_text(json.dumps({"jobs": counts, "seconds": seconds,
                                                    "settings": self.settings}, indent=1) + "\n")
            _publish(tmp, self.path)
            log.info("base images cached in %s", self.path)
        finally:
            shutil.rmtree(tmp, ignore_errors=True)


def _read(path: Path) -> Image.Image:
    with Image.open(path) as image:
        image.load()
        return image.copy()


def _publish(made: Path, entry: Path) -> None:
    """Rename `made` to `entry` in one step; a concurrent run's entry of the same key is kept."""
    try:
        os.replace(made, entry)
    except OSError:
        if not (entry / MANIFEST).is_file():
            raise
