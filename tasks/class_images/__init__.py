"""Stage `class_images`: generate the prior-preservation class images with the base model (resumable)."""
