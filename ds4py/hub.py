"""Models from the Hugging Face Hub: a short catalogue of names, `REPO/FILE` for anything else, and the record of
what was pulled (docs/pull.md).

The files live in the Hub's own cache layout (`$HF_HUB_CACHE`, else `$HF_HOME/hub`, else
~/.cache/huggingface/hub: blobs/<etag>, snapshots/<commit>/<file>), so `hf cache ls` sees them and a file another
tool already downloaded is found there. huggingface_hub gives the metadata (model_info with the LFS sha256 and
sizes, the resolve URL's ETag / commit / size), the auth headers ($HF_TOKEN) and the ranged transfer (http_get);
ds4py keeps the partial file itself (`blobs/<etag>.incomplete`), because the library deletes its partial files when
a download is interrupted, and a Ctrl-C in the middle of 80 GB must not cost the 40 already here.

The record of pulls (~/.cache/ds4py/pulled.json, $XDG_CACHE_HOME honoured) names each pulled model, its files and
the checksum each was verified against: `ds4py list`, and the commands that pick a model without -m, read it.
"""

from __future__ import annotations

import fnmatch
import hashlib
import json
import os
import re
import shutil
from dataclasses import asdict, dataclass, field
from pathlib import Path

from ds4py.errors import Ds4Error

V4_GGUF_REPO = "antirez/deepseek-v4-gguf"
V41_REPO = "deepseek-ai/DeepSeek-V4.1-Flash"

MODEL, MTP, CHECKPOINT = "model", "mtp", "checkpoint"       # what a pulled thing is used as


@dataclass(frozen=True)
class Entry:
    """A pullable thing: a repository, the files it takes from it (names or glob patterns), and what it is."""
    name: str
    repo: str
    files: tuple[str, ...]
    kind: str = MODEL
    about: str = ""
    pairs_with: str = ""            # an MTP block: the catalogue family of the models it drafts for


CATALOGUE: dict[str, Entry] = {e.name: e for e in (
    Entry("v4-flash-q2", V4_GGUF_REPO, ("DeepSeek-V4-Flash-IQ2XXS-w2Q2K-AProjQ8-SExpQ8-OutQ8-chat-v2.gguf",),
          about="DeepSeek V4 Flash, 2-bit routed experts (IQ2_XXS / Q2_K), 80.8 GiB: the one for a 128 GB Spark"),
    Entry("v4-flash-q4", V4_GGUF_REPO,
          ("DeepSeek-V4-Flash-Q4KExperts-F16HC-F16Compressor-F16Indexer-Q8Attn-Q8Shared-Q8Out-chat-v2.gguf",),
          about="DeepSeek V4 Flash, Q4_K routed experts, 153.3 GiB: about 167 GB with KV and workspaces, more "
                "than a Spark has"),
    Entry("v4-flash-mtp", V4_GGUF_REPO, ("DeepSeek-V4-Flash-MTP-Q4K-Q8_0-F32.gguf",), kind=MTP,
          about="V4 Flash's MTP draft block, 3.6 GiB: speculative decoding with v4-flash-q2 / -q4",
          pairs_with="v4-flash"),
    Entry("v41-flash-official", V41_REPO, ("*.safetensors", "*.json", "*.py"), kind=CHECKPOINT,
          about="the official DeepSeek V4.1 Flash checkpoint folder: convert it with docs/v41.md's recipe"),
)}

REPO_ID = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]*/[A-Za-z0-9][A-Za-z0-9._-]*$")


def resolve(name: str) -> Entry:
    """A catalogue name, or `OWNER/REPO/PATH/IN/REPO` for one file of any repository."""
    if name in CATALOGUE:
        return CATALOGUE[name]
    parts = name.split("/")
    if len(parts) >= 3 and REPO_ID.match("/".join(parts[:2])) and all(parts[2:]) and ".." not in parts:
        file = "/".join(parts[2:])
        kind = MTP if "mtp" in Path(file).name.lower() else MODEL
        return Entry(name, "/".join(parts[:2]), (file,), kind=kind, pairs_with=_family(file) if kind == MTP else "")
    raise Ds4Error(f"{name!r} is neither a catalogue name ({', '.join(CATALOGUE)}) nor REPO/FILE "
                   f"(e.g. {V4_GGUF_REPO}/{CATALOGUE['v4-flash-mtp'].files[0]})")


def _family(file: str) -> str:
    return "v4-flash" if "v4-flash" in file.lower() else ""


