"""The adapters a base export's endpoint applies: looked up in the real MLflow registry (the test's
own local store), eligible by their lineage document, downloaded into one folder bounded in bytes
and deleted on eviction, their file confined to their artifact; and in the pyfunc, looked up in the
model's turn and under its deadline. Versions here hold a small real safetensors file, no model:
GenAI applying them is test_adapter_registry.py's."""
from __future__ import annotations

import hashlib
import json
import os
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import numpy as np
import pytest
from mlflow.exceptions import MlflowException

from finetune_runtime.adapter_cache import MARKER, AdapterCache, confined_file, folder_bytes
from finetune_runtime.limits import TIMEOUT_ENV
from finetune_runtime.load import Loaded
from finetune_runtime.model import DiffusionImageModel
from finetune_runtime.registered import LINEAGE_PARAM, model_key
from tasks.register import manifest
from tests.runtime.test_limits import SlowPipe

pytestmark = pytest.mark.quick  # make test-fast

KEY = "b" * 64  # the base export key the endpoint serves
KB = 1024


def _no_check(_: str) -> None:
    pass


def register_adapter(root: Path, name: str, kb: int, lineage_key: str | None = KEY,
                     file: str = "genai_lora.safetensors", tags: dict | None = None,
                     lineage: dict | None = None) -> str:
    """A version of `name` laid out as the register stage lays out a run-time adapter version: its
    `adapter` artifact (a LoRA file of about `kb` KB, runtime_adapter.json) and, in its run, a
    lineage.json naming base export `lineage_key` (None: no lineage document; `lineage`: that
    document instead) with its SHA-256 as the run's param, and the manifest of its files, as the register
    stage records them."""
    import mlflow
    from mlflow.exceptions import MlflowException
    from safetensors.numpy import save_file

    client = mlflow.MlflowClient()
    folder = root / f"{name}-{kb}-{len(list(root.glob('*')))}"
    folder.mkdir(parents=True)
    save_file({"lora_unet_down.lora_down.weight": np.zeros(kb * KB // 4, np.float32)},
              str(folder / "genai_lora.safetensors"))
    (folder / "runtime_adapter.json").write_text(json.dumps({"file": file}))
    experiment = mlflow.set_experiment("adapters").experiment_id
    run = client.create_run(experiment)
    client.log_artifacts(run.info.run_id, str(folder), "model/artifacts/adapter")
    source = f"{run.info.artifact_uri}/model"
    manifest.record(client, run.info.run_id, source, source)  # its files' manifest, as register records it
    if lineage_key is not None:
        doc = lineage or {"model": {"name": name, "source": source}, "base_export": {"key": lineage_key}}
        text = json.dumps(doc)
        client.log_text(run.info.run_id, text, "lineage.json")
        client.log_param(run.info.run_id, LINEAGE_PARAM.format(model_key(source)),
                         hashlib.sha256(text.encode()).hexdigest())
    try:
        client.create_registered_model(name)
    except MlflowException:
        pass
    return str(client.create_model_version(name, source, run.info.run_id, tags=tags).version)


@pytest.fixture
def cache(tmp_path, monkeypatch) -> AdapterCache:
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path / "tmp"))  # what MLflow's downloads leave, too
    (tmp_path / "tmp").mkdir()
    made = AdapterCache(KEY, 1000 * KB, ("style", "big"))
    yield made
    made.close()


def test_cycling_through_more_versions_than_the_cache_holds_stays_under_its_bound(cache, tmp_path) -> None:
    for _ in range(12):
        register_adapter(tmp_path / "src", "style", 300)  # each about 300 KB: 3 fit in 1000 KB
    seen: dict[str, str] = {}
    for step in range(24):  # versions 1..12, twice
        key, entry, new = cache.get("style", None, str(step % 12 + 1), _no_check)
        assert new and Path(entry.file).is_file() and Path(entry.folder) in Path(entry.file).parents
        seen[key] = entry.folder
        on_disk = folder_bytes(cache.folder)
        assert on_disk <= 1000 * KB and on_disk == cache.used + os.path.getsize(Path(cache.folder) / MARKER)
        kept = {e.folder for e in cache.entries.values()}
        assert len(kept) == min(step + 1, 3) and {str(p) for p in Path(cache.folder).glob("a*")} == kept
        assert not any(Path(f).exists() for f in set(seen.values()) - kept), "evicted folders are deleted"
    assert cache.get("style", None, "12", _no_check)[2] is False, "the most recent is served from the cache"
    assert os.listdir(tmp_path / "tmp") == ["sd-pyfunc-adapters"], "no other download folder is left behind"
    cache.close()
    assert not Path(cache.folder).exists()


