"""Bad input gives one clear line (no traceback) and a non-zero exit."""
import pytest
from conftest import one_line_error

pytestmark = pytest.mark.model


def test_missing_model_path(cli, tmp_path):
    one_line_error(cli("generate", "-p", "hi", "--model", tmp_path / "nope.gguf"), "model file not found")


def test_not_a_gguf_file(cli, tmp_path):
    bad = tmp_path / "bad.gguf"
    bad.write_bytes(b"not a model at all")
    one_line_error(cli("generate", "-p", "hi", "--model", bad), "not a GGUF file")


def test_prompt_longer_than_context(cli):
    one_line_error(cli("generate", "-H", "0", "--n-ctx", "64", "--cap", "4"), "more than n_ctx=64")


def test_unknown_backend(cli):
    one_line_error(cli("generate", "-p", "hi", "--backend", "metal"), "unknown backend 'metal'")


def test_cap_zero(cli):
    one_line_error(cli("generate", "-p", "hi", "--cap", "0"), "output cap")


def test_missing_native_build(cli_subprocess, tmp_path):
    """A llama_cpp whose shared library cannot be loaded, as after a broken install."""
    fake = tmp_path / "llama_cpp"
    fake.mkdir()
    (fake / "__init__.py").write_text(
        "raise FileNotFoundError('Shared library with base name \"llama\" not found')\n")
    r = cli_subprocess("doctor", env={"PYTHONPATH": str(tmp_path)})
    one_line_error(r, "native library failed to load", "install.sh")
