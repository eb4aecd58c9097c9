"""Compile artifacts that travel between processes: torch's compiled code, keyed by what makes it valid.

A process that compiled (``RunnerConfig(compile=True)``) can hand its compiled code to another process,
which then skips most of the compile: `CompileArtifacts` reads and loads torch's "mega cache"
(``torch.compiler.save_cache_artifacts`` / ``load_cache_artifacts``: inductor, AOT autograd, autotuning
and dynamic-shape decisions). Contract:

* `ArtifactKey`: everything that makes artifacts valid (`artifact_key`): torch, triton and Python
  versions, device name and compute capability (CPU: its vector ISA), the modules' classes and
  configuration, dtype, every `RunnerConfig` field except those known to change nothing that is
  compiled (`NOT_COMPILE_FIELDS`: new fields count by default), and the shape key when artifacts are
  kept per key. Its ``digest`` names the artifacts; ``diff`` says which fields differ.
* One artifact (`encode` / `decode`) is a header -- magic, format version, key and origin as JSON,
  payload length, SHA-256 of key and payload -- followed by the payload. `decode` raises
  `ArtifactFormatError` for anything that is not one whole artifact (torn, foreign, corrupted).
* `ArtifactStore` keeps artifacts under a root: a local directory, or any URI fsspec opens (the
  ``cache`` extra; ``s3://bucket/prefix`` with s3fs). Writes are atomic (a temporary name, then a
  rename). `ArtifactStore.get` returns a `Lookup`: a hit (whole, with the expected key), a miss, or
  a mismatch with the reasons (artifacts for the same model and shape made under other fields). A
  torn or foreign file is skipped with one warning, never an error.
* Beside the artifacts the store keeps small records written once (`ArtifactStore.put_new`: the first
  write of a path wins, atomically in a local directory): the attention kernel chosen per device and
  shape (``deployments.attention_choices``).
* Beside it, the replicas' quantized transformers persist in a store of their own (`weights_store_root`:
  ``<temp dir>/bcg-quantized-weights`` on each replica's node unless the app names one;
  `bcg.runtime.weights_store`), which each replica reads and writes itself: weights are too large to
  travel through the coordinator.
* Loading artifacts only fills torch's caches: a load that does not fit (another torch) compiles
  afresh. Nothing here raises into the caller's warmup except `ArtifactFormatError` from `decode`.

Torch only: no Ray, no diffusers. The key format, file format and stores import no torch either (the
coordinator holds and stores artifacts without it); torch is imported where its state is read.
"""
from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import json
import logging
import os
import platform
import re
import struct
import sys
import tempfile
import time
import uuid
from typing import Iterable, Iterator, List, Mapping, Optional

from bcg.runtime.hooks import HookRegistry, ModelHook

logger = logging.getLogger(__name__)

#: A pipeline may carry, as the hook of this name in its registry (`bcg.runtime.hooks`, an `ArtifactsHook`),
#: the `CompileArtifacts` a replica shares its compiled code through instead of torch's mega cache (tests;
#: a custom cache). Its presence turns the sharing on: `pipeline_artifacts(pipe)`.
ARTIFACTS_HOOK = "bcg_compile_artifacts"


class ArtifactsHook(ModelHook):
    """The hook ``bcg_compile_artifacts``: what a pipeline's compiled code is shared through."""

    def __init__(self, artifacts):
        super().__init__()
        self.artifacts = artifacts


def pipeline_artifacts(pipe):
    """The artifacts object a pipeline carries (`ARTIFACTS_HOOK`), or None."""
    registry = HookRegistry.of(pipe)
    hook = registry.get_hook(ARTIFACTS_HOOK) if registry is not None else None
    return hook.artifacts if hook is not None else None


__all__ = ["ARTIFACTS_HOOK", "ARTIFACT_SUFFIX", "ArtifactsHook", "Artifact", "ArtifactFormatError", "ArtifactKey", "ArtifactStore", "CompileArtifacts",
           "FORMAT_VERSION", "Lookup", "NOT_COMPILE_FIELDS", "artifact_key", "decode", "encode", "open_store",
           "pipeline_artifacts", "safe_path_part", "weights_store_root"]

