"""Kiln's unchanged ASGI app served by Granian instead of uvicorn (bench/run.py --server granian).

`kiln serve` hands `kiln.app.create_app(...)` to uvicorn; this builds the same app the same
way (settings from the TOML file in $KILN_CONFIG plus the KILN_* environment, the catalog from
them) and lets Granian serve it: ASGI interface, one worker, uvloop, HTTP/1.1.

    KILN_CONFIG=kiln.toml KILN_PORT=8080 python bench/kiln_granian.py
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from kiln import config, wiring
from kiln.app import create_app
from kiln.server import collect_garbage_less_often


def app() -> Any:
    """The gateway's ASGI app (a factory: Granian calls it in its worker process)."""
    settings = config.load(os.environ["KILN_CONFIG"])
    app = create_app(settings, catalog=wiring.build_catalog(settings))
    collect_garbage_less_often()  # as `kiln serve` does once it has started
    return app


def main() -> None:
    from granian import Granian
    from granian.constants import HTTPModes, Interfaces, Loops

    settings = config.load(os.environ["KILN_CONFIG"])
    here = os.path.dirname(os.path.abspath(__file__))
    Granian("kiln_granian:app", address=settings.host, port=settings.port, interface=Interfaces.ASGI,
            factory=True, workers=1, loop=Loops.uvloop, http=HTTPModes.http1, websockets=False, backlog=2048,
            log_enabled=False, working_dir=Path(here)).serve()


if __name__ == "__main__":
    main()
