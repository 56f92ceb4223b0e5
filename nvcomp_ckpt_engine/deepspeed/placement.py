"""Where a rank's own ZeRO optimizer shard is decoded: straight into GPU memory, or host memory.

DeepSpeed loads each rank's optimizer shard with ``map_location="cpu"`` and then copies it onto
the GPU in ``optimizer.load_state_dict``, from pageable memory: 2.3 s for the 15.7 GB shard of a
1.3B model on the H200, a sixth of a cold load. Our decoder runs on the GPU anyway, so tensors
that were saved from a GPU can be decoded straight into GPU memory instead of being copied down
and up again. That is safe for what DeepSpeed does with the shard: torch's
``Optimizer.load_state_dict`` keeps a tensor that is already on its parameter's device and dtype
(no copy), and ZeRO copies its fp32 partitions into its own buffers (a GPU-to-GPU copy). Tensors
saved in host memory (ZeRO-Offload's state, CPU ``step`` counters) stay in host memory.

The cost is GPU memory: the shard's size, next to the state it replaces, until DeepSpeed drops
the old state at the end of the load. ``"load_to_gpu"``: ``"auto"`` decodes onto the GPU when
that fits with `HEADROOM_BYTES` to spare, ``true`` always (a `CheckpointError` when it does not
fit), ``false`` never (DeepSpeed's own placement).
"""

from __future__ import annotations

import logging
from collections.abc import Sequence

import torch

from ..errors import CheckpointError

logger = logging.getLogger(__name__)

#: GPU memory left free after decoding a shard onto the GPU in ``"auto"`` mode: room for
#: DeepSpeed's own allocations during the rest of the load.
HEADROOM_BYTES = 2 << 30


def available_gpu_bytes(device: torch.device) -> int:
    """Bytes `device` can still allocate: free in the driver plus torch's cached, unused blocks."""
    free, _ = torch.cuda.mem_get_info(device)
    return free + torch.cuda.memory_reserved(device) - torch.cuda.memory_allocated(device)


def shard_map_location(
    storages: Sequence[tuple[str, int]],
    *,
    mode: bool | str,
    device: torch.device,
    available_bytes: int,
    path: str,
) -> dict[str, str] | None:
    """A `map_location` that decodes the GPU-saved storages of the shard at `path` onto `device`.

    `storages` are the shard's (saved device, bytes); storages saved in host memory map to
    ``"cpu"``. None: decode as DeepSpeed asked (`mode` false, nothing saved on a GPU, or, in
    ``"auto"`` mode, not enough of `available_bytes`).
    """
    gpu_bytes = sum(nbytes for location, nbytes in storages if location.startswith("cuda"))
    if mode is False or gpu_bytes == 0:
        return None
    if gpu_bytes + HEADROOM_BYTES > available_bytes:
        message = (
            f"{path}: decoding its {gpu_bytes / 1e9:.2f} GB of GPU-saved tensors onto {device} "
            f"needs {(gpu_bytes + HEADROOM_BYTES) / 1e9:.2f} GB with headroom, "
            f"{available_bytes / 1e9:.2f} GB is available"
        )
        if mode is True:
            raise CheckpointError(
                f"{message}; set \"load_to_gpu\": \"auto\" (host memory when it does not fit) or "
                "false in the nvcomp_checkpoint section"
            )
        logger.info("%s: loading it into host memory, as DeepSpeed asks", message)
        return None
    logger.info("%s: decoding %.2f GB onto %s (load_to_gpu=%s)", path, gpu_bytes / 1e9, device, mode)
    return {location: str(device) if location.startswith("cuda") else "cpu" for location, _ in storages}
