"""Tensors between numpy / torch and attnd.v1.Tensor (raw little-endian, row-major).

numpy arrays: float16 and float32 map to FLOAT16 and FLOAT32; bfloat16 has no numpy type, so a
float32 (or float16) array sent as BFLOAT16 is rounded to nearest even here, and a BFLOAT16
answer comes back as float32 (exact). torch tensors (CPU or CUDA): float16, bfloat16, float32
as they are; answers come back as torch tensors of the same dtype on the caller's device.
"""
import numpy as np

from attnd.v1 import attnd_pb2 as pb

DTYPES = {
    "float16": pb.DTYPE_FLOAT16,
    "bfloat16": pb.DTYPE_BFLOAT16,
    "float8_e4m3": pb.DTYPE_FLOAT8_E4M3,
    "float32": pb.DTYPE_FLOAT32,
}
_ALIASES = {"fp16": "float16", "half": "float16", "bf16": "bfloat16", "fp8": "float8_e4m3",
            "fp8_e4m3": "float8_e4m3", "float8_e4m3fn": "float8_e4m3", "fp32": "float32",
            "float": "float32"}
_NAMES = {value: name for name, value in DTYPES.items()}
ELEMENT_BYTES = {pb.DTYPE_FLOAT16: 2, pb.DTYPE_BFLOAT16: 2, pb.DTYPE_FLOAT8_E4M3: 1,
                 pb.DTYPE_FLOAT32: 4}


def dtype_enum(dtype):
    """attnd.v1.DType of a name ("bfloat16", "bf16", ...), a torch/numpy dtype or the enum."""
    if dtype is None:
        return None
    if isinstance(dtype, int):
        return dtype
    name = str(dtype).replace("torch.", "")
    name = _ALIASES.get(name, name)
    if name not in DTYPES:
        raise ValueError(f"dtype: expected one of {sorted(DTYPES)}, got {dtype!r}")
    return DTYPES[name]


def dtype_name(dtype):
    return _NAMES[dtype_enum(dtype)]


def float32_to_bfloat16_bits(array):
    """Rounds float32 values to bfloat16 (nearest even; NaN stays NaN) as uint16 bit patterns."""
    bits = np.ascontiguousarray(array, dtype=np.float32).view(np.uint32)
    rounded = (bits + (0x7FFF + ((bits >> 16) & 1))) >> 16
    nan = (bits & 0x7FFFFFFF) > 0x7F800000
    return np.where(nan, (bits >> 16) | 0x40, rounded).astype(np.uint16)


def bfloat16_bits_to_float32(bits):
    return (np.asarray(bits, dtype=np.uint16).astype(np.uint32) << 16).view(np.float32)


def is_torch(value):
    return type(value).__module__.startswith("torch")


def _torch():
    import torch  # imported only when a torch tensor is involved
    return torch


def _torch_dtype(dtype):
    torch = _torch()
    return {pb.DTYPE_FLOAT16: torch.float16, pb.DTYPE_BFLOAT16: torch.bfloat16,
            pb.DTYPE_FLOAT32: torch.float32}[dtype]


def encode_bytes(value, dtype):
    """The raw little-endian bytes of `value` (numpy array or torch tensor) as `dtype`."""
    dtype = dtype_enum(dtype)
    if is_torch(value):
        torch = _torch()
        tensor = value.detach().to(device="cpu", dtype=_torch_dtype(dtype)).contiguous()
        if dtype == pb.DTYPE_BFLOAT16:
            return tensor.view(torch.int16).numpy().tobytes()
        return tensor.numpy().tobytes()
    array = np.asarray(value)
    if dtype == pb.DTYPE_BFLOAT16:
        if array.dtype == np.uint16:  # already bfloat16 bit patterns
            return np.ascontiguousarray(array).tobytes()
        return float32_to_bfloat16_bits(array).tobytes()
    numpy_dtype = {pb.DTYPE_FLOAT16: "<f2", pb.DTYPE_FLOAT32: "<f4"}.get(dtype)
    if numpy_dtype is None:
        raise ValueError(f"dtype: cannot send {dtype_name(dtype)} tensors")
    return np.ascontiguousarray(array, dtype=numpy_dtype).tobytes()


def default_dtype(value):
    """The wire dtype a tensor travels as when the caller names none."""
    name = str(value.dtype).replace("torch.", "")
    if name in ("float16", "bfloat16", "float32"):
        return DTYPES[name]
    if name == "uint16":
        return pb.DTYPE_BFLOAT16
    raise ValueError(f"tensor dtype {value.dtype} has no attnd dtype; pass dtype=")


