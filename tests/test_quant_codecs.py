"""Element codecs against the spec's scalar tables (§10.1) and its float64 reference encoders (§8)."""
import math

import numpy as np
import pytest
import torch

from fmoe.quant import _codecs as C


def ref_e4m3(x: float) -> int:
    """Spec §8 reference E4M3 encoder, exact float64 arithmetic."""
    if math.isnan(x):
        return 0x7F
    sign = 0x80 if math.copysign(1.0, x) < 0 else 0
    a = abs(x)
    if a > 448:
        return sign | 0x7E
    if a < 2.0 ** -6:
        return sign | round(a * 512)  # python round() is RNE; 8 lands on min normal 0x08
    m, e = math.frexp(a)
    e -= 1
    mant = round((a / 2.0 ** e - 1) * 8)
    if mant == 8:
        mant, e = 0, e + 1
    return sign | min(((e + 7) << 3) | mant, 0x7E)


def ref_e2m1(x: float) -> int:
    """Spec §8 reference E2M1 encoder."""
    sign = 8 if math.copysign(1.0, x) < 0 else 0
    a = abs(x)
    if a >= 6:
        return sign | 7
    if a < 1:
        return sign | round(2 * a)
    m, e = math.frexp(a)
    e -= 1
    mant = round((a / 2.0 ** e - 1) * 2)
    if mant == 2:
        mant, e = 0, e + 1
    return sign | min(((e + 1) << 1) | mant, 7)


def _e4m3_bytes(x):
    return C.encode_e4m3(torch.tensor(x, dtype=torch.float32)).view(torch.uint8).tolist()


def test_e4m3_table_a1():
    inf = float("inf")
    cases = [(0.0, 0x00), (-0.0, 0x80), (2**-9, 0x01), (2**-10, 0x00), (3 * 2**-10, 0x02),
             (2**-6, 0x08), (0.1, 0x1D), (1.0, 0x38), (1.0625, 0x38), (1.1875, 0x3A),
             (-1.5, 0xBC), (3.14159, 0x45), (240.0, 0x77), (448.0, 0x7E), (-448.0, 0xFE),
             (464.0, 0x7E), (470.0, 0x7E), (480.0, 0x7E), (1e6, 0x7E), (inf, 0x7E),
             (-inf, 0xFE), (float("nan"), 0x7F)]
    xs, want = zip(*cases)
    assert _e4m3_bytes(list(xs)) == list(want)
    assert [ref_e4m3(float(np.float32(x))) for x in xs] == list(want)


def test_e4m3_torch_cast_matches_reference_encoder():
    # Every representable value, every midpoint between neighbours, and random FP32 patterns.
    vals = C.E4M3_TABLE[torch.isfinite(C.E4M3_TABLE)].unique().double()
    mids = (vals[1:] + vals[:-1]) / 2
    rng = np.random.default_rng(0)
    bits = rng.integers(0, 2**32, 200_000, dtype=np.uint64).astype(np.uint32)
    rand = torch.from_numpy(bits.view(np.float32).copy())
    rand = rand[~torch.isnan(rand)]
    xs = torch.cat([vals.float(), -vals.float(), mids.float(), -mids.float(),
                    torch.nextafter(mids.float(), torch.tensor(0.0)), rand,
                    rand * 2.0**-120, torch.tensor([float("inf"), -float("inf")])])
    got = C.encode_e4m3(xs).view(torch.uint8).numpy()
    want = np.array([ref_e4m3(v) for v in xs.tolist()], dtype=np.uint8)
    assert (got == want).all()
    # Decoding every byte and re-encoding is the identity (except the NaNs 0x7F/0xFF).
    b = torch.arange(256, dtype=torch.int32).to(torch.uint8)
    finite = torch.isfinite(C.E4M3_TABLE)
    assert torch.equal(C.encode_e4m3(C.E4M3_TABLE[finite]).view(torch.uint8), b[finite])


def test_e2m1_table_a3():
    xs = [0.0, -0.0, 0.1, 0.25, 0.2500001, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, 5.5, 7.0,
          -0.1, -0.25, -1.25, -2.5, -5.0, -7.0, float("inf")]
    want = [0x0, 0x8, 0x0, 0x0, 0x1, 0x2, 0x2, 0x4, 0x4, 0x6, 0x6, 0x7, 0x7,
            0x8, 0x8, 0xA, 0xC, 0xE, 0xF, 0x7]
    assert C.encode_e2m1(torch.tensor(xs)).tolist() == want
    with pytest.raises(ValueError, match="NaN"):
        C.encode_e2m1(torch.tensor([1.0, float("nan")]))


def test_e2m1_matches_reference_encoder_dense_grid():
    rng = np.random.default_rng(1)
    grid = np.concatenate([np.arange(-800, 801) / 128.0, rng.normal(0, 3, 20000)]).astype(np.float32)
    got = C.encode_e2m1(torch.from_numpy(grid)).numpy()
    want = np.array([ref_e2m1(float(v)) for v in grid], dtype=np.uint8)
    assert (got == want).all()
    assert torch.equal(C.decode_e2m1(torch.arange(16, dtype=torch.uint8)), C.E2M1_VALUES)


def test_fp4_pack_low_nibble_first():
    codes = torch.tensor([[1, 2, 3, 15]], dtype=torch.uint8)
    packed = C.pack_fp4(codes)
    assert packed.tolist() == [[0x21, 0xF3]]
    assert torch.equal(C.unpack_fp4(packed), codes)
    with pytest.raises(ValueError, match="even"):
        C.pack_fp4(torch.zeros(1, 3, dtype=torch.uint8))


def test_e8m0_decode_a4():
    b = torch.tensor([0x00, 0x01, 0x76, 0x7E, 0x7F, 0x80, 0x81, 0xFE, 0xFF], dtype=torch.uint8)
    got = C.decode_e8m0(b).double().tolist()
    want = [2.0**-127, 2.0**-126, 2.0**-9, 0.5, 1.0, 2.0, 4.0, 2.0**127]
    assert got[:8] == want and math.isnan(got[8])
    # Matches torch's own float8_e8m0fnu decode for every byte.
    allb = torch.arange(256, dtype=torch.int32).to(torch.uint8)
    ours = C.decode_e8m0(allb)
    theirs = allb.view(torch.float8_e8m0fnu).float()
    assert torch.equal(ours[:255], theirs[:255]) and torch.isnan(theirs[255])


def test_mx_floor_scale_edge_exact_log2():
    # amax = nextafter(2^k, 0): float log2 would round up a binade (spec §10.2 scale-rule edge).
    ks = [2, 5, 10, 20, -10, -20]
    want = [0x7E, 0x81, 0x86, 0x90, 0x72, 0x68]
    amax = torch.nextafter(torch.tensor([2.0**k for k in ks]), torch.tensor(0.0))
    assert C.mx_scale_floor(amax, 2).tolist() == want
    special = torch.tensor([0.0, float("inf"), float("nan"), 1e-45])
    assert C.mx_scale_floor(special, 2).tolist() == [0x00, 0xFF, 0xFF, 0x00]
