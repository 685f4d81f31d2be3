"""Builds the stub CUDA libraries of the fake-CUDA environment: one small .so per CUDA library torch links against.

Run as `python -m bench.measure.cuda_stubs --torch-version X` with that environment's Python by bench.measure.cuda_env
(`python -m bench cuda-env`, `make cuda-fake-env`), after PyPI's CUDA build of torch was installed without its nvidia
dependencies. The list of libraries and of their symbols comes from torch's own ELF files (the NEEDED
entries and the undefined dynamic symbols, with their version tags), and from torchvision's operator library where
torchvision is installed (the `timm:` workload imports it), so the stubs always match the installed builds; they
are compiled here with the system C compiler and nothing binary is committed. A stub answers the handful of calls
that make torch see "one device, device 0, nothing being captured, streams and events whose work is always done"
(bench.measure.cuda_stub_source's ANSWERS, where the C source of each stub is written) and returns its library's
"not supported" error from every other function: under FakeTensorMode no kernel runs, so none of those should be
called, and one that is shows as a CUDA error naming it
(set MEMBENCH_FAKE_CUDA_TRACE=1 to see every stub call on stderr).

The stubs go into the first `nvidia/...` folder of torch's RUNPATH (site-packages/nvidia/<...>/lib), where the
wheel's nvidia packages would put the real libraries: `import torch` in that environment finds them with no
environment variable, in every process it starts (the isolated workers included).

Exit status 0 when the stubs are built and `import torch` reports CUDA with one device; otherwise 1, with the
reason on stderr and in `<venv>/fake-cuda-unavailable.txt` (which `predict` and the fake-CUDA tests report).
"""

from __future__ import annotations

import argparse
import importlib.metadata
import importlib.util
import os
import re
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

from bench.measure.cuda_stub_source import DEVICE_PROPERTIES_CUDA_MAJOR, c_source, version_script
from bench.measure.fake_cuda import UNAVAILABLE_FILE

# What an unversioned imported symbol's prefix says about the library that defines it (the versioned ones carry
# their library's soname as their version tag). Checked in this order: cuFile and cusparseLt before the driver.
UNVERSIONED_PREFIXES = [
    (re.compile(r"^nccl"), "libnccl.so"),
    (re.compile(r"^nvshmem"), "libnvshmem_host.so"),
    (re.compile(r"^cuFile"), "libcufile.so"),
    (re.compile(r"^cusparseLt"), "libcusparseLt.so"),
    (re.compile(r"^cu[A-Z]"), "libcuda.so"),  # the driver API (cuCtxGetCurrent, cuLaunchKernel, ...)
]
# The libraries stubbed: every NEEDED library of torch's with one of these names that torch does not ship itself.
CUDA_LIBRARY = re.compile(r"^lib(cu|nccl|nvrtc|nvshmem|nvToolsExt|nvJitLink)")

class Unavailable(Exception):
    """The fake-CUDA environment cannot be built here; the message says why."""


def torch_folder() -> Path:
    """The installed torch package's folder, found without importing it (it cannot load before the stubs exist)."""
    spec = importlib.util.find_spec("torch")
    if spec is None or not spec.submodule_search_locations:
        raise Unavailable("torch is not installed in this environment")
    return Path(list(spec.submodule_search_locations)[0])


def check_torch(folder: Path, wanted_version: str) -> str:
    """The CUDA version torch was built with; raises Unavailable for another torch version or a CPU-only build."""
    installed = importlib.metadata.version("torch")
    if installed.split("+")[0] != wanted_version:
        raise Unavailable(f"torch {installed} is installed, the fake-CUDA stubs are made for torch {wanted_version}")
    match = re.search(r"^cuda: .*= '([0-9.]+)'", (folder / "version.py").read_text(), re.MULTILINE)
    if match is None:
        raise Unavailable(f"torch {installed} is a build without CUDA (torch===X selects PyPI's CUDA build)")
    return match.group(1)


