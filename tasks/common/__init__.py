"""Shared services for the stages: params, errors, tracking, model and image helpers."""
