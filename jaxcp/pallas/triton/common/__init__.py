"""What the Triton kernels of both gates share."""
