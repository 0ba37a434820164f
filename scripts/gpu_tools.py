"""Helpers of ``scripts/gpu_wheels.sh`` and ``scripts/gpu_check.sh`` (the prepared check on the GPU machine: one
H200, its own ``python3``, no network). Standard library and ``packaging`` only, so it runs there before anything
is installed, and it names no module of the zoo: the check reaches the project through its ``zoo`` command.

    python scripts/gpu_tools.py wheels .whl [--manifest .whl/MANIFEST.txt --why NAME=TEXT ... --tree-bytes N]
        the requirements of every wheel in .whl/ against what the GPU machine holds and the other wheels; the list
    python scripts/gpu_tools.py fresh SITE       the project wheel installed in SITE holds exactly the tree's files
    python scripts/gpu_tools.py env --site SITE --out env.md [--rehearse]
        versions and where each package comes from, FlexAttention's API, the carried packages' requirements
    python scripts/gpu_tools.py zoo bench ...    the installed project's ``zoo`` console script
"""

from __future__ import annotations

import argparse
import importlib
import importlib.metadata as metadata
import importlib.util
import inspect
import json
import shutil
import subprocess
import sys
import time
import zipfile
from email.parser import HeaderParser
from pathlib import Path

from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

REPO = Path(__file__).resolve().parent.parent
PROJECT = "attention-zoo"

# The GPU machine, as the device notes (KINDS.md) record it: a session's `pip list` (2026-11) for the versions, the
# image's package list (2026-11-17) for the names. A name without a version is there in a version nobody recorded.
MACHINE_PYTHON = "3.12.3"
MACHINE_VERSIONS = {
    "accelerate": "1.15.0", "huggingface-hub": "1.33.0", "numpy": "2.5.2", "safetensors": "0.8.0",
    "sentence-transformers": "6.0.1", "sentencepiece": "0.2.2", "tokenizers": "0.23.2", "torch": "2.11.0",
    "torchaudio": "2.11.0", "torchvision": "0.26.0", "transformers": "5.17.0", "triton": "3.6.0",
    "jax": "0.11.2", "onnx": "1.23.1", "onnxruntime": "1.30.0", "pytorch-lightning": "2.6.6", "tiktoken": "0.14.0",
    "torchmetrics": "1.9.0",
}
MACHINE_NAMES = set(MACHINE_VERSIONS) | set("""
absl-py aiofiles aiohappyeyeballs aiohttp aiosignal annotated-doc anyio attrs botorch build certifi
charset-normalizer chex click cloudpickle cmake colorama contourpy coverage cuda-bindings cuda-core cuda-pathfinder
cuda-toolkit cupy-cuda13x cycler cython diffrax e3nn einops equinox etils execnet filelock flatbuffers flax fonttools
formulaic frozenlist fsspec gpytorch grpcio h11 h5py hf-xet httpcore httpx humanize hypothesis idna imageio iniconfig
interface-meta jax-cuda13-pjrt jax-cuda13-plugin jaxlib jaxtyping jinja2 joblib kiwisolver lazy-loader lightning
lightning-utilities linear-operator lineax llvmlite lxml markdown markdown-it-py markupsafe matplotlib mdurl meson
ml-dtypes mpi4py mpmath msgpack multidict multipledispatch mypy-extensions nanobind narwhals networkx ninja numba
numba-cuda numpyro nvidia-cublas nvidia-cuda-cupti nvidia-cuda-nvrtc nvidia-cuda-runtime nvidia-cudnn-cu13
nvidia-cufft nvidia-cufile nvidia-curand nvidia-cusolver nvidia-cusparse nvidia-cusparselt-cu13 nvidia-ml-py
nvidia-nccl-cu13 nvidia-nvjitlink nvidia-nvshmem-cu13 nvidia-nvtx onnx-ir onnxscript opencv-python-headless optax
opt-einsum opt-einsum-fx optimistix orbax-checkpoint packaging pandas pathspec patsy peft pillow pip pluggy portalocker
prometheus-client propcache protobuf psutil pyarrow pybind11 py-cpuinfo pygments pyparsing pyproject-hooks
pyre-extensions pytest pytest-benchmark pytest-cov pytest-mock pytest-timeout pytest-xdist python-dateutil pyyaml
regex requests rich sacrebleu scikit-build-core scikit-image scikit-learn scipy seaborn setuptools shellingham
simplejson six sortedcontainers statsmodels sympy tabulate tensorboard tensorboard-data-server tensorstore
threadpoolctl tifffile timm toolz torch-geometric torchdiffeq tqdm treescope typer typing-extensions
typing-inspect urllib3 uvloop wadler-lindig werkzeug wheel wrapt xarray xxhash yarl zipp
""".split())
MACHINE_MARKERS = {  # what environment markers see there
    "python_version": MACHINE_PYTHON.rsplit(".", 1)[0], "python_full_version": MACHINE_PYTHON, "os_name": "posix",
    "sys_platform": "linux", "platform_system": "Linux", "platform_machine": "x86_64",
    "implementation_name": "cpython", "platform_python_implementation": "CPython", "extra": "",
}
MIB = 2**20
DEVICE_LIMIT_MIB = 64  # the device tool's limit for the tree and the carried paths together


