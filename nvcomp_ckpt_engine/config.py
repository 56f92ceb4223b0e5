"""One validated, frozen configuration object for the engine.

A DeepSpeed user turns the engine on with a top-level ``"nvcomp_checkpoint"`` section of
``ds_config.json``; Python users pass keyword arguments. Both paths build the same
`NvcompConfig`, and both reject an unknown key or a bad value with a `ValueError` that names the
key and what it accepts, at initialize time rather than at the first save an hour later.
`NvcompConfig` extends `options.CompressionOptions` (how shards are compressed: its defaults
and its checks) with the keys only the DeepSpeed engine has.

The JSON keys are the field names, except ``"async"`` (a Python keyword), which is the field
`async_save`.
"""

from __future__ import annotations

import dataclasses
import difflib
import re
from collections.abc import Mapping
from typing import Any, ClassVar

from .options import CompressionOptions, check_io_path, is_number
from .tiers.tiered import LocalTierOptions

#: The ds_config section that configures the engine.
SECTION = "nvcomp_checkpoint"

#: JSON key -> dataclass field, where they differ.
_FIELD_OF_KEY = {"async": "async_save"}
_KEY_OF_FIELD = {field: key for key, field in _FIELD_OF_KEY.items()}

# "module.QualName": dotted identifiers, at least one dot.
_QUALNAME = re.compile(r"^[A-Za-z_]\w*(\.[A-Za-z_]\w*)+$")


