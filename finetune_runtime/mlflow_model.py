"""The file MLflow loads a registered version from ("models from code"): it sets the pyfunc.

The register stage logs it as the model's `python_model`, and this package as its `code_paths`.
"""
import mlflow

from finetune_runtime.model import DiffusionImageModel

mlflow.models.set_model(DiffusionImageModel())