MAGIC = b"BCGCART\n"
FORMAT_VERSION = 1
# magic, format version, envelope (key + origin JSON) length, payload length, sha256(envelope + payload)
_HEADER = struct.Struct(">8sHIQ32s")
_MAX_ENVELOPE = 1 << 20
ARTIFACT_SUFFIX = ".bcgart"

#: RunnerConfig fields that change nothing a compile produces (graph bookkeeping, capture policy).
#: Every other field, including ones added later, is part of the key.
NOT_COMPILE_FIELDS = frozenset({
    "enabled", "max_entries", "pool_budget_bytes", "max_segments", "copy_outputs", "max_break_mismatches",
    "max_capture_retries", "debug", "capture_warmup_runs", "pool_expandable_segments", "raw_launch",
})


class ArtifactFormatError(ValueError):
    """Bytes that are not one whole artifact of this format (torn, foreign, corrupted)."""


def _canonical(value) -> str:
    return json.dumps(value, sort_keys=True, separators=(",", ":"), default=str)


def safe_path_part(text: str) -> str:
    """`text` as one part of a store path: runs of anything but letters, digits, ``.``, ``_`` and ``-`` as ``_``."""
    return re.sub(r"[^A-Za-z0-9._-]+", "_", text).strip("_") or "_"


@dataclasses.dataclass(frozen=True)
class ArtifactKey:
    """What compile artifacts are valid for. ``name`` and ``shape_key`` say what they are *for* (the
    model, the shape); ``fields`` what they were made *under*."""

    name: str
    shape_key: Optional[str]
    fields: tuple  # sorted (field, JSON value) pairs

    @classmethod
    def make(cls, name: str, shape_key: Optional[str], fields: Mapping) -> "ArtifactKey":
        normal = json.loads(_canonical(dict(fields)))  # JSON values only: compare equal after a round trip
        return cls(str(name), None if shape_key is None else str(shape_key), tuple(sorted(normal.items())))

    @classmethod
    def from_dict(cls, data: Mapping) -> "ArtifactKey":
        try:
            return cls.make(data["name"], data.get("shape_key"), data["fields"])
        except (KeyError, TypeError, AttributeError) as exc:
            raise ArtifactFormatError(f"not an artifact key: {exc!r}") from None

    def as_dict(self) -> dict:
        return {"name": self.name, "shape_key": self.shape_key, "fields": dict(self.fields)}

    @property
    def digest(self) -> str:
        return hashlib.sha256(_canonical(self.as_dict()).encode()).hexdigest()[:24]

    @property
    def slot(self) -> str:
        """Where artifacts for the same model and shape live, whatever they were made under."""
        return f"{safe_path_part(self.name)}/{safe_path_part(self.shape_key or 'any')}"

    @property
    def path(self) -> str:
        return f"{self.slot}/{self.digest}{ARTIFACT_SUFFIX}"

    def nearest_diff(self, others: Iterable["ArtifactKey"]) -> List[str]:
        """How this key differs from the nearest of `others` made for the same model and shape (`slot`):
        the `diff` with the fewest differences; [] when none differs (or there are none)."""
        return min((d for d in (self.diff(o) for o in others if o.slot == self.slot) if d), key=len, default=[])

    def diff(self, other: "ArtifactKey") -> List[str]:
        """Readable differences, ``"torch: '2.11.0' here, '2.13.0' there"``; [] when equal."""
        out = []
        for attr in ("name", "shape_key"):
            if getattr(self, attr) != getattr(other, attr):
                out.append(f"{attr}: {getattr(self, attr)!r} here, {getattr(other, attr)!r} there")
        mine, theirs = dict(self.fields), dict(other.fields)
        for name in sorted(set(mine) | set(theirs)):
            if mine.get(name, "<absent>") != theirs.get(name, "<absent>"):
                out.append(f"{name}: {mine.get(name, '<absent>')!r} here, {theirs.get(name, '<absent>')!r} there")
        return out


