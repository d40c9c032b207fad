"""`met sync-recipes` and the local recipe index: every kind of source (a directory, a git
repository, a Hugging Face id from a hand-built offline cache, a tarball over HTTP from a
127.0.0.1 server), the check before install, the atomic swap, and the local index's place in
the ranking. No network."""

from __future__ import annotations

import functools
import http.server
import io
import json
import shutil
import subprocess
import tarfile
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest

from metrale.entrypoints.cli import main
from metrale.frontend.parser_selection import behavior_sources, choose_behavior
from metrale.recipes import Behavior, Checkpoint, RecipeError, local_recipes
from metrale.recipes import sync as sync_module
from metrale.recipes.sync import (
    SourceKind,
    Status,
    SyncError,
    parse_source,
    sync_recipes,
)

QWEN3 = '[match]\nrepo_ids = ["Qwen/Qwen3-*"]\n[behavior]\ntool_call_parser = "qwen3_xml"\n'
LLAMA = '[match]\nrepo_ids = ["meta-llama/*"]\n[behavior]\ntool_call_parser = "bare_json"\n'
MISTRAL = '[match]\nmodel_types = ["mistral"]\n[behavior]\ntool_call_parser = "mistral"\n'
BAD = {
    "bad_toml.toml": ("[match\n", "bad_toml.toml is not valid TOML"),
    "bad_parser.toml": (
        '[match]\nrepo_ids = ["x/*"]\n[behavior]\ntool_call_parser = "hermès"\n',
        "tool_call_parser = 'hermès' is not a known format",
    ),
    "no_match.toml": (
        '[behavior]\ntool_call_parser = "hermes"\n',
        "no_match.toml: a recipe needs a [match] table",
    ),
}


def write_recipes(folder: Path, recipes: dict[str, str]) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    for name, text in recipes.items():
        (folder / name).write_text(text)
    return folder


def snapshot(folder: Path) -> dict[str, bytes]:
    """Every file in `folder`, for byte-identical comparisons."""
    return {p.name: p.read_bytes() for p in sorted(folder.iterdir())}


def statuses(report: sync_module.SyncReport) -> dict[str, str]:
    return {f.name: f.status.value for f in report.files}


@pytest.fixture
def index(tmp_path: Path) -> Path:
    return tmp_path / "index"


# --- a directory source ---


def test_a_directory_syncs_added_then_unchanged_then_updated(tmp_path, index):
    source = write_recipes(tmp_path / "src", {"qwen3.toml": QWEN3, "llama.toml": LLAMA})
    report = sync_recipes(str(source), index)
    assert report.source.kind is SourceKind.DIRECTORY
    assert statuses(report) == {"llama.toml": "added", "qwen3.toml": "added"}
    assert (index / "qwen3.toml").read_text() == QWEN3
    assert statuses(sync_recipes(str(source), index)) == {
        "llama.toml": "unchanged",
        "qwen3.toml": "unchanged",
    }
    (source / "llama.toml").write_text(LLAMA + "# edited\n")
    assert statuses(sync_recipes(str(source), index)) == {
        "llama.toml": "updated",
        "qwen3.toml": "unchanged",
    }
    assert (index / "llama.toml").read_text().endswith("# edited\n")
    assert {r.name for r in local_recipes(index)} == {"llama", "qwen3"}


def test_a_recipes_folder_is_read_instead_of_the_top_level(tmp_path, index):
    source = write_recipes(tmp_path / "src", {"pyproject.toml": '[project]\nname = "x"\n'})
    write_recipes(source / "recipes", {"qwen3.toml": QWEN3})
    write_recipes(source / "recipes" / "deeper", {"llama.toml": LLAMA})
    assert statuses(sync_recipes(str(source), index)) == {"qwen3.toml": "added"}


