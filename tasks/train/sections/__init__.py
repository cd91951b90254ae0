"""The `train` section's shared settings, the keys every method reads, grouped by concern: one
model per group, each with its own checks (method, data, schedule, optimizer, precision and memory,
outputs, launch). The keys only one method reads are that method's options model, in its spec
(tasks/train/method_specs/). TrainConfig (tasks/train/config.py) is all of them together:
params.yaml keeps its flat `train.<key>` names and code reads `cfg.<key>`, while each key is defined
and checked beside the keys of its concern."""