def environment_fields(device=None) -> dict:
    """torch, triton and Python versions, and the device the code is compiled for."""
    import torch
    try:
        import triton
        triton_version = triton.__version__
    except ImportError:
        triton_version = None
    device = torch.device(device if device is not None else ("cuda" if torch.cuda.is_available() else "cpu"))
    fields = {"torch": torch.__version__, "triton": triton_version, "python": "%d.%d" % sys.version_info[:2],
              "device_type": device.type}
    if device.type == "cuda":
        index = device.index if device.index is not None else torch.cuda.current_device()
        fields["device_name"] = torch.cuda.get_device_name(index)
        fields["capability"] = "%d.%d" % torch.cuda.get_device_capability(index)
        fields["cuda"] = torch.version.cuda
    else:
        fields["device_name"] = platform.machine()
        capability = getattr(torch.backends.cpu, "get_cpu_capability", None)
        fields["capability"] = capability() if capability is not None else None
    return fields


def module_fingerprint(modules: Mapping[str, object]) -> str:
    """A hash of each module's class and configuration (diffusers' ``config``, else its parameter and
    buffer names, shapes and dtypes), by name."""
    import torch
    parts = {}
    for name, module in sorted(modules.items()):
        config = getattr(module, "config", None)
        if isinstance(config, Mapping):
            described = {k: v for k, v in config.items() if not str(k).startswith("_")}
        elif isinstance(module, torch.nn.Module):
            described = [(n, list(t.shape), str(t.dtype)) for n, t in module.state_dict(keep_vars=True).items()]
        else:
            described = None
        parts[name] = [f"{type(module).__module__}.{type(module).__qualname__}", described]
    return hashlib.sha256(_canonical(parts).encode()).hexdigest()[:24]


def compile_fields(config) -> dict:
    """The `RunnerConfig` fields that shape compiled code (all but `NOT_COMPILE_FIELDS`)."""
    return {k: v for k, v in config.as_dict().items() if k not in NOT_COMPILE_FIELDS}


def _dtype_of(modules: Mapping[str, object]) -> Optional[str]:
    import torch
    dtypes = set()
    for module in modules.values():
        if isinstance(module, torch.nn.Module):
            dtypes.update(str(p.dtype) for p in module.parameters())
    return ",".join(sorted(dtypes)) or None


def artifact_key(modules: Mapping[str, object], config, *, name: str, shape_key: Optional[str] = None,
                 device=None, dtype=None, options=None) -> ArtifactKey:
    """The key of the artifacts compiling `modules` (name -> module) under `config` (a `RunnerConfig`)
    and `options` (the transformers' `TransformerOptions`: float8 and the attention kernel change the
    compiled code) produces; `shape_key` when they are kept per shape. `dtype` defaults to the
    parameters' dtypes."""
    fields = {**environment_fields(device), "model": module_fingerprint(modules),
              "dtype": str(dtype) if dtype is not None else _dtype_of(modules),
              **{f"runner.{k}": v for k, v in compile_fields(config).items()},
              **{f"transformer.{k}": v for k, v in (options.as_dict() if options is not None else {}).items()}}
    return ArtifactKey.make(name, shape_key, fields)


@dataclasses.dataclass(frozen=True)
class Artifact:
    key: ArtifactKey
    payload: bytes
    origin: dict  # who made it and when (not part of the key)


def encode(key: ArtifactKey, payload: bytes, origin: Optional[Mapping] = None) -> bytes:
    """One artifact as bytes: header, key and origin (JSON), payload."""
    envelope = _canonical({"key": key.as_dict(), "origin": dict(origin or {})}).encode()
    checksum = hashlib.sha256(envelope + payload).digest()
    return _HEADER.pack(MAGIC, FORMAT_VERSION, len(envelope), len(payload), checksum) + envelope + payload


