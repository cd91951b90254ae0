"""The `train` section's settings, grouped by concern: one model per group, each with its own
checks (data, adapters, optimizer, schedule, precision and memory, outputs, launch). TrainConfig
(tasks/train/config.py) is all of them together: params.yaml keeps its flat `train.<key>` names and
code reads `cfg.<key>`, while each key is defined and checked beside the keys of its concern."""
