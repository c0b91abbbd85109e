"""`kiln serve --config BAD.toml`: every problem reported at once, with its place, and no start.

Each test runs the real CLI in a subprocess. A bad configuration must exit
non-zero quickly (it never gets as far as listening), so these are cheap.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import httpx
import pytest

from conftest import free_port

GOOD_MODEL = """
[[models]]
id = "m1"
context_window = 4096
prices = { input = "0.10", cached_input = "0.05", output = "0.30" }
[[models.backends]]
url = "http://127.0.0.1:9/v1"
"""


def serve(tmp_path: Path, text: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    path = tmp_path / "bad.toml"
    path.write_text(textwrap.dedent(text))
    port = free_port()
    clean = {k: v for k, v in os.environ.items() if not k.startswith("KILN_")}
    proc = subprocess.run(
        [sys.executable, "-m", "kiln", "serve", "--config", str(path), "--port", str(port),
         "--data-dir", str(tmp_path / "data")],
        capture_output=True, text=True, timeout=30, cwd=tmp_path, env={**clean, **(env or {})},
    )
    # It never started: nothing listens on the port.
    with pytest.raises(httpx.HTTPError):
        httpx.get(f"http://127.0.0.1:{port}/health", timeout=0.5)
    return proc


def problems(proc: subprocess.CompletedProcess[str]) -> str:
    assert proc.returncode != 0, proc.stdout + proc.stderr
    out = proc.stderr + proc.stdout
    if "Traceback" in out:
        pytest.fail(f"a configuration mistake must be reported, not crash:\n{out[-600:]}", pytrace=False)
    return out


def line_with(out: str, *needles: str) -> str:
    """The one output line that carries every needle (so place and problem are reported together)."""
    lines = [ln for ln in out.splitlines() if all(n in ln for n in needles)]
    assert lines, f"no line with {needles!r} in:\n{out}"
    return lines[0]


def line_with_any(out: str, *alternatives: tuple[str, ...]) -> str:
    """Like line_with, for a place that may be named by the model's id or by its index."""
    for needles in alternatives:
        lines = [ln for ln in out.splitlines() if all(n in ln for n in needles)]
        if lines:
            return lines[0]
    raise AssertionError(f"no line with any of {alternatives!r} in:\n{out}")


def test_every_problem_is_reported_at_once_with_its_place(tmp_path: Path) -> None:
    out = problems(serve(tmp_path, """
        [server]
        prot = 8080
        keepalive_s = "fast"

        [limits]
        rpm = -1
        concurency = 4

        [[models]]
        id = "m1"
        context_window = "big"
        prices = { input = "0.10" }
        [[models.backends]]
        url = "ftp://example.com/v1"

        [[models]]
        id = "m2"
        context_windw = 4096
        prices = { input = "abc", output = "0.3" }
        [[models.backends]]
        url = "not a url"
    """))
    assert "did you mean 'port'" in line_with(out, "server.prot", "unknown")
    line_with(out, "server.keepalive_s", "'fast'")
    line_with(out, "limits.rpm", "-1")
    assert "did you mean 'concurrency'" in line_with(out, "limits.concurency")
    line_with(out, "models[m1].context_window")
    line_with(out, "models[m1].prices.output", "missing")
    line_with(out, "models[m1].backends[0].url", "ftp://example.com/v1")
    assert "did you mean 'context_window'" in line_with_any(
        out, ("models[m2].context_windw",), ("models[1].context_windw",))
    line_with(out, "models[m2].prices.input", "abc")
    line_with(out, "models[m2].backends[0].url", "not a url")
    # Ten problems, each on its own line.
    assert len([ln for ln in out.splitlines() if ln.strip().startswith("- ")]) >= 10


def test_unknown_field_suggests_the_right_name(tmp_path: Path) -> None:
    out = problems(serve(tmp_path, GOOD_MODEL.replace('context_window = 4096', 'context_window = 4096\nalises = ["x"]')
                         + "\n[server]\nmax_body_byte = 10\n"))
    assert "did you mean 'aliases'" in line_with_any(
        out, ("models[m1].alises", "unknown field"), ("models[0].alises", "unknown field"))
    assert "did you mean 'max_body_bytes'" in line_with(out, "server.max_body_byte")


