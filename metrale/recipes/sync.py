"""Fill the local recipe index (`metrale.recipes.local_index_dir`) from a source: each recipe
checked first, the whole index swapped in at once.

A source is one of these, told apart by `parse_source` in this order:

- an `http://` or `https://` URL whose path ends `.tar.gz`, `.tgz` or `.tar`: a tarball,
  downloaded (at most `MAX_DOWNLOAD_BYTES`, `DOWNLOAD_TIMEOUT_S` without data) and extracted
  with `tarfile`'s "data" filter; a member that would land outside the folder refuses the
  whole tarball. A local file with one of those suffixes is read the same way.
- a git repository: a URL whose path ends `.git`, or one starting `git@`, `ssh://`, `file://`
  or `git+` (`git+https://...`: the prefix is dropped), or a local directory holding a git
  repository. It is cloned with `git clone --depth 1` (`revision`: a branch or tag), so only
  committed files count.
- any other local directory, read as it is.
- a Hugging Face model repository, `ORG/NAME` or `ORG/NAME@REVISION`, when no such path exists:
  its `*.toml` files are fetched with `huggingface_hub.snapshot_download` into the hub cache;
  with HF_HUB_OFFLINE=1 only what the cache holds is used.

The recipes of a source are the `*.toml` files in its `recipes/` folder if it has one, else those
at its top level, no deeper; a tarball whose only top-level entry is a folder (as a git host's
archives are) is read from inside it. Each is checked like a shipped recipe (a `[match]` is
required); one that fails is reported with why and not installed (an installed copy of that name
stays), and the others install.

The new index is built complete in a folder beside the old one and swapped in by two renames, so
a failure before the swap (an unreadable source, a download error, any exception) leaves the old
index as it was; a reader between the two renames sees no index for that instant. Recipes the
index has and the source lacks are kept (reported "kept") unless `prune`. The source is recorded
in the index (`SOURCE_RECORD`), so that `met sync-recipes` without a SOURCE syncs from it again.
"""

from __future__ import annotations

import contextlib
import enum
import fcntl
import json
import os
import re
import shutil
import subprocess
import tarfile
import tempfile
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path, PurePosixPath

from metrale.recipes import RecipeError, parse_recipe_file

SOURCE_RECORD = ".sync-source.json"  # in the index: where it was last synced from
TARBALL_SUFFIXES = (".tar.gz", ".tgz", ".tar")
MAX_DOWNLOAD_BYTES = 32 << 20  # recipes are a few hundred bytes each
MAX_EXTRACTED_BYTES = 64 << 20
MAX_RECIPE_BYTES = 1 << 20
DOWNLOAD_TIMEOUT_S = 60.0
GIT_TIMEOUT_S = 300.0
HF_REPO_ID = re.compile(r"[A-Za-z0-9][\w.-]*/[\w.-]+")
RECIPE_FILE_NAME = re.compile(r"[A-Za-z0-9][\w.-]*\.toml")


class SyncError(ValueError):
    """The source could not be read or the index not written: nothing was installed."""


class SourceKind(enum.Enum):
    DIRECTORY = "directory"
    GIT = "git"
    HUGGING_FACE = "hugging face"
    TARBALL = "tarball"


class Status(enum.Enum):
    ADDED = "added"
    UPDATED = "updated"
    UNCHANGED = "unchanged"
    KEPT = "kept"  # in the index, not in the source
    REMOVED = "removed"  # in the index, not in the source, and pruned
    REJECTED = "rejected"  # in the source, failed its check, not installed


@dataclass(frozen=True)
class RecipeSource:
    """A source as parsed: what to fetch and how."""

    kind: SourceKind
    location: str  # a URL, an absolute path or a Hugging Face id
    revision: str | None  # git branch or tag, or Hugging Face revision; None: the default


@dataclass(frozen=True)
class FileResult:
    name: str  # the recipe's file name, e.g. "qwen3.toml"
    status: Status
    reason: str | None = None  # why it was rejected, or a note on a kept file


@dataclass(frozen=True)
class SyncReport:
    """What one sync did, file by file (sorted by name)."""

    source: RecipeSource
    index_dir: Path
    files: tuple[FileResult, ...]

    def names(self, status: Status) -> list[str]:
        return [f.name for f in self.files if f.status is status]

    @property
    def num_rejected(self) -> int:
        return len(self.names(Status.REJECTED))


