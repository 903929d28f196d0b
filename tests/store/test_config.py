"""Configuration: arguments, then KILN_* variables, then defaults under the user cache."""

from __future__ import annotations

from pathlib import Path

import pytest

from kiln.artifact_store import ConfigError, StoreConfig, default_stats_file, open_store
from kiln.artifact_store.config import parse_size


def test_defaults_live_under_xdg_cache_home(clean_env: Path) -> None:
    config = StoreConfig.resolve()
    assert config.url == f"file://{clean_env}/kiln/store"
    assert config.local_cache is None  # the store is on local disk already
    assert config.stats_file == str(clean_env / "kiln" / "stats.json")
    assert default_stats_file() == config.stats_file
    assert (config.require_signed, config.read_only, config.timeout_s) == (False, False, 10.0)


def test_home_cache_without_xdg(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.delenv("XDG_CACHE_HOME")
    monkeypatch.setenv("HOME", str(tmp_path))
    assert StoreConfig.resolve().url == f"file://{tmp_path}/.cache/kiln/store"
    monkeypatch.setenv("XDG_CACHE_HOME", "relative/dir")  # ignored, as the XDG spec says
    assert StoreConfig.resolve().url == f"file://{tmp_path}/.cache/kiln/store"


def test_environment(monkeypatch: pytest.MonkeyPatch, tmp_path: Path, clean_env: Path) -> None:
    monkeypatch.setenv("KILN_STORE", "s3://farm-bucket/kiln")
    monkeypatch.setenv("KILN_LOCAL_CACHE_SIZE", "512M")
    monkeypatch.setenv("KILN_STORE_TIMEOUT", "2.5")
    monkeypatch.setenv("KILN_STORE_READ_ONLY", "1")
    monkeypatch.setenv("KILN_STORE_OPTIONS", '{"anon": true}')
    monkeypatch.setenv("KILN_STATS_FILE", "off")
    config = StoreConfig.resolve()
    assert config.url == "s3://farm-bucket/kiln"
    assert config.local_cache == f"file://{clean_env}/kiln/local"
    assert config.local_cache_max_bytes == 512 * 2**20
    assert config.timeout_s == 2.5 and config.read_only
    assert config.storage_options == {"anon": True}
    assert config.stats_file is None
    monkeypatch.setenv("KILN_LOCAL_CACHE", "off")
    assert StoreConfig.resolve().local_cache is None
    monkeypatch.setenv("KILN_LOCAL_CACHE", str(tmp_path / "mine"))
    assert StoreConfig.resolve().local_cache == f"file://{tmp_path}/mine"
    # Arguments win over the environment.
    config = StoreConfig.resolve("memory://x", local_cache=False, read_only=False, timeout=1)
    assert (config.url, config.local_cache, config.read_only, config.timeout_s) == (
        "memory://x", None, False, 1.0)


def test_paths_become_file_urls(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("HOME", str(tmp_path))
    assert StoreConfig.resolve("~/store").url == f"file://{tmp_path}/store"
    assert StoreConfig.resolve(tmp_path / "s").url == f"file://{tmp_path}/s"
    # An explicit local tier in front of a file store is honoured (an NFS mount, say),
    # unless it is the store itself.
    config = StoreConfig.resolve(tmp_path / "nfs", local_cache=tmp_path / "cache")
    assert config.local_cache == f"file://{tmp_path}/cache"
    assert StoreConfig.resolve(tmp_path / "s", local_cache=tmp_path / "s").local_cache is None


@pytest.mark.parametrize("text, size", [("10G", 10 * 2**30), ("512MiB", 512 * 2**20),
                                        ("1.5k", 1536), ("1000", 1000), (" 2 gb ", 2 * 2**30)])
def test_parse_size(text: str, size: int) -> None:
    assert parse_size(text) == size


@pytest.mark.parametrize("name, value", [
    ("KILN_LOCAL_CACHE_SIZE", "huge"), ("KILN_STORE_TIMEOUT", "soon"),
    ("KILN_STORE_TIMEOUT", "0"), ("KILN_STORE_OPTIONS", "{not json"),
    ("KILN_STORE_OPTIONS", "[1]"), ("KILN_REQUIRE_SIGNED", "maybe"),
])
def test_bad_values_are_config_errors(
    monkeypatch: pytest.MonkeyPatch, name: str, value: str, caplog: pytest.LogCaptureFixture
) -> None:
    monkeypatch.setenv(name, value)
    with pytest.raises(ConfigError, match=name):
        StoreConfig.resolve()
    store = open_store()  # the user's program never sees the exception
    assert store.disabled_reason is not None
    assert store.get("a" * 64) is None
    assert any("disabled" in r.getMessage() for r in caplog.records)
