"""End to end with the real `dvc`, from `dvc repro` to the registered version: SD3 (run-time
adapters over a shared base export, served over HTTP), FLUX.1 and Sana (DoRA on an int8 base).
The chain and its checks: tests/e2e/families_chain.py (PARTS["sd3_flux_sana"])."""
from __future__ import annotations

import pytest

from tests.e2e.families_chain import (  # noqa: F401 (the chain's tests, collected in this module)
    chain_fixtures,
    test_mlflow_models_serve_answers,
    test_the_export_loads_and_generates,
    test_the_lora_loads_with_the_family_pipeline,
)

pytestmark = pytest.mark.e2e

reproduced_families, pipeline = chain_fixtures("sd3_flux_sana")