def sync_recipes(
    source: str, index_dir: Path, *, revision: str | None = None, prune: bool = False
) -> SyncReport:
    """Install the recipes of `source` into `index_dir`, atomically. Raises SyncError (a
    ValueError) when the source cannot be read; a recipe that fails its check is reported, not
    raised."""
    spec = parse_source(source, revision)
    index_dir = index_dir.expanduser().resolve()
    with tempfile.TemporaryDirectory(prefix="metrale-recipes-") as work:
        root, confine = fetch(spec, Path(work))
        recipes, rejected = collect_recipes(root, confine)
        try:
            files = install(index_dir, recipes, rejected, spec, prune=prune)
        except OSError as e:
            raise SyncError(f"could not write the recipe index {index_dir}: {e}") from None
    return SyncReport(spec, index_dir, files)


def recorded_source(index_dir: Path) -> RecipeSource | None:
    """The source `index_dir` was last synced from, if it records one."""
    path = index_dir / SOURCE_RECORD
    try:
        record = json.loads(path.read_text())
        return RecipeSource(SourceKind(record["kind"]), record["location"], record["revision"])
    except FileNotFoundError:
        return None
    except (ValueError, KeyError, TypeError):
        raise SyncError(f"{path} is damaged: delete it and pass SOURCE") from None


def parse_source(source: str, revision: str | None = None) -> RecipeSource:
    """Which kind of source `source` is (see the module docstring for the rules)."""
    text = source.strip()
    if not text:
        raise SyncError("no source given: name a directory, git URL, tarball or Hugging Face id")
    if text.startswith(("http://", "https://")):
        url_path = urllib.parse.urlsplit(text).path
        if url_path.endswith(TARBALL_SUFFIXES):
            return _unversioned(SourceKind.TARBALL, text, revision)
        if url_path.endswith(".git"):
            return RecipeSource(SourceKind.GIT, text, revision)
        raise SyncError(
            f"{text}: a URL must end in .git (a git repository) or .tar.gz, .tgz or .tar "
            f"(a tarball); for a git host's page, add .git"
        )
    if text.startswith(("git@", "ssh://", "file://")):
        return RecipeSource(SourceKind.GIT, text, revision)
    if text.startswith("git+"):
        return RecipeSource(SourceKind.GIT, text.removeprefix("git+"), revision)
    path = Path(text).expanduser()
    if path.is_dir():
        if _is_git_repo(path):
            return RecipeSource(SourceKind.GIT, path.resolve().as_uri(), revision)
        return _unversioned(SourceKind.DIRECTORY, str(path.resolve()), revision)
    if path.is_file() and path.name.endswith(TARBALL_SUFFIXES):
        return _unversioned(SourceKind.TARBALL, str(path.resolve()), revision)
    repo_id, _, id_revision = text.partition("@")
    if HF_REPO_ID.fullmatch(repo_id) and not path.exists():
        if id_revision and revision and id_revision != revision:
            raise SyncError(f"{text} and --revision {revision} name two revisions: give one")
        return RecipeSource(SourceKind.HUGGING_FACE, repo_id, id_revision or revision)
    raise SyncError(
        f"{source!r} is not a directory, a git repository, a tarball, a URL ending .git or "
        f".tar.gz, or a Hugging Face id (ORG/NAME or ORG/NAME@REVISION)"
    )


def fetch(spec: RecipeSource, work_dir: Path) -> tuple[Path, Path | None]:
    """The folder holding the source's files, fetched under `work_dir` where need be, and the
    folder every file must stay inside once links are followed (None: no limit, for a local
    directory the user named)."""
    if spec.kind is SourceKind.DIRECTORY:
        return Path(spec.location), None
    if spec.kind is SourceKind.GIT:
        return _clone(spec, work_dir / "clone"), work_dir
    if spec.kind is SourceKind.HUGGING_FACE:
        snapshot = _from_hub(spec)
        return snapshot, snapshot.parent.parent  # its files link into the repo's blobs/
    tarball = Path(spec.location)
    if spec.location.startswith(("http://", "https://")):
        tarball = work_dir / "download.tar"
        download(spec.location, tarball)
    return extract_tarball(tarball, work_dir / "tree", spec.location), work_dir


def collect_recipes(
    root: Path, confine: Path | None = None
) -> tuple[dict[str, bytes], list[FileResult]]:
    """The source's recipe files that pass their check (name to contents), and those that do
    not, each with why."""
    folder = root / "recipes" if (root / "recipes").is_dir() else root
    good: dict[str, bytes] = {}
    rejected: list[FileResult] = []
    for path in sorted(folder.glob("*.toml")):
        if path.name.startswith(".") or not path.is_file():
            continue
        label = path.relative_to(root).as_posix()
        if (problem := _file_problem(path, label, confine)) is not None:
            rejected.append(FileResult(path.name, Status.REJECTED, problem))
            continue
        try:
            parse_recipe_file(path, label)
        except RecipeError as e:
            rejected.append(FileResult(path.name, Status.REJECTED, str(e)))
            continue
        good[path.name] = path.read_bytes()
    return good, rejected


