"""Put a local copy of PyTorch's memory viewer (`torch/utils/viz/MemoryViz.js`, the page behind
pytorch.org/memory_viz) and what it imports into a git-ignored cache, so that `tests/test_memory_viz.py` can open
membench's snapshot files in it in headless Chromium, and a person can open them offline.

torch's wheel does not ship MemoryViz.js, and the viewer imports d3 from a CDN (`https://cdn.skypack.dev/d3@5`,
`d3-axis@1`, `d3-scale@1`, `d3-zoom@1`, `d3-brush@1`). This script:

1. copies MemoryViz.js from `$MEMORY_VIZ_JS` (a path) when set, else downloads it from the tag of the pinned torch
   version (`https://raw.githubusercontent.com/pytorch/pytorch/v<version>/torch/utils/viz/MemoryViz.js`), and
   records where it came from, with its SHA-256, in `SOURCE.txt`;
2. reads the CDN imports from the copy itself, installs those packages (the same version ranges) from the npm
   registry with `npm install`, and bundles them with esbuild into ES modules that share one copy of each d3
   package (the viewer reads `d3.event`, which d3-selection sets: d3-zoom's and d3-brush's events must set the same
   one), in `modules/`;
3. writes `importmap.json`, which maps each CDN address the viewer imports to its local module, and `index.html`,
   the viewer page with that map (MemoryViz.js itself is not changed).

Nothing here is committed: the viewer and d3 are other projects' code. Usage (from the repository root):

    .venv/bin/python tools/viewer/memory_viz.py [--torch-version 2.13.0] [--cache .cache/memory_viz]
    MEMORY_VIZ_JS=/path/to/MemoryViz.js make memory-viz     # where GitHub cannot be reached
    MEMORY_VIZ_DIR=/shared/memory_viz make memory-viz       # one copy for several checkouts (the test reads it too)
    MEMORY_VIZ_REF=main make memory-viz     # the viewer torch's own trace_plot pages import (PyTorch's main branch)

Then `python -m http.server -d .cache/memory_viz` and open http://localhost:8000/ to drop a snapshot on the viewer
(module scripts are not run from file:// pages).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import re
import shutil
import subprocess
import sys
import urllib.request
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
# where the copy goes (and where tests/test_memory_viz.py looks): $MEMORY_VIZ_DIR, else .cache/memory_viz/ here
CACHE = Path(os.environ.get("MEMORY_VIZ_DIR") or ROOT / ".cache" / "memory_viz")
URL = "https://raw.githubusercontent.com/pytorch/pytorch/{ref}/torch/utils/viz/MemoryViz.js"
# `import ... from "https://cdn.skypack.dev/<package>@<range>"`
CDN_IMPORT = re.compile(r"""from\s+["'](https://cdn\.skypack\.dev/((?:@[\w.-]+/)?[\w.-]+)@([^"'/?]+))["']""")
ESBUILD = "esbuild@0.25"


class MemoryVizError(RuntimeError):
    """The viewer or its imports could not be put in the cache; the message says why and what to do."""


def torch_version() -> str:
    """The installed torch's version without its local part (`2.13.0+cpu` -> `2.13.0`)."""
    import torch

    return torch.__version__.split("+")[0]


def cdn_imports(source: str) -> dict[str, str]:
    """{CDN address: npm package spec} of every CDN module the viewer imports, in its own words."""
    return {url: f"{package}@{version}" for url, package, version in CDN_IMPORT.findall(source)}


def copy_viewer(cache: Path, version: str, ref: str | None = None) -> Path:
    """MemoryViz.js into `cache`, from $MEMORY_VIZ_JS, else from GitHub at `ref` (default: the tag of torch
    `version`); its origin in SOURCE.txt."""
    given = os.environ.get("MEMORY_VIZ_JS")
    if given:
        path = Path(given).expanduser()
        if not path.is_file():
            raise MemoryVizError(f"MEMORY_VIZ_JS={given}: no such file")
        data, origin = path.read_bytes(), f"copied from {path.resolve()} (MEMORY_VIZ_JS)"
    else:
        url = URL.format(ref=ref or f"v{version}")
        try:
            with urllib.request.urlopen(url, timeout=60) as response:
                data = response.read()
        except OSError as error:
            raise MemoryVizError(
                f"could not download {url} ({error}); set MEMORY_VIZ_JS to a copy of torch/utils/viz/MemoryViz.js "
                f"at {ref or 'v' + version} of github.com/pytorch/pytorch and run again") from None
        origin = f"downloaded from {url}"
    if not cdn_imports(data.decode("utf-8", "replace")):
        raise MemoryVizError(f"{origin.split(' (')[0]}: not PyTorch's MemoryViz.js (it imports nothing from "
                             "cdn.skypack.dev)")
    target = cache / "MemoryViz.js"
    target.write_bytes(data)
    (cache / "SOURCE.txt").write_text(f"MemoryViz.js {origin}\nsha256 {hashlib.sha256(data).hexdigest()}\n"
                                      f"for torch {version}\n")
    return target