def test_unknown_section_suggests_the_right_name(tmp_path: Path) -> None:
    out = problems(serve(tmp_path, "[limit]\nrpm = 5\n" + GOOD_MODEL))
    assert "did you mean 'limits'" in line_with(out, "limit", "unknown field")


def test_unknown_price_and_capability_fields(tmp_path: Path) -> None:
    out = problems(serve(tmp_path, """
        [[models]]
        id = "m1"
        context_window = 4096
        prices = { input = "0.10", cachedinput = "0.05", output = "0.30" }
        capabilities = { tool_choise = ["auto"] }
        [[models.backends]]
        url = "http://127.0.0.1:9/v1"
        modle = "upstream"
    """))
    assert "did you mean 'cached_input'" in line_with_any(
        out, ("models[m1].prices.cachedinput",), ("models[0].prices.cachedinput",))
    assert "did you mean 'tool_choice'" in line_with_any(
        out, ("models[m1].capabilities.tool_choise",), ("models[0].capabilities.tool_choise",))
    assert "did you mean 'model'" in line_with(out, "models[m1].backends[0].modle")


BAD_URLS = ["127.0.0.1:8000/v1", "ftp://host/v1", "http://", "", "localhost"]


def test_bad_backend_urls(tmp_path: Path) -> None:
    backends = "".join(f'[[models.backends]]\nurl = "{u}"\n' for u in BAD_URLS)
    out = problems(serve(tmp_path, GOOD_MODEL.split("[[models.backends]]")[0] + backends))
    for j, url in enumerate(BAD_URLS):
        line_with(out, f"models[m1].backends[{j}].url", "http", repr(url))


def test_backend_url_of_the_wrong_type(tmp_path: Path) -> None:
    out = problems(serve(tmp_path, GOOD_MODEL.replace('"http://127.0.0.1:9/v1"', "8000")))
    line_with(out, "models[m1].backends[0].url")


def test_missing_backends(tmp_path: Path) -> None:
    text = GOOD_MODEL.split("[[models.backends]]")[0]
    out = problems(serve(tmp_path, text))
    line_with(out, "models[m1].backends")


@pytest.mark.parametrize("missing", ["input", "output"])
def test_missing_price(tmp_path: Path, missing: str) -> None:
    prices = {"input": '"0.10"', "output": '"0.30"'}
    del prices[missing]
    text = GOOD_MODEL.replace('{ input = "0.10", cached_input = "0.05", output = "0.30" }',
                              "{ " + ", ".join(f"{k} = {v}" for k, v in prices.items()) + " }")
    out = problems(serve(tmp_path, text))
    assert "missing" in line_with(out, f"models[m1].prices.{missing}")


def test_missing_prices_table(tmp_path: Path) -> None:
    text = GOOD_MODEL.replace('prices = { input = "0.10", cached_input = "0.05", output = "0.30" }\n', "")
    out = problems(serve(tmp_path, text))
    line_with(out, "models[m1].prices")


BAD_PRICES = ['"-1"', '"free"', "true", '"NaN"', '"inf"']


def test_bad_price_values(tmp_path: Path) -> None:
    text = "".join(
        GOOD_MODEL.replace('id = "m1"', f'id = "p{i}"').replace('output = "0.30"', f"output = {price}")
        for i, price in enumerate(BAD_PRICES)
    )
    out = problems(serve(tmp_path, text))
    for i in range(len(BAD_PRICES)):
        line_with(out, f"models[p{i}].prices.output")


def test_wrong_types_in_server_and_limits(tmp_path: Path) -> None:
    out = problems(serve(tmp_path, """
        [server]
        port = "8080"
        host = 127
        request_timeout_s = "1h"
        max_body_bytes = 1.5
        sqlite_synchronous = "sometimes"
        keepalive_s = true
        [limits]
        rpm = "60"
        concurrency = 0
        tpm = 2.5
    """ + GOOD_MODEL))
    for place in ("server.port", "server.host", "server.request_timeout_s", "server.max_body_bytes",
                  "server.sqlite_synchronous", "server.keepalive_s", "limits.rpm", "limits.concurrency",
                  "limits.tpm"):
        line_with(out, place)


