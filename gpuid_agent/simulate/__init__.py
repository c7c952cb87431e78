"""A simulated GPU node: NVML in Python (and, later, a kubelet), for demos and benchmarks."""