def test_rejected_recipes_are_reported_with_why_and_the_others_install(tmp_path, index):
    recipes = {"qwen3.toml": QWEN3, **{name: text for name, (text, _) in BAD.items()}}
    report = sync_recipes(str(write_recipes(tmp_path / "src", recipes)), index)
    assert report.names(Status.ADDED) == ["qwen3.toml"]
    assert report.num_rejected == len(BAD)
    for result in report.files:
        if result.name in BAD:
            assert result.status is Status.REJECTED
            assert result.reason is not None and BAD[result.name][1] in result.reason
            assert not (index / result.name).exists()
    assert [r.name for r in local_recipes(index)] == ["qwen3"]


def test_a_rejected_recipe_leaves_the_installed_copy(tmp_path, index):
    source = write_recipes(tmp_path / "src", {"qwen3.toml": QWEN3})
    sync_recipes(str(source), index)
    (source / "qwen3.toml").write_text("[match\n")
    report = sync_recipes(str(source), index, prune=True)
    (result,) = report.files
    assert result.status is Status.REJECTED and "the index keeps its copy" in (result.reason or "")
    assert (index / "qwen3.toml").read_text() == QWEN3


def test_recipes_the_source_lacks_are_kept_unless_pruned(tmp_path, index):
    source = write_recipes(tmp_path / "src", {"qwen3.toml": QWEN3, "llama.toml": LLAMA})
    sync_recipes(str(source), index)
    (index / "NOTES.txt").write_text("mine")
    (source / "llama.toml").unlink()
    kept = sync_recipes(str(source), index)
    assert statuses(kept) == {"llama.toml": "kept", "qwen3.toml": "unchanged"}
    assert (index / "llama.toml").is_file()
    pruned = sync_recipes(str(source), index, prune=True)
    assert statuses(pruned) == {"llama.toml": "removed", "qwen3.toml": "unchanged"}
    assert sorted(p.name for p in index.glob("*.toml")) == ["qwen3.toml"]
    assert (index / "NOTES.txt").read_text() == "mine"  # not a recipe: never pruned


# --- a git source ---


def git(cwd: Path, *args: str) -> None:
    identity = [
        "-c",
        "user.name=t",
        "-c",
        "user.email=t@example.com",
        "-c",
        "init.defaultBranch=main",
    ]
    subprocess.run(["git", *identity, *args], cwd=cwd, check=True, capture_output=True)


@pytest.fixture
def git_repo(tmp_path: Path) -> Path:
    if shutil.which("git") is None:
        pytest.skip("git is not installed")
    repo = tmp_path / "repo"
    write_recipes(repo / "recipes", {"qwen3.toml": QWEN3, "llama.toml": LLAMA})
    git(repo, "init", "-q")
    git(repo, "add", ".")
    git(repo, "commit", "-q", "-m", "recipes")
    git(repo, "checkout", "-q", "-b", "v2")
    (repo / "recipes" / "mistral.toml").write_text(MISTRAL)
    git(repo, "add", ".")
    git(repo, "commit", "-q", "-m", "mistral")
    git(repo, "checkout", "-q", "main")
    (repo / "recipes" / "uncommitted.toml").write_text(MISTRAL)  # not in any commit
    return repo


@pytest.mark.parametrize("as_url", [False, True], ids=["path", "file-url"])
def test_a_git_repository_is_cloned_and_only_committed_files_count(git_repo, index, as_url):
    source = git_repo.as_uri() if as_url else str(git_repo)
    report = sync_recipes(source, index)
    assert report.source.kind is SourceKind.GIT
    assert statuses(report) == {"llama.toml": "added", "qwen3.toml": "added"}


def test_a_git_revision_picks_the_branch(git_repo, index):
    report = sync_recipes(str(git_repo), index, revision="v2")
    assert report.names(Status.ADDED) == ["llama.toml", "mistral.toml", "qwen3.toml"]


def test_a_git_clone_that_fails_is_an_error(tmp_path, index):
    if shutil.which("git") is None:
        pytest.skip("git is not installed")
    with pytest.raises(SyncError, match=r"git clone file://.*missing\.git failed"):
        sync_recipes((tmp_path / "missing.git").as_uri(), index)


# --- a Hugging Face source, offline ---

