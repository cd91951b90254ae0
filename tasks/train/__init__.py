"""Stage `train`: fine-tune the base model (DreamBooth now; more methods share the same loop)."""
