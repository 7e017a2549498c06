"""`ds4py pull NAME`: download a catalogue model (or REPO/FILE) into the Hub's cache, resumably, and check it
against the checksum the Hub publishes (docs/pull.md).

Before a byte moves: the size, the space left on the cache's disk (refused when it does not fit) and the memory
plan (a GPU too small for the model is refused, pointing at the one that fits). During: a bar on a terminal, a line
a minute in a log. Ctrl-C keeps `blobs/<etag>.incomplete`; the next pull asks for the rest with an HTTP Range.
After: the whole file is hashed and compared with the Hub's LFS sha256 (git blob sha1 for small files); a mismatch
deletes the copy and says so.
"""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path
from typing import TextIO

from ds4py import hub
from ds4py.errors import Ds4Error
from ds4py.hub import Entry, Pulled, PulledFile, RemoteFile
from ds4py.progress import Transfer, size_text

# a file the Hub stores on Xet and that is larger than this is not served over plain HTTP (huggingface_hub's
# constants.MAX_HTTP_DOWNLOAD_SIZE): it comes through hf_xet, which restarts an interrupted file (docs/pull.md)
HTTP_LIMIT = 50 * 1000 ** 3


class Interrupted(Ds4Error):
    """Ctrl-C during a transfer: the partial file stays for the next pull."""


class _Counting:
    """The partial file as http_get writes it, counting bytes for the progress line."""

    def __init__(self, fh, progress: Transfer):
        self.fh, self.progress = fh, progress

    def write(self, b: bytes) -> int:
        n = self.fh.write(b)
        self.progress.update(self.fh.tell())
        return n

    def __getattr__(self, name):
        return getattr(self.fh, name)


def _say(out: TextIO, line: str) -> None:
    print(line, file=out, flush=True)


def pull(name: str, *, force: bool = False, skip_memory_check: bool = False, revision: str = "main",
         out: TextIO | None = None, tty: bool | None = None) -> Pulled:
    out = out if out is not None else sys.stderr
    entry = hub.resolve(name)
    if hub.offline():
        return _offline(entry, out)
    from huggingface_hub.utils import disable_progress_bars

    disable_progress_bars()                  # ds4py draws its own (Transfer): bytes, rate, time left
    commit, files = hub.remote_files(entry, revision)
    folder = hub.repo_folder(entry.repo)
    blobs = folder / "blobs"
    total = sum(f.size for f in files)
    todo = sum(_missing_bytes(blobs, f, force) for f in files)
    what = files[0].file if len(files) == 1 else f"{len(files)} files"
    _say(out, f"ds4py pull {name}: {entry.repo} @ {commit[:12]}: {what}, {size_text(total)}"
              f"{f'; {size_text(todo)} to download into' if todo else '; already in'} {folder}")
    line, refusal = hub.memory_line(entry, total, hub.device_memory())
    if line:
        _say(out, f"ds4py pull {name}: {line}")
    if refusal is not None and not skip_memory_check:
        raise Ds4Error(refusal)
    hub.check_disk(name, todo, blobs)
    known = hub.load_registry().get(name)
    pulled = []
    for f in files:
        pulled.append(_fetch(entry, commit, f, blobs, folder, force, known, out, tty))
    ref = folder / "refs" / revision
    if not revision == commit:
        ref.parent.mkdir(parents=True, exist_ok=True)
        ref.write_text(commit)
    result = Pulled(entry.name, entry.repo, commit, entry.kind, pulled, time.time())
    hub.record(result)
    _say(out, f"ds4py pull {name}: ready: {result.path} ({size_text(total)}; "
              f"{_checked(files)} matched the Hub's)")
    return result


def _checked(files: list[RemoteFile]) -> str:
    kinds = sorted({f.checksum.split(":", 1)[0] for f in files})
    return " and ".join(kinds) + (" of every file" if len(files) > 1 else "")


def _missing_bytes(blobs: Path, f: RemoteFile, force: bool) -> int:
    if force:
        return f.size
    blob = blobs / f.etag
    if blob.is_file() and blob.stat().st_size == f.size:
        return 0
    part = blobs / f"{f.etag}.incomplete"
    have = part.stat().st_size if part.is_file() else 0
    return f.size - min(have, f.size)