def pinned_version(requirement_name: str) -> str | None:
    """The version torch's wheel pins `requirement_name` to (`nvidia-cudnn-cu13==9.20.0.48`), if it does."""
    for requirement in importlib.metadata.requires("torch") or []:
        match = re.match(rf"^{re.escape(requirement_name)}(-cu\d+)?(\[[^]]*\])?==([0-9.]+)", requirement)
        if match:
            return match.group(3)
    return None


def version_numbers(cuda: str) -> dict[str, int]:
    """The integers the stubs' version queries return: the versions torch was built against."""
    major, minor = (int(part) for part in cuda.split(".")[:2])
    cudnn = (pinned_version("nvidia-cudnn") or "9.0.0").split(".")
    nccl = (pinned_version("nvidia-nccl") or "2.0.0").split(".")
    return {"cuda_version": major * 1000 + minor * 10,
            "cudnn_major": int(cudnn[0]), "cudnn_minor": int(cudnn[1]), "cudnn_patch": int(cudnn[2]),
            "cudnn_version": int(cudnn[0]) * 10000 + int(cudnn[1]) * 100 + int(cudnn[2]),
            "nccl_version": int(nccl[0]) * 10000 + int(nccl[1]) * 100 + int(nccl[2])}


def elf_files(folder: Path) -> list[Path]:
    """torch's own libraries, and torchvision's operator library where torchvision is installed: it links against
    the CUDA runtime too (torchvision's image decoders bring their own, in torchvision.libs), so the stubs define
    what it imports as well, and its operators load as they would on a GPU."""
    return sorted(folder.glob("lib/*.so*")) + sorted(folder.glob("_C*.so")) + torchvision_operator_files()


def torchvision_operator_files() -> list[Path]:
    """torchvision's `_C.so`, found without importing torchvision; none where it is not installed."""
    spec = importlib.util.find_spec("torchvision")
    if spec is None or not spec.submodule_search_locations:
        return []
    return sorted(Path(list(spec.submodule_search_locations)[0]).glob("_C*.so"))


def readelf(*args: str) -> str:
    return subprocess.run(["readelf", "-W", *args], check=True, capture_output=True, text=True).stdout


def needed_and_runpath(path: Path) -> tuple[list[str], list[str]]:
    """The NEEDED sonames and the RUNPATH folders of one ELF file."""
    needed, runpath = [], []
    for line in readelf("-d", str(path)).splitlines():
        match = re.search(r"\((NEEDED|RUNPATH|RPATH)\).*\[(.*)\]", line)
        if match and match.group(1) == "NEEDED":
            needed.append(match.group(2))
        elif match:
            runpath += match.group(2).split(":")
    return needed, runpath


def imported_symbols(path: Path) -> list[tuple[str, str | None, str]]:
    """(name, version tag or None, FUNC/OBJECT/NOTYPE) of every undefined dynamic symbol of one ELF file."""
    symbols = []
    for line in readelf("--dyn-syms", str(path)).splitlines():
        fields = line.split()
        if len(fields) >= 8 and fields[6] == "UND" and fields[7]:
            name, _, version = fields[7].partition("@")
            symbols.append((name, version.split()[0] if version else None, fields[3]))
    return symbols


def version_files(path: Path) -> dict[str, str]:
    """{version tag: soname of the library that defines it} from one ELF file's version needs (.gnu.version_r):
    most CUDA libraries tag their symbols with their soname, NVSHMEM with `NVSHMEM`."""
    files, current = {}, None
    for line in readelf("-V", str(path)).splitlines():
        match = re.search(r"File: (\S+)", line)
        if match:
            current = match.group(1)
        match = re.search(r"Name: (\S+)", line)
        if match and current:
            files[match.group(1)] = current
    return files


def defined_symbols(path: Path) -> set[str]:
    return {line.split()[7].split("@")[0] for line in readelf("--dyn-syms", str(path)).splitlines()
            if len(line.split()) >= 8 and line.split()[6] not in ("UND", "Ndx")}


