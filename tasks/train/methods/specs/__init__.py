"""The built-in methods' specs, one module each (no torch): tasks/train/methods/spec.py reads them."""
