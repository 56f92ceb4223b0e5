"""The data path between tensors and shard files, one module per job:

- `plan`: tensors grouped into storages, each storage's codec plan, derived ranges
  (`prepare_shard`);
- `encode`: encode → device-to-host → write, synchronous (`write_prepared`) or captured first
  for an asynchronous save (`stage`, `write_staged`), or copied on its GPU and encoded beside
  training (`snapshot_on_device`, `write_snapshot`); the codecs set up ahead (`warm_up`);
- `decode`: read → host-to-device → decode, of whole shards (`read_shard`) or single storages
  and spans (`read_storage`, `read_storage_span`), or straight into the caller's tensors
  (`read_storages_into`); a storage declaring more than its bytes
  plausibly hold proven by decoding before anything is allocated for it (`prove_storage`);
- `map_location`: where loaded storages go (`destination`) and the tensors viewing them;
- `bounds`: codec threads, batches in flight, and the host staging memory bounds they give;
- `gpu_cache`: an async save's GPU budget, taken from memory torch's allocator has cached.

The names below are what the rest of the package uses.
"""

from . import gpu_cache
from .bounds import default_workers, load_staging_bound, save_staging_bound
from .decode import (DerivedFiller, prove_storage, read_shard, read_storage, read_storage_span,
                     read_storages_into)
from .encode import (DeviceSnapshot, ShardInfo, StagedShard, gpu_headroom_bytes, snapshot_bytes,
                     snapshot_on_device, stage, warm_up, write_prepared, write_snapshot,
                     write_staged)
from .map_location import MapLocation, destination, view_tensor
from .plan import PreparedShard, prepare_shard

__all__ = [
    "DerivedFiller", "DeviceSnapshot", "MapLocation", "PreparedShard", "ShardInfo", "StagedShard", "default_workers",
    "destination", "gpu_cache", "gpu_headroom_bytes", "load_staging_bound", "prepare_shard",
    "prove_storage", "read_shard", "read_storage", "read_storage_span", "read_storages_into",
    "save_staging_bound", "snapshot_bytes", "snapshot_on_device", "stage", "view_tensor",
    "warm_up", "write_prepared", "write_snapshot", "write_staged",
]
