"""Agent-sized request bodies: a Claude Code-like Messages request and a Codex-like Responses request.

Shapes follow what Claude Code 2.1.332 and Codex CLI 0.171.0 were seen to send
(shared/reference/real-clients.md §5 and §6): a long system prompt in blocks with
cache_control, a dozen tools with JSON schemas (`$schema`, additionalProperties false),
thinking blocks with signatures, tool_use / tool_result turns carrying file contents; for
Codex, developer messages, reasoning items with encrypted content, function calls and
outputs, a freeform `custom` apply_patch tool with a Lark grammar, web_search. The text is
deterministic filler of realistic length; each body is about `size` bytes of JSON.
"""

from __future__ import annotations

import json
import random
from typing import Any

SIZE = 60_000  # bytes of JSON per body, like a mid-session agent turn
_WORDS = ("the file function test value request gateway stream token model user system error check "
          "return config module import class data path line branch commit change build run output "
          "input result state handler server client cache limit retry timeout format parse write").split()
SCHEMA = "https://json-schema.org/draft/2020-12/schema"


def _prose(rng: random.Random, n: int) -> str:
    """About n characters of sentence-like text."""
    out: list[str] = []
    size = 0
    while size < n:
        words = rng.choices(_WORDS, k=rng.randint(8, 18))
        sentence = " ".join(words).capitalize() + ". "
        out.append(sentence)
        size += len(sentence)
    return "".join(out)


def _code(rng: random.Random, n: int) -> str:
    """About n characters of Python-looking source with line numbers (what a Read tool returns)."""
    lines: list[str] = []
    size, i = 0, 1
    while size < n:
        a, b, c = rng.sample(_WORDS, 3)
        line = rng.choice((f"def {a}_{b}({c}: str) -> int:", f"    {a} = {b}.{c}({a}, timeout=30)",
                           f"    if not {a}:", f"        raise ValueError('{b} {c} missing')",
                           f"    return {a}_{c}", f"from kiln.{a} import {b}_{c}", ""))
        text = f"{i:>6}\t{line}"
        lines.append(text)
        size += len(text) + 1
        i += 1
    return "\n".join(lines)


def _props(rng: random.Random, names: list[str]) -> dict[str, Any]:
    kinds = ("string", "integer", "boolean")
    return {n: {"type": rng.choice(kinds), "description": _prose(rng, 120)} for n in names}


def _cc_tool(rng: random.Random, name: str, fields: list[str]) -> dict[str, Any]:
    return {"name": name, "description": _prose(rng, 1400),
            "input_schema": {"$schema": SCHEMA, "type": "object", "properties": _props(rng, fields),
                             "required": fields[:1], "additionalProperties": False}}


CC_TOOLS = {
    "Agent": ["description", "prompt", "subagent_type"], "Bash": ["command", "timeout", "description",
    "run_in_background", "dangerouslyDisableSandbox"], "Edit": ["file_path", "old_string", "new_string",
    "replace_all"], "ListAgents": ["filter"], "Read": ["file_path", "offset", "limit"], "ReportFindings":
    ["summary", "severity"], "ScheduleWakeup": ["delay_seconds", "reason"], "Skill": ["name", "arguments"],
    "ToolSearch": ["query", "max_results"], "Workflow": ["name", "inputs"], "Write": ["file_path", "content"],
}


def claude_code_messages(model: str, tag: str, size: int = SIZE, stream: bool = True) -> dict[str, Any]:
    """A Claude Code-like /v1/messages body of about `size` bytes; `tag` ends the last user turn."""
    rng = random.Random(14)
    tools = [_cc_tool(rng, n, f) for n, f in CC_TOOLS.items()]
    tools.append({"name": "DeferredToolPlaceholder", "defer_loading": True, "description": "deferred",
                  "input_schema": {"type": "object", "properties": {}}})
    ephemeral = {"type": "ephemeral"}
    body: dict[str, Any] = {
        "model": model,
        "system": [
            {"type": "text", "text": "x-anthropic-billing-header: cc_version=2.1.332.a1b; cc_entrypoint=sdk-cli;"},
            {"type": "text", "text": "You are a Claude agent, built on Anthropic's Claude Agent SDK.",
             "cache_control": ephemeral},
            {"type": "text", "text": _prose(rng, 7000), "cache_control": ephemeral},
        ],
        "tools": tools,
        "metadata": {"user_id": json.dumps({"device_id": "d" * 64, "account_uuid": "", "session_id": "5f0c" * 8})},
        "max_tokens": 32000,
        "thinking": {"type": "adaptive", "display": "omitted"},
        "context_management": {"edits": [{"type": "clear_thinking_20251015", "keep": "all"}]},
        "output_config": {"effort": "medium"},
        "stream": stream,
    }
    messages: list[dict[str, Any]] = [
        {"role": "system", "content": "Environment: linux, cwd /work/repo. Deferred tools: CronCreate, WebFetch.",
         "output_config": {"effort": "medium"}},
        {"role": "user", "content": [
            {"type": "text", "text": "<system-reminder>gitStatus: clean, branch main</system-reminder>"},
            {"type": "text", "text": "Find why the stream handler is slow and fix it."}]},
    ]
    turn = 0
    while len(json.dumps({**body, "messages": messages})) < size - 2500:
        turn += 1
        call_id = f"toolu_{turn:02d}" + "a" * 18
        messages.append({"role": "assistant", "content": [
            {"type": "thinking", "thinking": _prose(rng, 400), "signature": "sig" + "Q" * 120},
            {"type": "text", "text": _prose(rng, 200)},
            {"type": "tool_use", "id": call_id, "name": "Read", "input": {"file_path": f"/work/repo/src/m{turn}.py"}}]})
        messages.append({"role": "user", "content": [
            {"type": "tool_result", "tool_use_id": call_id, "content": _code(rng, 3500), "is_error": False}]})
    messages.append({"role": "assistant", "content": [{"type": "text", "text": _prose(rng, 300)}]})
    messages.append({"role": "user", "content": [
        {"type": "text", "text": f"Now write the fix. {tag}", "cache_control": ephemeral}]})
    body["messages"] = messages
    return body


