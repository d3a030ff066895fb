"""What the host has (GPUs, RDMA ports, /proc and /sys files), read from sysfs: shared by the worker-agent's
recipe rules and the node preflight (``infera.tools.preflight``)."""
