"""The preflight's flags, declared once (flag, ``INFERA_PREFLIGHT_*`` env var, default)."""

from __future__ import annotations

from pydantic import Field, create_model, field_validator, model_validator
from pydantic_settings import SettingsConfigDict

from infera_common.settings import InferaSettings, directory_to_write

#: the probes of one node, in report order: flag name -> what it looks at
NODE_PROBES = {
    "host": "CPUs, memory, NUMA nodes, the locked-memory limit RDMA needs",
    "gpu": "AMD GPUs from the amdgpu driver's KFD topology: count, gfx target, VRAM, driver",
    "network": "network interfaces and RDMA ports and their state",
    "firmware": "the GPUs' MEC firmware versions",
    "storage": "the storage under --storage-path (or the largest local mount): free space and throughput",
    "compute": "each GPU's bf16 GEMM throughput (needs PyTorch with ROCm)",
    "hbm": "each GPU's memory copy bandwidth (needs PyTorch with ROCm)",
    "p2p": "copy bandwidth between each pair of GPUs (needs PyTorch with ROCm)",
    "topology": "the links between GPUs (xGMI or PCIe) and the GPUs' NUMA nodes",
    "fabric": "each active RDMA port's link layer, RoCE v2 IPv4 GIDs and MTU",
}
#: the probes across nodes (under SLURM, every node at once)
FLEET_PROBES = {
    "netperf": "RoCE bandwidth between the nodes' RDMA NICs",
    "mooncake": "Mooncake KV transfer between nodes",
    "mori": "Mori KV transfer between nodes",
}


class _Settings(InferaSettings):
    model_config = SettingsConfigDict(env_prefix="INFERA_PREFLIGHT_", extra="ignore", validate_default=True)


#: one flag per probe (``--gpu``, ``--no-gpu``): run it; none given, every probe runs
_ProbeFlags = create_model("_ProbeFlags", __base__=_Settings, **{
    name: (bool, Field(False, description=f"Run the {name} probe: {what}. No probe flag: every probe."))
    for name, what in {**NODE_PROBES, **FLEET_PROBES}.items()
})


class PreflightSettings(_ProbeFlags):
    dump_path: str = Field("output/preflight", description="Directory for each host's JSON and the HTML report "
                           "(give every node the same shared directory).")
    report_file_name: str = Field("infera_preflight_report", description="The HTML report's file name, without .html.")
    storage_path: str = Field("", description="Directory the storage probe measures (default: the local mount "
                              "with the most free space).")
    storage_gb: float = Field(4.0, ge=0, description="GiB the storage probe writes and reads back (0: no "
                              "throughput test).")
    collect_only: bool = Field(False, description="Write this host's JSON and stop (no report).")
    render_only: bool = Field(False, description="Probe nothing: combine the JSON files in --dump-path into the "
                              "report.")
    wait_timeout: float = Field(300.0, gt=0, description="Seconds the reporting host (SLURM rank 0) waits for every "
                                "node's JSON before it renders the report with what it has.")
    host_name: str | None = Field(None, description="This node's name in the report; default: the runbooks' "
                                  "PREFLIGHT_HOST, else SLURMD_NODENAME, else HOSTNAME, else the system's (inside a "
                                  "container the hostname is the container's id: pass the node's).")
    image: str | None = Field(None, description="The engine image the report names; default: the runbooks' "
                              "PREFLIGHT_IMAGE, else 'unknown'.")

    # checked before the probes run (the storage probe alone may take a minute)
    _dump_path_form = field_validator("dump_path")(directory_to_write)

    @model_validator(mode="after")
    def _one_mode(self) -> PreflightSettings:
        if self.collect_only and self.render_only:
            raise ValueError("--collect-only (probe, write this host's JSON, no report) and --render-only (no "
                             "probe, only the report) exclude each other: give one")
        return self

    def selected(self) -> list[str]:
        """The probes asked for; none asked: every one."""
        names = [*NODE_PROBES, *FLEET_PROBES]
        return [n for n in names if getattr(self, n)] or names
