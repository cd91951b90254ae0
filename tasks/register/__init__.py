"""Model registration (not a DVC stage): the fine-tuned pipeline and its OpenVINO export become
one MLflow pyfunc model version with lineage tags, alias `candidate`, and `champion` when the
evaluation gate passed.

Run by the flow after the stages, or alone: `python -m tasks.register --finetuned models/finetuned
--openvino models/openvino --evaluation reports/evaluate.json`.
"""
