"""Exact money.

Every amount Kiln stores or compares is an integer number of nanodollars
(1e-9 USD). Prices come from configuration as decimal USD per million tokens
and are converted once, with no float anywhere, so the sum of usage events is
exactly the credits consumed.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from decimal import ROUND_HALF_UP, Decimal, InvalidOperation

NANO_PER_USD = 1_000_000_000
_NANO = Decimal(NANO_PER_USD)


def usd_to_nano(value: object) -> int:
    """Parse a USD amount (str, int or Decimal; floats via their repr) into nanodollars.

    Raises ValueError for anything that is not a finite number or that has
    more precision than one nanodollar.
    """
    try:
        amount = Decimal(str(value))
    except (InvalidOperation, ValueError) as exc:
        raise ValueError(f"not a number: {value!r}") from exc
    if not amount.is_finite():
        raise ValueError(f"not a finite amount: {value!r}")
    nano = amount * _NANO
    if nano != nano.to_integral_value():
        raise ValueError(f"{value!r} is finer than one nanodollar (1e-9 USD)")
    return int(nano)


def nano_to_usd_str(nano: int) -> str:
    """Render nanodollars as an exact decimal USD string: 1155 -> '0.000001155'."""
    sign = "-" if nano < 0 else ""
    whole, frac = divmod(abs(nano), NANO_PER_USD)
    if not frac:
        return sign + str(whole)
    # The fraction's nine digits with their leading zeros: str() of it plus 10**9, less the "1"
    # (a format spec like {:09d} costs several times more, and this runs a few times a request).
    return sign + str(whole) + "." + str(frac + NANO_PER_USD)[1:].rstrip("0")


@dataclass(frozen=True, slots=True)
class Prices:
    """USD per one million tokens, kept as exact Decimals."""

    input: Decimal
    cached_input: Decimal
    output: Decimal
    # The same prices as integers over one power of ten (derived): a request's cost in integer
    # arithmetic, about ten times cheaper than three Decimal products, and exactly the same.
    _scaled: tuple[int, int, int, int] = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        places = max(0, *(-int(p.as_tuple().exponent) for p in (self.input, self.cached_input, self.output)))
        scale = 10**places
        ints = [p * scale for p in (self.input, self.cached_input, self.output)]
        exact = all(i == i.to_integral_value() and i >= 0 for i in ints)
        # Negative or absurd prices (never from a valid config) keep the Decimal path.
        object.__setattr__(self, "_scaled", (*(int(i) for i in ints), scale) if exact else (0, 0, 0, 0))

    def cost_nano(self, prompt_tokens: int, cached_tokens: int, completion_tokens: int) -> int:
        """Cost of one request in nanodollars, rounded half-up once per request.

        prompt_tokens includes cached_tokens (OpenAI semantics); cached tokens
        are billed at the cached-input price, the rest at the input price.
        """
        cached = min(max(cached_tokens, 0), prompt_tokens)
        input_, cached_input, output, scale = self._scaled
        if scale:
            # USD per 1M tokens -> nanodollars: * 1e9 / 1e6 = * 1e3; half-up on a non-negative ratio
            scaled = ((prompt_tokens - cached) * input_ + cached * cached_input + completion_tokens * output) * 1000
            if scaled >= 0:
                return (2 * scaled + scale) // (2 * scale)
        usd_per_m = (
            (prompt_tokens - cached) * self.input
            + cached * self.cached_input
            + completion_tokens * self.output
        )
        return int((usd_per_m * 1000).to_integral_value(rounding=ROUND_HALF_UP))
