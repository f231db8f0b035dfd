"""Code formats: how one group of values becomes codes + per-group parameters, and back.

Every format dequantizes with one formula, so a kernel that implements it reads every format:

    x' = table[code] * scale + zero          (fp32; `zero` is 0 for formats that do not store it)

`table` is an fp32 vector of 2^bits entries fixed by the format (int: the integers; fp8: the values of the 256
bit patterns) or given per tensor / layer (lut: a codebook; nvfp4: E2M1 values times its per-tensor scale); `scale`
and `zero` are one per group, stored as the format declares (`param_encodings`: fp16 unless it says otherwise) and
read as a float that holds the stored value exactly (`param_dtype`: fp16, or fp32 for e8m0).
Groups are formed elsewhere (`kvq_lab.quant.groups.grouped`); a format only sees the grouped layout:

    g      [..., n_groups, G]   the values (any float dtype; arithmetic in fp32)
    valid  bool, broadcastable to g, or None: which elements may enter the group's statistics
    codes  uint8 [..., n_groups, G], every code < 2^bits (elements outside `valid` get code 0)
    scale  [..., n_groups] in its `param_dtype` (fp16 for most formats);  zero: the same, or None when the format
           stores no zero point

Parameter storage (`param_encodings`, a ClassVar mapping a parameter to its encoding where it is not fp16; bytes per
parameter in PARAM_ENCODINGS; the conversions are `kvq_lab.quant.formats.encodings`):

    fp16   2 bytes, read as is (every format before fp4)
    e4m3   1 byte: an fp8 E4M3 value (e4m3fn bits), read as the fp16 of that value (exact)
    e8m0   1 byte: a power of two 2^(e - 127) stored as its biased exponent e (OCP MX), read as fp32 (exact; fp16
           holds 2^-24 .. 2^15 only)

The byte accounting counts the stored width (`param_bytes_per_group`, `bits_per_element`, `tensor_nbytes`,
`kvq_lab.quant.pack.qtensor_nbytes`); packed storage holds the stored bytes and widens them on read
(`encode_params`, `decode_params`), so quantization, the formula above and the kernels see the read floats.

Registered formats (`FORMATS`: one registry line each below, imported on first lookup):
    int               asymmetric uniform integer, today's arithmetic (`kvq_lab.quant.reference`), bits 1-4, 8
    fp8_e4m3/e5m2     8-bit float codes times a per-group absmax scale, no zero point
    lut               2^bits arbitrary sorted code values (a codebook) under a per-group (scale, zero), bits 1-4, 8
    nuq               KVQuant's non-uniform codes: lut at 1-4 bits with a codebook fitted per layer (calibration)
    q8_0, q4_0, q4_1  llama.cpp's cache block types, ggml's arithmetic bit for bit (codes from the fp32 scale)
    q5_0, q5_1        the same at 5 bits (ggml's block_q5_0 / block_q5_1), packed 8 codes to a 40-bit word
    iq4_nl            llama.cpp's non-linear 4-bit type: 16 fixed values, a fitted fp16 scale per group
    turbo             TurboQuant's MSE stage: |x| / sqrt(n) per group, Lloyd-Max levels of N(0, 1), bits 1-4
    nvfp4             NVIDIA's FP4: E2M1 codes, an E4M3 scale per block (16: `group_size=16`), an fp32 scale per layer
                      and tensor fitted on calibration data (amax / (448 * 6))
    mxfp4             OCP MX FP4 (ggml's MXFP4 bit for bit): E2M1 codes, a power-of-two E8M0 scale per block (32)

Adding a format
---------------
One new file, `kvq_lab/quant/formats/<name>.py`, and its registry line in `FORMATS` below
(`"myfmt": "kvq_lab.quant.formats.myfmt:MyFormat"`):

    @register_format("myfmt")
    @dataclass(frozen=True)
    class MyFormat(CodeFormat):
        '''What it is, the paper, its arithmetic (the docstring is the specification).'''
        name: str = "myfmt"
        supported_bits = (2, 4)
        default_bits = 4                        # the width when the config gives none (`key_bits: null`)
        params = ("scale",)                     # what one group stores, in this order
        param_encodings = {"scale": "e4m3"}     # how, where not fp16 (PARAM_ENCODINGS); default: all fp16

        def build_table(self): ...              # -> fp32 [2^bits], on the CPU
        def quantize_groups(self, g, valid=None): ...   # -> codes, scale, zero (None if not in params)
        def error_bound(self, g, scale, zero): ...      # -> fp32 [..., n_groups, G], the worst case |x - x'|

A format that stores something once per tensor or layer says so in `table_bytes` (lut: its codebook; nvfp4: its fp32
tensor scale; the byte accounting adds it); one fitted on calibration data sets `fitted = True` and implements `fit`
(calibration calls it per layer; `nuq` and `nvfp4` are the examples).

`tests/quant/test_formats.py` iterates `FORMATS` and each format's `supported_bits`, so the new format is tested
(round trip within its own `error_bound`, codes in range, the dequantize formula, adversarial inputs) with no
test edit; `tests/quant/test_format_matrix.py` runs it through the reference, simulated and packed caches and every
kernel. Kernels declare the formats they read with `add_kernel_support` (the C and Triton kernels read the formula
above for any format: `"*"`); a format that a backend cannot read says so in `unsupported_backends`.

This module imports neither torch nor its plugins: `FORMATS` names each built-in plugin by "module:Name" and imports
it on first lookup (listing the names imports nothing); the plugin's `@register_format` runs as it is imported.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Mapping
from dataclasses import dataclass, fields
from functools import cache
from typing import TYPE_CHECKING, ClassVar

from kvq_lab.common.registry import Registry
from kvq_lab.quant.layout import packed_rows
from kvq_lab.quant.spec import QuantConfigError, QuantSpec

if TYPE_CHECKING:
    import torch

# how a per-group parameter may be stored (`CodeFormat.param_encodings`) -> its bytes (module docstring)
PARAM_ENCODINGS: dict[str, int] = {"fp16": 2, "e4m3": 1, "e8m0": 1}
PARAM_BYTES = PARAM_ENCODINGS["fp16"]  # the default encoding (kvq_lab.quant.rounding.PARAM_DTYPE)
EVERY_FORMAT = "*"  # add_kernel_support(backend, "*"): the kernels read the table formula, so every format

# The built-in formats: one registry line each, imported on first lookup (kvq_lab.common.registry).
FORMATS: Registry[type[CodeFormat]] = Registry(
    "format",
    lazy={
        "fp8_e4m3": "kvq_lab.quant.formats.fp8:FP8Format",
        "fp8_e5m2": "kvq_lab.quant.formats.fp8:FP8Format",
        "int": "kvq_lab.quant.formats.int_:IntFormat",
        "iq4_nl": "kvq_lab.quant.formats.iq4_nl:IQ4NLFormat",
        "lut": "kvq_lab.quant.formats.lut:LUTFormat",
        "mxfp4": "kvq_lab.quant.formats.mxfp4:MXFP4Format",
        "nuq": "kvq_lab.quant.formats.nuq:NUQFormat",
        "nvfp4": "kvq_lab.quant.formats.nvfp4:NVFP4Format",
        "q4_0": "kvq_lab.quant.formats.q4_0:Q4_0Format",
        "q4_1": "kvq_lab.quant.formats.q4_1:Q4_1Format",
        "q5_0": "kvq_lab.quant.formats.q5_0:Q5_0Format",
        "q5_1": "kvq_lab.quant.formats.q5_1:Q5_1Format",
        "q8_0": "kvq_lab.quant.formats.q8_0:Q8_0Format",
        "turbo": "kvq_lab.quant.formats.turbo:TurboFormat",
    },
    unknown="{kind}={name!r} is not a registered code format; allowed: {known}",
)
_KERNEL_SUPPORT: dict[str, set[str]] = {}  # backend -> names of the formats its kernels read (or "*")


def register_format(name: str):
    """Class decorator: make `name` resolve to the decorated `CodeFormat` subclass in `FORMATS`.

    A class may carry several names (fp8_e4m3 and fp8_e5m2 share one class); the instance's `name` field says
    which one it is. Its `param_encodings` must name its own parameters and known encodings (PARAM_ENCODINGS).
    A name is refused if another class holds it (`kvq_lab.common.registry`: a reloaded module may register again).
    """

    def decorate(cls: type[CodeFormat]) -> type[CodeFormat]:
        for param, enc in cls.param_encodings.items():
            if param not in cls.params or enc not in PARAM_ENCODINGS:
                raise ValueError(
                    f"{cls.__qualname__}.param_encodings: {param!r} -> {enc!r}; its params are {cls.params} and the "
                    f"encodings {', '.join(PARAM_ENCODINGS)}"
                )
        FORMATS.register(name, cls)
        cls.names = tuple(n for n in cls.__dict__.get("names", ()) if n != name) + (name,)
        return cls

    return decorate


def add_kernel_support(backend: str, *names: str) -> None:
    """Declare that `backend`'s kernels read the formats `names` (called by the kernel module when imported);
    `"*"` (EVERY_FORMAT): every format, as kernels that implement `table[code] * scale (+ zero)` do."""
    _KERNEL_SUPPORT.setdefault(backend, set()).update(names)


def _formats_with(bits: int) -> list[str]:
    return sorted(n for n, cls in FORMATS.items() if bits in cls.supported_bits)


def check_bits(name: str, bits, bits_name: str = "bits", format_name: str = "format") -> int:
    """`bits` if format `name` supports it, else a one-line QuantConfigError naming the setting and the fix.

    bits=None picks the format's only width (fp8: 8); a format with several widths needs one.
    bits_name, format_name: how the caller's settings are called in error messages (e.g. `key_bits`, `key_format`).
    """
    allowed = FORMATS[name].supported_bits
    shown = ", ".join(map(str, allowed))
    if bits is None:
        if len(allowed) == 1:
            return allowed[0]
        raise QuantConfigError(f"{format_name}={name} needs {bits_name}: one of {shown}")
    if isinstance(bits, bool) or not isinstance(bits, int) or bits not in allowed:
        others = _formats_with(bits) if isinstance(bits, int) and not isinstance(bits, bool) else []
        other = f", or a format with {bits} bits: {format_name}={' | '.join(others)}" if others else ""
        fix = f"drop {bits_name}" if len(allowed) == 1 else f"choose {bits_name} in {shown}"
        raise QuantConfigError(f"{format_name}={name} takes {shown} bits; {bits_name}={bits!r} conflicts: {fix}{other}")
    return bits


def _check_name(name: str, format_name: str = "format") -> type[CodeFormat]:
    if name not in FORMATS:  # the registry's one-line message, with the caller's setting name
        raise QuantConfigError(FORMATS.unknown.format(kind=format_name, name=name, known=", ".join(FORMATS)))
    return FORMATS[name]


def default_bits(name: str, format_name: str = "format") -> int:
    """The width format `name` takes when none is given (`key_bits: null`): its `default_bits`, else its only one."""
    cls = _check_name(name, format_name)
    return cls.default_bits if cls.default_bits is not None else check_bits(name, None, format_name=format_name)


def get_format(
    name: str, bits: int | None = None, bits_name: str = "bits", format_name: str = "format", **options
) -> CodeFormat:
    """The format `name` at `bits` bits with its `options` (lut: `codebook`), validated with one-line errors.

    bits_name, format_name: how the caller's settings are called in error messages (e.g. `key_bits`, `key_format`).
    """
    cls = _check_name(name, format_name)
    known = {f.name for f in fields(cls)} - {"name", "bits"}
    for key in options:
        if key not in known:
            has = ", ".join(sorted(known)) or "none"
            raise QuantConfigError(f"{format_name}={name} has no option {key!r}; its options: {has}")
    return cls(bits=check_bits(name, bits, bits_name, format_name), name=name, **options)


@dataclass(frozen=True)
class CodeFormat(ABC):
    """A code format: `bits`-bit codes plus per-group parameters (see the module docstring for shapes and storage).

    Subclasses set `supported_bits` and `params` (class attributes), give `name` a default, and implement
    `build_table`, `quantize_groups` and `error_bound`. Dequantization is the same formula for every format
    (`dequantize_groups`); formats differ only in their table and in how they choose codes and parameters.
    """

    bits: int
    name: str

    names: ClassVar[tuple[str, ...]] = ()  # registered names, filled by `register_format`
    supported_bits: ClassVar[tuple[int, ...]] = ()
    default_bits: ClassVar[int | None] = None  # the width when none is given; None: the only supported one
    params: ClassVar[tuple[str, ...]] = ("scale", "zero")  # stored per group, in this order
    # how a parameter is stored where it is not fp16: "e4m3" or "e8m0" (PARAM_ENCODINGS; the module docstring)
    param_encodings: ClassVar[Mapping[str, str]] = {}
    unsupported_backends: ClassVar[tuple[str, ...]] = ()  # backends that cannot read it although they read "*"
    codes_are_values: ClassVar[bool] = False  # table[c] == c: a kernel may use the code itself (int's fast path)
    allows_identity: ClassVar[bool] = True  # bits=16 means "not quantized" (False: an error, as for a fitted format)
    fitted: ClassVar[bool] = False  # fitted per layer on calibration data (`fit`): a config naming it calibrates

    def __post_init__(self):
        if self.name not in type(self).names:
            have = ", ".join(type(self).names) or "none (not registered)"
            raise QuantConfigError(f"name={self.name!r} is not a name of {type(self).__name__}; its names: {have}")
        check_bits(self.name, self.bits)

    # -- what is stored --------------------------------------------------------------------------------------
    @property
    def code_bits(self) -> int:
        """Bits per stored code (packed by `kvq_lab.quant.pack`)."""
        return self.bits

    def param_encoding(self, param: str) -> str:
        """How parameter `param` is stored: "fp16" (the default), "e4m3" or "e8m0"."""
        return self.param_encodings.get(param, "fp16")

    @property
    def param_bytes_per_group(self) -> int:
        """Stored bytes of one group's parameters, at their encodings' widths (int: 2 + 2; nvfp4, mxfp4: 1)."""
        return sum(PARAM_ENCODINGS[self.param_encoding(p)] for p in self.params)

    @property
    def widens(self) -> bool:
        """Whether a parameter is stored narrower than it is read (e4m3, e8m0): a store then widens it on read."""
        return any(self.param_encoding(p) != "fp16" for p in self.params)

    def param_dtype(self, param: str = "scale") -> torch.dtype:
        """The float `param` is read as (what `quantize_groups` returns and the formula reads): fp16, fp32 for e8m0."""
        from .encodings import READ

        return READ[self.param_encoding(param)]

    def stored_dtype(self, param: str = "scale") -> torch.dtype:
        """The dtype `param` is stored in: fp16, or uint8 for the one-byte encodings."""
        from .encodings import STORED

        return STORED[self.param_encoding(param)]

    def encode_params(self, scale: torch.Tensor, zero: torch.Tensor | None):
        """(scale, zero) as read -> as stored (`decode_params` inverts it exactly; fp16 parameters are returned as
        they are)."""
        from .encodings import encode

        return encode(self.param_encoding("scale"), scale), encode(self.param_encoding("zero"), zero)

    def decode_params(self, scale: torch.Tensor | None, zero: torch.Tensor | None):
        """(scale, zero) as stored -> as read: widened to `param_dtype` (fp16 parameters are returned as they are)."""
        from .encodings import decode

        return decode(self.param_encoding("scale"), scale), decode(self.param_encoding("zero"), zero)

    @property
    def table_bytes(self) -> int:
        """Bytes a store keeps once per tensor or layer to know its table: 0 where name and bits fix the table (lut: the
        codebook, 4 * 2^bits; nvfp4: its fp32 tensor scale, 4, the table being E2M1 values times it)."""
        return 0

    def fit(self, spec: QuantSpec, x: torch.Tensor, g: torch.Tensor, mask: torch.Tensor | None = None) -> QuantSpec:
        """Fitted formats: the spec one layer stores once fitted on its calibration tensor x [1, H, T, D] fp32 (as the
        quantizer sees it, after transforms), g the loss gradient with respect to x (Fisher weights g^2), mask
        bool [1, H, T, D] of elements kept outside the format (outliers) or None. Others fit nothing: `spec`."""
        return spec

    def supports(self, backend: str) -> bool:
        """Whether `backend` can read this format: the PyTorch path always; kernels declare what they read
        (`add_kernel_support`), and a format may refuse a backend (`unsupported_backends`)."""
        if backend == "torch":
            return True
        declared = _KERNEL_SUPPORT.get(backend, ())
        return backend not in self.unsupported_backends and (self.name in declared or EVERY_FORMAT in declared)

    # -- arithmetic ------------------------------------------------------------------------------------------
    @abstractmethod
    def build_table(self) -> torch.Tensor:
        """fp32 [2^bits] on the CPU: the value of each code before scale and zero. Finite everywhere."""

    def table(self, device=None) -> torch.Tensor:
        """fp32 [2^bits] on `device` (built once per format and device: do not modify it)."""
        return _table(self, str(device or "cpu"))

    def midpoints(self, device=None) -> torch.Tensor:
        """fp32 [2^bits - 1]: (table[i] + table[i + 1]) / 2, the decision boundaries of nearest-entry rounding for a
        sorted table (lut, turbo), built once per format and device."""
        return _midpoints(self, str(device or "cpu"))

    @abstractmethod
    def quantize_groups(
        self, g: torch.Tensor, valid: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
        """g [..., n, G] -> (codes uint8 [..., n, G], scale [..., n], zero [..., n] or None), parameters in their
        `param_dtype` and representable in their encoding (fp16 for most formats)."""

    def dequantize_groups(self, codes: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor | None) -> torch.Tensor:
        """codes [..., n, G], scale/zero [..., n] -> fp32 [..., n, G] = table[codes] * scale + zero."""
        if (zero is None) != ("zero" not in self.params):
            got = "no zero" if zero is None else "a zero"
            raise ValueError(f"format={self.name} stores {', '.join(self.params)} per group; got {got}")
        x = self.table(codes.device)[codes.long()] * scale.float().unsqueeze(-1)
        return x if zero is None else x + zero.float().unsqueeze(-1)

    @abstractmethod
    def error_bound(self, g: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor | None) -> torch.Tensor:
        """fp32 [..., n, G]: the largest |x - x'| the arithmetic allows for each valid element of g, computed
        exactly (fp32 rounding of x' itself comes on top) from the parameters `quantize_groups` chose."""


@cache
def _table(fmt: CodeFormat, device: str) -> torch.Tensor:
    return fmt.build_table().to(device)


@cache
def _midpoints(fmt: CodeFormat, device: str) -> torch.Tensor:
    t = fmt.table(device)
    return (t[:-1] + t[1:]) / 2


# -- byte accounting ---------------------------------------------------------------------------------------------
def bits_per_element(
    fmt: CodeFormat, group_size: int, axis: str = "token", n_tokens: int | None = None, head_dim: int | None = None
) -> float:
    """Stored bits per element: codes plus per-group parameters at their stored width, e.g. int2 G32: 2 + 2*16/32 =
    3.0, fp8 G32: 8.5, nvfp4 G16: 4 + 8/16 = 4.5 (e4m3 scales), mxfp4 G32: 4 + 8/32 = 4.25 (e8m0 scales).

    Without a shape: whole groups, `code_bits + 8 * param_bytes_per_group / group_size` (the axis only changes
    how partial groups and blocks round up). With `n_tokens` and `head_dim`: the exact count of one
    [1, 1, n_tokens, head_dim] tensor in the packed layout (`tensor_nbytes`). Neither includes what is kept once per
    tensor (`fmt.table_bytes`, for a tensor or layer that owns one: 64 bytes for a 4-bit lut, 4 for nvfp4).
    """
    spec = QuantSpec(fmt.code_bits, group_size, axis)  # validates group_size and axis with one-line errors
    if n_tokens is None and head_dim is None:
        return fmt.code_bits + 8 * fmt.param_bytes_per_group / spec.group_size
    if n_tokens is None or head_dim is None:
        raise QuantConfigError("bits_per_element needs both n_tokens and head_dim, or neither")
    return 8 * tensor_nbytes(fmt, group_size, axis, n_tokens, head_dim) / (n_tokens * head_dim)


def tensor_nbytes(fmt: CodeFormat, group_size: int, axis: str, n_tokens: int, head_dim: int) -> int:
    """Bytes of one quantized [1, 1, n_tokens, head_dim] tensor: codes in whole packing blocks of tokens
    (`kvq_lab.quant.pack`), parameters in whole groups at their stored width, table excluded. It is
    `pack.qtensor_nbytes` for the format's spec."""
    spec = QuantSpec(fmt.code_bits, group_size, axis)  # validates group_size and axis
    spec.check_head_dim(head_dim)
    G = spec.group_size
    groups = n_tokens * (head_dim // G) if axis == "token" else -(-n_tokens // G) * head_dim
    return packed_rows(n_tokens, fmt.code_bits) * head_dim + groups * fmt.param_bytes_per_group
