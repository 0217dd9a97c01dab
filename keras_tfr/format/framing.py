"""TFRecord framing: the one home of the frame layout and its masked CRC.

A TFRecord file is a sequence of frames, each::

    uint64  length             little-endian, bytes of data
    uint32  masked_crc(length) CRC-32C of the 8 length bytes, masked
    byte    data[length]       here: one serialized `tf.train.Example`
    uint32  masked_crc(data)   CRC-32C of the data, masked

``masked(crc) = ((crc >> 15) | (crc << 17)) + 0xa282ead8`` (mod 2**32), as TensorFlow's
`TFRecordWriter` writes and `TFRecordDataset` checks. keras-tfr's readers and writer
import these facts from here.
"""

from __future__ import annotations

import struct

import numpy as np

from keras_tfr import _crc

HEADER_BYTES = 12  # length + masked CRC of the length
FOOTER_BYTES = 4  # masked CRC of the data
OVERHEAD = HEADER_BYTES + FOOTER_BYTES

masked = _crc.masked
masked_bytes = _crc.masked_bytes


MASK_DELTA = 0xA282EAD8


def unmasked(values: np.ndarray) -> np.ndarray:
    """The CRC-32Cs behind masked CRCs, for an array of them (any unsigned dtype)."""
    rot = (values.astype(np.uint64) - MASK_DELTA) & 0xFFFFFFFF
    return (((rot >> 17) | (rot << 15)) & 0xFFFFFFFF).astype(np.uint32)


def frame_size(length: int) -> int:
    """Bytes a record of ``length`` data bytes takes in a file."""
    return length + OVERHEAD


def header(length: int) -> bytes:
    """The 12 bytes before a record of ``length`` data bytes."""
    head = struct.pack("<Q", length)
    return head + masked_bytes(_crc.crc32c([head]))
