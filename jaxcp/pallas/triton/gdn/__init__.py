"""Gated DeltaNet's Triton kernels (scalar gate)."""
