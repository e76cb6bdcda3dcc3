"""Gated DeltaNet's Mosaic GPU kernels (scalar gate)."""
