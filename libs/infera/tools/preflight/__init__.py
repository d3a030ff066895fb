"""``python -m infera.tools.preflight``: check a node before engines are launched on it.

Each probe reads what the node offers (``/proc``, ``/sys``: the amdgpu driver's KFD topology, the
RDMA devices, the mounts) and says what it found as findings of level ``info``, ``warn`` or
``fail``. One JSON file per host goes to ``--dump-path``; one host (rank 0 under SLURM) then
combines every host's file into an HTML report and flags values that differ across the fleet.
Exit code 2 when any finding is ``fail``, else 0. See ``docs/preflight.md``.
"""