def test_a_version_is_applied_only_when_its_lineage_document_names_this_base(cache, tmp_path) -> None:
    src = tmp_path / "src"
    ok = register_adapter(src, "style", 4, tags={"base_export.key": "c" * 64})  # a tag says otherwise
    other = register_adapter(src, "style", 4, lineage_key="c" * 64, tags={"base_export.key": KEY})
    none = register_adapter(src, "style", 4, lineage_key=None, tags={"base_export.key": KEY})
    assert cache.get("style", None, ok, _no_check)[2]
    with pytest.raises(ValueError, match=rf"adapter: style/{other} .*not registered for this base export \(its "
                                         r"lineage document names base export cccccccccccc"):
        cache.get("style", None, other, _no_check)
    with pytest.raises(ValueError, match=rf"adapter: style/{none} .*has no recorded digest of its lineage document"):
        cache.get("style", None, none, _no_check)
    with pytest.raises(ValueError, match="adapter: style/99 is not a registered model version here"):
        cache.get("style", None, "99", _no_check)
    assert list(cache.entries) == [f"style/{ok}"], "nothing refused was downloaded"


@pytest.mark.parametrize("file", ["/etc/passwd", "../../lineage.json", "sub/../../runtime_adapter.json", "."])
def test_an_adapter_file_outside_its_artifact_is_refused(cache, tmp_path, file) -> None:
    version = register_adapter(tmp_path / "src", "style", 4, file=file)
    with pytest.raises(ValueError, match=rf"adapter: style/{version}: runtime_adapter.json `file` '{file}' "
                                         r"(is an absolute path|leaves the version's adapter artifact)"):
        cache.get("style", None, version, _no_check)
    assert not cache.entries and not list(Path(cache.folder).glob("a*")), "its download is deleted"


def test_a_link_out_of_the_artifact_is_refused(tmp_path) -> None:
    (tmp_path / "adapter").mkdir()
    (tmp_path / "adapter" / "lora.safetensors").symlink_to(tmp_path / "elsewhere")
    (tmp_path / "elsewhere").write_text("x")
    with pytest.raises(ValueError, match="`file` 'lora.safetensors' leaves the version's adapter artifact"):
        confined_file(str(tmp_path / "adapter"), {"file": "lora.safetensors"}, "adapter: x/1")
    with pytest.raises(ValueError, match="has no `file`"):
        confined_file(str(tmp_path / "adapter"), {}, "adapter: x/1")


def test_an_adapter_over_the_whole_cache_is_refused_naming_the_knob(cache, tmp_path) -> None:
    version = register_adapter(tmp_path / "src", "big", 1200)
    with pytest.raises(ValueError, match=r"adapter: big/\d+ is 1.17 MB, more than this endpoint's adapter cache "
                                         r"holds \(0.977 MB, model_config adapter_cache_mb\)"):
        cache.get("big", None, version, _no_check)
    assert not list(Path(cache.folder).glob("a*"))


def test_a_killed_servers_cache_folder_is_removed_at_the_next_start(tmp_path) -> None:
    root = tmp_path / "root"
    code = ("import sys, time; from finetune_runtime.adapter_cache import AdapterCache; "
            f"print(AdapterCache('k', 1000, root={str(root)!r}).folder, flush=True); time.sleep(60)")
    child = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True,
                             cwd=Path(__file__).resolve().parents[2])
    killed = Path(child.stdout.readline().strip())
    (killed / "a1").mkdir()
    (killed / "a1" / "genai_lora.safetensors").write_bytes(b"x" * 100)
    live = AdapterCache("k", 1000, root=str(root))  # started while the first one runs: keeps its folder
    assert killed.is_dir() and Path(live.folder).is_dir()
    child.send_signal(signal.SIGKILL)
    child.wait(10)
    (root / "not-ours").mkdir()  # no marker: never deleted
    AdapterCache("k", 1000, root=str(root)).close()
    assert not killed.exists() and Path(live.folder).is_dir() and (root / "not-ours").is_dir()
    live.close()


