"""Orchestration: the Prefect flow `finetune`, its server (`make serve`), the demo summary."""
