"""A GGUF file's metadata and tensor table, read in one pass over its header.

gguf.GGUFReader builds a numpy view per array element of the metadata, 8.8 s for the demo's 49152-token
vocabulary (and its merges); the loader needs a few numbers, the chat template and the tensor table.
Here the header is walked with `struct` (string arrays decoded in a plain loop, numeric arrays with one
np.frombuffer each: about 0.1 s for the demo), and each tensor is a gguf.ReaderTensor over the file's
memory map, the form gguf.quants.dequantize takes. Format: https://github.com/ggml-org/ggml/blob/master/docs/gguf.md
(little-endian versions 2 and 3).
"""

import struct
from typing import Any

import numpy as np
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType, GGUFValueType, ReaderTensor
from gguf.quants import quant_shape_to_byte_shape

_V = GGUFValueType
_SCALARS = {_V.UINT8: "<B", _V.INT8: "<b", _V.UINT16: "<H", _V.INT16: "<h", _V.UINT32: "<I", _V.INT32: "<i",
            _V.FLOAT32: "<f", _V.BOOL: "<?", _V.UINT64: "<Q", _V.INT64: "<q", _V.FLOAT64: "<d"}
_Q = GGMLQuantizationType
# Tensor types stored as plain numbers; every other (quantized) type is handed over as its bytes.
_ITEM_TYPES = {_Q.F16: np.float16, _Q.F32: np.float32, _Q.F64: np.float64, _Q.I8: np.int8, _Q.I16: np.int16,
               _Q.I32: np.int32, _Q.I64: np.int64}
SUPPORTED_VERSIONS = (2, 3)
DEFAULT_ALIGNMENT = 32


class GGUFFormatError(ValueError):
    """The file is not a GGUF this reader understands (version, truncation, an unknown value type)."""


class GGUFFile:
    """`fields`: key -> value (numbers, str, bool, lists for arrays); `tensors`: gguf.ReaderTensor in file order."""

    def __init__(self, path: str) -> None:
        self.path = path
        self._map = np.memmap(path, mode="r")
        self._buf = memoryview(self._map)
        self._offset = 0
        try:
            self._read_header()
        except (struct.error, UnicodeDecodeError, ValueError) as e:
            raise GGUFFormatError(f"{path}: unreadable GGUF header: {e}") from None

    def get(self, key: str, default: Any = None) -> Any:
        return self.fields.get(key, default)

    def _read_header(self) -> None:
        magic, version = self._unpack("<4sI")
        if magic != b"GGUF" or version not in SUPPORTED_VERSIONS:
            raise GGUFFormatError(f"{self.path}: GGUF version {version} (readable: {SUPPORTED_VERSIONS})")
        tensor_count, kv_count = self._unpack("<QQ")
        self.fields: dict[str, Any] = {}
        for _ in range(kv_count):
            key = self._string()
            self.fields[key] = self._value(self._unpack("<I")[0])
        infos = [self._tensor_info() for _ in range(tensor_count)]
        alignment = int(self.fields.get("general.alignment", DEFAULT_ALIGNMENT))
        data_start = -(-self._offset // alignment) * alignment
        self.tensors = [self._tensor(data_start, *info) for info in infos]

    def _unpack(self, fmt: str) -> tuple:
        values = struct.unpack_from(fmt, self._buf, self._offset)
        self._offset += struct.calcsize(fmt)
        return values

    def _string(self) -> str:
        (length,) = self._unpack("<Q")
        start, self._offset = self._offset, self._offset + length
        if self._offset > len(self._buf):
            raise GGUFFormatError(f"{self.path}: a string runs past the end of the file")
        return str(self._buf[start:self._offset], "utf-8")

    def _value(self, value_type: int) -> Any:
        if value_type == _V.STRING:
            return self._string()
        if value_type == _V.ARRAY:
            item_type, count = self._unpack("<IQ")
            if item_type == _V.STRING:
                return [self._string() for _ in range(count)]
            if item_type in _SCALARS:
                dtype = np.dtype(_SCALARS[item_type])
                items = np.frombuffer(self._buf, dtype, count, self._offset)
                self._offset += count * dtype.itemsize
                return items.tolist()
            return [self._value(item_type) for _ in range(count)]  # arrays of arrays
        if value_type in _SCALARS:
            return self._unpack(_SCALARS[value_type])[0]
        raise GGUFFormatError(f"{self.path}: unknown metadata value type {value_type}")

    def _tensor_info(self) -> tuple[str, np.ndarray, GGMLQuantizationType, int]:
        name = self._string()
        (n_dims,) = self._unpack("<I")
        dims = np.array(self._unpack(f"<{n_dims}Q"), dtype=np.uint64)
        raw_type, offset = self._unpack("<IQ")
        return name, dims, GGMLQuantizationType(raw_type), offset

    def _tensor(self, data_start: int, name: str, dims: np.ndarray, qtype: GGMLQuantizationType,
                offset: int) -> ReaderTensor:
        n_elements = int(np.prod(dims, dtype=np.int64))
        block_size, type_size = GGML_QUANT_SIZES[qtype]
        n_bytes = n_elements * type_size // block_size
        shape = tuple(int(d) for d in reversed(dims.tolist()))  # numpy order: slowest first
        start = data_start + offset
        if start + n_bytes > len(self._map):
            raise GGUFFormatError(f"{self.path}: tensor {name!r} runs past the end of the file")
        if qtype in _ITEM_TYPES:
            data = self._map[start:start + n_bytes].view(_ITEM_TYPES[qtype]).reshape(shape)
        else:
            data = self._map[start:start + n_bytes].reshape(quant_shape_to_byte_shape(shape, qtype))
        return ReaderTensor(name=name, tensor_type=qtype, shape=dims, n_elements=n_elements, n_bytes=n_bytes,
                            data_offset=start, data=data, field=None)
