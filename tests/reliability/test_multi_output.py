"""Requests that generate several outputs, against a small balance.

The adversarial backend's `multi` fault generates every output a request allows (n per
prompt, each to its max_tokens): the worst case. Admission's documented bound
(src/kiln/core/admission.py): a non-streaming request reserves its whole output (all
outputs), lowered to what the money left covers, so it never spends more than the
balance; a stream passes it by at most one chunk per output in flight.
"""

from __future__ import annotations

from decimal import Decimal
from typing import Any

import pytest

from conftest import Gateway
from reliability.conftest import ADV_MODEL
from reliability.harness import observe, send, settle

BALANCE = Decimal("0.001")
TOKEN_OUT = Decimal("0.30") / 10**6  # the adversarial model's output price per token

CASES: dict[str, tuple[str, dict[str, Any], int]] = {  # name: (protocol, body, outputs)
    "completions 50 prompts x n=4, JSON": (
        "completions", {"prompt": [f"p{i} fault=multi" for i in range(50)], "n": 4, "max_tokens": 100}, 200),
    "chat n=8, JSON": ("chat", {"messages": [{"role": "user", "content": "fault=multi"}], "n": 8,
                                "max_tokens": 1000}, 8),
    "chat n=4, stream": ("chat", {"messages": [{"role": "user", "content": "fault=multi"}], "n": 4,
                                  "max_tokens": 2000, "stream": True}, 4),
    "completions 20 prompts x n=2, stream": (
        "completions", {"prompt": [f"p{i} fault=multi" for i in range(20)], "n": 2, "max_tokens": 200,
                        "stream": True}, 40),
}


@pytest.mark.parametrize("case", list(CASES))
def test_multi_output_spend_stays_within_the_bound(adv_gateway: Gateway, case: str) -> None:
    protocol, extra, outputs = CASES[case]
    tenant = adv_gateway.new_key(credits=str(BALANCE))
    body = {"model": ADV_MODEL, "stream": False, **extra}
    answer = send(tenant, protocol, body, timeout=60)
    books = settle(tenant)
    stream = bool(body["stream"])
    bound = BALANCE + (outputs * TOKEN_OUT if stream else 0)
    spent = books.granted - books.credits
    observe(f"multi-output:{case}", status=answer.status, capped=answer.headers.get("x-kiln-output-capped"),
            seconds=round(answer.seconds, 2), spent=str(spent), balance=str(BALANCE), bound=str(bound),
            events=[{k: e[k] for k in ("status", "cost", "completion_tokens")} for e in books.events])
    assert answer.status in (200, 400, 402), answer.summary()
    assert spent <= bound, f"spent {spent} of a {BALANCE} balance (bound {bound})"
    assert books.credits == books.granted - books.costs
    assert books.in_flight == 0