def _fetch(entry: Entry, commit: str, f: RemoteFile, blobs: Path, folder: Path, force: bool,
           known: Pulled | None, out: TextIO, tty: bool | None) -> PulledFile:
    """One file into blobs/<etag>, checked, linked from snapshots/<commit>/<file>."""
    blob, part = blobs / f.etag, blobs / f"{f.etag}.incomplete"
    blobs.mkdir(parents=True, exist_ok=True)
    if force:
        blob.unlink(missing_ok=True)
        part.unlink(missing_ok=True)
    label = f"ds4py pull {entry.name}" + (f" {f.file}" if len(entry.files) > 1 or "*" in entry.files[0] else "")
    if blob.is_file() and blob.stat().st_size == f.size:
        prior = next((p for p in known.files if p.checksum == f.checksum), None) if known else None
        if prior is not None and prior.verified_at and prior.mtime == blob.stat().st_mtime:
            # hashed when it was pulled and unchanged since: `inspect --verify` hashes it again on request
            return _link(blob, folder, commit, f, prior.verified_at)
        _verify(blob, f, label, out, tty, fresh=False, name=entry.name)
        return _link(blob, folder, commit, f, time.time())
    if blob.exists():
        raise Ds4Error(f"{blob} ({f.file}) has {blob.stat().st_size:,} of the Hub's {f.size:,} bytes (truncated): "
                       f"`ds4py pull {entry.name} --force` fetches it again")
    _download(entry, commit, f, part, label, out, tty)
    _verify(part, f, label, out, tty, fresh=True, name=entry.name)
    os.replace(part, blob)
    return _link(blob, folder, commit, f, time.time())


def _download(entry: Entry, commit: str, f: RemoteFile, part: Path, label: str, out: TextIO,
              tty: bool | None) -> None:
    from huggingface_hub import get_hf_file_metadata, hf_hub_url
    from huggingface_hub.errors import HfHubHTTPError
    from huggingface_hub.file_download import http_get, xet_get
    from huggingface_hub.utils import build_hf_headers

    from ds4py import __version__

    url = hf_hub_url(entry.repo, f.file, revision=commit, endpoint=hub.endpoint())
    headers = build_hf_headers(library_name="ds4py", library_version=__version__)
    try:
        meta = get_hf_file_metadata(url, endpoint=hub.endpoint(), library_name="ds4py",
                                    library_version=__version__)
    except HfHubHTTPError as e:
        raise Ds4Error(f"the Hub refused {entry.repo}/{f.file}: {hub._first_line(e)}") from None
    except hub.net_errors() as e:
        raise Ds4Error(f"cannot reach {hub.endpoint()} for {entry.repo}/{f.file}: {hub._first_line(e)}") from None
    have = part.stat().st_size if part.is_file() else 0
    if have > f.size:
        part.unlink()
        have = 0
    progress = Transfer(label, f.size, initial=have, stream=out, tty=tty)
    xet = meta.xet_file_data is not None and f.size > HTTP_LIMIT and have == 0
    if have:
        _say(out, f"{label}: resuming at {size_text(have)} of {size_text(f.size)} ({part})")
    try:
        if xet:
            xet_get(incomplete_path=part, xet_file_data=meta.xet_file_data, headers=headers,
                    expected_size=f.size, displayed_filename=f.file)
        else:
            with open(part, "r+b" if have else "wb") as fh:
                fh.seek(have)
                http_get(meta.location, _Counting(fh, progress), resume_size=have, headers=headers,
                         expected_size=f.size, displayed_filename=f.file)
    except KeyboardInterrupt:
        progress.close()
        if xet:                    # hf_xet writes chunks where they belong, not as a prefix: nothing to resume from
            part.unlink(missing_ok=True)
            raise Interrupted(f"interrupted: {f.file} came through hf_xet, which does not resume a partial file; "
                              f"`ds4py pull {entry.name}` starts it again (hf_xet's chunk cache keeps what "
                              f"arrived)") from None
        kept = part.stat().st_size if part.is_file() else 0
        raise Interrupted(f"interrupted: {size_text(kept)} of {size_text(f.size)} kept in {part}; run "
                          f"`ds4py pull {entry.name}` again to resume") from None
    except HfHubHTTPError as e:
        progress.close()
        if xet:
            part.unlink(missing_ok=True)
        raise Ds4Error(f"the download of {entry.repo}/{f.file} failed: {hub._first_line(e)}; "
                       f"`ds4py pull {entry.name}` resumes it") from None
    # the connection gone for good (http_get retried it), a full disk, an hf_xet failure
    except (*hub.net_errors(), RuntimeError) as e:
        progress.close()
        if xet:
            part.unlink(missing_ok=True)
        raise Ds4Error(f"the download of {entry.repo}/{f.file} stopped: {hub._first_line(e)}; "
                       f"`ds4py pull {entry.name}` resumes it") from None
    progress.close()
    took = time.monotonic() - progress.t0
    _say(out, f"{label}: downloaded {size_text(f.size - have)} in {took:.1f} s "
              f"({size_text((f.size - have) / max(took, 1e-9))}/s)")


