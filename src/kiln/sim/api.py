"""The two generation endpoints and the app factory.

Order of work per request mirrors vLLM closely enough for a gateway to observe the
same behaviour: body -> auth -> sim faults -> schema checks -> model -> prompt and
context window -> generation -> one JSON body or an SSE stream.

Per-request control object, body key ``"sim"`` (all keys optional; never part of the prompt)::

    reply: str              exact content (tokenized; one stream chunk per token)
    reply_tokens: int       length of the default pseudo-random reply
    reasoning: str          exact reasoning text (emitted even for non-reasoning models)
    tool_calls: [{"name": str, "arguments": object | str}]   emit these calls instead of text
                            ([]: no call, even where the model would call one by default)
    status: int             answer with this status + vLLM error body (500 without
                            error_message: plain text "Internal Server Error")
    error_message: str      message for status / error_after / non-stream error_after
    headers: {str: str}     extra response headers (e.g. Retry-After with status 429)
    delay_ms: number        sleep before anything (before headers)
    ttft_ms, token_delay_ms: number   override the global delays for this request
    poll_ms: number         stream: how often those delays look for a client that went away
                            (default 50; the benchmark's thousands of slow streams poll once a token)
    drop_after: int         stream: close the TCP connection after N SSE events (role chunk
                            counts); non-stream: close without any response
    malformed: bool         answer 200 with a body that is not JSON (with stream_malformed: true,
                            an SSE stream whose data is not JSON)
    error_after: int        stream: N events, then an in-band {"error":{...,"code":500}} and
                            [DONE]; non-stream: HTTP 500 with a vLLM JSON error body
    ignore_stop, legacy_length_check, no_prompt_tokens_details, forced_tool_choice_fails,
    reasoning_field         the global settings of the same names, for this request only

A request without a `sim` object gets one from the `rules` setting (/sim/config) when its
latest turn contains a rule's `when` text: that is how tests drive clients that cannot send one.
`POST /sim/rules` adds one rule ({"when", "sim"}) without touching the others.
"""

from __future__ import annotations

import time
from typing import Any, Callable

from aiohttp import web

from . import checks, generate, tokenizer, wire
from .checks import Invalid
from .server import SimServer, Ctx, new_id
from .settings import SimSettings

SIM_KEY: web.AppKey[SimServer] = web.AppKey("kiln_sim", SimServer)


def _sim_of(body: dict[str, Any]) -> dict[str, Any]:
    sim = body.get("sim")
    return sim if isinstance(sim, dict) else {}


def _requested_calls(
    body: dict[str, Any], sim: dict[str, Any], messages: list[Any], fails: bool
) -> tuple[list[generate.ToolCall], bool]:
    """Which tool calls the model makes, and whether tool_choice named a function."""
    choice = body.get("tool_choice")
    named = isinstance(choice, dict)
    calls: list[generate.ToolCall] = []
    forced = sim.get("tool_calls")
    tools = body.get("tools") or []
    if isinstance(forced, list):
        for c in forced:
            if isinstance(c, dict) and isinstance(c.get("name"), str):
                calls.append(generate.make_tool_call(c["name"], c.get("arguments", {})))
    elif tools and choice != "none":
        last = messages[-1].get("role")
        if named or choice == "required" or last == "user":
            fn = tools[0]["function"]
            if named:
                wanted = choice["function"]["name"]
                fn = next(t["function"] for t in tools if t["function"]["name"] == wanted)
            args: Any = "" if (named and fails) else generate.arguments_for(fn.get("parameters"))
            calls.append(generate.make_tool_call(fn["name"], args))
    if body.get("parallel_tool_calls") is False:
        calls = calls[:1]
    return calls, named


def _scripted(messages: Any, rules: list[dict[str, Any]]) -> dict[str, Any]:
    """The `sim` of the first rule whose `when` occurs in the latest turn (after the last assistant message)."""
    if not rules or not isinstance(messages, list):
        return {}
    turn = []
    for msg in reversed(messages):
        if not isinstance(msg, dict) or msg.get("role") == "assistant":
            break
        if msg.get("role") != "system":
            try:
                turn.append(tokenizer.content_text(msg.get("content")))
            except ValueError:  # malformed: the schema checks answer it
                break
    text = "\n".join(turn)
    return next((dict(r["sim"]) for r in rules if r["when"] in text), {})


async def _intake(srv: SimServer, request: web.Request, ctx: Ctx, check: Callable[[dict[str, Any]], Invalid | None],
                  *, scripted: bool) -> tuple[dict[str, Any], dict[str, Any]] | web.StreamResponse:
    """The body and its `sim` object (`scripted`: or the one a rule gives its latest turn), or
    what the request gets instead: a fault asked for up front, or vLLM's 400 for a bad body."""
    body = await srv.read_body(request)
    if isinstance(body, web.Response):
        return body
    sim = _sim_of(body) or (_scripted(body.get("messages"), srv.settings.rules) if scripted else {})
    if sim:
        early = await srv.pre_faults(request, sim, ctx)
        if early is not None:
            return srv.extra_headers(early, sim)
    bad = check(body)
    if bad is not None:
        return srv.invalid(bad)
    return body, sim


