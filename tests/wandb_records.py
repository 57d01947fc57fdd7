"""What an offline W&B run recorded, read back without W&B's servers (its SDK has no reader).

The run file is a LevelDB-style log: a 7-byte file header, then 32 KiB blocks of records, each
with a 7-byte header (crc32, length, type: 1 full, 2 first, 3 middle, 4 last piece) holding
a serialized `wandb.proto.wandb_internal_pb2.Record`."""

from __future__ import annotations

import json
import struct
from pathlib import Path

BLOCK, HEADER = 32768, 7


def wandb_history(path: Path) -> list[dict]:
    """The history rows (`run.log` calls) of one offline run file, oldest first."""
    from wandb.proto import wandb_internal_pb2 as pb

    data, pos, rows, pieces = path.read_bytes(), HEADER, [], b""
    while pos + HEADER <= len(data):
        room = BLOCK - pos % BLOCK
        _, length, kind = struct.unpack("<IHB", data[pos : pos + HEADER]) if room >= HEADER else (0, 0, 0)
        if kind == 0:  # the zero padding at a block's end
            pos += room
            continue
        pieces = (b"" if kind in (1, 2) else pieces) + data[pos + HEADER : pos + HEADER + length]
        pos += HEADER + length
        if kind in (1, 4):
            record = pb.Record()
            record.ParseFromString(pieces)
            if record.WhichOneof("record_type") == "history":
                rows.append(
                    {item.key or "/".join(item.nested_key): json.loads(item.value_json) for item in record.history.item}
                )
    return rows
