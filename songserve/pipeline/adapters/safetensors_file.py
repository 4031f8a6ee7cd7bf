"""The safetensors file format, read and written with torch alone (no ``safetensors`` package here).

The format (huggingface/safetensors, ``docs``): 8 bytes little-endian ``N``, then ``N`` bytes of a
UTF-8 JSON object mapping each tensor's name to ``{"dtype", "shape", "data_offsets": [begin, end]}``
(offsets into the byte buffer that follows; an optional ``"__metadata__"`` entry of strings), then
the buffer, little-endian, row-major. Reading checks every rule a loader must (the header's size
and JSON, each entry's dtype, shape and offsets agreeing with each other and with the file's
length, no overlap), so a file that is not safetensors is refused with what is wrong, never read
as garbage. Files are small (adapters): read whole.
"""

from __future__ import annotations

import json
import math
import struct
from pathlib import Path

import torch

DTYPES: dict[str, torch.dtype] = {
    "F64": torch.float64,
    "F32": torch.float32,
    "F16": torch.float16,
    "BF16": torch.bfloat16,
    "I64": torch.int64,
    "I32": torch.int32,
    "I16": torch.int16,
    "I8": torch.int8,
    "U8": torch.uint8,
    "BOOL": torch.bool,
}
NAMES = {v: k for k, v in DTYPES.items()}
MAX_HEADER = 100 * 2**20  # the reference implementation's limit


class SafetensorsError(ValueError):
    """The file is not a well-formed safetensors file; the message says what is wrong."""


def read_safetensors(path: Path) -> dict[str, torch.Tensor]:
    """Every tensor of the file, on the CPU, in its stored dtype."""
    data = path.read_bytes()
    if len(data) < 8:
        raise SafetensorsError("shorter than a safetensors header (8 bytes)")
    (n,) = struct.unpack("<Q", data[:8])
    if n > MAX_HEADER or 8 + n > len(data):
        raise SafetensorsError(f"its header length ({n} bytes) does not fit the file ({len(data)} bytes)")
    try:
        header = json.loads(data[8 : 8 + n].decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise SafetensorsError(f"its header is not JSON ({exc})") from None
    if not isinstance(header, dict):
        raise SafetensorsError("its header is not a JSON object")
    buf = memoryview(data)[8 + n :]
    out: dict[str, torch.Tensor] = {}
    spans: list[tuple[int, int]] = []
    for name, entry in header.items():
        if name == "__metadata__":
            continue
        if not isinstance(entry, dict) or not {"dtype", "shape", "data_offsets"} <= set(entry):
            raise SafetensorsError(f"entry {name!r} lacks dtype, shape or data_offsets")
        dtype = DTYPES.get(entry["dtype"])
        shape, offsets = entry["shape"], entry["data_offsets"]
        if dtype is None:
            raise SafetensorsError(f"entry {name!r} has an unknown dtype {entry['dtype']!r}")
        if not (isinstance(shape, list) and all(isinstance(d, int) and d >= 0 for d in shape)):
            raise SafetensorsError(f"entry {name!r} has a bad shape {shape!r}")
        if not (isinstance(offsets, list) and len(offsets) == 2 and all(isinstance(o, int) for o in offsets)):
            raise SafetensorsError(f"entry {name!r} has bad data_offsets {offsets!r}")
        begin, end = offsets
        size = math.prod(shape) * torch.empty(0, dtype=dtype).element_size()
        if not 0 <= begin <= end <= len(buf) or end - begin != size:
            raise SafetensorsError(
                f"entry {name!r}: data_offsets {offsets} do not hold shape {shape} of {entry['dtype']}"
            )
        spans.append((begin, end))
        raw = bytes(buf[begin:end])
        t = torch.frombuffer(bytearray(raw), dtype=dtype) if raw else torch.empty(0, dtype=dtype)
        out[name] = t.reshape(shape)
    spans.sort()
    for (_, e1), (b2, _) in zip(spans, spans[1:], strict=False):
        if b2 < e1:
            raise SafetensorsError("two entries' data overlap")
    return out


def write_safetensors(path: Path, tensors: dict[str, torch.Tensor], metadata: dict[str, str] | None = None) -> None:
    """Write ``tensors`` (contiguous CPU copies are made) as one safetensors file, atomically."""
    header: dict[str, object] = {}
    if metadata:
        header["__metadata__"] = dict(metadata)
    blobs: list[bytes] = []
    at = 0
    for name in sorted(tensors):
        t = tensors[name].detach().to("cpu").contiguous()
        raw = t.reshape(-1).view(torch.uint8).numpy().tobytes() if t.numel() else b""
        header[name] = {"dtype": NAMES[t.dtype], "shape": list(t.shape), "data_offsets": [at, at + len(raw)]}
        blobs.append(raw)
        at += len(raw)
    head = json.dumps(header, separators=(",", ":")).encode("utf-8")
    head += b" " * (-len(head) % 8)  # the buffer starts 8-aligned, as the reference writer does
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_bytes(struct.pack("<Q", len(head)) + head + b"".join(blobs))
    tmp.replace(path)