def test_boolean_port_is_a_wrong_type(tmp_path: Path) -> None:
    out = problems(serve(tmp_path, "[server]\nport = true\n" + GOOD_MODEL))
    line_with(out, "server.port", "True")


MODEL_MISTAKES = [
    ("context_window = 4096", "context_window = 0", "context_window"),
    ("context_window = 4096", 'context_window = 4096\nmax_output_tokens = "lots"', "max_output_tokens"),
    ("context_window = 4096", 'context_window = 4096\naliases = "one-alias"', "aliases"),
    ("context_window = 4096", 'context_window = 4096\ncapabilities = { reasoning = "yes" }', "capabilities.reasoning"),
    ("context_window = 4096", "context_window = 4096\ncapabilities = { tool_choice = ['sometimes'] }",
     "capabilities.tool_choice"),
]


def test_wrong_types_in_models(tmp_path: Path) -> None:
    text = "".join(
        GOOD_MODEL.replace('id = "m1"', f'id = "w{i}"').replace(old, new, 1)
        for i, (old, new, _) in enumerate(MODEL_MISTAKES)
    )
    text += GOOD_MODEL.replace('id = "m1"', "id = 1")
    out = problems(serve(tmp_path, text))
    for i, (_, _, place) in enumerate(MODEL_MISTAKES):
        line_with(out, f"models[w{i}].{place}")
    line_with(out, f"models[{len(MODEL_MISTAKES)}].id")


def test_models_must_be_an_array_of_tables(tmp_path: Path) -> None:
    out = problems(serve(tmp_path, '[models]\nid = "m1"\n'))
    line_with(out, "models")


def test_api_key_env_must_be_set(tmp_path: Path) -> None:
    text = GOOD_MODEL.replace('url = "http://127.0.0.1:9/v1"',
                              'url = "http://127.0.0.1:9/v1"\napi_key_env = "KILN_TEST_UNSET_VAR"')
    out = problems(serve(tmp_path, text))
    line_with(out, "models[m1].backends[0].api_key_env", "KILN_TEST_UNSET_VAR")


def test_toml_syntax_error_names_the_line(tmp_path: Path) -> None:
    out = problems(serve(tmp_path, "[server]\nport = 80\nhost = \n"))
    assert "line 3" in out, out


def test_missing_config_file(tmp_path: Path) -> None:
    port = free_port()
    proc = subprocess.run(
        [sys.executable, "-m", "kiln", "serve", "--config", str(tmp_path / "nope.toml"), "--port", str(port)],
        capture_output=True, text=True, timeout=30, cwd=tmp_path,
    )
    out = problems(proc)
    assert "nope.toml" in out and "not found" in out


def test_duplicate_model_name_is_reported_not_a_crash(tmp_path: Path) -> None:
    """A name used twice (id or alias) is a configuration mistake like any other."""
    second = GOOD_MODEL.replace('id = "m1"', 'id = "m2"\naliases = ["m1"]')
    out = problems(serve(tmp_path, GOOD_MODEL + second))
    line_with(out, "m1")


def test_a_model_id_used_twice_is_reported(tmp_path: Path) -> None:
    out = problems(serve(tmp_path, GOOD_MODEL + GOOD_MODEL))
    line_with(out, "m1")


def test_the_exit_status_is_nonzero_and_nothing_is_created(tmp_path: Path) -> None:
    proc = serve(tmp_path, "[server]\nprot = 1\n" + GOOD_MODEL)
    assert proc.returncode == 2
    assert not (tmp_path / "data" / "kiln.db").exists(), "a rejected configuration must not create a database"


def test_bad_environment_override_is_reported(tmp_path: Path) -> None:
    out = problems(serve(tmp_path, GOOD_MODEL, env={"KILN_PORT": "eighty"}))
    line_with(out, "KILN_PORT", "eighty")