def family_of(name: str) -> str:
    """The catalogue family a model name belongs to ('v4-flash' for v4-flash-q2 and the V4 Flash GGUFs)."""
    if name in CATALOGUE and CATALOGUE[name].kind != CHECKPOINT:
        return "v4-flash" if name.startswith("v4-flash") else ""
    return _family(name)


# ---- where things are -----------------------------------------------------------------------------------------

def _true(v: str | None) -> bool:
    return (v or "").strip().upper() in ("1", "ON", "YES", "TRUE")


def offline() -> bool:
    """$HF_HUB_OFFLINE, read now (huggingface_hub reads it once, at import)."""
    return _true(os.environ.get("HF_HUB_OFFLINE"))


def endpoint() -> str:
    return (os.environ.get("HF_ENDPOINT") or "https://huggingface.co").rstrip("/")


def hub_cache() -> Path:
    """The Hub's cache folder as huggingface_hub finds it: $HF_HUB_CACHE, $HF_HOME/hub, ~/.cache/huggingface/hub."""
    if os.environ.get("HF_HUB_CACHE"):
        return Path(os.environ["HF_HUB_CACHE"]).expanduser()
    home = os.environ.get("HF_HOME") or os.path.join(os.environ.get("XDG_CACHE_HOME") or "~/.cache", "huggingface")
    return Path(home).expanduser() / "hub"


def ds4py_cache() -> Path:
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache").expanduser() / "ds4py"


def repo_folder(repo: str) -> Path:
    return hub_cache() / ("models--" + repo.replace("/", "--"))


# ---- the record of pulls --------------------------------------------------------------------------------------

@dataclass
class PulledFile:
    file: str                 # path in the repository
    path: str                 # the snapshot path (a link to the blob)
    size: int
    checksum: str             # "sha256:<hex>" (an LFS file) or "git-sha1:<hex>" (a small file: its git blob id)
    verified_at: float = 0.0  # when the whole file was hashed and matched
    mtime: float = 0.0        # the blob's mtime then: a changed file is hashed again


@dataclass
class Pulled:
    name: str
    repo: str
    commit: str
    kind: str
    files: list[PulledFile] = field(default_factory=list)
    pulled_at: float = 0.0

    @property
    def size(self) -> int:
        return sum(f.size for f in self.files)

    @property
    def path(self) -> str:
        """The file a command opens: the GGUF, or the checkpoint's snapshot folder."""
        if self.kind == CHECKPOINT:        # the snapshot folder: <...>/snapshots/<commit>
            f = self.files[0]
            return f.path[: -len(f.file) - 1] if f.path.endswith("/" + f.file) else os.path.dirname(f.path)
        return self.files[0].path

    def state(self) -> str:
        """'ok', or what is wrong with the files on disk now (size only: `inspect --verify` hashes)."""
        for f in self.files:
            try:
                n = os.path.getsize(f.path)
            except OSError:
                return f"missing {f.file}"
            if n != f.size:
                return f"truncated {f.file} ({n:,} of {f.size:,} bytes)"
        return "ok"


def partial_downloads() -> list[tuple[str, Path, int]]:
    """(repository, partial file, bytes) of every interrupted download in the Hub cache."""
    root = hub_cache()
    out = []
    for part in sorted(root.glob("models--*/blobs/*.incomplete")) if root.is_dir() else []:
        repo = part.parent.parent.name[len("models--"):].replace("--", "/", 1)
        out.append((repo, part, part.stat().st_size))
    return out


def registry_path() -> Path:
    return ds4py_cache() / "pulled.json"


def load_registry() -> dict[str, Pulled]:
    p = registry_path()
    try:
        raw = json.loads(p.read_text())
    except FileNotFoundError:
        return {}
    except (OSError, ValueError) as e:
        raise Ds4Error(f"cannot read the record of pulled models {p}: {e}; delete it and pull again") from None
    out = {}
    for name, d in raw.get("models", {}).items():
        files = [PulledFile(**f) for f in d.pop("files", [])]
        out[name] = Pulled(files=files, **d)
    return out


def save_registry(models: dict[str, Pulled]) -> None:
    p = registry_path()
    p.parent.mkdir(parents=True, exist_ok=True)
    tmp = p.with_suffix(".tmp")
    tmp.write_text(json.dumps({"models": {n: asdict(m) for n, m in models.items()}}, indent=1))
    os.replace(tmp, p)


def record(pulled: Pulled) -> None:
    models = load_registry()
    models[pulled.name] = pulled
    save_registry(models)