def plan_stubs(folder: Path) -> tuple[dict[str, dict[str, tuple[str | None, str]]], Path]:
    """{soname: {symbol: (version tag, type)}} of every CUDA library torch needs, and where the stubs go."""
    files = elf_files(folder)
    shipped = {path.name for path in files}
    sonames, runpath = set(), []
    imports, defined, tag_files = [], set(), {}
    for path in files:
        needed, folders = needed_and_runpath(path)
        sonames |= {name for name in needed if CUDA_LIBRARY.match(name) and name not in shipped}
        runpath += [f for f in folders if f not in runpath]
        imports += imported_symbols(path)
        defined |= defined_symbols(path)
        tag_files.update(version_files(path))
    target = next((f for f in runpath if "/nvidia/" in f), None)
    if target is None:
        raise Unavailable("torch's libraries have no nvidia/ folder in their RUNPATH: not a PyPI CUDA build")
    stubs: dict[str, dict[str, tuple[str | None, str]]] = {soname: {} for soname in sonames}
    by_stem = {soname.split(".so")[0] + ".so": soname for soname in sonames}
    for name, version, kind in imports:
        if name in defined:
            continue
        if tag_files.get(version) in stubs:
            stubs[tag_files[version]][name] = (version, kind)
        elif version is None:
            soname = next((by_stem.get(stem) for prefix, stem in UNVERSIONED_PREFIXES if prefix.match(name)), None)
            if soname is not None:
                stubs[soname][name] = (None, kind)
    return stubs, Path(os.path.normpath(target.replace("$ORIGIN", str(folder / "lib"))))


def compile_stub(compiler: str, soname: str, source: str, script: str | None, target: Path, work: Path) -> None:
    c_file = work / f"{soname}.c"
    c_file.write_text(source)
    command = [compiler, "-shared", "-fPIC", "-O1", "-w", f"-Wl,-soname,{soname}", "-o", str(target / soname),
               str(c_file)]
    if script:
        (work / f"{soname}.map").write_text(script)
        command.insert(1, f"-Wl,--version-script={work / f'{soname}.map'}")
    done = subprocess.run(command, capture_output=True, text=True)
    if done.returncode != 0:
        raise Unavailable(f"{compiler} could not build the stub {soname}: {done.stderr.strip()[-500:]}")


def check_import(python: str) -> None:
    """Imports torch in a fresh process and checks it sees one CUDA device through the stubs."""
    code = "import torch; assert torch.cuda.is_available() and torch.cuda.device_count() == 1; print(torch.version.cuda)"
    done = subprocess.run([python, "-c", code], capture_output=True, text=True)
    if done.returncode != 0:
        raise Unavailable("torch does not load with the stubs: " + (done.stderr.strip().splitlines() or ["?"])[-1])


def build(torch_version: str) -> Path:
    """Builds every stub; returns the folder they are in."""
    compiler = os.environ.get("CC", "cc")
    for tool in (compiler, "readelf"):
        if shutil.which(tool) is None:
            raise Unavailable(f"no {tool} on this machine (the stubs are compiled at set-up)")
    folder = torch_folder()
    cuda = check_torch(folder, torch_version)
    if int(cuda.split(".")[0]) != DEVICE_PROPERTIES_CUDA_MAJOR:
        raise Unavailable(f"torch {torch_version} is built with CUDA {cuda}; the stubs' device properties are laid "
                          f"out for CUDA {DEVICE_PROPERTIES_CUDA_MAJOR}")
    numbers = version_numbers(cuda)
    stubs, target = plan_stubs(folder)
    target.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory() as work:
        for soname, symbols in sorted(stubs.items()):
            compile_stub(compiler, soname, c_source(soname, symbols, numbers, torch_version), version_script(symbols),
                         target, Path(work))
    check_import(sys.executable)
    return target


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--torch-version", required=True, help="the torch version the stubs are made for")
    args = parser.parse_args()
    reason_file = Path(sys.prefix) / UNAVAILABLE_FILE
    try:
        target = build(args.torch_version)
    except Unavailable as error:
        reason_file.write_text(f"{error}\n")
        print(f"cuda_stubs: {error}", file=sys.stderr)
        return 1
    reason_file.unlink(missing_ok=True)
    print(f"cuda_stubs: stub CUDA libraries for torch {args.torch_version} in {target}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