def _fn(rng: random.Random, name: str, fields: list[str]) -> dict[str, Any]:
    return {"type": "function", "name": name, "description": _prose(rng, 1500), "strict": False,
            "parameters": {"type": "object", "properties": _props(rng, fields), "required": fields[:1],
                           "additionalProperties": False}}


CODEX_TOOLS = {
    "exec_command": ["cmd", "justification", "login", "max_output_tokens", "prefix_rule", "sandbox_permissions",
                     "shell", "tty", "workdir", "yield_time_ms"],
    "write_stdin": ["session_id", "chars", "yield_time_ms"], "request_user_input": ["question"],
    "view_image": ["path"], "get_goal": ["id"], "create_goal": ["title", "detail"], "update_goal": ["id", "status"],
}
LARK = ("start: begin_patch hunk+ end_patch\nbegin_patch: \"*** Begin Patch\" LF\nend_patch: \"*** End Patch\" LF?\n"
        "hunk: add_hunk | delete_hunk | update_hunk\nadd_hunk: \"*** Add File: \" filename LF add_line+\n")


def codex_responses(model: str, tag: str, size: int = SIZE, stream: bool = True) -> dict[str, Any]:
    """A Codex-like /v1/responses body of about `size` bytes; `tag` ends the last user message."""
    rng = random.Random(171)
    tools: list[dict[str, Any]] = [_fn(rng, n, f) for n, f in CODEX_TOOLS.items()]
    tools.append({"type": "custom", "name": "apply_patch", "description": _prose(rng, 800),
                  "format": {"type": "grammar", "syntax": "lark", "definition": LARK * 6}})
    tools.append({"type": "web_search", "external_web_access": False, "search_content_types": ["text", "image"]})

    def msg(role: str, text: str, kind: str = "input_text") -> dict[str, Any]:
        part: dict[str, Any] = {"type": kind, "text": text}
        if kind == "output_text":
            part["annotations"] = []
        return {"type": "message", "role": role, "content": [part], "id": f"msg_{rng.getrandbits(64):016x}"}

    items: list[dict[str, Any]] = [
        msg("developer", _prose(rng, 9000)), msg("developer", _prose(rng, 1500)),
        msg("user", "<environment_context><cwd>/work/repo</cwd><shell>bash</shell></environment_context>"),
        msg("user", "Find why the stream handler is slow and fix it."),
    ]
    body: dict[str, Any] = {"model": model, "stream": stream, "input": items, "tools": tools, "tool_choice": "auto",
                            "parallel_tool_calls": True, "reasoning": {"effort": "medium"}, "store": False,
                            "include": ["reasoning.encrypted_content"], "prompt_cache_key": "3c1e" * 8,
                            "text": {"verbosity": "low"},
                            "client_metadata": {"session_id": "3c1e" * 8, "x-codex-window-id": "3c1e:0"}}
    turn = 0
    while len(json.dumps(body)) < size - 1500:
        turn += 1
        call = f"call_{turn:02d}" + "b" * 20
        items.append({"type": "reasoning", "id": f"rs_{turn:04d}", "content": None,
                      "summary": [{"type": "summary_text", "text": _prose(rng, 300)}],
                      "encrypted_content": "gAAAA" + "x" * 600})
        items.append({"type": "function_call", "status": "completed", "id": f"fc_{turn:04d}", "name": "exec_command",
                      "arguments": json.dumps({"cmd": f"sed -n 1,200p src/m{turn}.py"}), "call_id": call})
        items.append({"type": "function_call_output", "id": f"fco_{turn:04d}", "call_id": call,
                      "output": "Chunk ID: 1\nWall time: 0.01\nProcess exited with code 0\nOutput:\n"
                                + _code(rng, 3500)})
    items.append({"type": "custom_tool_call", "id": "ctc_0001", "status": "completed", "call_id": "call_patch",
                  "name": "apply_patch", "input": "*** Begin Patch\n*** Add File: NOTES.md\n+notes\n*** End Patch\n"})
    items.append({"type": "custom_tool_call_output", "id": "ctco_0001", "call_id": "call_patch", "output": "Done"})
    items.append({**msg("assistant", _prose(rng, 300), "output_text"), "status": "completed"})
    items.append(msg("user", f"Now write the fix. {tag}"))
    return body