def _envelope(blob: bytes):
    """(envelope dict, payload length, checksum, header end) from the start of `blob`."""
    if len(blob) < _HEADER.size:
        raise ArtifactFormatError(f"{len(blob)} bytes, shorter than the {_HEADER.size}-byte header (torn?)")
    magic, version, envelope_len, payload_len, checksum = _HEADER.unpack_from(blob)
    if magic != MAGIC:
        raise ArtifactFormatError("not a bcg compile artifact (foreign file: wrong magic)")
    if version != FORMAT_VERSION:
        raise ArtifactFormatError(f"artifact format version {version}, this code reads {FORMAT_VERSION}")
    if envelope_len > _MAX_ENVELOPE:
        raise ArtifactFormatError(f"key of {envelope_len} bytes is implausible (corrupted header)")
    end = _HEADER.size + envelope_len
    if len(blob) < end:
        raise ArtifactFormatError("the key is cut short (torn file)")
    try:
        envelope = json.loads(blob[_HEADER.size:end])
    except ValueError:
        raise ArtifactFormatError("the key is not JSON (corrupted)") from None
    if not isinstance(envelope, dict):
        raise ArtifactFormatError("the key is not a JSON object (corrupted)")
    return envelope, payload_len, checksum, end


def read_key(prefix: bytes) -> ArtifactKey:
    """The key of an artifact from its first bytes (header and key), without the payload."""
    envelope, _, _, _ = _envelope(prefix)
    return ArtifactKey.from_dict(envelope.get("key"))


def decode(blob: bytes, expected: Optional[ArtifactKey] = None) -> Artifact:
    """The artifact in `blob`; raises `ArtifactFormatError` when it is not whole, or (with `expected`)
    when it was made for another key (the message lists the fields that differ)."""
    envelope, payload_len, checksum, end = _envelope(blob)
    if len(blob) != end + payload_len:
        raise ArtifactFormatError(f"payload of {len(blob) - end} bytes, the header says {payload_len} (torn file)")
    if hashlib.sha256(blob[_HEADER.size:]).digest() != checksum:
        raise ArtifactFormatError("checksum mismatch (corrupted)")
    key = ArtifactKey.from_dict(envelope.get("key"))
    if expected is not None and key != expected:
        raise ArtifactFormatError("made for another key: " + "; ".join(expected.diff(key)))
    origin = envelope.get("origin") if isinstance(envelope.get("origin"), dict) else {}
    return Artifact(key, bytes(blob[end:]), origin)


def header_bytes(prefix: bytes) -> int:
    """How many bytes of an artifact hold its header and key (for reading only those)."""
    if len(prefix) < _HEADER.size:
        return _HEADER.size
    _, _, envelope_len, _, _ = _HEADER.unpack_from(prefix)
    return _HEADER.size + min(envelope_len, _MAX_ENVELOPE)


@dataclasses.dataclass
class Lookup:
    """What a store holds for a key: ``status`` is "hit" (``artifact`` set), "miss" or "mismatch"
    (``reasons``: how the nearest artifacts for the same model and shape differ)."""

    status: str
    artifact: Optional[Artifact] = None
    reasons: List[str] = dataclasses.field(default_factory=list)


class _LocalFiles:
    """A local directory."""

    def __init__(self, root: str):
        self.root = os.path.abspath(os.path.expanduser(root))

    def read(self, path: str, length: Optional[int] = None) -> Optional[bytes]:
        try:
            with open(os.path.join(self.root, path), "rb") as f:
                return f.read() if length is None else f.read(length)
        except FileNotFoundError:
            return None

    def _written_whole(self, path: str, data: bytes, suffix: str = "") -> tuple:
        """``(target, temporary file)``: `data` written and synced under a temporary name beside `path`'s
        target (the caller moves it into place and removes what is left)."""
        target = os.path.join(self.root, path)
        os.makedirs(os.path.dirname(target), exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=os.path.dirname(target), prefix=".tmp-", suffix=suffix)
        try:
            with os.fdopen(fd, "wb") as f:
                f.write(data)
                f.flush()
                os.fsync(f.fileno())
        except BaseException:
            with contextlib.suppress(Exception):
                os.unlink(tmp)
            raise
        return target, tmp

    def write(self, path: str, data: bytes) -> None:
        target, tmp = self._written_whole(path, data, ARTIFACT_SUFFIX)
        try:
            os.replace(tmp, target)  # readers see the old file or the whole new one
        except BaseException:
            with contextlib.suppress(Exception):
                os.unlink(tmp)
            raise

    def write_new(self, path: str, data: bytes) -> bool:
        """Write `data` at `path` unless a file is there already (False then): written whole under a
        temporary name, then hard-linked into place, which fails when the name exists, so of writers
        racing for one path exactly one wins and readers never see a part."""
        target, tmp = self._written_whole(path, data)
        try:
            try:
                os.link(tmp, target)
            except FileExistsError:
                return False
            return True
        finally:
            with contextlib.suppress(Exception):
                os.unlink(tmp)

    def list(self, directory: str, suffix: str = ARTIFACT_SUFFIX) -> List[str]:
        """Files in `directory` named ``*<suffix>``, newest first."""
        base = os.path.join(self.root, directory)
        try:
            names = [n for n in os.listdir(base) if n.endswith(suffix) and not n.startswith(".tmp-")]
        except FileNotFoundError:
            return []
        names.sort(key=lambda n: os.path.getmtime(os.path.join(base, n)), reverse=True)
        return [f"{directory}/{n}" for n in names]