def metadata_of(wheel: Path):
    with zipfile.ZipFile(wheel) as archive:
        name = next(n for n in archive.namelist() if n.count("/") == 1 and n.endswith(".dist-info/METADATA"))
        return HeaderParser().parsestr(archive.read(name).decode())


def requirements(meta, environment: dict | None = None) -> list[Requirement]:
    """The wheel's unconditional requirements (no extras) that apply in ``environment`` (markers)."""
    found = []
    for line in meta.get_all("Requires-Dist") or []:
        requirement = Requirement(line)
        if requirement.marker is None or requirement.marker.evaluate(environment or {"extra": ""}):
            found.append(requirement)
    return found


def judge(requirement: Requirement, carried: dict[str, str]) -> tuple[str, str]:
    """(verdict, what satisfies it) for a requirement on the GPU machine with the carried wheels installed over it."""
    name = canonicalize_name(requirement.name)
    if name in carried:
        version, where = carried[name], "carried"
    elif name in MACHINE_VERSIONS:
        version, where = MACHINE_VERSIONS[name], "machine"
    elif name in MACHINE_NAMES:
        return "assumed", "machine, version not recorded"
    else:
        return "MISSING", "-"
    if requirement.specifier and not requirement.specifier.contains(version, prereleases=True):
        return "CONFLICT", f"{where} {version}"
    return "ok", f"{where} {version}"


def check_wheels(folder: Path) -> tuple[list[tuple[Path, str, str]], list[str], list[str]]:
    """(wheels as (path, name, version), requirement lines, problems) for the wheels in ``folder``."""
    wheels, problems = [], []
    for path in sorted(folder.glob("*.whl")):
        meta = metadata_of(path)
        wheels.append((path, canonicalize_name(meta["Name"]), meta["Version"]))
    carried: dict[str, str] = {}
    for _, name, version in wheels:
        if name in carried:
            problems.append(f"two wheels of {name} ({carried[name]}, {version}): pip --no-deps would install both")
        carried[name] = version
    lines = []
    for path, name, _ in wheels:
        for requirement in requirements(metadata_of(path), MACHINE_MARKERS):
            verdict, found = judge(requirement, carried)
            lines.append(f"{name:24} {str(requirement):44} {verdict:8} {found}")
            if verdict in ("MISSING", "CONFLICT"):
                problems.append(f"{name} needs {requirement}: {verdict.lower()} ({found})")
    return wheels, lines, problems


def build_info(path: Path) -> str:
    """What a wheel with compiled CUDA code says it was built for (xformers' cpp_lib.json), else ''."""
    with zipfile.ZipFile(path) as archive:
        names = [n for n in archive.namelist() if n.endswith("/cpp_lib.json")]
        if not names:
            return ""
        version = json.loads(archive.read(names[0]))["version"]
    return f"its C++/CUDA extension was built for torch {version['torch']}, CUDA {version['cuda']}"