def install(
    index_dir: Path,
    recipes: dict[str, bytes],
    rejected: list[FileResult],
    spec: RecipeSource,
    *,
    prune: bool,
) -> tuple[FileResult, ...]:
    """Build the new index beside `index_dir` (absolute) and swap it in; what happened to each
    file."""
    if index_dir.exists() and not index_dir.is_dir():
        raise SyncError(f"the recipe index {index_dir} is not a directory: move it away")
    index_dir.parent.mkdir(parents=True, exist_ok=True)
    with _locked(index_dir):
        old = {p.name: p for p in index_dir.iterdir()} if index_dir.is_dir() else {}
        staging = Path(tempfile.mkdtemp(prefix=f".{index_dir.name}.new-", dir=index_dir.parent))
        try:
            # mkdtemp makes it private; the index stays as readable as it was
            staging.chmod(index_dir.stat().st_mode & 0o7777 if index_dir.is_dir() else 0o755)
            files = _stage(staging, old, recipes, {r.name for r in rejected}, prune=prune)
            record = {"kind": spec.kind.value, "location": spec.location}
            (staging / SOURCE_RECORD).write_text(json.dumps({**record, "revision": spec.revision}))
            _swap(staging, index_dir)
        except BaseException:
            shutil.rmtree(staging, ignore_errors=True)
            raise
    for r in rejected:
        note = "; the index keeps its copy" if r.name in old else ""
        files.append(FileResult(r.name, r.status, f"{r.reason}{note}"))
    return tuple(sorted(files, key=lambda f: f.name))


def download(url: str, dest: Path) -> None:
    """`url` into `dest`, refusing more than MAX_DOWNLOAD_BYTES."""
    request = urllib.request.Request(url, headers={"User-Agent": "metrale-sync-recipes"})
    too_big = f"{url} is larger than {MAX_DOWNLOAD_BYTES >> 20} MiB: not a recipe tarball"
    try:
        with (
            urllib.request.urlopen(request, timeout=DOWNLOAD_TIMEOUT_S) as response,
            dest.open("wb") as out,
        ):
            length = response.headers.get("Content-Length")
            if length is not None and length.isdigit() and int(length) > MAX_DOWNLOAD_BYTES:
                raise SyncError(too_big)
            num_bytes = 0
            while chunk := response.read(1 << 16):
                num_bytes += len(chunk)
                if num_bytes > MAX_DOWNLOAD_BYTES:
                    raise SyncError(too_big)
                out.write(chunk)
    except urllib.error.HTTPError as e:
        raise SyncError(f"could not download {url}: HTTP {e.code} {e.reason}") from None
    except (OSError, urllib.error.URLError) as e:
        raise SyncError(f"could not download {url}: {e}; check the URL and network") from None


def extract_tarball(tarball: Path, dest: Path, label: str) -> Path:
    """`tarball` extracted into `dest`; the folder to read recipes from."""
    dest.mkdir()
    try:
        with tarfile.open(tarball) as tar:
            members = tar.getmembers()
            _check_members(members, label)
            tar.extractall(dest, filter="data")
    except tarfile.TarError as e:  # FilterError too: a link or path the data filter refuses
        raise SyncError(f"{label} is not a usable tarball: {e}") from None
    entries = list(dest.iterdir())
    return entries[0] if len(entries) == 1 and entries[0].is_dir() else dest


def _unversioned(kind: SourceKind, location: str, revision: str | None) -> RecipeSource:
    if revision is not None:
        raise SyncError(
            f"--revision applies to git and Hugging Face sources, not to the {kind.value} "
            f"{location}"
        )
    return RecipeSource(kind, location, None)


def _is_git_repo(path: Path) -> bool:
    """A working tree (`.git` inside) or a bare repository."""
    return (path / ".git").exists() or ((path / "HEAD").is_file() and (path / "objects").is_dir())


def _clone(spec: RecipeSource, dest: Path) -> Path:
    command = ["git", "clone", "--quiet", "--depth", "1"]
    if spec.revision is not None:
        command += ["--branch", spec.revision]
    command += ["--", spec.location, str(dest)]
    env = {**os.environ, "GIT_TERMINAL_PROMPT": "0"}  # fail rather than ask for a password
    try:
        subprocess.run(
            command, check=True, capture_output=True, text=True, timeout=GIT_TIMEOUT_S, env=env
        )
    except FileNotFoundError:
        raise SyncError(
            "git is not installed: install it, or sync from a directory or tarball instead"
        ) from None
    except subprocess.TimeoutExpired:
        raise SyncError(
            f"git clone {spec.location} took over {GIT_TIMEOUT_S:.0f} s: check the network"
        ) from None
    except subprocess.CalledProcessError as e:
        said = e.stderr.strip().splitlines()[-1] if e.stderr.strip() else f"exit {e.returncode}"
        raise SyncError(f"git clone {spec.location} failed: {said}") from None
    return dest