class _FsspecFiles:
    """Any filesystem fsspec opens (``s3://``, ``gs://``, ``memory://``, ``file://``, ...)."""

    def __init__(self, uri: str):
        try:
            import fsspec
        except ImportError:
            raise ImportError(f"compile_cache {uri!r} needs fsspec: pip install 'bcg-serve[cache]' (and the "
                              "filesystem's own package, e.g. s3fs for s3://)") from None
        self.fs, self.root = fsspec.core.url_to_fs(uri)
        self.root = self.root.rstrip("/")

    def _full(self, path: str) -> str:
        return f"{self.root}/{path}"

    def read(self, path: str, length: Optional[int] = None) -> Optional[bytes]:
        try:
            with self.fs.open(self._full(path), "rb") as f:
                return f.read() if length is None else f.read(length)
        except FileNotFoundError:
            return None

    def write(self, path: str, data: bytes) -> None:
        target = self._full(path)
        tmp = f"{target.rsplit('/', 1)[0]}/.tmp-{uuid.uuid4().hex}{ARTIFACT_SUFFIX}"
        self.fs.makedirs(target.rsplit("/", 1)[0], exist_ok=True)
        self.fs.pipe_file(tmp, data)
        try:
            self.fs.mv(tmp, target)  # object stores: the copy appears whole or not at all
        except BaseException:
            with contextlib.suppress(Exception):
                self.fs.rm(tmp)
            raise

    def write_new(self, path: str, data: bytes) -> bool:
        """Write `data` at `path` unless a file is there already (False then). fsspec has no portable
        create-if-absent: writers racing within the moment between the check and the move may both
        write (the last move stays); a local directory has no such moment (`_LocalFiles.write_new`)."""
        if self.fs.exists(self._full(path)):
            return False
        self.write(path, data)
        return True

    def list(self, directory: str, suffix: str = ARTIFACT_SUFFIX) -> List[str]:
        try:
            entries = self.fs.ls(self._full(directory), detail=True)
        except FileNotFoundError:
            return []
        files = [e for e in entries if str(e.get("name", "")).endswith(suffix)
                 and not str(e["name"]).rsplit("/", 1)[-1].startswith(".tmp-")]
        files.sort(key=lambda e: str(e.get("mtime") or e.get("LastModified") or e.get("created") or ""), reverse=True)
        return [f"{directory}/{str(e['name']).rsplit('/', 1)[-1]}" for e in files]


