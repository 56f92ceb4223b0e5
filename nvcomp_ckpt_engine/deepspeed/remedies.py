"""What a refused DeepSpeed load says to do: the conversion for another data-parallel size,
the way out of a folder whose save did not finish."""

from __future__ import annotations

import os
import shlex

from .. import discovery, manifest


def universal_dir(save_dir: str) -> str:
    """Where the refusal of an elastic load suggests writing the universal checkpoint."""
    return os.path.normpath(save_dir) + "_universal"


def to_universal_command(save_dir: str, tag: str) -> str:
    """The shell command that converts `tag` of `save_dir`, quoted where the shell needs it."""
    words = (save_dir, universal_dir(save_dir), "--tag", tag)
    return f"`nvcomp-ckpt to-universal {' '.join(shlex.quote(w) for w in words)}`"


def elastic_remedy(save_dir: str, tag: str, found: manifest.Manifest) -> str:
    """How to load a checkpoint at another data-parallel size: the two steps that work."""
    if any(found.layout.get(key, 1) != 1 for key in ("tp", "pp")):
        return (
            "Load it with the saved layout: nvcomp-ckpt to-universal converts data-parallel "
            f"checkpoints only (DeepSpeed's own route: `nvcomp-ckpt decompress {save_dir} OUT`, "
            "then ds_to_universal --inject_missing_state)"
        )
    return (
        "Load it with the saved layout, or resume on another number of GPUs in two steps: "
        f"{to_universal_command(save_dir, tag)} (once, on one machine), then set "
        '"checkpoint": {"load_universal": true} in ds_config and call '
        f"engine.load_checkpoint({universal_dir(save_dir)!r}). (DeepSpeed's own route, "
        f"`nvcomp-ckpt decompress` to a plain copy, then ds_to_universal "
        "--inject_missing_state, works too but writes the state twice more.)"
    )


def unlisted_message(path: str, tag_dir: str, found: manifest.Manifest | None) -> str:
    if found is not None:
        return (
            f"{path} is not listed in the manifest of {tag_dir}: it is not part of that "
            "checkpoint, so it is not opened (a file placed there later, or a leftover)"
        )
    save_dir = os.path.dirname(tag_dir)
    complete = discovery.find_complete_checkpoints(save_dir)
    hint = (
        f" The newest complete checkpoint in {save_dir} is {complete[0]!r}: load it with "
        f"load_checkpoint({save_dir!r}, tag={complete[0]!r})."
        if complete
        else f" {save_dir} holds no complete checkpoint."
    )
    return (
        f"{tag_dir} was written by nvcomp_ckpt_engine but has no {manifest.MANIFEST_NAME}: its "
        "save did not complete (a rank failed or the job stopped during the save), so nothing "
        f"in it is loaded, {path} included.{hint}"
    )


__all__ = ["elastic_remedy", "to_universal_command", "universal_dir", "unlisted_message"]
