"""drop/scale_division's arithmetic, modelled exactly on the CPU (no GPU): its instruction
sequence, each step rounded to fp32 as the GPU rounds it, gives the e4m3 value of an IEEE
division (and, from 2^-53 on, its fp32 quotient) for values of magnitudes 2^-70 to 2^111,
subnormals and zero, over the FP8 recipe's scales of groups whose amax is up to 2^12 times the
value or the floor, and of groups with scales up to 2^120, whichever reciprocal within an ulp
MUFU.RCP starts from (the module's docstring argues it for every finite value). The GPU's own
bits are compared with torch's division in test_device_routed.py (the quantizing dispatch)."""

from __future__ import annotations

import random
from fractions import Fraction

import pytest
import torch
from megamoe_kernels.shim.fp8 import AMAX_FLOOR, E4M3_MAX, E4M3_MAX_RECIPROCAL

SMALLEST_NORMAL_EXPONENT = -126
MANTISSA_BITS = 23


def rounded(value: Fraction) -> Fraction:
    """value rounded to the nearest fp32 (ties to even), subnormals included; no overflow."""
    if value == 0:
        return value
    magnitude = abs(value)
    exponent = magnitude.numerator.bit_length() - magnitude.denominator.bit_length()
    if Fraction(2) ** exponent > magnitude:
        exponent -= 1
    quantum = Fraction(2) ** (max(exponent, SMALLEST_NORMAL_EXPONENT) - MANTISSA_BITS)
    units, remainder = divmod(magnitude / quantum, 1)
    if remainder > Fraction(1, 2) or (remainder == Fraction(1, 2) and units % 2):
        units += 1
    return (units * quantum) * (1 if value > 0 else -1)


def fp32(value: float) -> Fraction:
    return Fraction(float(torch.tensor(value, dtype=torch.float32)))


def ulp_away(value: Fraction, steps: int) -> Fraction:
    """The fp32 `steps` ulps from the normal positive fp32 `value`."""
    bits = torch.tensor(float(value), dtype=torch.float32).view(torch.int32).item() + steps
    return Fraction(torch.tensor(bits, dtype=torch.int32).view(torch.float32).item())


def corrected_quotient(x: Fraction, divisor: Fraction, reciprocal: Fraction) -> Fraction:
    """scale_division.quotient: q0 = x r, the residual by an FMA, the corrected quotient by an
    FMA, each rounded once. (Its last step, x's sign bit or-ed in, only gives a zero quotient
    x's sign: fractions hold no signed zero, so the GPU test checks that one.)"""
    q0 = rounded(x * reciprocal)
    residual = rounded(-q0 * divisor + x)
    return rounded(residual * reciprocal + q0)


def quotient(x: Fraction, divisor: Fraction, approximate_reciprocal: Fraction) -> Fraction:
    """x over a value's scale as scale_division divides it: the reciprocal refined by one
    Newton step, then the corrected quotient."""
    t = rounded(-divisor * approximate_reciprocal + 1)
    r = rounded(approximate_reciprocal * t + approximate_reciprocal)
    return corrected_quotient(x, divisor, r)


def group_scale(amax: Fraction) -> Fraction:
    """scale_division.group_scale: the corrected quotient from the host's E4M3_MAX_RECIPROCAL."""
    floored = max(amax, fp32(AMAX_FLOOR))
    return corrected_quotient(floored, fp32(E4M3_MAX), Fraction(E4M3_MAX_RECIPROCAL))


def test_the_host_reciprocal_of_e4m3_max_is_its_fp32_rounding():
    assert Fraction(E4M3_MAX_RECIPROCAL) == rounded(1 / fp32(E4M3_MAX))


def e4m3(value: Fraction) -> int:
    return torch.tensor([float(value)]).to(torch.float8_e4m3fn).view(torch.uint8).item()


def sampled_values(generator: random.Random, count: int) -> list[Fraction]:
    values = [Fraction(0), fp32(2.0**-126), fp32(2.0**-130), fp32(1e-39), fp32(2.0**-60)]
    for _ in range(count):
        exponent = generator.uniform(-70, 110)
        sign = generator.choice((-1, 1))
        values.append(fp32(sign * generator.uniform(1, 2) * 2.0**exponent))
    return values


@pytest.mark.parametrize("reciprocal_ulps", [-1, 0, 1])
def test_the_sequence_gives_divisions_e4m3_values_over_a_groups_scale(reciprocal_ulps):
    generator = random.Random(reciprocal_ulps + 7)
    divisor_448 = fp32(E4M3_MAX)
    for value in sampled_values(generator, 400):
        # a group whose amax is this value's magnitude times up to 2^12, or the floor
        amax = max(rounded(abs(value) * fp32(generator.uniform(1, 4096))), fp32(AMAX_FLOOR))
        scale = group_scale(amax)
        assert scale == rounded(amax / divisor_448), amax
        for x in (value, amax, -amax, rounded(value / 3)):
            reciprocal = ulp_away(rounded(1 / scale), reciprocal_ulps)
            fast = quotient(x, scale, reciprocal)
            exact = rounded(x / scale)
            if abs(x) >= Fraction(2) ** -53:
                assert fast == exact, (x, scale, reciprocal_ulps)
            assert e4m3(fast) == e4m3(exact), (x, scale, reciprocal_ulps)


@pytest.mark.parametrize("reciprocal_ulps", [-1, 0, 1])
def test_groups_of_scales_far_above_their_values_give_divisions_e4m3_values(reciprocal_ulps):
    # groups whose amax is far above most values (scales up to 2^120): there q0 and the
    # residual turn subnormal or zero, where division's quotient is far below e4m3's smallest
    # value too
    generator = random.Random(reciprocal_ulps + 11)
    divisor_448 = fp32(E4M3_MAX)
    for value in sampled_values(generator, 200):
        amax = fp32(generator.uniform(1, 2) * 2.0 ** generator.uniform(20, 126))
        scale = group_scale(amax)
        assert scale == rounded(amax / divisor_448), amax
        reciprocal = ulp_away(rounded(1 / scale), reciprocal_ulps)
        for x in (value, -value) if abs(value) <= amax else ():
            fast, exact = quotient(x, scale, reciprocal), rounded(x / scale)
            assert e4m3(fast) == e4m3(exact), (x, scale, reciprocal_ulps)


def test_a_groups_scale_is_divisions_for_every_magnitude_of_amax():
    generator = random.Random(5)
    amaxes = [Fraction(0), fp32(AMAX_FLOOR), fp32(2.0**-126), fp32(3.4e38)]
    amaxes += [
        fp32(generator.uniform(1, 2) * 2.0 ** generator.uniform(-40, 127)) for _ in range(2000)
    ]
    for amax in amaxes:
        floored = max(amax, fp32(AMAX_FLOOR))
        assert group_scale(amax) == rounded(floored / fp32(E4M3_MAX)), amax