def pulled_file(path: str) -> tuple[str, PulledFile] | None:
    """(the model's name, the record) of a pulled file by any of its paths (the snapshot link or its blob)."""
    real = os.path.realpath(path)
    for m in load_registry().values():
        for f in m.files:
            if os.path.realpath(f.path) == real:
                return m.name, f
    return None


# ---- checksums ------------------------------------------------------------------------------------------------

CHUNK = 8 << 20


def file_checksum(path: str | Path, kind: str, on_bytes=None) -> str:
    """'sha256:<hex>' of the whole file, or 'git-sha1:<hex>' (git's blob id: sha1 of 'blob <size>\\0' + bytes)."""
    if kind == "sha256":
        h = hashlib.sha256()
    else:
        h = hashlib.sha1()
        h.update(f"blob {os.path.getsize(path)}\0".encode())
    done = 0
    with open(path, "rb") as fh:
        while chunk := fh.read(CHUNK):
            h.update(chunk)
            done += len(chunk)
            if on_bytes is not None:
                on_bytes(done)
    return f"{kind}:{h.hexdigest()}"


def verify_file(f: PulledFile, on_bytes=None) -> str | None:
    """None when the file matches the checksum the Hub published for it, else one sentence saying how not."""
    try:
        n = os.path.getsize(f.path)
    except OSError:
        return f"{f.path} is missing"
    if n != f.size:
        return f"{f.path} has {n:,} bytes, the Hub's file {f.size:,} (truncated or overwritten)"
    got = file_checksum(f.path, f.checksum.split(":", 1)[0], on_bytes)
    if got != f.checksum:
        return f"{f.path}: {got} does not match the Hub's {f.checksum} (the file is corrupt)"
    return None


# ---- the plan before a download -------------------------------------------------------------------------------

@dataclass(frozen=True)
class RemoteFile:
    file: str
    size: int
    checksum: str             # as PulledFile.checksum
    etag: str                 # the blob's name in the cache (the LFS sha256, else the git blob id)


def remote_files(entry: Entry, revision: str = "main") -> tuple[str, list[RemoteFile]]:
    """(commit, the entry's files with their sizes and checksums) from the Hub's model info."""
    from huggingface_hub import HfApi
    from huggingface_hub.errors import (GatedRepoError, HfHubHTTPError, RepositoryNotFoundError,
                                        RevisionNotFoundError)

    try:
        info = HfApi(endpoint=endpoint()).model_info(entry.repo, revision=revision, files_metadata=True)
    except GatedRepoError:
        raise Ds4Error(f"{entry.repo} is gated: accept its terms on the Hub and set HF_TOKEN") from None
    except RepositoryNotFoundError:
        raise Ds4Error(f"no repository {entry.repo} on {endpoint()} (or it is private: set HF_TOKEN)") from None
    except RevisionNotFoundError:
        raise Ds4Error(f"{entry.repo} has no revision {revision}") from None
    except HfHubHTTPError as e:
        raise Ds4Error(f"the Hub refused the model info of {entry.repo}: {_first_line(e)}") from None
    except net_errors() as e:
        raise Ds4Error(f"cannot reach {endpoint()} for {entry.repo}: {_first_line(e)} (HF_HUB_OFFLINE=1 uses only "
                       f"what is already here)") from None
    out = []
    for s in info.siblings or []:
        if not any(fnmatch.fnmatchcase(s.rfilename, pat) for pat in entry.files):
            continue
        if s.lfs is not None:
            out.append(RemoteFile(s.rfilename, int(s.lfs.size), f"sha256:{s.lfs.sha256}", s.lfs.sha256))
        else:
            out.append(RemoteFile(s.rfilename, int(s.size or 0), f"git-sha1:{s.blob_id}", s.blob_id))
    missing = [pat for pat in entry.files if not any(fnmatch.fnmatchcase(f.file, pat) for f in out)]
    if missing:
        raise Ds4Error(f"{entry.repo} (commit {info.sha[:12]}) has no file {missing[0]}")
    return info.sha, sorted(out, key=lambda f: f.file)


def net_errors() -> tuple[type[BaseException], ...]:
    """What a failed connection raises under huggingface_hub: OSError, and its HTTP client's transport errors."""
    try:
        import httpx2

        return (OSError, httpx2.HTTPError)
    except ImportError:                       # an older huggingface_hub on httpx
        import httpx

        return (OSError, httpx.HTTPError)


def _first_line(e: BaseException) -> str:
    return (str(e).strip().splitlines() or [type(e).__name__])[0]


