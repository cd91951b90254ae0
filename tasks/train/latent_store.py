"""The caches on disk (`cache_latents_to_disk`): one small safetensors file per image crop or prompt.

A file holds one image's VAE posterior parameters (mean and log-variance, float32), as the
in-memory cache does, so training reads the same numbers either way, with the original size and
crop corner the decoding found (SDXL's conditioning). Its name is the SHA-256 of the example's
latent key (the image file's SHA-256, the target size (bucket or square), the flip) inside a
folder named by the VAE's fingerprint (SHA-256 of its weights, names and dtypes): another
image, size, bucket or flip is another file, another VAE or precision another folder; nothing
else is invalidated. Files are written once (temporary name, then an atomic rename, so ranks
writing the same entry and a crash mid-write are harmless) and reused by later runs and
resumes. Nothing is kept in memory: the footprint does not grow with the dataset.

An example whose entry exists is never decoded: the data loader reads the entry instead of the
image. Its key still needs the image file's SHA-256, and reading and hashing every file every
step would cost most of what decoding does, so `FileHashes` remembers each file's hash under
the file's identity (device, inode, size, modification and change times in nanoseconds), as
git's index and DVC's state database do. Any write to the file changes its change time (which,
unlike the modification time, no tool can set back), so an edited, replaced, truncated or
`touch`ed image gets its hash computed again and, with new content, a new latent. A hash is
remembered only once the file has been unchanged for 2 seconds: a write within the same clock
tick as the hashing could otherwise keep the times (git's "racily clean" case). The ingest's
`sha256` column cannot serve instead: it is the hash of the source file, not of the processed
one the train stage reads, and a column is not updated when someone edits a file.

Text embeddings likewise: a file per prompt (SHA-256 of the prompt and the token limit) in a
folder named by the text encoders' fingerprint and the family.
"""
from __future__ import annotations

import hashlib
import os
import tempfile
import time
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file, save_file


def vae_fingerprint(*modules: torch.nn.Module) -> str:
    """SHA-256 of the modules' states (parameter names, dtypes, shapes and bytes)."""
    digest = hashlib.sha256()
    for name, tensor in (item for m in modules for item in sorted(m.state_dict().items())):
        t = tensor.detach().cpu().contiguous().reshape(-1)  # 0-d buffers too (FLUX.2's bn.num_batches_tracked)
        digest.update(f"{name}|{t.dtype}|{tuple(tensor.shape)}".encode())
        digest.update(t.view(torch.uint8).numpy().tobytes() if t.numel() else b"")
    return digest.hexdigest()


def _write_atomic(path: Path, write: Any) -> None:
    """`write(temporary path)`, then rename onto `path`: readers see the whole file or none."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, suffix=".tmp")
    os.close(fd)
    try:
        write(tmp)
        os.replace(tmp, path)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)


class FileHashes:
    """SHA-256 of a file's bytes, remembered under `folder` by the file's identity (module docstring)."""

    SETTLED_NS = 2_000_000_000  # a file unchanged this long is remembered

    def __init__(self, folder: Path) -> None:
        self.folder = Path(folder)

    def digest(self, path: Path) -> str:
        st = os.stat(path)
        identity = (f"{os.path.abspath(path)}|{st.st_dev}|{st.st_ino}|{st.st_size}|"
                    f"{st.st_mtime_ns}|{st.st_ctime_ns}")
        name = hashlib.sha256(identity.encode()).hexdigest()
        memo = self.folder / name[:2] / name
        try:
            known = memo.read_text()
            if len(known) == 64:
                return known
        except OSError:
            pass
        digest = hashlib.sha256(Path(path).read_bytes()).hexdigest()
        if time.time_ns() - max(st.st_mtime_ns, st.st_ctime_ns) > self.SETTLED_NS:
            _write_atomic(memo, lambda tmp: Path(tmp).write_text(digest))
        return digest


class DiskLatentStore:
    """A mapping latent key -> {"parameters": [1, 2C, h, w], "original_size": [2], "crop_top_left": [2]},
    kept as files under `root/<vae>/`; the image files' hashes are remembered under `root/files/`."""

    def __init__(self, root: Path, vae: torch.nn.Module, folder: str | None = None) -> None:
        self.folder = Path(root) / (folder or vae_fingerprint(vae)[:32])
        self.folder.mkdir(parents=True, exist_ok=True)
        self.hashes = FileHashes(Path(root) / "files")

    def path(self, key: str) -> Path:
        name = hashlib.sha256(key.encode()).hexdigest()
        return self.folder / name[:2] / f"{name}.safetensors"

    def __contains__(self, key: str) -> bool:
        return self.path(key).is_file()

    def __getitem__(self, key: str) -> dict[str, torch.Tensor]:
        return load_file(self.path(key))

    def __setitem__(self, key: str, value: dict[str, torch.Tensor]) -> None:
        self.write(key, value)

    def get(self, key: str) -> dict[str, torch.Tensor] | None:
        """The entry with its crop geometry, or None (absent, or written without the geometry)."""
        try:
            entry = load_file(self.path(key))
        except FileNotFoundError:
            return None
        return entry if {"original_size", "crop_top_left"} <= entry.keys() else None

    def write(self, key: str, tensors: dict[str, torch.Tensor]) -> None:
        contiguous = {k: v.contiguous() for k, v in tensors.items()}
        _write_atomic(self.path(key), lambda tmp: save_file(contiguous, tmp, metadata={"key": key[:1000]}))


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