async def chat_completions(srv: SimServer, request: web.Request, ctx: Ctx) -> web.StreamResponse:
    """POST /v1/chat/completions."""
    taken = await _intake(srv, request, ctx, checks.check_chat, scripted=True)
    if not isinstance(taken, tuple):
        return taken
    body, sim = taken
    model = srv.check_model(body)
    if isinstance(model, web.Response):
        return model
    s = srv.settings.for_request(sim)
    messages = body["messages"]
    try:
        prompt = tokenizer.render_chat(messages, body.get("tools"), body.get("add_generation_prompt", True) is not False)
    except ValueError as exc:
        return srv.invalid(Invalid(str(exc)))
    ids = tokenizer.encode(prompt)
    requested = body.get("max_completion_tokens")
    requested = body.get("max_tokens") if requested is None else requested
    max_tokens = checks.fit_max_tokens(len(ids), requested, None, s.max_model_len, s.legacy_length_check)
    if isinstance(max_tokens, Invalid):
        return srv.invalid(max_tokens)
    if s.forced_tool_choice_fails and body.get("tool_choice") == "required" and body.get("tools"):
        return wire.plain_500()
    cached = srv.cached_tokens(model, ids)
    prefill = srv.prefill_s(len(ids), cached)
    calls, named = _requested_calls(body, sim, messages, s.forced_tool_choice_fails)
    kwargs = body.get("chat_template_kwargs")
    thinking = not (isinstance(kwargs, dict) and kwargs.get("enable_thinking") is False)
    is_reasoner = model in s.reasoning_models
    plan = generate.plan_chat(
        seed=s.seed,
        prompt=prompt,
        reply_tokens=s.reply_tokens,
        max_tokens=max_tokens,
        sim=sim,
        reasoning_enabled=is_reasoner and thinking,
        calls=calls,
        named_choice=named,
        stops=[] if s.ignore_stop else generate.normalize_stop(body.get("stop")),
        include_stop=body.get("include_stop_str_in_output") is True,
    )
    usage = wire.usage_obj(
        len(ids),
        plan.completion_tokens,
        None if s.no_prompt_tokens_details else cached,
        plan.reasoning_tokens if (is_reasoner or plan.reasoning) else None,
    )
    rid = new_id("chatcmpl-")
    created = int(time.time())
    if body.get("stream") is True:
        options = body.get("stream_options")
        include_usage = isinstance(options, dict) and options.get("include_usage") is True
        continuous = isinstance(options, dict) and options.get("continuous_usage_stats") is True
        events, n_tok = wire.chat_events(
            rid, created, model, plan, s.reasoning_field, usage if include_usage else None,
            usage if continuous else None,
        )
        return await srv.stream(request, sim, ctx, events, 2, n_tok + 1, prefill)
    data = wire.chat_body(rid, created, model, plan, s.reasoning_field, usage)
    return await srv.finish_plain(request, sim, ctx, data, plan.completion_tokens, prefill)


async def completions(srv: SimServer, request: web.Request, ctx: Ctx) -> web.StreamResponse:
    """POST /v1/completions: one choice per prompt (string, strings, ids, id lists)."""
    taken = await _intake(srv, request, ctx, checks.check_completion, scripted=False)
    if not isinstance(taken, tuple):
        return taken
    body, sim = taken
    prompts = checks.prompts_of(body["prompt"])
    if prompts is None:
        return srv.invalid(checks.schema_error("union_tag_invalid", "prompt",
                                               "Input should be a string, a list of strings, or token ids",
                                               body["prompt"]))
    model = srv.check_model(body)
    if isinstance(model, web.Response):
        return model
    s = srv.settings.for_request(sim)
    echo = body.get("echo") is True
    top = body.get("logprobs")
    stops = [] if s.ignore_stop else generate.normalize_stop(body.get("stop"))
    rid, created = new_id("cmpl-"), int(time.time())
    streaming = body.get("stream") is True
    prefix = wire.completion_prefix(rid, created, model)
    choices: list[dict[str, Any]] = []
    events: list[bytes] = []
    running: list[int] = []  # completion tokens so far, per event (continuous_usage_stats)
    n_prompt = n_completion = n_cached = 0
    for index, prompt in enumerate(prompts):
        if isinstance(prompt, str):
            text, ids = prompt, tokenizer.encode(prompt)
        else:
            text, ids = tokenizer.decode(prompt), prompt
        plan = _completion_plan(s, sim, body, text, ids, stops)
        if isinstance(plan, Invalid):
            return srv.invalid(plan)
        n_cached += srv.cached_tokens(model, ids)
        head = text if echo else ""
        if streaming:
            more, counts = _completion_events(prefix, index, head, plan, top, n_completion)
            events += more
            running += counts
        else:
            lp = generate.completion_logprobs(plan.content, top, len(head)) if top is not None else None
            choices.append(wire.completion_choice(index, head + "".join(plan.content), lp, plan))
        n_prompt += len(ids)
        n_completion += plan.completion_tokens
    usage = wire.usage_obj(n_prompt, n_completion, None if s.no_prompt_tokens_details else n_cached)
    prefill = srv.prefill_s(n_prompt, n_cached)
    n_gen = len(events)
    if not streaming:
        data = wire.completion_body(rid, created, model, choices, usage)
        return await srv.finish_plain(request, sim, ctx, data, n_completion, prefill)
    options = body.get("stream_options")
    if isinstance(options, dict) and options.get("continuous_usage_stats") is True:
        events = wire.with_completion_usage(events, running, n_prompt)
    if isinstance(options, dict) and options.get("include_usage") is True:
        events.append(wire.completion_usage_event(prefix, usage))
    events.append(wire.DONE)
    return await srv.stream(request, sim, ctx, events, 1, n_gen - 1, prefill)


