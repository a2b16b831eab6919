"""The main job with a broken codec: ``--compression silent`` decodes every value as zero.

int8 on the wire, nothing delivered (and no uncompressed warm-up): the optimizer never sees a
gradient, so the run must fail its verify step (``DID NOT TRAIN``), however lossy a codec may be.
Run under ``shardline run`` with the main job's flags after the script.
"""

from __future__ import annotations

import sys

import torch

from shardline.compression import registry
from shardline.compression.quantize import Int8
from shardline.examples import train


class Silent(Int8):
    """Int8 whose decoding returns zeros."""

    name = "silent"

    def decode_blocks(self, codes: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
        """Zeros, whatever was sent."""
        return torch.zeros(codes.shape, dtype=torch.float32, device=codes.device)


if __name__ == "__main__":
    registry.BY_NAME["silent"] = lambda: Silent(warmup_steps=0)
    sys.exit(train.main(["--compression", "silent", *sys.argv[1:]]))
