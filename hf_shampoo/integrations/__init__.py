"""Thin adapters between ``hf_shampoo`` and other libraries (Transformers, Accelerate, timm).

Each submodule imports its library only when used, so ``import hf_shampoo`` stays light.
"""
