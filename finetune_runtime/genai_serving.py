"""One OpenVINO base export serving any number of registered LoRA fine-tunes (OpenVINO GenAI).

The registered base export (`<model>-base`, written by the register
stage for `export.adapters: runtime`) loads this: its requests name the adapters in the `adapter`
param, e.g. `sks-toy@champion`, `sks-toy/3`, or a blend `sks-toy/3:0.7,other@champion:0.3`.

- A name is resolved through the MLflow registry the endpoint runs against (MLFLOW_TRACKING_URI):
  an alias or a version of one of the registered models the base export was registered to apply
  (model_config `adapter_models`: by default the pipeline's own model of this base), whose lineage
  document is the registered one and names this base export (adapter_cache.py); anything else is a
  ValueError naming the field (HTTP 400).
- An adapter's files are downloaded on first use into one cache folder bounded in bytes
  (model_config `adapter_cache_mb`) and in versions, deleted when evicted (adapter_cache.py); the
  pyfunc resolves them inside the model's turn, under the request's deadline (`check`). One
  compiled pipeline serves them all, the LoRA applied per call.
- GenAI applies, in MODE_DYNAMIC, only the layers it compiled LoRA branches for: a new adapter
  whose layers the compiled set does not cover recompiles the pipeline once (seconds), with the
  cached adapters and the new one.
"""
from __future__ import annotations

import json
import logging
import os
import re
import threading
from collections.abc import Callable
from typing import Any

from finetune_runtime import adapter_cache, layout

log = logging.getLogger("sd_pyfunc.genai")

#: The file of a registered base export that says what it is (key, family, static shape).
BASE_INFO = layout.GENAI_BASE
#: The registered adapter version's artifact: genai_lora.safetensors, runtime_adapter.json and
#: BASE_REF, the base export's registered version it applies to.
ADAPTER_ARTIFACT = adapter_cache.ADAPTER_ARTIFACT
BASE_REF = "base_export.json"
_REF = re.compile(r"^(?P<name>[A-Za-z0-9][\w.\-]*)(?:@(?P<alias>[\w\-]+)|/(?P<version>\d+))"
                  r"(?::(?P<weight>-?\d+(?:\.\d+)?))?$")
MAX_BLEND = 4


def parse_adapters(spec: str) -> list[tuple[str, str | None, str | None, float]]:
    """`name@alias[:weight]` or `name/version[:weight]`, comma-separated (at most MAX_BLEND):
    [(name, alias, version, weight)]; a ValueError says what is wrong."""
    parts = [p.strip() for p in spec.split(",") if p.strip()]
    if len(parts) > MAX_BLEND:
        raise ValueError(f"adapter: {len(parts)} adapters named; a request blends at most {MAX_BLEND}")
    out = []
    for part in parts:
        match = _REF.match(part)
        if match is None:
            raise ValueError(f"adapter: {part!r} is not <registered model>@<alias> or <registered "
                             "model>/<version>, with an optional :<weight> (e.g. sks-toy@champion:0.5)")
        weight = float(match["weight"]) if match["weight"] is not None else 1.0
        if not -2.0 <= weight <= 2.0:
            raise ValueError(f"adapter: weight {weight:g} of {part!r} is out of range; allowed: -2 to 2")
        out.append((match["name"], match["alias"], match["version"], weight))
    return out


def _layers(path: str) -> set[str]:
    from safetensors import safe_open

    with safe_open(path, "np") as fh:
        return {k.split(".")[0] for k in fh.keys()}  # noqa: SIM118  (safe_open is not iterable)