def cmd_wheels(args: argparse.Namespace) -> int:
    wheels, lines, problems = check_wheels(args.folder)
    why = dict(item.split("=", 1) for item in args.why)
    total = sum(path.stat().st_size for path, _, _ in wheels)
    out = [f"# {len(wheels)} wheels for scripts/gpu_check.sh on the GPU machine (python3 {MACHINE_PYTHON}, "
           f"torch {MACHINE_VERSIONS['torch']}+cu130, transformers {MACHINE_VERSIONS['transformers']}, no network)",
           f"# made by scripts/gpu_wheels.sh, {time.strftime('%Y-%m-%d %H:%M', time.gmtime())} UTC; installed there "
           "by scripts/gpu_check.sh: python3 -m pip install --no-index --no-deps --target DIR .whl/*.whl", "",
           f"{'wheel':58} {'MiB':>6}  why"]
    for path, name, _ in wheels:
        reason = why.get(name, "")
        extra = build_info(path)
        out.append(f"{path.name:58} {path.stat().st_size / MIB:6.2f}  {reason}{'; ' + extra if extra else ''}")
    out.append(f"{'total':58} {total / MIB:6.2f}")
    if args.tree_bytes:
        together = (total + args.tree_bytes) / MIB
        out.append(f"{'with the working tree':58} {together:6.2f}  (the device tool takes {DEVICE_LIMIT_MIB} MiB)")
        if together >= DEVICE_LIMIT_MIB:
            problems.append(f"the tree and the wheels come to {together:.1f} MiB, over {DEVICE_LIMIT_MIB} MiB")
    out += ["", "Requirements on the GPU machine with these wheels installed over its packages (ok: version known "
            "to fit; assumed: the package is there, its version was not recorded):", ""]
    out += [f"{'wheel':24} {'requires':44} {'verdict':8} found"] + lines
    out += ["", "Problems: " + ("; ".join(problems) if problems else "none")]
    text = "\n".join(out) + "\n"
    if args.manifest:
        args.manifest.write_text(text)
    print(text, end="")
    return 1 if problems else 0


# ---------------------------------------------------------------------------------------------------------------
# the installed project


def tree_path(installed: str, package_dirs: dict[str, str]) -> str:
    """The tree's file for a file of the installed project (``zoo/variants/x.py`` -> ``variants/x.py``)."""
    parts = installed.split("/")
    for depth in range(len(parts) - 1, 0, -1):
        mapped = package_dirs.get(".".join(parts[:depth]))
        if mapped is not None:
            return "/".join([mapped, *parts[depth:]])
    return installed


def cmd_fresh(args: argparse.Namespace) -> int:
    import tomllib  # Python 3.11+, as on both machines

    config = tomllib.loads((REPO / "pyproject.toml").read_text())["tool"]["setuptools"]
    package_dirs = config.get("package-dir", {})
    records = list(args.site.glob("attention_zoo-*.dist-info/RECORD"))
    if len(records) != 1:
        print(f"gpu_tools fresh: expected one attention_zoo dist-info in {args.site}, found {len(records)}")
        return 1
    installed = [line.split(",")[0] for line in records[0].read_text().splitlines()]
    installed = [p for p in installed if p and ".dist-info/" not in p and "__pycache__" not in p
                 and not p.startswith("../")]
    stale = [p for p in installed
             if not (REPO / tree_path(p, package_dirs)).is_file()
             or (REPO / tree_path(p, package_dirs)).read_bytes() != (args.site / p).read_bytes()]
    shipped = {tree_path(p, package_dirs) for p in installed}
    for package in config["packages"]:
        folder = REPO / package_dirs.get(package, package.replace(".", "/"))
        stale += [str(f.relative_to(REPO)) + " (not in the wheel)" for f in sorted(folder.glob("*.py"))
                  if str(f.relative_to(REPO)) not in shipped]
    if stale:
        print(f"gpu_tools fresh: the project wheel differs from the tree in {len(stale)} files "
              f"({', '.join(stale[:5])}{', ...' if len(stale) > 5 else ''}): run scripts/gpu_wheels.sh again")
        return 1
    print(f"gpu_tools fresh: the installed project wheel holds the tree's {len(installed)} files")
    return 0


