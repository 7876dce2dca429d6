"""The built-in models the recipes train (CNN, MLP, causal transformer)."""