class AdapterPipe(SlowPipe):
    """A stand-in for genai_serving.AdapterServer (no compiled model): names resolved through the
    real AdapterCache and registry, generation like SlowPipe."""

    own = None

    def __init__(self, step_s: float, cache: AdapterCache) -> None:
        super().__init__(step_s)
        self.cache, self.looked_up = cache, 0

    def resolve(self, spec: str, check) -> list:
        from finetune_runtime.genai_serving import parse_adapters

        self.looked_up += bool(spec)  # a request without `adapter` resolves "" (nothing to look up)
        return [(self.cache.get(name, alias, version, check)[1].file, weight)
                for name, alias, version, weight in parse_adapters(spec)]


def _served(cache: AdapterCache, max_waiting: int) -> tuple[DiffusionImageModel, AdapterPipe]:
    model, pipe = DiffusionImageModel(), AdapterPipe(0.02, cache)
    model.serve(Loaded(pipe, "genai", "stand-in"), {"budget_images": 100, "max_waiting": max_waiting})
    return model, pipe


def _generating(model: DiffusionImageModel, steps: int):
    """A request holding the model for `steps` steps, in a thread."""
    thread = threading.Thread(target=model.predict, args=(None, ["a"], {"num_inference_steps": steps}))
    thread.start()
    while not model.turns.model.locked():
        time.sleep(0.01)
    return thread


def test_an_adapter_request_beyond_the_queue_gets_429_before_any_look_up(cache, tmp_path, monkeypatch) -> None:
    monkeypatch.delenv(TIMEOUT_ENV, raising=False)
    register_adapter(tmp_path / "src", "style", 4)
    model, pipe = _served(cache, max_waiting=0)
    holder = _generating(model, 25)
    with pytest.raises(MlflowException, match=r"the model is busy: one request generating and 0 waiting") as info:
        model.predict(None, ["a"], {"adapter": "style/1", "num_inference_steps": 2})
    assert info.value.get_http_status_code() == 429 and info.value.json_kwargs["retry_after_s"] >= 1
    assert pipe.looked_up == 0 and not cache.entries, "refused before looking anything up"
    holder.join(10)
    assert len(model.predict(None, ["a"], {"adapter": "style/1", "num_inference_steps": 2})) == 1
    assert list(cache.entries) == ["style/1"], "with the model free, looked up and downloaded"


def test_an_adapter_request_past_its_deadline_gets_the_generations_timeout(cache, tmp_path, monkeypatch) -> None:
    monkeypatch.delenv(TIMEOUT_ENV, raising=False)
    register_adapter(tmp_path / "src", "style", 4)
    model, pipe = _served(cache, max_waiting=1)
    holder = _generating(model, 40)  # no deadline for it
    model.timeout_s = 0.2  # what the server's --timeout sets, for the next request
    with pytest.raises(MlflowException, match=r"waited 0.2 s for the model") as info:
        model.predict(None, ["a"], {"adapter": "style/1", "num_inference_steps": 2})
    assert info.value.get_http_status_code() == 504 and pipe.looked_up == 0 and not cache.entries
    holder.join(10)
    model.timeout_s = 1e-6  # past by the time the adapter is looked up
    with pytest.raises(MlflowException, match=rf"stopped after 1e-06 s \({TIMEOUT_ENV}\), at image 1 of 1, "
                                              "before looking up adapter style/1") as info:
        model.predict(None, ["a"], {"adapter": "style/1", "num_inference_steps": 2})
    assert info.value.get_http_status_code() == 504 and not cache.entries and not model.turns.model.locked()
    model.timeout_s = None
    assert len(model.predict(None, ["a"], {"adapter": "style/1", "num_inference_steps": 2})) == 1
    assert list(cache.entries) == ["style/1"] and pipe.looked_up == 2
