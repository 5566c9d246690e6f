"""One consolidated Lightning checkpoint file from a distributed checkpoint directory.

Run as ``python -m lightning_parallel.checkpoint.consolidate CKPT_DIR OUT_FILE``.
"""

from __future__ import annotations

import argparse
import os
from typing import Any

import torch

from lightning_parallel.checkpoint import distributed
from lightning_parallel.checkpoint.directory import META_NAME, is_checkpoint_dir
from lightning_parallel.io import atomic

__all__ = ["DCP_KEY", "FORMAT", "consolidate_checkpoint", "read_meta"]

DCP_KEY = "distributed_checkpoint"  # meta.pt's record of how the directory was written
FORMAT = "lightning_parallel.dcp/1"


def read_meta(path: str, weights_only: bool | None = None) -> dict[str, Any]:
    """``meta.pt`` of a distributed checkpoint directory (Lightning's loop and callback state, ...).

    Raises:
        ValueError: ``path`` is not such a directory.
    """
    if not os.path.isdir(path) or not is_checkpoint_dir(path):
        raise ValueError(
            f"{path!r} is not a distributed checkpoint directory (one holds {META_NAME} and .metadata, as "
            "PipelineStrategy(save_distributed_checkpoint=True) writes): pass such a directory, or a "
            "checkpoint file"
        )
    meta = torch.load(os.path.join(path, META_NAME), map_location="cpu", weights_only=bool(weights_only))
    if not isinstance(meta, dict) or meta.get(DCP_KEY, {}).get("format") != FORMAT:
        raise ValueError(f"{path!r} was not written by PipelineStrategy(save_distributed_checkpoint=True)")
    return meta


def consolidate_checkpoint(checkpoint_dir: str | os.PathLike, out_file: str | os.PathLike) -> str:
    """Turn a distributed checkpoint directory into one ordinary Lightning checkpoint file; return its path.

    Reads every shard in this process (it needs the whole model's memory, on CPU) and writes
    ``out_file`` atomically (tagged with its SHA-256 as Rank0Checkpoint's files): the unsplit module's
    ``state_dict`` and the optimizer states in torch's single-device layout, so
    ``Model.load_from_checkpoint(out_file)`` and ``Trainer.fit(..., ckpt_path=out_file)`` work on one
    device (or any strategy that reads full checkpoints).

    Raises:
        ValueError: ``checkpoint_dir`` is not a directory written with ``save_distributed_checkpoint=True``.

    Example::

        consolidate_checkpoint("checkpoints/epoch=3-step=800.ckpt", "model.ckpt")
        model = GPT.load_from_checkpoint("model.ckpt")
    """
    path = str(checkpoint_dir)
    meta = read_meta(path)
    record = meta.pop(DCP_KEY)
    everything = distributed.read_all(path)
    checkpoint = dict(meta)
    checkpoint["state_dict"] = _section(everything, "state_dict")
    if record["optimizer_types"]:
        checkpoint["optimizer_states"] = [
            distributed.single_device_optimizer_state(
                _section(everything, f"optimizer_{i}"), record["model_param_order"], type_name
            )
            for i, type_name in enumerate(record["optimizer_types"])
        ]
    tag = {"step": int(meta.get("global_step", -1)), "epoch": int(meta.get("epoch", -1))}
    atomic.save_checkpoint_file(checkpoint, str(out_file), tag)
    return str(out_file)


def _section(flat: dict[str, Any], prefix: str) -> dict[str, Any]:
    return {k[len(prefix) + 1 :]: v for k, v in flat.items() if k.startswith(f"{prefix}.")}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        prog="python -m lightning_parallel.checkpoint.consolidate",
        description="Write one Lightning checkpoint file from a distributed checkpoint directory.",
    )
    parser.add_argument("checkpoint_dir")
    parser.add_argument("out_file")
    args = parser.parse_args(argv)
    print(consolidate_checkpoint(args.checkpoint_dir, args.out_file))


if __name__ == "__main__":
    main()