class ArtifactStore:
    """Artifacts under `root`: a local directory (a path or ``file://``-less string) or a URI fsspec
    opens. `get` never raises for a bad file; `put` raises what the filesystem raises."""

    def __init__(self, root: str, max_candidates: int = 8):
        self.root = str(root)
        self.max_candidates = max_candidates
        self._files = _FsspecFiles(self.root) if "://" in self.root else _LocalFiles(self.root)
        self._warned: set = set()

    def __repr__(self):
        return f"ArtifactStore({self.root!r})"

    def put(self, key: ArtifactKey, blob: bytes) -> str:
        """Write one encoded artifact (`encode`) for `key`, atomically; returns its path in the store."""
        self._files.write(key.path, blob)
        return key.path

    def put_new(self, path: str, data: bytes) -> bool:
        """Write `data` at `path` in the store unless something is there (first write wins); True when
        this write made the file. For records beside the artifacts (``deployments.attention_choices``)."""
        return self._files.write_new(path, data)

    def read(self, path: str) -> Optional[bytes]:
        """The bytes at `path` in the store, None when there are none."""
        return self._files.read(path)

    def list_files(self, directory: str, suffix: str) -> List[str]:
        """The paths of the files ``*<suffix>`` in `directory` of the store, newest first."""
        return self._files.list(directory, suffix)

    def get(self, key: ArtifactKey) -> Lookup:
        blob = self._files.read(key.path)
        if blob is not None:
            try:
                return Lookup("hit", decode(blob, expected=key))
            except ArtifactFormatError as exc:
                self._warn(key.path, exc)
        reasons = self.mismatch_reasons(key)
        return Lookup("mismatch", reasons=reasons) if reasons else Lookup("miss")

    def mismatch_reasons(self, key: ArtifactKey) -> List[str]:
        """How the artifacts stored for `key`'s model and shape differ from `key`: the fields of the
        nearest one (`ArtifactKey.nearest_diff`), read from headers only."""
        return key.nearest_diff(self._stored_keys(key))

    def _stored_keys(self, key: ArtifactKey) -> Iterator[ArtifactKey]:
        """The keys of the other artifacts stored for `key`'s model and shape (at most `max_candidates`
        files; unreadable headers are warned about and skipped)."""
        for path in self._files.list(key.slot)[: self.max_candidates]:
            if path == key.path:
                continue
            prefix = self._files.read(path, _HEADER.size)
            try:
                yield read_key(self._files.read(path, header_bytes(prefix or b"")) or b"")
            except ArtifactFormatError as exc:
                self._warn(path, exc)

    def _warn(self, path: str, exc: Exception) -> None:
        if path not in self._warned:  # one warning per file
            self._warned.add(path)
            logger.warning("compile cache %s: ignoring %s: %s", self.root, path, exc)


def open_store(root: Optional[str]) -> Optional[ArtifactStore]:
    """`ArtifactStore` for `root`, None for None or ""."""
    return ArtifactStore(root) if root else None


def weights_store_root(quantized_weights_cache: Optional[str]) -> Optional[str]:
    """The app arg ``quantized_weights_cache`` -> where a replica's quantized transformers persist
    (`bcg.runtime.weights_store`; each replica reads and writes it itself): None is
    ``<temp dir>/bcg-quantized-weights`` on the replica's node, "off" nowhere, anything else that directory
    or URI (every replica of a node, or of the cluster for a shared URI, reloads what the first wrote)."""
    if quantized_weights_cache is None:
        return os.path.join(tempfile.gettempdir(), "bcg-quantized-weights")
    return None if quantized_weights_cache.strip().lower() in ("", "off", "none") else quantized_weights_cache


class CompileArtifacts:
    """This process's compiled code, through torch's mega cache. `save` returns every artifact this
    process compiled (or loaded and used) so far, cumulatively; `load` fills torch's caches so the
    next compile of the same graphs reads them instead of compiling."""

    def save(self) -> Optional[bytes]:
        import torch
        saved = torch.compiler.save_cache_artifacts()
        return None if saved is None else saved[0]

    def load(self, payload: bytes) -> dict:
        """Load `payload`; returns ``{"artifacts": count}``, raises ValueError when torch refuses it."""
        import torch
        t0 = time.perf_counter()
        info = torch.compiler.load_cache_artifacts(payload)
        if info is None:
            raise ValueError("torch could not read the artifacts (another torch version?)")
        count = sum(len(v) for v in getattr(info, "artifacts", {}).values())
        return {"artifacts": count, "load_ms": (time.perf_counter() - t0) * 1e3}
