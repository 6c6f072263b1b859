"""MXFP4 expert weights (OCP microscaling FP4, as GPT-OSS releases its experts): each run of
32 weights along K shares one power-of-two scale (an E8M0 byte, 2 ** (s - 127)), and each
weight is a 4-bit E2M1 code (sign, 2 exponent bits, 1 mantissa bit: 0, 0.5, 1, 1.5, 2, 3,
4, 6), two a byte, the even K index in the low nibble.

Layout: w [..., N, K] -> packed uint8 [..., N, K / 2] and scales uint8 [..., N, K / 32]. The
grouped GEMM (``grouped_gemm``) reads them as they are and widens each tile in registers; on
a CPU the reference dequantizes.
"""
from __future__ import annotations

import torch

GROUP = 32  # weights per shared scale
# The 16 values of a code, sign in the top bit.
FP4_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)
_EMAX = 2  # the largest E2M1 exponent: 6 = 1.5 * 2 ** 2


def dequantize_mxfp4(packed: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """packed uint8 [..., N, K / 2], scales uint8 [..., N, K / 32] -> ``dtype`` [..., N, K] (exact
    in float32 and bfloat16: every value is a code times a power of two)."""
    lut = torch.tensor(FP4_VALUES, dtype=torch.float32, device=packed.device)
    codes = torch.stack([packed & 0x0F, packed >> 4], dim=-1).flatten(-2).long()  # [..., N, K]
    values = lut[codes].unflatten(-1, (-1, GROUP))  # [..., N, K / 32, 32]
    scaled = torch.ldexp(values, (scales.to(torch.int32) - 127)[..., None].float())
    return scaled.flatten(-2).to(dtype)


def quantize_mxfp4(w: torch.Tensor, max_rows: int = 1 << 14) -> tuple[torch.Tensor, torch.Tensor]:
    """w [..., N, K] (K a multiple of 32) -> (packed uint8 [..., N, K / 2], scales uint8
    [..., N, K / 32]). Each group's scale is 2 ** (floor(log2 max|w|) - 2), the OCP rule, and
    each weight rounds to the nearest code (ties to the even code); weights past 6 * scale
    clamp. MXFP4 weights quantize back to themselves. Rows go in blocks of ``max_rows``."""
    *lead, n, k = w.shape
    if k % GROUP:
        raise ValueError(f"w {list(w.shape)}: expected K a multiple of {GROUP} (MXFP4 groups)")
    rows = w.reshape(-1, k)
    packed = torch.empty(rows.shape[0], k // 2, dtype=torch.uint8, device=w.device)
    scales = torch.empty(rows.shape[0], k // GROUP, dtype=torch.uint8, device=w.device)
    grid = torch.tensor(FP4_VALUES[:8], dtype=torch.float32, device=w.device)  # the magnitudes, ascending
    mids = (grid[1:] + grid[:-1]) / 2
    for lo in range(0, rows.shape[0], max_rows):
        g = rows[lo:lo + max_rows].float().unflatten(-1, (-1, GROUP))  # [r, K / 32, 32]
        amax = g.abs().amax(-1)
        exp = torch.where(amax > 0, torch.floor(torch.log2(amax.clamp(min=2.0 ** -126))) - _EMAX,
                          torch.full_like(amax, -127.0)).clamp(-127, 127)
        mag = torch.ldexp(g.abs(), (-exp)[..., None]).clamp(max=6.0)
        idx = torch.bucketize(mag, mids)  # the nearest magnitude; on a midpoint, the lower one
        at_mid = (idx < len(mids)) & (mag == mids[idx.clamp(max=len(mids) - 1)])
        idx = idx + (at_mid & (idx % 2 == 1)).long()  # ties to the even code (mantissa bit 0)
        code = (idx | ((g < 0) & (idx > 0)).long() << 3).flatten(-2)  # [r, K]
        packed[lo:lo + max_rows] = (code[:, 0::2] | code[:, 1::2] << 4).to(torch.uint8)
        scales[lo:lo + max_rows] = (exp + 127).to(torch.uint8)
    return packed.view(*lead, n, k // 2), scales.view(*lead, n, k // GROUP)
