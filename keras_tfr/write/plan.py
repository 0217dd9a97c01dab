"""`Layout`: how a data set's samples are cut into records and shards.

Planned once, from the first batch and the options (`plan_layout`), or read back from
the journal of a conversion being resumed; after that every batch is cut the same way.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

from keras_tfr.format.framing import OVERHEAD
from keras_tfr.schema import MAX_RECORD_BYTES, BlockEncoder, FeatureSpec, Lattice, plan_lattice
from keras_tfr.write.inputs import Batch, mean_sample_bytes
from keras_tfr.write.options import WriteOptions


@dataclasses.dataclass(frozen=True)
class Layout:
    """The data set's structure, features (in key order), and record and shard sizes;
    ``key_order``: per dict role, its names in the order the first batch gave them."""

    structure: dict[str, str]
    specs: list[FeatureSpec]
    samples_per_record: int
    record_bytes: int
    records_per_shard: int
    compression: str | None
    lattice: Lattice | None = None
    shuffle_seed: int | None = None  # the samples' write order (`WriteOptions.shuffle_seed`)
    key_order: dict[str, list[str]] = dataclasses.field(default_factory=dict)

    def config(self) -> dict[str, Any]:
        """The fields the manifest and the journal share."""
        return {
            "structure": self.structure,
            "features": [s.to_json() for s in self.specs],
            "samples_per_record": self.samples_per_record,
            "record_bytes": self.record_bytes,
            **({"lattice": self.lattice.to_json()} if self.lattice is not None else {}),
            "compression": self.compression,
            **({"shuffle_seed": self.shuffle_seed} if self.shuffle_seed is not None else {}),
            **({"key_order": self.key_order} if self.key_order else {}),
        }


def plan_layout(batch: Batch, options: WriteOptions) -> Layout:
    """The layout for data like `batch`; ValueError when the sizes cannot work."""
    specs = list(batch.specs)
    sample_bytes = sum(s.sample_bytes for s in specs)
    variable = any(s.kind != "fixed" for s in specs)
    encoder = BlockEncoder(specs)
    if variable:  # sized from the first batch's mean sample
        mean = sum(map(mean_sample_bytes, batch.specs, batch.arrays))
        sample_bytes = max(1, math.ceil(mean))

    def record_bytes(spr: int) -> int:
        if variable:
            return spr * sample_bytes + 32 * (1 + 2 * len(specs))
        return encoder.fixed_layout(spr)[2]

    def on_disk(spr: int) -> int:  # a record and its TFRecord framing
        return record_bytes(spr) + OVERHEAD

    shard_bytes = options.shard_bytes
    spr = options.samples_per_record
    if spr is None:
        spr = max(1, options.record_bytes // sample_bytes)
        if on_disk(spr) > shard_bytes:
            # A shard holds whole records: records shrink until one fits.
            framing = on_disk(1) - sample_bytes
            spr = max(1, (shard_bytes - framing) // sample_bytes)
            while spr > 1 and on_disk(spr) > shard_bytes:
                spr -= 1  # a few steps at most: only varint lengths grow with spr
    if on_disk(spr) > shard_bytes:
        if options.samples_per_record is not None and spr > 1:
            raise ValueError(
                f"Expected `shard_size` to hold at least one record of "
                f"`samples_per_record={spr}` samples, which takes {on_disk(spr)} bytes on "
                f"disk. Received: shard_size={shard_bytes} bytes. Raise `shard_size` "
                "or lower `samples_per_record`."
            )
        raise ValueError(
            f"Expected `shard_size` to hold at least one sample: a record of one sample "
            f"takes {on_disk(1)} bytes on disk ({sample_bytes} bytes of data"
            f"{' on average' if variable else ''} and {on_disk(1) - sample_bytes} of "
            f"framing). Received: shard_size={shard_bytes} bytes."
        )
    if spr * sample_bytes > MAX_RECORD_BYTES:
        raise ValueError(
            f"A record of {spr} samples of {sample_bytes} bytes would pass the 2 GiB "
            "protobuf limit: lower `samples_per_record`."
        )
    lattice = None
    if not variable and options.compression is None and options.lattice:
        lattice, spr = _on_lattice(specs, spr, options)
        encoder = BlockEncoder(specs, lattice)
    return Layout(
        structure=dict(batch.structure),
        specs=specs,
        samples_per_record=spr,
        record_bytes=record_bytes(spr),
        records_per_shard=_records_per_shard(record_bytes(spr), spr, options),
        compression=options.compression,
        lattice=lattice,
        shuffle_seed=options.shuffle_seed,
        key_order={role: list(names) for role, names in batch.key_order.items()},
    )


def _on_lattice(
    specs: list[FeatureSpec], spr: int, options: WriteOptions
) -> tuple[Lattice | None, int]:
    """The lattice and the samples per record to use with it, or ``(None, spr)`` where
    the padding would pass 1/16 of a record or a record would no longer fit in a shard.

    Sample mode reads uncompressed fixed-size data straight from mapped shards; on a
    lattice a sample is whole rows of one aligned tensor (`keras_tfr.schema.Lattice`).
    """
    plain = BlockEncoder(specs)
    lattice = plan_lattice(specs, plain.fixed_layout(spr)[2])
    if lattice is None:
        return None, spr
    padded = BlockEncoder(specs, lattice)
    sample_bytes = sum(s.sample_bytes for s in specs)
    sizes: dict[int, int] = {}

    def size(n: int) -> int:
        if n not in sizes:
            sizes[n] = padded.fixed_layout(n)[2]
        return sizes[n]

    candidates = [spr]
    if options.samples_per_record is None and spr > 1:
        # The padding depends on where the last feature ends: of the sizes down to 7/8
        # of this one, the one with the least padding per sample.
        candidates = list(range(spr, max(1, spr - spr // 8) - 1, -1))
    fits = [n for n in candidates if size(n) + OVERHEAD <= options.shard_bytes]
    if not fits:
        return None, spr
    best = min(fits, key=lambda n: (size(n) - n * sample_bytes) / n)
    padding = size(best) - plain.fixed_layout(best)[2]
    if padding * 16 > plain.fixed_layout(best)[2]:
        return None, spr
    return lattice, best


def _records_per_shard(record_bytes: int, spr: int, options: WriteOptions) -> int:
    per_shard = max(1, options.shard_bytes // (record_bytes + OVERHEAD))
    if options.expected_samples:
        total_records = math.ceil(options.expected_samples / spr)
        # Rounded down: ceil would give 5 shards of 2 for 10 records and min_shards=8.
        per_shard = min(per_shard, max(1, total_records // options.min_shards))
    return per_shard
