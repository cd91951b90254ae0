"""What a registered model needs at run time, shared by the pipeline's stages and the served model.

A registered version logs this package whole as its code (MLflow `code_paths`), and the stages
import it as they import any package, so a rule written here is the same rule in both places and
the served model never re-implements what a stage does. It imports nothing from the project
(`tasks`, `flows`): a version loads in a Python that has only this package, MLflow and the model's
libraries.

- layout.py: the names of a version's artifacts and of the files a train output holds;
- convention.py: how a family's pipeline is called (`CallConvention`), recorded in the model's config;
- size.py: the one rule for the size of the images a call makes;
- pipeline_call.py: one call of a pipeline, for every stage and the served model;
- adapters.py: adapters applied to a loaded pipeline;
- load.py: a version's artifacts loaded as the pipeline that serves them (its back ends: `BACKENDS`);
- registry.py: `Registry`, the one registry style of families, methods, adapter types, adapter output
  formats and serving back ends (here, so the served model's back ends use it too);
- limits.py, images.py: what a request may ask, its input images;
- genai_serving.py, adapter_cache.py, base_reference.py: a base export serving registered adapters,
  and a base registered by reference;
- model.py: the MLflow pyfunc; mlflow_model.py: the file MLflow loads it from; quiet.py: the scope it
  loads and predicts in, where the libraries it imports keep quiet.
"""