COMMIT = "0123456789abcdef0123456789abcdef01234567"


@pytest.fixture
def hub_cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A hub cache as huggingface_hub lays it out, holding org/recipes at commit COMMIT."""
    cache = tmp_path / "hub"
    repo = cache / "models--org--recipes"
    write_recipes(repo / "snapshots" / COMMIT, {"qwen3.toml": QWEN3, "llama.toml": LLAMA})
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(COMMIT)
    monkeypatch.setenv("HF_HUB_CACHE", str(cache))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    return cache


def test_a_hugging_face_id_syncs_from_the_cache_offline(hub_cache, index):
    report = sync_recipes("org/recipes", index)
    assert report.source.kind is SourceKind.HUGGING_FACE
    assert statuses(report) == {"llama.toml": "added", "qwen3.toml": "added"}
    assert statuses(sync_recipes(f"org/recipes@{COMMIT}", index))["qwen3.toml"] == "unchanged"


def test_a_hugging_face_id_not_cached_offline_is_a_clear_error(hub_cache, index):
    with pytest.raises(
        SyncError,
        match=r"org/other is not in the Hugging Face cache .* "
        r"HF_HUB_OFFLINE is set",
    ):
        sync_recipes("org/other", index)
    assert not index.exists()


# --- a tarball over HTTP ---


def make_tarball(members: dict[str, str], gzip: bool = True) -> bytes:
    buffer = io.BytesIO()
    with tarfile.open(fileobj=buffer, mode="w:gz" if gzip else "w") as tar:
        for name, text in members.items():
            data = text.encode()
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
    return buffer.getvalue()


@pytest.fixture
def http_root(tmp_path: Path) -> Iterator[tuple[Path, str]]:
    """A folder served over HTTP on 127.0.0.1, and its base URL."""
    root = tmp_path / "www"
    root.mkdir()

    class Quiet(http.server.SimpleHTTPRequestHandler):
        def log_message(self, *args: object) -> None:
            pass

    server = http.server.ThreadingHTTPServer(
        ("127.0.0.1", 0), functools.partial(Quiet, directory=str(root))
    )
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield root, f"http://127.0.0.1:{server.server_address[1]}"
    finally:
        server.shutdown()
        server.server_close()


@pytest.mark.parametrize("name, gzip", [("r.tar.gz", True), ("r.tgz", True), ("r.tar", False)])
def test_an_http_tarball_is_downloaded_and_read(http_root, index, name, gzip):
    root, url = http_root
    members = {"recipes-main/recipes/qwen3.toml": QWEN3, "recipes-main/README.md": "hi"}
    (root / name).write_bytes(make_tarball(members, gzip))
    report = sync_recipes(f"{url}/{name}", index)
    assert report.source.kind is SourceKind.TARBALL
    assert statuses(report) == {"qwen3.toml": "added"}  # read from inside the one folder


def test_a_tarball_with_a_member_outside_the_folder_is_refused(http_root, tmp_path, index):
    root, url = http_root
    sync_recipes(str(write_recipes(tmp_path / "src", {"qwen3.toml": QWEN3})), index)
    before = snapshot(index)
    (root / "evil.tar.gz").write_bytes(make_tarball({"ok.toml": LLAMA, "../evil.toml": QWEN3}))
    with pytest.raises(SyncError, match=r"member '\.\./evil\.toml' would land outside"):
        sync_recipes(f"{url}/evil.tar.gz", index)
    assert snapshot(index) == before
    assert not (tmp_path / "evil.toml").exists()


# --- atomicity ---


def not_found(monkeypatch: pytest.MonkeyPatch, url: str) -> str:
    return f"{url}/missing.tar.gz"


def fail_in_fetch(monkeypatch: pytest.MonkeyPatch, url: str) -> str:
    real_fetch = sync_module.fetch

    def fetch_then_fail(spec, work_dir):
        real_fetch(spec, work_dir)  # the files arrive, then the sync breaks
        raise ConnectionResetError("connection lost")

    monkeypatch.setattr(sync_module, "fetch", fetch_then_fail)
    return f"{url}/new.tar.gz"


def fail_at_swap(monkeypatch: pytest.MonkeyPatch, url: str) -> str:
    def swap(staging, index_dir):
        raise OSError("disk full")

    monkeypatch.setattr(sync_module, "_swap", swap)
    return f"{url}/new.tar.gz"


@pytest.mark.parametrize(
    "break_it, error",
    [
        (not_found, r"HTTP 404"),
        (fail_in_fetch, r"connection lost"),
        (fail_at_swap, r"could not write the recipe index .*disk full"),
    ],
    ids=["http-404", "fetch-raises", "swap-fails"],
)
def test_a_failed_sync_leaves_the_old_index_byte_identical(
    http_root, tmp_path, index, monkeypatch, break_it, error
):
    root, url = http_root
    sync_recipes(str(write_recipes(tmp_path / "src", {"qwen3.toml": QWEN3})), index)
    before = snapshot(index)
    (root / "new.tar.gz").write_bytes(make_tarball({"qwen3.toml": LLAMA, "m.toml": MISTRAL}))
    source = break_it(monkeypatch, url)
    with pytest.raises((SyncError, ConnectionResetError), match=error):
        sync_recipes(source, index)
    assert snapshot(index) == before
    assert sorted(p.name for p in tmp_path.iterdir() if p.name.startswith(".index")) == [
        ".index.lock"  # no half-built index left beside it
    ]


# --- telling sources apart ---


@pytest.mark.parametrize(
    "source, kind, location, revision",
    [
        ("https://example.com/r.tar.gz?x=1", SourceKind.TARBALL, None, None),
        ("https://github.com/org/recipes.git", SourceKind.GIT, None, None),
        ("git@github.com:org/recipes.git", SourceKind.GIT, None, None),
        ("git+https://example.com/r", SourceKind.GIT, "https://example.com/r", None),
        ("file:///srv/recipes", SourceKind.GIT, None, None),
        ("org/name", SourceKind.HUGGING_FACE, None, None),
        ("org/name@v1", SourceKind.HUGGING_FACE, "org/name", "v1"),
    ],
)
def test_the_kind_of_a_source(source, kind, location, revision):
    spec = parse_source(source)
    assert (spec.kind, spec.location, spec.revision) == (kind, location or source, revision)


@pytest.mark.parametrize(
    "source, message",
    [
        ("https://example.com/recipes", r"a URL must end in \.git .* or \.tar\.gz"),
        ("./not/here", r"is not a directory, a git repository"),
        ("", r"no source given"),
    ],
)
def test_a_source_of_no_known_kind_is_an_error(source, message):
    with pytest.raises(SyncError, match=message):
        parse_source(source)


def test_revision_is_refused_for_a_directory(tmp_path):
    with pytest.raises(SyncError, match=r"--revision applies to git and Hugging Face"):
        parse_source(str(tmp_path), "v1")


# --- the local index in the ranking ---


@pytest.fixture
def qwen3_checkpoint(tmp_path: Path) -> tuple[Path, Checkpoint]:
    model_dir = tmp_path / "ckpt"
    model_dir.mkdir()
    (model_dir / "config.json").write_text(
        json.dumps({"architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3"})
    )
    return model_dir, Checkpoint("Qwen/Qwen3-8B", "Qwen3ForCausalLM", "qwen3")


def test_a_local_recipe_beats_the_shipped_one_and_its_label_names_the_file(
    tmp_path, monkeypatch, qwen3_checkpoint
):
    index = write_recipes(tmp_path / "index", {"my_qwen3.toml": QWEN3})
    monkeypatch.setenv("METRALE_RECIPES_DIR", str(index))
    sources = behavior_sources(Behavior(), *qwen3_checkpoint)
    choice = choose_behavior(sources, "")
    assert choice.tool_call_parser == "qwen3_xml"
    assert choice.tool_call_parser_source == f"local recipe my_qwen3 ({index / 'my_qwen3.toml'})"
    # What the local recipe leaves out still comes from the shipped one.
    assert choice.reasoning_parser == "qwen3"
    assert choice.reasoning_parser_source == "recipe qwen3 (metrale/recipes/qwen3.toml)"


def test_a_local_recipe_of_a_shipped_ones_name_replaces_it(tmp_path, monkeypatch, qwen3_checkpoint):
    other = '[match]\nrepo_ids = ["someone/*"]\n[behavior]\ntool_call_parser = "mistral"\n'
    monkeypatch.setenv(
        "METRALE_RECIPES_DIR", str(write_recipes(tmp_path / "i", {"qwen3.toml": other}))
    )
    choice = choose_behavior(behavior_sources(Behavior(), *qwen3_checkpoint), "")
    # Neither the local qwen3 (it matches someone/*) nor the shipped qwen3 (replaced) applies.
    assert choice.tool_call_parser_source == "tool_defaults.toml, model_type qwen3"


def test_a_missing_index_is_empty(tmp_path, monkeypatch, qwen3_checkpoint):
    monkeypatch.setenv("METRALE_RECIPES_DIR", str(tmp_path / "never-synced"))
    assert local_recipes() == []
    choice = choose_behavior(behavior_sources(Behavior(), *qwen3_checkpoint), "")
    assert choice.tool_call_parser_source == "recipe qwen3 (metrale/recipes/qwen3.toml)"


def test_a_broken_local_recipe_is_an_error_naming_the_file_and_the_fix(
    tmp_path, monkeypatch, qwen3_checkpoint
):
    index = write_recipes(tmp_path / "index", {"broken.toml": "[match\n"})
    monkeypatch.setenv("METRALE_RECIPES_DIR", str(index))
    with pytest.raises(RecipeError, match=r"broken\.toml is not valid TOML.*met sync-recipes"):
        behavior_sources(Behavior(), *qwen3_checkpoint)


def test_the_index_defaults_to_the_metrale_cache(tmp_path, monkeypatch):
    from metrale.recipes import local_index_dir

    monkeypatch.delenv("METRALE_RECIPES_DIR", raising=False)
    monkeypatch.setenv("METRALE_CACHE_DIR", str(tmp_path / "cache"))
    assert local_index_dir() == tmp_path / "cache" / "recipes"


# --- the command line ---


def test_the_cli_prints_a_table_and_its_exit_status_says_what_happened(tmp_path, capsys):
    source = write_recipes(tmp_path / "src", {"qwen3.toml": QWEN3})
    index = tmp_path / "index"
    assert main(["sync-recipes", str(source), "--index", str(index)]) == 0
    out = capsys.readouterr().out
    assert f"synced directory {source} into {index}" in out
    assert "added      qwen3.toml" in out
    (source / "bad.toml").write_text("[match\n")
    assert main(["sync-recipes", str(source), "--index", str(index)]) == 1
    out = capsys.readouterr().out
    assert "unchanged  qwen3.toml" in out
    assert "rejected   bad.toml    (bad.toml is not valid TOML" in out
    assert main(["sync-recipes", str(tmp_path / "nowhere"), "--index", str(index)]) == 2
    assert "met sync-recipes: error:" in capsys.readouterr().err


def test_the_cli_without_a_source_syncs_the_recorded_one_and_can_print_json(tmp_path, capsys):
    source = write_recipes(tmp_path / "src", {"qwen3.toml": QWEN3})
    index = tmp_path / "index"
    assert main(["sync-recipes", "--index", str(index)]) == 2
    assert "was never synced" in capsys.readouterr().err
    assert main(["sync-recipes", str(source), "--index", str(index)]) == 0
    capsys.readouterr()
    (source / "llama.toml").write_text(LLAMA)
    assert main(["sync-recipes", "--index", str(index), "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["source"] == {"kind": "directory", "location": str(source), "revision": None}
    assert report["files"] == [
        {"name": "llama.toml", "status": "added", "reason": None},
        {"name": "qwen3.toml", "status": "unchanged", "reason": None},
    ]
