"""Stage `base`: resolve `base.model` into a diffusers pipeline folder (models/base/)."""