def test_log_and_metrics_mistakes_are_reported(tmp_path: Path) -> None:
    out = problems(serve(tmp_path, """
        [log]
        format = "xml"
        level = 3
        colour = true
        [metrics]
        port = 70000
        host = ""
        org_label = "yes"
        prot = 9000
    """ + GOOD_MODEL))
    line_with(out, "log.format", "json", "'xml'")
    line_with(out, "log.level", "info", "3")
    assert "unknown field" in line_with(out, "log.colour")
    line_with(out, "metrics.port", "70000")
    line_with(out, "metrics.host")
    line_with(out, "metrics.org_label", "true or false")
    assert "did you mean 'port'" in line_with(out, "metrics.prot")
    out = problems(serve(tmp_path, "[metrics]\nport = true\n[log]\nformat = 'TEXT'\n" + GOOD_MODEL))
    line_with(out, "metrics.port", "True")
    assert "log.format" not in out  # names are not case-sensitive


def test_log_and_metrics_settings_load(tmp_path: Path) -> None:
    from kiln import config

    path = tmp_path / "ok.toml"
    path.write_text("[log]\nformat = 'JSON'\nlevel = 'warning'\n[metrics]\nport = 9464\nhost = '0.0.0.0'\n"
                    "org_label = true\n" + GOOD_MODEL)
    settings = config.load(path, env={})
    assert (settings.log.format, settings.log.level) == ("json", "warning")
    assert (settings.metrics.port, settings.metrics.host, settings.metrics.org_label) == (9464, "0.0.0.0", True)
    defaults = config.load(None, env={})
    assert (defaults.log.format, defaults.log.level, defaults.metrics.port) == ("auto", "info", None)


def test_routing_mistakes_are_reported_with_their_place(tmp_path: Path) -> None:
    out = problems(serve(tmp_path, """
        [routing]
        affinity = "yes"
        retries = -1
        headers_timeout_s = 0
        ejection_s = 60
        max_ejection_s = 10
        affinty_balance = 1

        [[models]]
        id = "m1"
        context_window = 4096
        prices = { input = "1", output = "2" }
        [[models.backends]]
        url = "http://127.0.0.1:9/v1"
        weight = 0
        max_in_flight = "many"
        idle_timeout_s = -5
    """))
    line_with(out, "routing.affinity", "true or false")
    line_with(out, "routing.retries", "integer >= 0")
    line_with(out, "routing.headers_timeout_s", "seconds > 0")
    line_with(out, "routing.max_ejection_s", "routing.ejection_s")
    line_with(out, "routing.affinty_balance", "affinity_balance")
    line_with_any(out, ("models[m1].backends[0].weight", "positive integer"))
    line_with(out, "models[m1].backends[0].max_in_flight", "positive integer")
    line_with(out, "models[m1].backends[0].idle_timeout_s", "seconds > 0")


def test_backend_kind_is_checked_and_kept(tmp_path: Path) -> None:
    from kiln import config, wiring

    model = """
        [[models]]
        id = "m1"
        context_window = 4096
        prices = { input = "1", output = "2" }
        [[models.backends]]
        url = "http://127.0.0.1:9/v1"
        kind = "%s"
    """
    out = problems(serve(tmp_path, model % "tgi"))
    line_with(out, "models[m1].backends[0].kind", "vllm, sglang, llamacpp, openai", "'tgi'")
    path = tmp_path / "ok.toml"
    path.write_text(model % "llamacpp")
    [backend] = wiring.build_catalog(config.load(path, env={}), env={}).models[0].backends
    assert backend.kind == "llamacpp"


def test_a_database_url_of_another_kind_is_refused_without_its_password(tmp_path: Path) -> None:
    out = problems(serve(tmp_path, GOOD_MODEL, env={"KILN_DATABASE": "mysql://kiln:hunter2@db.example.com/kiln"}))
    assert "scheme 'mysql'" in line_with(out, "server.database") and "hunter2" not in out
