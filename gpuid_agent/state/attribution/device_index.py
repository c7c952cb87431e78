"""One inventory's GPUs and MIG devices by every form a device id can name them in: the
lookups the kubelet's device ids and DRA claims are resolved through.

A UUID NVML reports for two GPUs names neither: resolving it fails as `ambiguous_uuid`, so
its holder is listed unmapped with that reason instead of given to whichever GPU came last.
An index or device node naming one of those GPUs fails the same way: series and records know
a GPU's holders by its UUID, which would give the holder to both."""

from __future__ import annotations

from gpuid_agent.facts import GpuIdentity, MigDevice, NodeInventory
from gpuid_agent.sources.kubelet import DeviceIdError, DeviceRef


class DeviceIndex:
    """Lookups from every device-id form to (GPU, MIG device) of one inventory."""

    def __init__(self, inventory: NodeInventory) -> None:
        self.by_uuid: dict[str, GpuIdentity] = {}
        self.by_index: dict[int, GpuIdentity] = {}
        self.by_device: dict[str, GpuIdentity] = {}
        self.mig_by_uuid: dict[str, tuple[GpuIdentity, MigDevice]] = {}
        self.shared: dict[str, list[int]] = {}  # a UUID more than one GPU reports: indexes
        for gpu in inventory.gpus:
            uuid = gpu.uuid.lower()
            if uuid in self.by_uuid or uuid in self.shared:
                first = self.by_uuid.pop(uuid, None)
                self.shared.setdefault(uuid, [] if first is None else [first.index])
                self.shared[uuid].append(gpu.index)
            else:
                self.by_uuid[uuid] = gpu
            self.by_index[gpu.index] = gpu
            self.by_device[gpu.device] = gpu
            for mig in gpu.mig_devices:
                self.mig_by_uuid[mig.uuid.lower()] = (gpu, mig)

    def resolve(self, ref: DeviceRef) -> tuple[GpuIdentity, MigDevice | None]:
        """The GPU (and MIG device) a parsed id names; DeviceIdError when this node has none."""
        if ref.form == "mig_uuid":
            found = self.mig_by_uuid.get((ref.mig_uuid or "").lower())
            if found is None:
                raise DeviceIdError("unknown_mig", f"no MIG device {ref.mig_uuid} on this node")
            return found
        gpu = self._gpu(ref)
        if not ref.is_mig:
            return gpu, None
        for mig in gpu.mig_devices:
            if ref.mig_index is not None and mig.index == ref.mig_index:
                return gpu, mig
            if (
                ref.mig_index is None
                and mig.gpu_instance_id == ref.gpu_instance_id
                and ref.compute_instance_id in (None, mig.compute_instance_id)
            ):
                return gpu, mig
        raise DeviceIdError("unknown_mig", f"no such MIG device on GPU {gpu.index}")

    def _gpu(self, ref: DeviceRef) -> GpuIdentity:
        gpu: GpuIdentity | None = None
        if ref.gpu_uuid is not None:
            shared = self.shared.get(ref.gpu_uuid.lower())
            if shared is not None:
                raise DeviceIdError(
                    "ambiguous_uuid",
                    f"GPUs {', '.join(map(str, shared))} all report {ref.gpu_uuid}: "
                    "attributed to none of them",
                )
            gpu = self.by_uuid.get(ref.gpu_uuid.lower())
        elif ref.gpu_index is not None:
            gpu = self.by_index.get(ref.gpu_index)
        elif ref.gpu_minor is not None:
            gpu = self.by_device.get(f"nvidia{ref.gpu_minor}")
        if gpu is None:
            raise DeviceIdError("unknown_gpu", f"device id {ref.device_id} names no GPU here")
        if gpu.uuid.lower() in self.shared:  # everything downstream knows a GPU by its UUID
            raise DeviceIdError(
                "ambiguous_uuid", f"GPU {gpu.index} reports a UUID another GPU reports too"
            )
        return gpu