def _completion_plan(s: SimSettings, sim: dict[str, Any], body: dict[str, Any], text: str, ids: list[int],
                     stops: list[str]) -> generate.Plan | Invalid:
    """One prompt's completion, or why its max_tokens does not fit the context window."""
    max_tokens = checks.fit_max_tokens(len(ids), body.get("max_tokens"), 16, s.max_model_len, s.legacy_length_check)
    if isinstance(max_tokens, Invalid):
        return max_tokens
    return generate.plan_completion(
        seed=s.seed,
        prompt=text or ",".join(map(str, ids)),
        reply_tokens=s.reply_tokens,
        max_tokens=max_tokens,
        sim=sim,
        stops=stops,
        include_stop=body.get("include_stop_str_in_output") is True,
    )


def _completion_events(prefix: bytes, index: int, head: str, plan: generate.Plan, top: Any,
                       before: int) -> tuple[list[bytes], list[int]]:
    """One prompt's stream events (the echoed prompt, a chunk per token, the finish) and the
    completion tokens of all prompts so far at each (for continuous_usage_stats); `before`: the
    earlier prompts' tokens."""
    events: list[bytes] = []
    running: list[int] = []
    end = before + plan.completion_tokens
    if head:
        events.append(wire.completion_event(prefix, _chunk(index, head, None)))
        running.append(before)
    offset = len(head)
    for k, piece in enumerate(plan.content, 1):
        lp = generate.completion_logprobs([piece], top, offset) if top is not None else None
        offset += len(piece)
        events.append(wire.completion_event(prefix, _chunk(index, piece, lp)))
        running.append(min(before + k, end))
    final = _chunk(index, "", None)
    final["finish_reason"], final["stop_reason"] = plan.finish_reason, plan.stop_reason
    events.append(wire.completion_event(prefix, final))
    running.append(end)
    return events, running


def _chunk(index: int, text: str, logprobs: Any) -> dict[str, Any]:
    return {"index": index, "text": text, "logprobs": logprobs, "finish_reason": None, "stop_reason": None}


def create_app(settings: SimSettings) -> web.Application:
    """Build the aiohttp app. Run it with handler_cancellation=True (see serve())."""
    srv = SimServer(settings)
    app = web.Application(client_max_size=64 * 1024 * 1024)
    app[SIM_KEY] = srv

    async def name_server(request: web.Request, response: web.StreamResponse) -> None:
        response.headers["x-sim-id"] = settings.id  # which replica answered, for routing tests

    app.on_response_prepare.append(name_server)

    def bind(fn: Any) -> Any:
        async def handler(request: web.Request, ctx: Ctx) -> web.StreamResponse:
            return await fn(srv, request, ctx)

        return srv.track(handler)

    r = app.router
    r.add_post("/v1/chat/completions", bind(chat_completions))
    r.add_post("/v1/completions", bind(completions))
    r.add_get("/v1/models", srv.models)
    r.add_get("/health", srv.health)
    r.add_get("/version", srv.version)
    r.add_post("/tokenize", srv.tokenize)
    r.add_post("/detokenize", srv.detokenize)
    r.add_get("/sim/stats", srv.get_stats)
    r.add_post("/sim/stats/reset", srv.reset_stats)
    r.add_get("/sim/requests", srv.get_requests)
    r.add_delete("/sim/requests", srv.clear_requests)
    r.add_get("/sim/config", srv.get_config)
    r.add_post("/sim/config", srv.set_config)
    r.add_post("/sim/rules", srv.add_rule)
    return app