def bundle_imports(cache: Path, imports: dict[str, str]) -> dict[str, str]:
    """Installs the viewer's CDN packages from npm and bundles them into `cache/modules/` (one module per CDN
    address, the d3 packages they share in common chunks); {CDN address: the module's path from `cache`}."""
    npm = shutil.which("npm")
    if npm is None:
        raise MemoryVizError("npm is needed to fetch the viewer's d3 modules from the npm registry (apt-get install "
                             "npm, or Node.js from nodejs.org)")
    work = cache / "npm"
    entries = work / "entries"
    shutil.rmtree(entries, ignore_errors=True)
    entries.mkdir(parents=True)
    if not (work / "package.json").exists():
        (work / "package.json").write_text('{"private": true}\n')
    specs = sorted(set(imports.values()))
    done = subprocess.run([npm, "install", "--no-audit", "--no-fund", "--loglevel=error", *specs, ESBUILD],
                          cwd=work, capture_output=True, text=True)
    if done.returncode:
        raise MemoryVizError(f"npm install {' '.join(specs)} failed:\n{done.stderr.strip()}")
    names = {}
    for url, spec in imports.items():
        package = spec.rsplit("@", 1)[0]
        name = package.replace("/", "_").lstrip("@")
        # `export *` re-exports the live bindings: `d3.event` is d3-selection's own variable
        (entries / f"{name}.js").write_text(f'export * from "{package}";\n')
        names[url] = name
    out = cache / "modules"
    shutil.rmtree(out, ignore_errors=True)
    esbuild = work / "node_modules" / ".bin" / "esbuild"
    done = subprocess.run([str(esbuild), *sorted(str(p.relative_to(work)) for p in entries.glob("*.js")), "--bundle",
                           "--splitting", "--format=esm", "--platform=browser", "--log-level=error",
                           f"--outdir={out}"], cwd=work, capture_output=True, text=True)
    if done.returncode:
        raise MemoryVizError(f"esbuild could not bundle the viewer's imports:\n{done.stderr.strip()}")
    return {url: f"./modules/{name}.js" for url, name in names.items()}


def installed_versions(cache: Path, imports: dict[str, str]) -> dict[str, str]:
    """{npm spec: the version npm installed for it} (the top-level copy of each package)."""
    out = {}
    for spec in imports.values():
        package = spec.rsplit("@", 1)[0]
        manifest = cache / "npm" / "node_modules" / package / "package.json"
        out[spec] = json.loads(manifest.read_text())["version"] if manifest.exists() else "?"
    return out


def write_page(cache: Path, import_map: dict[str, str]) -> None:
    """importmap.json and index.html: the viewer page as pytorch.org/memory_viz serves it, with local modules."""
    text = json.dumps({"imports": import_map}, indent=1)
    (cache / "importmap.json").write_text(text + "\n")
    (cache / "index.html").write_text(f"""<!DOCTYPE html>
<html><head><meta charset="utf-8"><title>PyTorch memory viewer (local copy)</title>
<script type="importmap">{text}</script></head>
<body><script type="module" src="./MemoryViz.js"></script></body></html>
""")


def build(cache: Path = CACHE, version: str | None = None, ref: str | None = None) -> Path:
    """The whole cache (MemoryViz.js, modules/, importmap.json, index.html); returns `cache`."""
    cache.mkdir(parents=True, exist_ok=True)
    version = version or torch_version()
    viewer = copy_viewer(cache, version, ref)
    imports = cdn_imports(viewer.read_text())
    write_page(cache, bundle_imports(cache, imports))
    with open(cache / "SOURCE.txt", "a") as handle:
        for spec, installed in installed_versions(cache, imports).items():
            handle.write(f"{spec} from the npm registry: {installed}\n")
    return cache


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--torch-version", help="the torch tag to download from (default: the installed torch's)")
    parser.add_argument("--ref", default=os.environ.get("MEMORY_VIZ_REF"),
                        help="the git ref to download from instead of the torch tag: `main` is the viewer that "
                             "torch.cuda._memory_viz.trace_plot pages import (default: $MEMORY_VIZ_REF, else "
                             "v<torch version>)")
    parser.add_argument("--cache", type=Path, default=CACHE, help=f"where to put it (default: {CACHE})")
    args = parser.parse_args(argv)
    try:
        cache = build(args.cache.resolve(), args.torch_version, args.ref)
    except MemoryVizError as error:
        print(f"memory_viz: {error}", file=sys.stderr)
        return 1
    print((cache / "SOURCE.txt").read_text(), end="")
    print(f"the viewer is in {cache}: python -m http.server -d {cache} and open http://localhost:8000/")
    return 0


if __name__ == "__main__":
    sys.exit(main())
