"""Where the time goes: per-kernel GPU time and traffic of the op, jaxcp's or FLA's, under
Nsight Compute or torch's profiler (``kernels``), each stage of the Pallas pipeline timed
alone (``stages``), and the registers and spills of the KDA kernels without a GPU
(``registers``)."""
