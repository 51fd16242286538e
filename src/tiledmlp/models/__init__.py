"""Built-in models that plan, bench and train share: reference MLP modules (mlps.py) and the
model presets (presets.py: tiny random-init causal LMs built from a config, reference shapes).

Invariant: these import torch only at module level (transformers lazily, to build a preset), so
every layer above may use them without importing each other.
"""
