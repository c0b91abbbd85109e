"""Exact money: the per-request cost in integers equals the Decimal definition, rounding included."""

from __future__ import annotations

import random
from decimal import ROUND_HALF_UP, Decimal

import pytest

from kiln.core.money import Prices, nano_to_usd_str, usd_to_nano


def by_definition(p: Prices, prompt: int, cached: int, completion: int) -> int:
    cached = min(max(cached, 0), prompt)
    usd_per_m = (prompt - cached) * p.input + cached * p.cached_input + completion * p.output
    return int((usd_per_m * 1000).to_integral_value(rounding=ROUND_HALF_UP))


PRICES = [
    Prices(Decimal("0.10"), Decimal("0.05"), Decimal("0.40")),
    Prices(Decimal("0.0000005"), Decimal("0.00000025"), Decimal("0.0000015")),  # a half nanodollar per token
    Prices(Decimal("3"), Decimal("0.3"), Decimal("15")),
    Prices(Decimal("0.123456789123"), Decimal("0"), Decimal("7.000000000001")),
    Prices(Decimal(0), Decimal(0), Decimal(0)),
    Prices(Decimal("1E+3"), Decimal("2.5E-4"), Decimal("1.0000")),
]


@pytest.mark.parametrize("prices", PRICES)
def test_cost_matches_the_decimal_definition_and_rounds_half_up_once(prices: Prices) -> None:
    rng = random.Random(7)
    cases = [(0, 0, 0), (1, 0, 0), (0, 0, 1), (1, 1, 1), (3, 5, 2), (10**9, 10**8, 10**9), (2**63, 0, 2**63)]
    cases += [(rng.randrange(0, 300_000), rng.randrange(-5, 300_000), rng.randrange(0, 100_000)) for _ in range(2000)]
    for prompt, cached, completion in cases:
        assert prices.cost_nano(prompt, cached, completion) == by_definition(prices, prompt, cached, completion), \
            (prices, prompt, cached, completion)


def test_half_a_nanodollar_rounds_up_and_a_hair_below_rounds_down() -> None:
    half = Prices(Decimal("0.0005"), Decimal(0), Decimal("0.0004999"))  # 0.5 and 0.4999 nano a token
    assert half.cost_nano(1, 0, 0) == 1  # 0.5 nanodollars
    assert half.cost_nano(0, 0, 1) == 0  # 0.4999
    assert half.cost_nano(3, 0, 0) == 2  # 1.5


def test_usd_round_trips_through_nanodollars() -> None:
    assert usd_to_nano("0.000001155") == 1155
    assert nano_to_usd_str(1155) == "0.000001155"
    assert nano_to_usd_str(-2_500_000_000) == "-2.5"
    with pytest.raises(ValueError):
        usd_to_nano("0.0000000001")
