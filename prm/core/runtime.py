"""Device, autocast dtype and torchrun plumbing."""
import contextlib
import gc
import os
import sys
from dataclasses import dataclass

import torch
import torch.distributed as dist


@dataclass
class Runtime:
    rank: int = 0
    world_size: int = 1
    device: torch.device = torch.device("cpu")

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    @property
    def distributed(self) -> bool:
        return self.world_size > 1


def setup() -> Runtime:
    """Under torchrun: a process group, nccl on CUDA, gloo on CPU."""
    cuda = torch.cuda.is_available()
    if "WORLD_SIZE" not in os.environ:
        return Runtime(device=torch.device("cuda" if cuda else "cpu"))
    device = torch.device("cuda", int(os.environ["LOCAL_RANK"])) if cuda else torch.device("cpu")
    if cuda:
        torch.cuda.set_device(device)
    dist.init_process_group("nccl" if cuda else "gloo", device_id=device if cuda else None)
    return Runtime(int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"]), device)


def teardown(rt: Runtime):
    """Ends the process group and fully_shard's meshes now: gloo threads alive at exit abort."""
    if rt.distributed:
        gc.collect()
        dist.destroy_process_group()
        meshes = sys.modules.get("torch.distributed.device_mesh")  # never imported: no mesh exists
        for m in [o for o in gc.get_objects() if meshes and isinstance(o, meshes.DeviceMesh)]:
            getattr(m, "_pg_registry", {}).clear()


def autocast_dtype(name, device: torch.device):
    """None (fp32), bf16 or fp16; name None: bf16 where the device runs it natively."""
    if name is None:
        cuda = device.type == "cuda" and torch.cuda.is_bf16_supported()
        return torch.bfloat16 if (cpu_has_bf16() if device.type == "cpu" else cuda) else None
    return {"fp32": None, "bf16": torch.bfloat16, "fp16": torch.float16}[name]


def gather_objects(obj, rt: Runtime) -> list:
    if not rt.distributed:
        return [obj]
    out = [None] * rt.world_size
    dist.all_gather_object(out, obj)
    return out


def decided_by_main(rt: Runtime, decide):
    """decide() by rank 0 alone; its value or exception reaches every rank."""
    if not rt.distributed:
        return decide()
    box = [None]
    if rt.is_main:
        try:
            box[0] = (decide(), None)
        except Exception as e:  # raised on every rank: none waits in a collective
            box[0] = (None, e)
    dist.broadcast_object_list(box, src=0)
    value, error = box[0]
    if error is not None:
        raise error
    return value


def barrier(rt: Runtime):
    if rt.distributed:
        dist.barrier()


@contextlib.contextmanager
def main_first(rt: Runtime):
    """Rank 0 runs the block (filling a cache) before the others."""
    if not rt.is_main:
        barrier(rt)
    yield
    if rt.is_main:
        barrier(rt)


def cpu_has_bf16() -> bool:
    """Native bf16 on this CPU (AMX, AVX512-BF16); PRM_CPU_BF16=1/0 overrides."""
    if os.environ.get("PRM_CPU_BF16") in ("0", "1"):
        return os.environ["PRM_CPU_BF16"] == "1"
    probes = ("_is_amx_tile_supported", "_is_avx512_bf16_supported")
    return any(getattr(torch.cpu, name, lambda: False)() for name in probes)


def progress_off(disable: bool) -> bool:
    """Whether progress bars (datasets', transformers' too) stay off: asked, or no terminal."""
    off = disable or not sys.stderr.isatty()
    if off:
        import datasets
        import transformers
        datasets.disable_progress_bars()
        transformers.utils.logging.disable_progress_bar()
    return off
