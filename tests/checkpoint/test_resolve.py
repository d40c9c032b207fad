"""Model directory resolution against a hand-made Hugging Face hub cache; no network."""

from __future__ import annotations

from pathlib import Path

import pytest

from metrale.checkpoint.resolve import ModelNotFoundError, find_cached_snapshot, resolve_model_dir

COMMIT = "0123456789abcdef0123456789abcdef01234567"
OTHER_COMMIT = "ffffffffffffffffffffffffffffffffffffffff"


def add_snapshot(cache: Path, repo_id: str, commit: str, *, ref: str | None = "main") -> Path:
    """Lay out one snapshot as huggingface_hub does: models--ORG--NAME/snapshots/<commit>/."""
    repo_dir = cache / ("models--" + repo_id.replace("/", "--"))
    snapshot = repo_dir / "snapshots" / commit
    snapshot.mkdir(parents=True)
    (snapshot / "config.json").write_text("{}")
    if ref is not None:
        (repo_dir / "refs").mkdir(exist_ok=True)
        (repo_dir / "refs" / ref).write_text(commit + "\n")
    return snapshot


@pytest.fixture
def hub_env(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> Path:
    """An empty hub cache named by HF_HUB_CACHE, offline, and a cwd without stray directories."""
    cache = tmp_path / "hub-cache"
    cache.mkdir()
    for name in ("HF_HUB_CACHE", "HF_HOME", "HF_HUB_OFFLINE"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("HF_HUB_CACHE", str(cache))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    work = tmp_path / "cwd"
    work.mkdir()
    monkeypatch.chdir(work)
    return cache


def test_hub_id_resolves_to_the_snapshot_named_by_refs_main(hub_env: Path):
    snapshot = add_snapshot(hub_env, "org/name", COMMIT)
    assert resolve_model_dir("org/name") == snapshot


def test_refs_main_wins_over_other_snapshots(hub_env: Path):
    wanted = add_snapshot(hub_env, "org/name", COMMIT)
    add_snapshot(hub_env, "org/name", OTHER_COMMIT, ref=None)  # sorts last, but not main
    assert resolve_model_dir("org/name") == wanted


def test_cache_without_refs_takes_a_complete_snapshot(hub_env: Path):
    snapshot = add_snapshot(hub_env, "org/name", COMMIT, ref=None)
    incomplete = hub_env / "models--org--name" / "snapshots" / OTHER_COMMIT
    incomplete.mkdir()  # no config.json: a download cut short
    assert find_cached_snapshot("org/name") == snapshot
    assert resolve_model_dir("org/name") == snapshot


def test_hf_home_hub_is_the_cache_when_hf_hub_cache_is_unset(
    hub_env: Path, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
):
    monkeypatch.delenv("HF_HUB_CACHE")
    home = tmp_path / "hf-home"
    snapshot = add_snapshot(home / "hub", "org/name", COMMIT)
    monkeypatch.setenv("HF_HOME", str(home))
    assert resolve_model_dir("org/name") == snapshot


def test_hf_hub_cache_wins_over_hf_home(
    hub_env: Path, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
):
    snapshot = add_snapshot(hub_env, "org/name", COMMIT)
    add_snapshot(tmp_path / "hf-home" / "hub", "org/name", OTHER_COMMIT)
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf-home"))
    assert resolve_model_dir("org/name") == snapshot


def test_an_existing_directory_wins_over_the_cache(hub_env: Path):
    add_snapshot(hub_env, "org/name", COMMIT)
    Path("org/name").mkdir(parents=True)  # relative to the cwd, spelled like the hub id
    assert resolve_model_dir("org/name") == Path("org/name")


def test_model_from_path_wins_over_the_model_argument(hub_env: Path, tmp_path: Path):
    add_snapshot(hub_env, "org/name", COMMIT)
    local = tmp_path / "local-model"
    local.mkdir()
    assert resolve_model_dir("org/name", model_from_path=local) == local
    assert resolve_model_dir(None, model_from_path=str(local)) == local


def test_model_from_path_to_a_missing_directory(hub_env: Path, tmp_path: Path):
    missing = tmp_path / "nowhere"
    with pytest.raises(ModelNotFoundError, match=r"--model-from-path .*nowhere: no such directory"):
        resolve_model_dir("org/name", model_from_path=missing)


def test_no_model_named(hub_env: Path):
    with pytest.raises(ModelNotFoundError, match=r"no model named.*--model-from-path"):
        resolve_model_dir(None)


@pytest.mark.parametrize("model", ["justaname", "a/b/c", "./org/name", "/abs/missing", "~/x"])
def test_malformed_id_that_is_not_a_directory(hub_env: Path, model: str):
    with pytest.raises(
        ModelNotFoundError, match=r"neither a directory, a \.gguf file nor a Hugging Face id"
    ):
        resolve_model_dir(model)


def test_id_missing_from_the_cache_while_offline(hub_env: Path):
    add_snapshot(hub_env, "org/other", COMMIT)
    with pytest.raises(ModelNotFoundError) as excinfo:
        resolve_model_dir("org/name")
    message = str(excinfo.value)
    assert "org/name" in message
    assert "not in the Hugging Face cache" in message and str(hub_env) in message
    assert "HF_HUB_OFFLINE" in message
    assert "--model-from-path" in message


def test_model_not_found_is_a_file_not_found_error():
    assert issubclass(ModelNotFoundError, FileNotFoundError)