@dataclasses.dataclass(frozen=True)
class NvcompConfig(CompressionOptions):
    """How checkpoints are compressed, committed and loaded.

    Attributes (JSON key in brackets where it differs): those of `CompressionOptions`
    (algorithm, portable, chunk_mb, gpu_batch_mb), and
        enabled: use the engine for DeepSpeed checkpoints. Off unless set, like DeepSpeed's own
            ``"enabled"`` switches, so a section can be kept in a config and turned off.
        verify: check checksums when loading (per chunk, and each file against the manifest).
        trusted_classes: extra classes a checkpoint may create when loaded, as
            "module.QualName" strings; the engine's default allowlist already covers what
            DeepSpeed 0.19 writes.
        trust_plain_checkpoints: read plain torch files in folders the engine did not make (a
            checkpoint saved before the engine was turned on) with
            ``torch.load(weights_only=False)``, as DeepSpeed's own engine does, which runs
            whatever code a file names; off, they are read with the allowlist above
            (`torchsave.load_file`), which DeepSpeed's own checkpoints pass.
        async_save ["async"]: capture the state (compressed on the GPU and copied to host
            memory, or snapshotted) and write it in the background; the manifest and ``latest``
            appear at a later step, once every rank's data is durable.
        async_host_memory_gb: cap on host memory an async save may hold; None = derived from
            free memory per local rank.
        async_gpu_memory_gb: GPU memory an async save's compressed payloads may still occupy,
            on their way to host memory, once training resumes, so that training waits for the
            GPU encoding only; 0 = wait for the copies too; None = half of what the job's peak
            GPU memory before its first save leaves spare (`pipeline.gpu_headroom_bytes`).
            Taken only from memory the allocator has cached (`pipeline.gpu_cache`), which the
            engine grows after the first training step (by the raw state on the GPU) and after
            a save that wanted more.
        async_gpu_snapshot: where that GPU memory holds a raw copy of a file's GPU state, copy
            the state there (device to device) and encode the copy beside the next training
            steps, so training waits for the copy only (`api.save_async`; the default: on an H100
            it blocked 0.144 s on a first save and 0.074 s after, against 0.213 s encoding
            first); false: always encode before training resumes.
        keep_last: keep only the newest N complete checkpoints in the save directory (None =
            keep all).
        fallback_to_complete: when ``latest`` is missing, empty, stale or names a checkpoint
            that is incomplete or damaged, resume from the newest intact checkpoint (with a
            warning naming it) instead of raising an error that names it. A checkpoint counts as
            damaged when a file's size, or (with ``verify``) the CRC-32 its shard index records,
            differs from the manifest; ``"verify"`` also reads every byte of the candidate's
            files against the manifest's CRC-32 before resuming (slower: rank 0 reads them all).
        commit_timeout_s: how long a rank waits for the others at the commit before failing.
        log_jsonl: path of a JSON-lines file to which rank 0 appends one record per commit
            (None = no such log).
        async_if_busy: what a save does while the previous async save is still being
            written: ``"wait"`` for it (then commit it and go on) or ``"refuse"`` (raise
            `CheckpointError` on every rank; the pending save carries on).
        o_direct: write shard files with ``O_DIRECT`` (bypassing the page cache), for file
            systems where that is measured faster; buffered writes start their writeback as they
            go either way. A file system that refuses ``O_DIRECT`` gets buffered writes and a
            warning.
        local_tier: the node-local tier (docs/DEEPSPEED.md, "Node-local tier"): ``{"path":
            folder on each node's local disk or /dev/shm, "{node}" replaced by the node's index;
            "replicas": copies of each file on other nodes (1); "keep_last": local checkpoints
            kept per node (2); "persist_every": drain every n-th local checkpoint to the save
            folder (1)}``, or null (off: checkpoints go to the save folder alone).
        load_to_gpu: decode a rank's own ZeRO optimizer shard straight into GPU memory, where
            DeepSpeed would copy it anyway, instead of the host memory DeepSpeed asks for:
            ``"auto"`` when it fits in free GPU memory, true always (an error if it does not
            fit), false never. Tensors saved in host memory stay there (`deepspeed.placement`).
        io_path: how GPU-coded payloads reach the shard file: ``"pinned"`` (copied into pinned
            host memory, written from there), ``"gds"`` (written from GPU memory through
            GPUDirect Storage: needs the ``gds-cu12``/``gds-cu13`` extra, kvikio; cuFile where
            the system has nvidia-fs, kvikio's compatibility mode otherwise) or ``"auto"``
            (`options.AUTO_IO_PATH`, the faster one measured). Sync saves and async saves that
            snapshot on the GPU take it; an async capture stages in pinned memory anyway.
    """

    enabled: bool = False
    verify: bool = True
    trusted_classes: tuple[str, ...] = ()
    trust_plain_checkpoints: bool = False
    async_save: bool = False
    async_host_memory_gb: float | None = None
    async_gpu_memory_gb: float | None = None
    async_gpu_snapshot: bool = True
    keep_last: int | None = None
    fallback_to_complete: bool | str = False
    commit_timeout_s: float = 1800.0
    log_jsonl: str | None = None
    async_if_busy: str = "wait"
    o_direct: bool = False
    load_to_gpu: bool | str = "auto"
    io_path: str = "auto"
    local_tier: LocalTierOptions | Mapping[str, Any] | None = None

    _ORIGIN: ClassVar[str] = f"{SECTION}: "

    def __post_init__(self) -> None:
        super().__post_init__()
        for name in ("enabled", "verify", "async_save", "async_gpu_snapshot", "o_direct",
                     "trust_plain_checkpoints"):
            self._check_bool(name)
        if not (isinstance(self.fallback_to_complete, bool) or self.fallback_to_complete == "verify"):
            raise ValueError(self._invalid("fallback_to_complete", self.fallback_to_complete,
                                          'true, false or "verify"'))
        if isinstance(self.trusted_classes, (str, bytes)) or not isinstance(
            self.trusted_classes, (list, tuple)
        ):
            raise ValueError(self._invalid("trusted_classes", self.trusted_classes,
                                          'a list of "module.QualName" strings'))
        for name in self.trusted_classes:
            if not isinstance(name, str) or not _QUALNAME.match(name):
                expected = 'a "module.QualName" string, e.g. "argparse.Namespace"'
                raise ValueError(self._invalid("trusted_classes", name, expected))
        object.__setattr__(self, "trusted_classes", tuple(self.trusted_classes))
        if self.async_host_memory_gb is not None:
            self._check_positive("async_host_memory_gb", "or null (auto)")
            object.__setattr__(self, "async_host_memory_gb", float(self.async_host_memory_gb))
        if self.async_gpu_memory_gb is not None:
            if not is_number(self.async_gpu_memory_gb) or self.async_gpu_memory_gb < 0:
                raise ValueError(self._invalid("async_gpu_memory_gb", self.async_gpu_memory_gb,
                                               "a number of GiB >= 0, or null (auto)"))
            object.__setattr__(self, "async_gpu_memory_gb", float(self.async_gpu_memory_gb))
        if self.keep_last is not None:
            self._check_int("keep_last", low=1, extra="or null (keep all)")
        self._check_positive("commit_timeout_s", "")
        if self.async_if_busy not in ("wait", "refuse"):
            raise ValueError(self._invalid("async_if_busy", self.async_if_busy, '"wait" or "refuse"'))
        if not (isinstance(self.load_to_gpu, bool) or self.load_to_gpu == "auto"):
            raise ValueError(self._invalid("load_to_gpu", self.load_to_gpu, '"auto", true or false'))
        check_io_path(self.io_path, origin=self._ORIGIN)
        object.__setattr__(self, "commit_timeout_s", float(self.commit_timeout_s))
        if self.local_tier is not None:
            object.__setattr__(self, "local_tier", self._local_tier(self.local_tier))
        if self.log_jsonl is not None and not (isinstance(self.log_jsonl, str) and self.log_jsonl):
            raise ValueError(self._invalid("log_jsonl", self.log_jsonl, "a file path string or null"))

    def _local_tier(self, section: Any) -> LocalTierOptions:
        """The ``"local_tier"`` section, each key checked and named in the error."""
        if isinstance(section, LocalTierOptions):
            section = dataclasses.asdict(section)
        if not isinstance(section, Mapping):
            raise ValueError(self._invalid("local_tier", section, 'an object {"path": ...} or null'))
        allowed = {f.name for f in dataclasses.fields(LocalTierOptions)}
        unknown = sorted(set(section) - allowed, key=str)
        if unknown:
            raise ValueError(f"{self._ORIGIN}unknown key 'local_tier.{unknown[0]}'; allowed keys: "
                             f"{sorted(allowed)}")
        path = section.get("path")
        if not isinstance(path, str) or not path.strip():
            raise ValueError(self._invalid("local_tier.path", path, "a folder path string (with "
                                           '"{node}" where several nodes share one machine)'))
        if "{" in path.replace("{node}", "") or "}" in path.replace("{node}", ""):
            raise ValueError(self._invalid("local_tier.path", path, 'no placeholder but "{node}"'))
        values = {"path": path}
        for key, low in (("replicas", 0), ("keep_last", 1), ("persist_every", 1)):
            value = section.get(key, getattr(LocalTierOptions, key))
            if not (isinstance(value, int) and not isinstance(value, bool) and value >= low):
                raise ValueError(self._invalid(f"local_tier.{key}", value, f"an integer >= {low}"))
            values[key] = value
        return LocalTierOptions(**values)

    @classmethod
    def _key(cls, field: str) -> str:
        """The field's JSON key in the section."""
        return _KEY_OF_FIELD.get(field, field)

    def _check_int(self, field: str, *, low: int, extra: str = "") -> None:
        value = getattr(self, field)
        if not (isinstance(value, int) and not isinstance(value, bool) and value >= low):
            raise ValueError(self._invalid(field, value, f"an integer >= {low} {extra}".strip()))

    def _check_positive(self, field: str, extra: str) -> None:
        value = getattr(self, field)
        if not (is_number(value) and value > 0):
            raise ValueError(self._invalid(field, value, f"a positive number {extra}".strip()))

    @classmethod
    def from_mapping(cls, section: Mapping[str, Any]) -> NvcompConfig:
        """Build from the ``"nvcomp_checkpoint"`` section's JSON object (JSON key names)."""
        if not isinstance(section, Mapping):
            raise ValueError(
                f"ds_config[{SECTION!r}] must be a JSON object, got {type(section).__name__}"
            )
        kwargs: dict[str, Any] = {}
        for key, value in section.items():
            field = _FIELD_OF_KEY.get(key, key)
            if key in _KEY_OF_FIELD or field not in _FIELDS:
                raise ValueError(_unknown_key(key))
            kwargs[field] = value
        return cls(**kwargs)

    @classmethod
    def from_ds_config(cls, ds_config: Mapping[str, Any] | None) -> NvcompConfig:
        """Build from a whole ds_config dict; no section means the engine is off."""
        if not ds_config or SECTION not in ds_config:
            return cls()
        return cls.from_mapping(ds_config[SECTION])

    def replace(self, **changes: Any) -> NvcompConfig:
        """A copy with `changes` (field names), validated like a new object."""
        unknown = set(changes) - _FIELDS
        if unknown:
            raise ValueError(
                f"unknown option(s) {sorted(unknown)}; allowed: {sorted(_FIELDS)}"
            )
        return dataclasses.replace(self, **changes)

    def to_json(self) -> dict[str, Any]:
        """The section as JSON (for logs and the manifest)."""
        out = {}
        for field in dataclasses.fields(self):
            value = getattr(self, field.name)
            if isinstance(value, LocalTierOptions):
                value = dataclasses.asdict(value)
            out[self._key(field.name)] = (
                list(value) if isinstance(value, tuple) else value
            )
        return out


