"""The caches on disk (`cache_latents_to_disk`): one small safetensors file per image crop or prompt.

A file holds one image's VAE posterior parameters (mean and log-variance, float32), as the
in-memory cache does, so training reads the same numbers either way. Its name is the SHA-256 of
the example's latent key (the image file's SHA-256, the target size (bucket or square), the flip)
inside a folder named by the VAE's fingerprint (SHA-256 of its weights, names and dtypes):
another image, size, bucket or flip is another file, another VAE or precision another folder;
nothing else is invalidated. Files are written once (temporary name, then an atomic rename, so
ranks writing the same entry and a crash mid-write are harmless) and reused by later runs and
resumes. Nothing is kept in memory: the footprint does not grow with the dataset.

Text embeddings likewise: a file per prompt (SHA-256 of the prompt and the token limit) in a
folder named by the text encoders' fingerprint and the family.
"""
from __future__ import annotations

import hashlib
import os
import tempfile
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file


def vae_fingerprint(*modules: torch.nn.Module) -> str:
    """SHA-256 of the modules' states (parameter names, dtypes, shapes and bytes)."""
    digest = hashlib.sha256()
    for name, tensor in (item for m in modules for item in sorted(m.state_dict().items())):
        t = tensor.detach().cpu().contiguous()
        digest.update(f"{name}|{t.dtype}|{tuple(t.shape)}".encode())
        digest.update(t.view(torch.uint8).numpy().tobytes() if t.numel() else b"")
    return digest.hexdigest()


class DiskLatentStore:
    """A mapping latent key -> posterior parameters [1, 2C, h, w], kept as files under `root/<vae>/`."""

    def __init__(self, root: Path, vae: torch.nn.Module, folder: str | None = None) -> None:
        self.folder = Path(root) / (folder or vae_fingerprint(vae)[:32])
        self.folder.mkdir(parents=True, exist_ok=True)

    def path(self, key: str) -> Path:
        name = hashlib.sha256(key.encode()).hexdigest()
        return self.folder / name[:2] / f"{name}.safetensors"

    def __contains__(self, key: str) -> bool:
        return self.path(key).is_file()

    def __getitem__(self, key: str) -> torch.Tensor:
        return load_file(self.path(key))["parameters"]

    def __setitem__(self, key: str, value: torch.Tensor) -> None:
        self.write(key, {"parameters": value})

    def write(self, key: str, tensors: dict[str, torch.Tensor]) -> None:
        path = self.path(key)
        path.parent.mkdir(exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=path.parent, suffix=".tmp")
        os.close(fd)
        try:
            save_file({k: v.contiguous() for k, v in tensors.items()}, tmp, metadata={"key": key[:1000]})
            os.replace(tmp, path)
        finally:
            if os.path.exists(tmp):
                os.unlink(tmp)


class DiskPromptStore(DiskLatentStore):
    """A mapping prompt -> (hidden states, pooled embeds or None), as files under `root/text-<encoders>/`."""

    def __init__(self, root: Path, encoders: list[torch.nn.Module], family: str, max_length: int | None) -> None:
        digest = hashlib.sha256(f"{family}|{max_length}|{vae_fingerprint(*encoders)}".encode()).hexdigest()
        super().__init__(root, encoders[0], f"text-{digest[:32]}")

    def __getitem__(self, prompt: str) -> tuple[torch.Tensor, torch.Tensor | None]:  # type: ignore[override]
        tensors = load_file(self.path(prompt))
        return tensors["hidden"], tensors.get("pooled")

    def __setitem__(self, prompt: str, value: tuple) -> None:  # type: ignore[override]
        hidden, pooled = value
        self.write(prompt, {"hidden": hidden, **({"pooled": pooled} if pooled is not None else {})})
