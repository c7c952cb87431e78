"""A simulated GPU node: NVML in Python and an in-process kubelet, for demos and benchmarks."""