def free_bytes(folder: Path) -> int:
    """Free space of the file system that holds `folder` (its nearest existing parent)."""
    p = folder
    while not p.exists() and p != p.parent:
        p = p.parent
    return shutil.disk_usage(p).free


def check_disk(name: str, todo: int, folder: Path) -> None:
    free = free_bytes(folder)
    if todo > free:
        raise Ds4Error(f"{name} needs {todo / 1e9:.1f} GB more on the disk of {folder} but only {free / 1e9:.1f} GB "
                       f"are free: free some space, or set HF_HOME to a folder on a larger disk")


# the plan's margin beyond the weights and one sequence's KV: the engine's workspaces, graphs, the CUDA context
PLAN_MARGIN = 2 << 30


def device_memory() -> tuple[str, int] | None:
    """(the GPU's name, its total memory in bytes), or None without a usable CUDA device."""
    try:
        from ds4py.cuda.driver import Device
        from ds4py.cuda.probe import device_memory as mem

        _free, total = mem(0)
        dev = Device.open(0)
        try:
            name = dev.name
        finally:
            dev.close()
        return str(name), int(total)
    except Exception:       # no driver, no device, no cuda-bindings: the CPU reference runs it instead
        return None


def v4_flash_kv_bytes(ctx: int) -> int:
    """One sequence's KV state of V4 Flash (43 layers) after ctx tokens, from the state layout."""
    from ds4py.config import V4_FLASH, ModelConfig
    from ds4py.cuda.memory_plan import kv_bytes
    from ds4py.kv import state_layout
    from ds4py.contract import DEFAULT_ROLLBACK_HORIZON

    cfg = ModelConfig(**{**V4_FLASH, **dict(n_layers=43, dim=4096, vocab_size=129280, n_heads=64,
                                           context_length=1 << 20, swiglu_clamp=10.0,
                                           compress_ratios=[0, 0] + [4, 128] * 20 + [4])})
    return kv_bytes(state_layout(cfg, DEFAULT_ROLLBACK_HORIZON), ctx)


def memory_line(entry: Entry, size: int, device: tuple[str, int] | None) -> tuple[str, str | None]:
    """(one line on what this machine can run, a refusal sentence or None). A V4 Flash GGUF on a GPU: the weights
    (about the file's size) + KV at the default context + a margin against the GPU's memory; without a GPU the
    CPU reference pages the file from disk, so nothing is refused."""
    from ds4py.cuda.memory_plan import DEFAULT_CTX

    if entry.kind != MODEL:
        return "", None
    if device is None:
        ram = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
        how = "in RAM" if size < ram else "paged from disk (slow: the file is larger than RAM)"
        return (f"memory plan: no GPU here: the CPU reference runs it {how}, {ram / 1e9:.0f} GB of RAM"), None
    gpu, total = device
    kv = v4_flash_kv_bytes(DEFAULT_CTX)
    need = size + kv + PLAN_MARGIN
    line = (f"memory plan: weights {size / 1e9:.1f} GB + KV {kv / 1e9:.2f} GB at {DEFAULT_CTX:,} tokens + "
            f"{PLAN_MARGIN / 1e9:.1f} GB workspaces = {need / 1e9:.1f} GB of {total / 1e9:.1f} GB on {gpu}")
    if need <= total:
        return line, None
    smaller = [e.name for e in CATALOGUE.values() if e.kind == MODEL and e.name != entry.name
               and family_of(e.name) == family_of(entry.name) and e.name < entry.name]
    hint = f"; pull {smaller[0]} instead" if smaller else ""
    return line, (f"{entry.name} does not fit this machine: it needs about {need / 1e9:.0f} GB (weights "
                  f"{size / 1e9:.1f} GB + KV + workspaces) but {gpu} has {total / 1e9:.0f} GB{hint} "
                  f"(or pass --skip-memory-check to download it anyway)")


def describe_needs(m: Pulled) -> str:
    """What a pulled model needs, for `ds4py list`."""
    if m.kind == MTP:
        return "pairs with the V4 Flash models (speculative decoding)"
    if m.kind == CHECKPOINT:
        return "convert first (docs/v41.md)"
    from ds4py.cuda.memory_plan import DEFAULT_CTX

    need = m.size + v4_flash_kv_bytes(DEFAULT_CTX) + PLAN_MARGIN if family_of(m.name) else m.size + PLAN_MARGIN
    return f"GPU with {need / 1e9:.0f} GB, or the CPU reference"


# ---- which model a command uses -------------------------------------------------------------------------------

def config_path() -> Path:
    base = Path(os.environ.get("XDG_CONFIG_HOME") or Path.home() / ".config").expanduser()
    return base / "ds4py" / "config.json"


