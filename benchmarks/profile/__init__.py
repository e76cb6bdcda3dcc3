"""Where the time goes: per-kernel GPU time and traffic of the op, jaxcp's or FLA's, under
Nsight Compute or torch's profiler (``kernels``), each stage of the Pallas pipeline timed
alone (``stages``), the registers and spills of the KDA kernels without a GPU
(``registers``), and the kernels, busy and idle time of a context-parallel call on one
device of several under JAX's profiler (``cp``)."""
