"""diffusers' own example training scripts, at the tag of the installed diffusers, in an ignored cache.

The benchmarks run them unchanged as the baseline users would otherwise run. They are never
committed: this fetches them into .cache/diffusers-examples/v<version>/ (git-ignored).

    .venv/bin/python benchmarks/diffusers_scripts.py                   # from GitHub, at v<installed>
    .venv/bin/python benchmarks/diffusers_scripts.py --from-git DIR    # from a local diffusers clone

`--from-git` reads the files with `git show v<version>:<path>` from a clone (or mirror) that has
the tag, for machines without access to GitHub.
"""
from __future__ import annotations

import argparse
import subprocess
import urllib.request
from pathlib import Path

SCRIPTS = (
    "examples/dreambooth/train_dreambooth.py",
    "examples/dreambooth/train_dreambooth_lora.py",
    "examples/dreambooth/train_dreambooth_lora_sd3.py",
    "examples/dreambooth/train_dreambooth_sd3.py",
    "examples/dreambooth/train_dreambooth_lora_flux.py",
    "examples/dreambooth/train_dreambooth_lora_sana.py",
    "examples/dreambooth/train_dreambooth_lora_z_image.py",
    "examples/dreambooth/train_dreambooth_lora_qwen_image.py",
    "examples/textual_inversion/textual_inversion.py",
    "examples/text_to_image/train_text_to_image.py",
)
ROOT = Path(__file__).resolve().parents[1]
RAW = "https://raw.githubusercontent.com/huggingface/diffusers/{tag}/{path}"


def tag() -> str:
    import diffusers

    return f"v{diffusers.__version__}"


def cache_dir() -> Path:
    return ROOT / ".cache" / "diffusers-examples" / tag()


def script(name: str) -> Path:
    """The cached copy of one script (by file name); tells how to fetch it when it is missing."""
    path = cache_dir() / name
    if not path.is_file():
        raise SystemExit(f"{path} is missing: run `.venv/bin/python benchmarks/diffusers_scripts.py` first")
    return path


def fetch(from_git: Path | None) -> list[Path]:
    out = cache_dir()
    out.mkdir(parents=True, exist_ok=True)
    written = []
    for path in SCRIPTS:
        if from_git is not None:
            text = subprocess.run(["git", "-C", str(from_git), "show", f"{tag()}:{path}"],
                                  check=True, capture_output=True, text=True).stdout
        else:
            with urllib.request.urlopen(RAW.format(tag=tag(), path=path), timeout=60) as response:
                text = response.read().decode()
        target = out / Path(path).name
        target.write_text(text)
        written.append(target)
    return written


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--from-git", type=Path, default=None, help="a local diffusers clone with the tag")
    for path in fetch(parser.parse_args().from_git):
        print(path)


if __name__ == "__main__":
    main()