def to_proto(value, dtype=None):
    """An attnd.v1.Tensor of a numpy array or torch tensor, converted to `dtype` when given."""
    dtype = dtype_enum(dtype) if dtype is not None else default_dtype(value)
    shape = list(value.shape)
    return pb.Tensor(dtype=dtype, shape=shape, data=encode_bytes(value, dtype))


def to_numpy(tensor):
    """A numpy array of an attnd.v1.Tensor (BFLOAT16 widened to float32, exactly)."""
    shape = tuple(tensor.shape)
    if tensor.dtype == pb.DTYPE_BFLOAT16:
        return bfloat16_bits_to_float32(np.frombuffer(tensor.data, dtype="<u2")).reshape(shape)
    numpy_dtype = {pb.DTYPE_FLOAT16: "<f2", pb.DTYPE_FLOAT32: "<f4"}.get(tensor.dtype)
    if numpy_dtype is None:
        raise ValueError(f"cannot read a {_NAMES.get(tensor.dtype, tensor.dtype)} tensor")
    return np.frombuffer(tensor.data, dtype=numpy_dtype).reshape(shape).copy()


def to_torch(tensor, device=None):
    """A torch tensor of an attnd.v1.Tensor, on `device` (CPU by default)."""
    torch = _torch()
    if tensor.dtype == pb.DTYPE_BFLOAT16:
        flat = torch.from_numpy(np.frombuffer(tensor.data, dtype="<i2").copy()).view(torch.bfloat16)
    elif tensor.dtype in (pb.DTYPE_FLOAT16, pb.DTYPE_FLOAT32):
        numpy_dtype = "<f2" if tensor.dtype == pb.DTYPE_FLOAT16 else "<f4"
        flat = torch.from_numpy(np.frombuffer(tensor.data, dtype=numpy_dtype).copy())
    else:
        raise ValueError(f"cannot read a {_NAMES.get(tensor.dtype, tensor.dtype)} tensor")
    out = flat.reshape(tuple(tensor.shape))
    return out.to(device, non_blocking=False) if device is not None else out


def like(tensor, reference):
    """`tensor` (attnd.v1.Tensor) as the kind of object `reference` is: a torch tensor on the
    reference's device, or a numpy array. None stays None."""
    if tensor is None:
        return None
    if reference is not None and is_torch(reference):
        return to_torch(tensor, reference.device)
    return to_numpy(tensor)


def wire_numpy_dtype(dtype):
    """The numpy dtype holding `dtype`'s raw elements (bfloat16 as uint16 bit patterns)."""
    return {pb.DTYPE_FLOAT16: np.dtype("<f2"), pb.DTYPE_BFLOAT16: np.dtype("<u2"),
            pb.DTYPE_FLOAT32: np.dtype("<f4"), pb.DTYPE_FLOAT8_E4M3: np.dtype("u1")}[dtype]


def to_wire_numpy(value, dtype):
    """`value` (numpy or torch, any float dtype) as a host numpy array of `dtype`'s raw
    elements (bfloat16: uint16 bit patterns), copying only where a conversion needs it."""
    dtype = dtype_enum(dtype)
    if is_torch(value):
        torch = _torch()
        tensor = value.detach().to(device="cpu", dtype=_torch_dtype(dtype))
        if dtype == pb.DTYPE_BFLOAT16:
            return tensor.view(torch.int16).numpy().view(np.uint16)
        return tensor.numpy()
    array = np.asarray(value)
    if dtype == pb.DTYPE_BFLOAT16:
        return array if array.dtype == np.uint16 else float32_to_bfloat16_bits(array)
    return array.astype(wire_numpy_dtype(dtype), copy=False)


def from_wire_numpy(array, dtype, reference=None):
    """A copy of raw elements `array` as the kind of object `reference` is: a torch tensor of
    `dtype` on the reference's device, or numpy (bfloat16 widened to float32)."""
    dtype = dtype_enum(dtype)
    if reference is not None and is_torch(reference):
        torch = _torch()
        if dtype == pb.DTYPE_BFLOAT16:
            out = torch.from_numpy(array.view(np.int16).copy()).view(torch.bfloat16)
        else:
            out = torch.from_numpy(array.copy())
        return out.to(reference.device)
    if dtype == pb.DTYPE_BFLOAT16:
        return bfloat16_bits_to_float32(array)
    return array.copy()