def cmd_zoo(args: argparse.Namespace) -> int:
    """Runs the ``zoo`` console script of the installed project (where its pyproject points it)."""
    script = next(ep for ep in metadata.distribution(PROJECT).entry_points
                  if ep.group == "console_scripts" and ep.name == "zoo")
    sys.argv = ["zoo", *args.rest]
    return script.load()()


# ---------------------------------------------------------------------------------------------------------------
# the environment report

REPORTED = ["transformers", PROJECT, "accelerate", "datasets", "evaluate", "xformers", "flash-linear-attention",
            "fla-core", "triton", "pyarrow", "fsspec", "huggingface-hub", "tokenizers", "safetensors", "pytest"]


def origin(path: Path | None, site: Path) -> str:
    if path is None:
        return "-"
    return "carried" if site in path.resolve().parents or path.resolve() == site else "machine"


def try_import(module: str) -> str:
    start = time.perf_counter()
    try:
        importlib.import_module(module)
    except Exception as exc:  # a broken build is reported, not raised
        return f"import failed: {type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"
    return f"imports ({time.perf_counter() - start:.1f} s)"


def unsatisfied(site: Path) -> list[str]:
    """Requirements of the packages installed in ``site`` that the environment as a whole does not meet."""
    found = []
    for dist in metadata.distributions(path=[str(site)]):
        for line in dist.requires or []:
            requirement = Requirement(line)
            if requirement.marker is not None and not requirement.marker.evaluate({"extra": ""}):
                continue
            try:
                version = metadata.version(requirement.name)
            except metadata.PackageNotFoundError:
                found.append(f"{dist.metadata['Name']} needs {requirement}: not installed")
                continue
            if requirement.specifier and not requirement.specifier.contains(version, prereleases=True):
                found.append(f"{dist.metadata['Name']} needs {requirement}: found {version}")
    return found


# what the zoo calls of torch's FlexAttention (with the keywords it passes) and of transformers' plug points
FLEX_API = {"flex_attention": ["block_mask", "scale", "enable_gqa"], "create_block_mask": ["device"],
            "BlockMask.from_kv_blocks": ["BLOCK_SIZE", "mask_mod", "seq_lengths"]}
TRANSFORMERS_API = {"AttentionInterface.register": [], "AttentionMaskInterface.register": [],
                    "masking_utils.and_masks": [], "masking_utils.or_masks": [],
                    "masking_utils.causal_mask_function": [], "masking_utils.padding_mask_function": [],
                    "masking_utils.flash_attention_mask": []}


def resolve(module_name: str, dotted: str):
    """``module_name.dotted`` (``masking_utils.and_masks``, ``BlockMask.from_kv_blocks``), None when absent."""
    parts = dotted.split(".")
    for cut in range(len(parts) - 1, -1, -1):  # the longest prefix that is a module
        try:
            target = importlib.import_module(".".join([module_name, *parts[:cut]]))
        except ImportError:
            continue
        for part in parts[cut:]:
            target = getattr(target, part, None)
        return target
    return None


def missing_api(module_name: str, api: dict[str, list[str]]) -> list[str]:
    """The names of ``api`` (below ``module_name``, each with the keywords it must take) that are not there."""
    missing = []
    for name, keywords in api.items():
        target = resolve(module_name, name)
        if target is None:
            missing.append(name)
            continue
        parameters = inspect.signature(target).parameters
        missing += [f"{name}({word}=)" for word in keywords if word not in parameters]
    return missing


