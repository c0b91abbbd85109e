"""A pinned LiteLLM proxy in its own virtual environment, for the side-by-side benchmark.

`litellm[proxy]` does not resolve from the registry here, so this installs `litellm==VERSION`
and then the proxy extra's other requirements, read from the installed wheel's METADATA
(`Requires-Dist: ...; extra == "proxy"`), skipping (and listing) those that do not resolve.
The environment lives under ~/.cache/kiln-bench/litellm-VERSION/ and is built once.

    .venv/bin/python bench/litellm_env.py [--version 1.110.2] [--force]
"""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
from pathlib import Path

VERSION = "1.110.2"  # the version the figures were measured with
CACHE = Path.home() / ".cache" / "kiln-bench"
MARKER = "installed.json"  # written last: what was installed and what was skipped

# Run inside the LiteLLM venv: the proxy extra's requirements from litellm's METADATA.
_READ_EXTRA = """
import json, re
from importlib.metadata import distribution
out = []
for req in distribution("litellm").requires or []:
    spec, _, marker = req.partition(";")
    if re.search(r'extra\\s*==\\s*["\\']proxy["\\']', marker):
        rest = re.sub(r'(and\\s+)?extra\\s*==\\s*["\\']proxy["\\']', "", marker).strip()
        rest = re.sub(r'^and\\s+|\\s+and$', "", rest).strip()
        out.append(spec.strip() + (f"; {rest}" if rest else ""))
print(json.dumps(out))
"""


def env_dir(version: str = VERSION) -> Path:
    return CACHE / f"litellm-{version}"


def python_of(version: str = VERSION) -> Path:
    return env_dir(version) / "bin" / "python"


def installed(version: str = VERSION) -> dict[str, object] | None:
    """The install record ({"version", "extra", "skipped"}) when the environment is ready."""
    marker = env_dir(version) / MARKER
    return json.loads(marker.read_text()) if marker.exists() else None


def _pip(py: Path, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([str(py), "-m", "pip", "install", "-q", *args], capture_output=True, text=True, check=False)


def ensure(version: str = VERSION, force: bool = False, log: bool = True) -> dict[str, object]:
    """Build the environment if needed; returns the install record. Raises RuntimeError on failure."""
    if not force and (done := installed(version)):
        return done
    root = env_dir(version)
    if root.exists():
        shutil.rmtree(root)
    say = print if log else (lambda *_a, **_k: None)
    say(f"building LiteLLM {version} in {root} (once; a few minutes) ...", flush=True)
    subprocess.run([sys.executable, "-m", "venv", str(root)], check=True)
    py = python_of(version)
    out = _pip(py, f"litellm=={version}")
    if out.returncode != 0:
        raise RuntimeError(f"pip install litellm=={version} failed:\n{out.stdout}{out.stderr}")
    read = subprocess.run([str(py), "-c", _READ_EXTRA], capture_output=True, text=True, check=True)
    extra: list[str] = json.loads(read.stdout)
    skipped: list[str] = []
    if _pip(py, *extra).returncode != 0:  # all at once failed: one by one, keep what resolves
        for req in extra:
            res = _pip(py, req)
            if res.returncode != 0:
                skipped.append(req)
                say(f"  skipped (does not resolve): {req}", flush=True)
    record = {"version": version, "extra": extra, "skipped": skipped}
    (root / MARKER).write_text(json.dumps(record, indent=1))
    say(f"LiteLLM {version} ready; proxy requirements: {len(extra) - len(skipped)} installed, "
        f"{len(skipped)} skipped" + (f" ({', '.join(skipped)})" if skipped else ""), flush=True)
    return record


def main() -> int:
    p = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    p.add_argument("--version", default=VERSION, help=f"LiteLLM version (default {VERSION})")
    p.add_argument("--force", action="store_true", help="rebuild the environment")
    a = p.parse_args()
    try:
        ensure(a.version, a.force)
    except (RuntimeError, subprocess.CalledProcessError) as exc:
        print(f"LiteLLM environment failed: {exc}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