def default_name() -> tuple[str | None, str]:
    """(the model named by $DS4PY_MODEL or the config's "model", where it came from)."""
    if os.environ.get("DS4PY_MODEL"):
        return os.environ["DS4PY_MODEL"], "$DS4PY_MODEL"
    p = config_path()
    try:
        name = json.loads(p.read_text()).get("model")
    except FileNotFoundError:
        return None, ""
    except (OSError, ValueError, AttributeError) as e:
        raise Ds4Error(f"cannot read {p}: {e}") from None
    return (str(name), str(p)) if name else (None, "")


def set_default(name: str | None) -> Path:
    p = config_path()
    try:
        cfg = json.loads(p.read_text())
    except (OSError, ValueError):
        cfg = {}
    if name is None:
        cfg.pop("model", None)
    else:
        cfg["model"] = name
    p.parent.mkdir(parents=True, exist_ok=True)
    p.write_text(json.dumps(cfg, indent=1) + "\n")
    return p


@dataclass(frozen=True)
class Choice:
    path: str | None          # None: the demo model
    why: str                  # for the one line each command prints
    name: str | None = None   # the pulled model's name, when it is one
    mtp: str | None = None    # the pulled MTP block that pairs with it


def _by_name(name: str, models: dict[str, Pulled], source: str) -> Choice:
    m = models.get(name)
    if m is None:
        if name in CATALOGUE:
            raise Ds4Error(f"{name} ({source}) is not pulled: run `ds4py pull {name}` first")
        raise Ds4Error(f"model file not found: {name} ({source}; nor a pulled model's name: `ds4py list` shows "
                       f"them)")
    if m.kind == CHECKPOINT:
        raise Ds4Error(f"{name} is a checkpoint folder, not a GGUF: convert it first (docs/v41.md)")
    state = m.state()
    if state != "ok":
        raise Ds4Error(f"{name}: {state}; run `ds4py pull {name}` to finish it")
    return Choice(m.path, source, name, mtp_for(m, models))


def mtp_for(m: Pulled, models: dict[str, Pulled]) -> str | None:
    """The pulled MTP block that drafts for `m` (same family), if any."""
    if m.kind != MODEL or not family_of(m.name):
        return None
    for other in sorted(models.values(), key=lambda o: -o.pulled_at):
        if other.kind == MTP and family_of(other.name) == family_of(m.name) and other.state() == "ok":
            return other.path
    return None


def choose(model: str | None) -> Choice:
    """The model a command uses. -m PATH: that file; -m NAME: the pulled model of that name; no -m: $DS4PY_MODEL
    or the config's model, else the one pulled model, else (several) the most recently pulled, else the demo."""
    if model is not None:
        if os.path.exists(model):
            return Choice(model, "-m")
        models = load_registry()
        if model in models or model in CATALOGUE:
            return _by_name(model, models, "-m")
        raise Ds4Error(f"model file not found: {model} (nor a pulled model's name: `ds4py list` shows them)")
    models = load_registry()
    name, source = default_name()
    if name is not None:
        if os.path.exists(name):
            return Choice(name, source)
        return _by_name(name, models, source)
    pulled = sorted((m for m in models.values() if m.kind == MODEL), key=lambda m: -m.pulled_at)
    usable = [m for m in pulled if m.state() == "ok"]
    if not usable and pulled:                # say so rather than fall back to the demo model silently
        m = pulled[0]
        raise Ds4Error(f"the pulled model {m.name} is not usable: {m.state()}; `ds4py pull {m.name} --force` "
                       f"fetches it again (or -m another model)")
    if not usable:
        return Choice(None, "no model pulled")
    m = usable[0]
    why = "the one pulled model" if len(usable) == 1 else (
        f"the most recently pulled of {len(usable)} ({', '.join(u.name for u in usable)}); choose with "
        f"$DS4PY_MODEL or `ds4py list --default NAME`")
    return Choice(m.path, why, m.name, mtp_for(m, models))


def announce(command: str, choice: Choice) -> str:
    """The one line each command prints about its model."""
    if choice.path is None:
        return (f"ds4py {command}: model: the demo model (tiny, RANDOM WEIGHTS; `ds4py pull v4-flash-q2` for "
                f"DeepSeek V4 Flash)")
    named = f"{choice.name} = " if choice.name else ""
    mtp = f"; MTP {choice.mtp} paired" if choice.mtp else ""
    return f"ds4py {command}: model: {named}{choice.path} ({choice.why}{mtp})"
