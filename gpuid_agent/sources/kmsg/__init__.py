"""The kernel log (/dev/kmsg) as an optional source of what NVIDIA's drivers print: XIDs with
their text, GPUs that fell off the bus, NVSwitch SXIDs. Imported only when KERNEL_LOG is set."""
