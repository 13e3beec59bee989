"""Element codecs: FP4 E2M1, FP8 E4M3FN, E8M0 and UE4M3 scale bytes (spec §1, §2.2, §8).

Everything here is elementwise and shape-agnostic. Encoders take float tensors and return
uint8 codes (or float8 tensors); decoders map bytes to float32 through exact tables.
The conventions are the pinned fmoe ones (spec §6.3): round-half-to-even, saturating,
sign of zero kept.
"""
from __future__ import annotations

import torch

E4M3_MAX = 448.0
E2M1_MAX = 6.0

# E2M1 code -> value (spec §1.3 table); index is the 4-bit code.
E2M1_VALUES = torch.tensor(
    [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0],
    dtype=torch.float32,
)


def _e4m3_table() -> torch.Tensor:
    # Decoding through torch's own dtype keeps us bit-identical to torch for every byte.
    return torch.arange(256, dtype=torch.int32).to(torch.uint8).view(torch.float8_e4m3fn).float()


def _e8m0_table() -> torch.Tensor:
    bits = torch.arange(256, dtype=torch.int32) << 23
    bits[0] = 0x00400000  # 2^-127 is an FP32 subnormal, not exponent field 0
    bits[255] = 0x7FC00000  # 0xFF is NaN
    return bits.view(torch.float32)


E4M3_TABLE = _e4m3_table()  # [256] float32, byte -> value (0x7F/0xFF NaN)
E8M0_TABLE = _e8m0_table()  # [256] float32, byte -> 2^(b-127)


# --- FP4 E2M1 -------------------------------------------------------------------------------

# RNE midpoints between consecutive magnitudes 0,.5,1,1.5,2,3,4,6. A tie goes to the even
# code, so the comparison is strict when the lower code is even and inclusive when odd.
_E2M1_MIDPOINTS = ((0.25, False), (0.75, True), (1.25, False), (1.75, True),
                   (2.5, False), (3.5, True), (5.0, False))


def encode_e2m1(x: torch.Tensor) -> torch.Tensor:
    """Already-scaled float tensor -> E2M1 codes (uint8 in 0..15, same shape).

    RNE, saturating to +-6 (including +-inf), sign bit kept (-0.0 -> 0x8). E2M1 has no NaN,
    so NaN input raises ValueError (spec §6.3).
    """
    if not torch.is_floating_point(x):
        raise TypeError(f"encode_e2m1 expects a float tensor, got {x.dtype}")
    if torch.isnan(x).any():
        raise ValueError("encode_e2m1: NaN input has no E2M1 encoding")
    a = x.abs()
    code = torch.zeros(x.shape, dtype=torch.uint8, device=x.device)
    for mid, inclusive in _E2M1_MIDPOINTS:
        code += (a >= mid) if inclusive else (a > mid)
    return code | (torch.signbit(x).to(torch.uint8) << 3)


def decode_e2m1(codes: torch.Tensor) -> torch.Tensor:
    """E2M1 codes (uint8 0..15) -> float32 values."""
    return E2M1_VALUES.to(codes.device)[codes.long()]


def pack_fp4(codes: torch.Tensor) -> torch.Tensor:
    """[..., K] codes -> [..., K/2] bytes; element 2i in the low nibble (spec §1.3)."""
    if codes.shape[-1] % 2:
        raise ValueError(f"pack_fp4: last dim must be even, got shape {tuple(codes.shape)}")
    c = codes.to(torch.uint8)
    return c[..., 0::2] | (c[..., 1::2] << 4)


def unpack_fp4(packed: torch.Tensor) -> torch.Tensor:
    """[..., K/2] bytes -> [..., K] codes (uint8 0..15)."""
    lo = packed & 0x0F
    hi = packed >> 4
    return torch.stack([lo, hi], dim=-1).flatten(-2)


# --- FP8 E4M3FN -----------------------------------------------------------------------------

def encode_e4m3(x: torch.Tensor) -> torch.Tensor:
    """Float tensor -> float8_e4m3fn, RNE, saturating to +-448 (+-inf too), NaN -> 0x7F/0xFF.

    The clamp is explicit because torch before 2.13 produced NaN on overflow (spec §1.1).
    Inputs are converted to float32 first: bf16 NaN has its sign bit set (spec §8), and
    float32 is the precision every pinned formula is defined on.
    """
    return x.float().clamp(-E4M3_MAX, E4M3_MAX).to(torch.float8_e4m3fn)


def decode_e4m3(x: torch.Tensor) -> torch.Tensor:
    """float8_e4m3fn (or its uint8 bytes) -> float32."""
    if x.dtype == torch.uint8:
        return E4M3_TABLE.to(x.device)[x.long()]
    return x.float()


# --- E8M0 (MX shared scale) ------------------------------------------------------------------

def decode_e8m0(b: torch.Tensor) -> torch.Tensor:
    """E8M0 bytes (uint8) -> float32 2^(b-127); 0x00 -> 2^-127, 0xFF -> NaN (spec §1.4)."""
    if b.dtype == torch.float8_e8m0fnu:
        b = b.view(torch.uint8)
    return E8M0_TABLE.to(b.device)[b.long()]


def floor_log2(a: torch.Tensor) -> torch.Tensor:
    """Exact floor(log2(a)) for positive finite float32 a, from the exponent (frexp) bits."""
    return torch.frexp(a.float()).exponent.to(torch.int32) - 1


def mx_scale_floor(amax: torch.Tensor, emax_elem: int) -> torch.Tensor:
    """MX FLOOR scale byte (spec §2.2, §8): floor(log2 amax) - emax, clamped to [-127, 127].

    amax: float tensor of block maxima (>= 0). Returns uint8 bytes; amax = 0 -> 0x00,
    non-finite amax -> 0xFF.
    """
    amax = amax.float()
    se = floor_log2(torch.where(amax > 0, amax, torch.ones_like(amax))) - emax_elem
    byte = se.clamp(min=-127) + 127
    byte = torch.where(amax > 0, byte, torch.zeros_like(byte))
    byte = torch.where(torch.isfinite(amax) & (se <= 127), byte, torch.full_like(byte, 255))
    return byte.to(torch.uint8)


def mx_scale_rceil(amax: torch.Tensor, max_elem: float) -> torch.Tensor:
    """MX RCEIL scale byte (spec §2.4): 2^ceil(log2(amax / max_elem)) on the FP32 quotient."""
    amax = amax.float()
    q = amax / max_elem  # tensor / scalar: IEEE division (spec §6.1 item 3)
    bits = q.view(torch.int32).to(torch.int64)
    byte = ((bits + 0x7FFFFF) & 0x7F800000) >> 23
    byte = torch.where(amax > 0, byte, torch.zeros_like(byte))
    byte = torch.where(torch.isfinite(amax), byte.clamp(max=254), torch.full_like(byte, 255))
    return byte.to(torch.uint8)


def pow2_ceil(s: torch.Tensor) -> torch.Tensor:
    """Smallest power of two >= s for positive normal float32 s (DeepSeek ue8m0 scale_fmt)."""
    bits = s.float().view(torch.int32).to(torch.int64)
    return (((bits + 0x7FFFFF) & 0x7F800000).to(torch.int32)).view(torch.float32)
