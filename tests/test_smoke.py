"""The README's promise: a key, a completion with usage.cost and the generation id."""

from conftest import Tenant


def test_completion_has_cost_and_generation_id(tenant: Tenant) -> None:
    raw = tenant.openai().chat.completions.with_raw_response.create(
        model="qwen3-32b", messages=[{"role": "user", "content": "Hello!"}], max_tokens=50
    )
    resp = raw.parse()
    gen_id = raw.headers["x-neocloud-generation-id"]
    assert gen_id.startswith("gen-")
    assert resp.model == "qwen3-32b"
    assert resp.choices[0].message.content
    assert resp.usage.model_extra["cost"] > 0
    [event] = tenant.usage()
    assert event["id"] == gen_id
    assert event["prompt_tokens"] == resp.usage.prompt_tokens
