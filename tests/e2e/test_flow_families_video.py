"""End to end with the real `dvc`, from `dvc repro` to the registered version: LTX-Video trained on the
demo clips (the truncated one rejected with its reason), exported with OVLTXPipeline, scored frame by
frame against the base, registered and served over HTTP as an MP4 decoded here.
The chain and its checks: tests/e2e/families_chain.py (PARTS["video"])."""
from __future__ import annotations

import pytest

from tests.e2e.families_chain import (  # noqa: F401 (the chain's tests, collected in this module)
    chain_fixtures,
    test_mlflow_models_serve_answers,
    test_the_export_loads_and_generates,
    test_the_lora_loads_with_the_family_pipeline,
)

pytestmark = pytest.mark.e2e

reproduced_families, pipeline = chain_fixtures("video")