def _verify(path: Path, f: RemoteFile, label: str, out: TextIO, tty: bool | None, fresh: bool, name: str) -> None:
    """The whole file's checksum against the Hub's; a mismatch deletes the file (it cannot be resumed)."""
    kind = f.checksum.split(":", 1)[0]
    size = path.stat().st_size
    if size != f.size:
        if fresh:
            path.unlink()
        raise Ds4Error(f"{f.file} has {size:,} bytes but the Hub's file {f.size:,}: "
                       + (f"deleted; run `ds4py pull {name}` to fetch it again" if fresh else
                          f"`ds4py pull {name} --force` fetches it again"))
    progress = Transfer(f"{label}: checking {kind}", f.size, stream=out, tty=tty)
    got = hub.file_checksum(path, kind, progress.update)
    progress.close()
    if got != f.checksum:
        if fresh:                      # a bad download cannot be resumed into a good one
            path.unlink()
            raise Ds4Error(f"{f.file}: the download does not match the Hub's checksum ({got} != {f.checksum}): "
                           f"it was deleted; run `ds4py pull {name}` to fetch it again")
        raise Ds4Error(f"{f.file}: the copy in the cache ({path}) does not match the Hub's checksum ({got} != "
                       f"{f.checksum}): it is corrupt; `ds4py pull {name} --force` fetches it again")


def _link(blob: Path, folder: Path, commit: str, f: RemoteFile, verified_at: float) -> PulledFile:
    snap = folder / "snapshots" / commit / f.file
    snap.parent.mkdir(parents=True, exist_ok=True)
    if snap.is_symlink() or snap.exists():
        snap.unlink()
    try:
        os.symlink(os.path.relpath(blob, snap.parent), snap)
    except OSError:                     # no symlinks on this file system: a hard link, as the Hub's cache does
        os.link(blob, snap)
    return PulledFile(f.file, str(snap), f.size, f.checksum, verified_at, blob.stat().st_mtime)


def _offline(entry: Entry, out: TextIO) -> Pulled:
    """HF_HUB_OFFLINE: only what is already here: a pulled model, or files another tool put in the cache (an LFS
    blob's name is its sha256, so it is checked against that)."""
    known = hub.load_registry().get(entry.name)
    if known is not None and known.state() == "ok":
        _say(out, f"ds4py pull {entry.name}: offline (HF_HUB_OFFLINE): already here: {known.path}")
        return known
    folder = hub.repo_folder(entry.repo)
    found = []
    if all("*" not in p for p in entry.files):
        for ref in sorted((folder / "refs").glob("*")) if (folder / "refs").is_dir() else []:
            commit = ref.read_text().strip()
            snaps = [folder / "snapshots" / commit / p for p in entry.files]
            if all(s.is_file() for s in snaps):
                found = [(commit, p, s) for p, s in zip(entry.files, snaps)]
                break
    if not found:
        partial = next((p for p in (folder / "blobs").glob("*.incomplete")), None) if folder.is_dir() else None
        extra = f" ({size_text(partial.stat().st_size)} of it are in {partial})" if partial else ""
        raise Ds4Error(f"{entry.name} is not here and HF_HUB_OFFLINE is set: unset it to download{extra}")
    files = []
    for commit, p, s in found:
        blob = Path(os.path.realpath(s))
        digest = blob.name
        if len(digest) == 64:
            checksum = f"sha256:{digest}"
        elif len(digest) == 40:
            checksum = f"git-sha1:{digest}"
        else:
            raise Ds4Error(f"{s} is not in the Hub cache's layout (blob {digest}); pull it online")
        rf = RemoteFile(p, blob.stat().st_size, checksum, digest)
        _verify(blob, rf, f"ds4py pull {entry.name}", out, None, fresh=False, name=entry.name)
        files.append(PulledFile(p, str(s), rf.size, checksum, time.time(), blob.stat().st_mtime))
    result = Pulled(entry.name, entry.repo, found[0][0], entry.kind, files, time.time())
    hub.record(result)
    _say(out, f"ds4py pull {entry.name}: offline (HF_HUB_OFFLINE): found in the Hub cache and checked: "
              f"{result.path}")
    return result
