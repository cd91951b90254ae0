"""Pipeline stages. Each stage is a package run as `python -m tasks.<stage>` from dvc.yaml."""
