"""Stage `evaluate`: images from the exported model (and the base), scored as in DreamBooth."""