_FIELDS = frozenset(f.name for f in dataclasses.fields(NvcompConfig))


def _unknown_key(key: Any) -> str:
    """The error for a key the section does not have, with the key it is closest to."""
    close = difflib.get_close_matches(key, json_keys(), n=1) if isinstance(key, str) else []
    meant = f" (did you mean {close[0]!r}?)" if close else ""
    return f"{SECTION}: unknown key {key!r}{meant}; allowed keys: {sorted(json_keys())}"


def section_mistake(ds_config: Mapping[str, Any] | None) -> str | None:
    """Why a ds_config that looks meant for the engine does not turn it on, or None.

    DeepSpeed accepts unknown top-level keys silently, so a misspelled section (any key that
    starts with "nvcomp" but is not ``"nvcomp_checkpoint"``) or the section without
    ``"enabled"`` would leave DeepSpeed's own engine saving every checkpoint, unnoticed until
    someone looks at the files. ``"enabled": false`` is a choice, not a mistake.
    """
    if not isinstance(ds_config, Mapping):
        return None
    lookalikes = sorted(k for k in ds_config
                        if isinstance(k, str) and k.lower().startswith("nvcomp") and k != SECTION)
    if lookalikes:
        keys = ", ".join(repr(k) for k in lookalikes)
        if SECTION in ds_config:
            return (f"ds_config key(s) {keys} are ignored: nvcomp_ckpt_engine reads only the "
                    f"{SECTION!r} section; merge them into it or remove them")
        return (f"ds_config has {keys} but no {SECTION!r} section, so DeepSpeed's default "
                f"checkpoint engine is used; rename it to {SECTION!r} "
                f'(with "enabled": true) to use nvcomp_ckpt_engine')
    section = ds_config.get(SECTION)
    if isinstance(section, Mapping) and "enabled" not in section:
        return (f'ds_config\'s {SECTION!r} section has no "enabled" key, so DeepSpeed\'s default '
                f'checkpoint engine is used; add "enabled": true to it to use nvcomp_ckpt_engine '
                f'(or "enabled": false to keep it off without this warning)')
    return None


def json_keys() -> frozenset[str]:
    """Every key the ``"nvcomp_checkpoint"`` section accepts."""
    return frozenset(_KEY_OF_FIELD.get(name, name) for name in _FIELDS)


__all__ = ["NvcompConfig", "SECTION", "json_keys", "section_mistake"]
