"""Kimi Delta Attention's Triton kernels (per-channel gate)."""
