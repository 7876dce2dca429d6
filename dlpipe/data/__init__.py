"""The built-in datasets the recipes train on (JPEG images, token sequences, tabular rows)."""