def _from_hub(spec: RecipeSource) -> Path:
    from huggingface_hub import snapshot_download

    from metrale.checkpoint.resolve import hub_cache_dir

    offline = os.environ.get("HF_HUB_OFFLINE", "").upper() in ("1", "ON", "YES", "TRUE")
    cache = hub_cache_dir()
    named = spec.location + (f"@{spec.revision}" if spec.revision else "")
    try:
        return Path(
            snapshot_download(
                spec.location,
                repo_type="model",
                revision=spec.revision,
                allow_patterns=["*.toml"],
                cache_dir=cache,
                local_files_only=offline,
            )
        )
    except Exception as e:  # the hub client raises many kinds; all mean the same to the user
        if offline:
            raise SyncError(
                f"{named} is not in the Hugging Face cache ({cache}) and HF_HUB_OFFLINE is set: "
                f"run `met sync-recipes {named}` once with network access, or unset HF_HUB_OFFLINE"
            ) from None
        raise SyncError(
            f"could not fetch {named} from Hugging Face ({type(e).__name__}: {e}), and no local "
            f"path of that name exists: check the id (a model repository) and the network"
        ) from None


def _check_members(members: list[tarfile.TarInfo], label: str) -> None:
    """Refuse the whole tarball for a member that would land outside the folder, or for one
    too large to be recipes."""
    num_bytes = 0
    for member in members:
        parts = PurePosixPath(member.name).parts
        if member.name.startswith(("/", "\\")) or ".." in parts:
            raise SyncError(
                f"{label}: member {member.name!r} would land outside the folder: refusing the "
                f"tarball"
            )
        num_bytes += member.size
    if num_bytes > MAX_EXTRACTED_BYTES:
        raise SyncError(f"{label} unpacks to over {MAX_EXTRACTED_BYTES >> 20} MiB: refusing it")


def _file_problem(path: Path, label: str, confine: Path | None) -> str | None:
    """Why `path` cannot be a recipe file before it is even parsed, or None."""
    if not RECIPE_FILE_NAME.fullmatch(path.name):
        return f"{label}: a recipe's file name has letters, digits, '_', '-' and '.' only"
    if confine is not None and not path.resolve().is_relative_to(confine.resolve()):
        return f"{label} links outside the source"
    if path.stat().st_size > MAX_RECIPE_BYTES:
        return f"{label} is over {MAX_RECIPE_BYTES >> 20} MiB: not a recipe"
    return None


def _stage(
    staging: Path,
    old: dict[str, Path],
    recipes: dict[str, bytes],
    rejected_names: set[str],
    *,
    prune: bool,
) -> list[FileResult]:
    """Write the new index into `staging`: the source's recipes, then what of the old index
    stays (every other file; a recipe the source lacks unless `prune`)."""
    files = []
    for name, data in sorted(recipes.items()):
        (staging / name).write_bytes(data)
        if name not in old:
            status = Status.ADDED
        else:
            status = Status.UNCHANGED if old[name].read_bytes() == data else Status.UPDATED
        files.append(FileResult(name, status))
    for name, path in sorted(old.items()):
        if name in recipes or name == SOURCE_RECORD:
            continue
        is_recipe = name.endswith(".toml") and path.is_file()
        if is_recipe and prune and name not in rejected_names:
            files.append(FileResult(name, Status.REMOVED))
            continue
        if path.is_dir():
            shutil.copytree(path, staging / name, symlinks=True)
        else:
            shutil.copy2(path, staging / name, follow_symlinks=False)
        if is_recipe and name not in rejected_names:
            files.append(FileResult(name, Status.KEPT, "not in the source; --prune removes it"))
    return files


def _swap(staging: Path, index_dir: Path) -> None:
    """Put `staging` where `index_dir` is, the old one moved aside and then removed."""
    if not index_dir.exists():
        os.replace(staging, index_dir)
        return
    backup = staging.with_name(staging.name.replace(".new-", ".old-", 1))
    os.replace(index_dir, backup)
    try:
        os.replace(staging, index_dir)
    except BaseException:
        os.replace(backup, index_dir)
        raise
    shutil.rmtree(backup, ignore_errors=True)


@contextlib.contextmanager
def _locked(index_dir: Path) -> Iterator[None]:
    """One sync of `index_dir` at a time."""
    with (index_dir.parent / f".{index_dir.name}.lock").open("w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        yield