class AdapterServer:
    """GenAI's Text2ImagePipeline over one base export, called like a diffusers pipeline with
    `adapters=[(file, weight)]`; `resolve()` turns the `adapter` param into those files."""

    def __init__(self, export: str, ov_config: dict[str, str], cache_mb: float = 1024.0,
                 own: str | None = None, allowed: tuple[str, ...] | None = None) -> None:
        """`own`: the one adapter file of an adapter version's endpoint (None: the base's endpoint,
        which downloads the adapters requests name into a cache of `cache_mb` MB, versions of the
        registered models `allowed` only: adapter_cache.py)."""
        with open(os.path.join(export, BASE_INFO)) as fh:
            self.info = json.load(fh)
        shape = self.info["static_shape"]
        self.export, self.ov_config = export, ov_config
        self.height, self.width = int(shape["height"]), int(shape["width"])
        self.guidance = float(self.info["guidance_scale"])
        self.covered: set[str] = set()
        self.lock = threading.Lock()
        self._compile([own] if own else [])
        self.own, self.cache = None, None
        if own:
            import openvino_genai as genai

            self.own = genai.Adapter(own)
        else:
            self.cache = adapter_cache.AdapterCache(self.info["key"], int(cache_mb * 2**20), allowed)

    def _compile(self, files: list[str]) -> None:
        import openvino_genai as genai

        pipe = genai.Text2ImagePipeline(self.export)
        pipe.reshape(1, self.height, self.width, self.guidance)
        config = genai.AdapterConfig([genai.Adapter(f) for f in files], genai.AdapterConfig.Mode.MODE_DYNAMIC)
        pipe.compile("CPU", adapters=config, **self.ov_config)
        self.pipe = pipe
        self.covered = set().union(*(_layers(f) for f in files)) if files else set()
        log.info("compiled the base export with %d adapter(s)", len(files))

    def set_progress_bar_config(self, **_: Any) -> None:
        """GenAI draws no progress bar."""

    def resolve(self, spec: str, check: Callable[[str], None] = lambda _: None) -> list[tuple[Any, float]]:
        """The `adapter` param as [(GenAI Adapter, weight)], downloading what is new; `check(what)`
        before each step that takes time (the pyfunc's deadline)."""
        refs = parse_adapters(spec)
        with self.lock:
            keep: frozenset[str] = frozenset()
            out = []
            for name, alias, version, weight in refs:
                key, entry, _ = self.cache.get(name, alias, version, check, keep)
                keep |= {key}
                out.append((self._loaded(key, entry, check), weight))
            return out

    def _loaded(self, key: str, entry: Any, check: Callable[[str], None]) -> Any:
        """The GenAI Adapter of a cached version, compiled for: a new adapter whose layers the
        compiled pipeline does not cover recompiles it once, with every cached adapter."""
        import openvino_genai as genai

        if entry.handle is None:
            try:
                entry.handle = (genai.Adapter(entry.file), _layers(entry.file))
            except Exception as err:  # GenAI's error type varies: a file it cannot read
                self.cache.evict(key)
                raise ValueError(f"adapter: {key}: its adapter file cannot be loaded ({err})") from None
        adapter, layers = entry.handle
        if not layers <= self.covered:
            check(f"compiling the base export for adapter {key}")
            self._compile([e.file for e in self.cache.entries.values()])
        return adapter

    def __call__(self, prompt: str, num_inference_steps: int, guidance_scale: float, generator: Any,
                 callback_on_step_end: Any = None, adapters: Any = (), **_: Any) -> Any:
        import numpy as np
        import openvino_genai as genai
        from PIL import Image

        used = [(a, float(w)) for a, w in adapters if w != 0]  # zero weights: see tasks/common/genai.py
        config = genai.AdapterConfig(used) if used else genai.AdapterConfig()

        stopped: list[BaseException] = []

        def step(index: int, steps: int, latent: Any) -> bool:
            """The diffusers-style callback (the deadline) per step; True stops GenAI, and what the
            callback raised is raised again after generate() returns."""
            try:
                if callback_on_step_end is not None:
                    callback_on_step_end(self, index, None, {})
            except BaseException as err:
                stopped.append(err)
                return True
            return False

        # compiled at one size: like a static optimum-intel export, it makes that size whatever was asked
        result = self.pipe.generate(
            prompt, width=self.width, height=self.height, num_inference_steps=num_inference_steps,
            guidance_scale=guidance_scale, generator=genai.TorchGenerator(generator.initial_seed()),
            adapters=config, callback=step)
        if stopped:
            raise stopped[0]
        images = np.asarray(result.data)
        return type("Output", (), {"images": [Image.fromarray(im) for im in images]})


def base_export_of(adapter_dir: str) -> tuple[str, str, str]:
    """(base export folder, base pipeline folder, this version's GenAI LoRA file) for an adapter
    version, the base's two downloaded from its registered base export version."""
    import mlflow

    with open(os.path.join(adapter_dir, BASE_REF)) as fh:
        ref = json.load(fh)
    lora = adapter_cache.adapter_file(adapter_dir, f"adapter version {ref.get('model')}")
    uri = f"models:/{ref['model']}/{ref['version']}/artifacts"
    log.info("loading the base export %s/%s this adapter applies to", ref["model"], ref["version"])
    folder = mlflow.artifacts.download_artifacts(uri)
    names = {p: os.path.join(folder, p) for p in os.listdir(folder)}
    export = next(p for p in names.values() if os.path.isfile(os.path.join(p, BASE_INFO)))
    pipeline = next(p for p in names.values() if p != export and layout.is_pipeline(p))
    return export, pipeline, lora