def cmd_env(args: argparse.Namespace) -> int:
    site = args.site.resolve()
    rows: list[tuple[str, str, str]] = [("python", sys.version.split()[0], sys.executable)]
    problems: list[str] = []
    import torch

    rows.append(("torch", f"{torch.__version__} (CUDA {torch.version.cuda})", "machine"))
    if torch.cuda.is_available():
        props = torch.cuda.get_device_properties(0)
        rows.append(("GPU", f"{props.name}, {props.total_memory / 2**30:.0f} GiB, {props.multi_processor_count} SMs",
                     f"{torch.cuda.device_count()} device(s)"))
    elif args.rehearse:
        rows.append(("GPU", "none (rehearsal)", "-"))
    else:
        problems.append("torch sees no CUDA device")
    if shutil.which("nvidia-smi") and not args.rehearse:
        smi = subprocess.run(["nvidia-smi", "--query-gpu=name,memory.total,driver_version", "--format=csv,noheader"],
                             capture_output=True, text=True, timeout=30)
        rows.append(("nvidia-smi", smi.stdout.strip() or smi.stderr.strip(), "driver"))
    missing = missing_api("torch.nn.attention.flex_attention", FLEX_API)
    if missing:
        problems.append(f"torch {torch.__version__} lacks FlexAttention's {', '.join(missing)}")
    else:
        rows.append(("FlexAttention API", ", ".join(FLEX_API), "torch"))
    for name in REPORTED:
        try:
            dist = metadata.distribution(name)
        except metadata.PackageNotFoundError:
            rows.append((name, "not installed", "-"))
            continue
        rows.append((name, dist.version, origin(Path(str(dist.locate_file(""))), site)))
    carried_transformers = next(metadata.distributions(name="transformers", path=[str(site)]), None)
    imported = try_import("transformers")
    if imported.startswith("import failed"):
        problems.append(f"transformers: {imported}")
    else:
        import transformers

        if carried_transformers is not None and transformers.__version__ != carried_transformers.version:
            problems.append(f"transformers {transformers.__version__} imported, not the carried "
                            f"{carried_transformers.version}")
        missing = missing_api("transformers", TRANSFORMERS_API)
        if missing:
            problems.append(f"transformers {transformers.__version__} lacks {', '.join(missing)}")
        else:
            rows.append(("transformers plug points", "attention and mask interfaces, masking_utils", "transformers"))
    imported = try_import("zoo")
    if imported.startswith("import failed"):
        problems.append(f"zoo: {imported}")
    else:
        where = Path(sys.modules["zoo"].__file__).parent
        rows.append(("zoo package", imported, origin(where, site)))  # not the path: it names a temporary folder
        if origin(where, site) != "carried":
            problems.append(f"zoo imported from {where}, not from the project wheel installed in {site}")
    for module in ("datasets", "evaluate", "xformers.ops"):  # not used by the check's steps: reported only
        rows.append((f"import {module}", try_import(module), ""))
    if args.rehearse:  # fla and triton on a CPU machine reroute transformers' torch fallbacks: never imported here
        rows.append(("import fla", "found" if importlib.util.find_spec("fla") else "not installed", "not imported"))
    else:
        rows.append(("import fla", try_import("fla"), ""))
    gaps = unsatisfied(site)
    rows += [("unmet requirement", gap, "warning") for gap in gaps]
    lines = ["| what | version / result | from |", "|---|---|---|"]
    lines += [f"| {a} | {b} | {c} |" for a, b, c in rows]
    lines += [f"| PROBLEM | {p} | |" for p in problems]
    text = "\n".join(lines) + "\n"
    args.out.write_text(text)
    print(text, end="")
    return 1 if problems else 0


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["zoo"]:  # everything after it is the zoo command's own
        return cmd_zoo(argparse.Namespace(rest=argv[1:]))
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser("wheels")
    p.add_argument("folder", type=Path)
    p.add_argument("--manifest", type=Path)
    p.add_argument("--why", action="append", default=[], metavar="NAME=TEXT")
    p.add_argument("--tree-bytes", type=int, default=0)
    p.set_defaults(func=cmd_wheels)
    p = sub.add_parser("fresh")
    p.add_argument("site", type=Path)
    p.set_defaults(func=cmd_fresh)
    p = sub.add_parser("env")
    p.add_argument("--site", type=Path, required=True)
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--rehearse", action="store_true")
    p.set_defaults(func=cmd_env)
    sub.add_parser("zoo", help="the installed project's zoo command (everything after it is passed on)")
    args = parser.parse_args(argv)
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
