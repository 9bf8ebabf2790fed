"""Streaming safetensors I/O: read a header, read row blocks with plain file reads (no mmap,
so the resident set stays the block size), write a file tensor by tensor at precomputed offsets.

The format: 8-byte little-endian header length, a JSON header ``{name: {dtype, shape,
data_offsets: [begin, end]}, "__metadata__": {...}}`` padded with spaces to a multiple of 8,
then the tensor bytes back to back.
"""
from __future__ import annotations

import json
import math
import os
import struct
from pathlib import Path

DTYPE_SIZE = {"BF16": 2, "F16": 2, "F32": 4, "F64": 8, "I8": 1, "U8": 1, "I16": 2, "I32": 4,
              "I64": 8, "BOOL": 1, "F8_E4M3": 1, "F8_E5M2": 1, "U16": 2, "U32": 4, "U64": 8}


def torch_dtype(code: str):
    import torch

    table = {"BF16": torch.bfloat16, "F16": torch.float16, "F32": torch.float32, "F64": torch.float64,
             "I8": torch.int8, "U8": torch.uint8, "I16": torch.int16, "I32": torch.int32,
             "I64": torch.int64, "BOOL": torch.bool}
    if code not in table:
        raise ValueError(f"unsupported safetensors dtype {code!r}; valid: {', '.join(table)}")
    return table[code]


def dtype_code(dtype) -> str:
    import torch

    table = {torch.bfloat16: "BF16", torch.float16: "F16", torch.float32: "F32", torch.float64: "F64",
             torch.int8: "I8", torch.uint8: "U8", torch.int16: "I16", torch.int32: "I32",
             torch.int64: "I64", torch.bool: "BOOL"}
    return table[dtype]


def read_header(path) -> tuple[dict, int]:
    """Return ``(header, data_start)``; ``header`` includes ``__metadata__`` if present."""
    with open(path, "rb") as f:
        raw = f.read(8)
        if len(raw) != 8:
            raise ValueError(f"{path}: not a safetensors file (too short)")
        (n,) = struct.unpack("<Q", raw)
        if n > 100_000_000:
            raise ValueError(f"{path}: not a safetensors file (header length {n})")
        header = json.loads(f.read(n))
    return header, 8 + n


def nbytes(entry: dict) -> int:
    return math.prod(entry["shape"]) * DTYPE_SIZE[entry["dtype"]]


class Reader:
    """Row-block reads of 2-D (or any) tensors of one safetensors file."""

    def __init__(self, path):
        self.path = Path(path)
        self.header, self.data_start = read_header(path)
        self.f = open(path, "rb")

    def close(self):
        self.f.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    @property
    def names(self) -> list[str]:
        return [k for k in self.header if k != "__metadata__"]

    def entry(self, name: str) -> dict:
        return self.header[name]

    def read_bytes(self, name: str, start: int = 0, length: int | None = None) -> bytes:
        e = self.header[name]
        b, end = e["data_offsets"]
        length = (end - b - start) if length is None else length
        self.f.seek(self.data_start + b + start)
        data = self.f.read(length)
        if len(data) != length:
            raise ValueError(f"{self.path}: truncated tensor {name}")
        return data

    def rows(self, name: str, r0: int, r1: int):
        import torch

        e = self.header[name]
        shape = e["shape"]
        row_bytes = (math.prod(shape[1:]) if len(shape) > 1 else 1) * DTYPE_SIZE[e["dtype"]]
        buf = bytearray(self.read_bytes(name, r0 * row_bytes, (r1 - r0) * row_bytes))
        t = torch.frombuffer(buf, dtype=torch_dtype(e["dtype"])) if buf else torch.empty(0, dtype=torch_dtype(e["dtype"]))
        return t.reshape(r1 - r0, *shape[1:])

    def tensor(self, name: str):
        return self.rows(name, 0, self.header[name]["shape"][0]) if self.header[name]["shape"] else \
            self._scalar(name)

    def _scalar(self, name):
        import torch

        e = self.header[name]
        return torch.frombuffer(bytearray(self.read_bytes(name)), dtype=torch_dtype(e["dtype"])).reshape(())

    def copy_to(self, name: str, out, chunk: int = 64 << 20) -> None:
        e = self.header[name]
        b, end = e["data_offsets"]
        pos = b
        while pos < end:
            n = min(chunk, end - pos)
            self.f.seek(self.data_start + pos)
            out.write(self.f.read(n))
            pos += n


class Writer:
    """Write a safetensors file whose tensor list (name, dtype code, shape) is known up front.

    Tensors are laid out in the given order; write a tensor whole with :meth:`put`, or in row
    blocks with :meth:`put_rows`, or by raw copy with :meth:`copy_from`. :meth:`finish` fsyncs.
    """

    def __init__(self, path, specs: list[tuple[str, str, list[int]]], metadata: dict | None = None):
        self.path = Path(path)
        header: dict = {}
        if metadata:
            header["__metadata__"] = {str(k): str(v) for k, v in metadata.items()}
        off = 0
        for name, code, shape in specs:
            n = math.prod(shape) * DTYPE_SIZE[code]
            header[name] = {"dtype": code, "shape": list(shape), "data_offsets": [off, off + n]}
            off += n
        self.total = off
        self.header = header
        raw = json.dumps(header, separators=(",", ":")).encode()
        raw += b" " * (-len(raw) % 8)
        self.data_start = 8 + len(raw)
        self.f = open(self.path, "wb")
        self.f.write(struct.pack("<Q", len(raw)))
        self.f.write(raw)
        self.f.truncate(self.data_start + self.total)

    def _seek(self, name: str, start: int = 0):
        self.f.seek(self.data_start + self.header[name]["data_offsets"][0] + start)

    def put(self, name: str, tensor) -> None:
        self.put_rows(name, 0, tensor)

    def put_rows(self, name: str, r0: int, tensor) -> None:
        import torch

        e = self.header[name]
        t = tensor.detach().to("cpu").contiguous()
        if dtype_code(t.dtype) != e["dtype"]:
            raise ValueError(f"{name}: dtype {t.dtype} != declared {e['dtype']}")
        shape = e["shape"]
        row_bytes = (math.prod(shape[1:]) if len(shape) > 1 else 1) * DTYPE_SIZE[e["dtype"]]
        data = t.reshape(-1).view(torch.uint8).numpy() if t.numel() else b""
        end = r0 * row_bytes + len(data)
        if end > nbytes(e):
            raise ValueError(f"{name}: write past the end of the tensor")
        self._seek(name, r0 * row_bytes)
        self.f.write(memoryview(data) if len(data) else b"")

    def copy_from(self, reader: Reader, name: str, src_name: str | None = None) -> None:
        self._seek(name)
        reader.copy_to(src_name or name, self.f)

    def finish(self) -> None:
        self.f.flush()
        os.fsync(self.f.fileno())
        self.f.close()

    def abort(self) -> None:
        try:
            self.f.close()
        finally:
            self.path.unlink(missing_ok=True)


def fsync_dir(path) -> None:
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def atomic_write_text(path, text: str) -> None:
    path = Path(path)
    tmp = path.with_name(path.name + ".onecard-tmp")
    with open(tmp, "w") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    fsync_dir(path.parent)
