"""Quantized weights produced once and reloaded as they are: `WeightsKey`, `WeightsStore`.

A module's state after quantization (torchao's float8 weights are tensor subclasses: their data and
scales travel inside them) is written once to a store and loaded by the next process instead of reading
the model's own weights and quantizing them again. Contract:

* `WeightsKey`: everything that makes a stored state valid for a module: what it is *for* (``name``: the
  model and component) and what it was made *under* (``fields``: the model files' identity, the quantize
  configuration and its format version, torch's and torchao's versions, the device type, name and compute
  capability). Its ``digest`` names the file; ``diff`` says which fields differ from another key's.
* One entry is one ``torch.save`` file (zip format): ``{"format", "key", "meta", "state_dict",
  "buffers", "frozen"}``; ``buffers`` holds the module's non-persistent buffers, so a module built without
  weights (on the meta device) is whole after a load; ``frozen`` the parameters that need no gradient. `load_into` reads it with ``torch.load(mmap=True,
  weights_only=True, map_location=device)``: tensors go straight from the mapped file to the device and
  the module's tensors are replaced (``load_state_dict(assign=True)``), not copied into. No pickled code
  runs: the globals such an entry holds beyond torch's own (a quantized tensor's class and its settings)
  are allowed only where they come from a ``trusted`` package (default: torchao), found in the file before
  it is loaded (``torch.serialization.get_unsafe_globals_in_checkpoint``); any other makes it a miss.
* Writes are atomic: the file is written and synced under a temporary name, then linked into place
  (`put`: the first write of a key wins, a racing writer's copy is dropped); readers see a whole file
  or none. A root that is a URI (``s3://bucket/prefix``; fsspec) is written by a temporary name and a
  move, and read through a local copy (``cache_dir``), since a memory map needs a local file.
* Nothing here raises into a load for a bad entry: `load_into` answers None (a miss) and logs one
  warning for a torn, foreign or refused file; the caller quantizes afresh.

Torch only; no diffusers (the model files' identity is the caller's, `bcg.diffusers.models`).
"""
from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import importlib
import json
import logging
import os
import re
import tempfile
import time
import uuid
from typing import Any, Mapping, Optional

import torch

logger = logging.getLogger(__name__)

__all__ = ["FORMAT_VERSION", "WeightsKey", "WeightsStore", "environment_fields", "open_weights_store"]

FORMAT_VERSION = 1
SUFFIX = ".bcgw"


def _canonical(value) -> str:
    return json.dumps(value, sort_keys=True, separators=(",", ":"), default=str)


def _safe(text: str) -> str:
    return re.sub(r"[^A-Za-z0-9._-]+", "_", text).strip("_") or "_"


@dataclasses.dataclass(frozen=True)
class WeightsKey:
    """What a stored state is valid for (see the module docstring)."""

    name: str
    fields: tuple  # sorted (field, JSON value) pairs

    @classmethod
    def make(cls, name: str, fields: Mapping) -> "WeightsKey":
        normal = json.loads(_canonical(dict(fields)))  # JSON values only: equal after a round trip
        return cls(str(name), tuple(sorted(normal.items())))

    def as_dict(self) -> dict:
        return {"name": self.name, "fields": dict(self.fields)}

    @property
    def digest(self) -> str:
        return hashlib.sha256(_canonical(self.as_dict()).encode()).hexdigest()[:24]

    @property
    def path(self) -> str:
        return f"{_safe(self.name)}/{self.digest}{SUFFIX}"

    def diff(self, other: "WeightsKey") -> list[str]:
        """Readable differences, ``"torch: '2.11.0' here, '2.13.0' there"``; [] when equal."""
        out = [f"name: {self.name!r} here, {other.name!r} there"] if self.name != other.name else []
        mine, theirs = dict(self.fields), dict(other.fields)
        for name in sorted(set(mine) | set(theirs)):
            if mine.get(name, "<absent>") != theirs.get(name, "<absent>"):
                out.append(f"{name}: {mine.get(name, '<absent>')!r} here, {theirs.get(name, '<absent>')!r} there")
        return out


def environment_fields(device) -> dict:
    """torch's and torchao's versions and the device the weights live on (CUDA: its name and compute
    capability, which decide the float8 kernels)."""
    try:
        from importlib.metadata import version
        torchao = version("torchao")
    except Exception:  # noqa: BLE001 -- not installed: nothing it made can be stored anyway
        torchao = None
    device = torch.device(device if device is not None else "cpu")
    fields = {"torch": torch.__version__, "torchao": torchao, "device_type": device.type}
    if device.type == "cuda":
        index = device.index if device.index is not None else torch.cuda.current_device()
        fields["device_name"] = torch.cuda.get_device_name(index)
        fields["capability"] = "%d.%d" % torch.cuda.get_device_capability(index)
    return fields


class WeightsStore:
    """Stored module states under `root`: a local directory, or a URI fsspec opens (read through a local
    copy in `cache_dir`, default ``<temp dir>/bcg-weights-copies``). See the module docstring."""

    def __init__(self, root: str, cache_dir: Optional[str] = None, trusted: tuple = ("torchao.",)):
        self.root = str(root)
        self.trusted = tuple(trusted)  # module prefixes whose classes an entry may hold (module docstring)
        self.remote = "://" in self.root
        if self.remote:
            try:
                import fsspec
            except ImportError:
                raise ImportError(f"quantized weights store {root!r} needs fsspec: pip install 'bcg-serve[cache]' "
                                  "(and the filesystem's own package, e.g. s3fs for s3://)") from None
            self._fs, self._base = fsspec.core.url_to_fs(self.root)
            self._base = self._base.rstrip("/")
            self.cache_dir = cache_dir or os.path.join(tempfile.gettempdir(), "bcg-weights-copies")
        else:
            self._base = os.path.abspath(os.path.expanduser(self.root))
            self.cache_dir = None

    def __repr__(self):
        return f"WeightsStore({self.root!r})"

    # -- files -------------------------------------------------------------------------------------

    def has(self, key: WeightsKey) -> bool:
        if self.remote:
            return bool(self._fs.exists(f"{self._base}/{key.path}"))
        return os.path.isfile(os.path.join(self._base, key.path))

    def _local_path(self, key: WeightsKey) -> Optional[str]:
        """A local file holding the entry of `key` (a remote one copied first, once), or None."""
        if not self.remote:
            path = os.path.join(self._base, key.path)
            return path if os.path.isfile(path) else None
        local = os.path.join(self.cache_dir, key.path)
        if os.path.isfile(local):
            return local
        remote = f"{self._base}/{key.path}"
        if not self._fs.exists(remote):
            return None
        os.makedirs(os.path.dirname(local), exist_ok=True)
        tmp = f"{local}.tmp-{uuid.uuid4().hex}"
        try:
            self._fs.get_file(remote, tmp)
            os.replace(tmp, local)
        finally:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(tmp)
        return local

    def put(self, key: WeightsKey, module: torch.nn.Module, meta: Optional[Mapping] = None) -> bool:
        """Write `module`'s state for `key` unless an entry is there already; True when this call wrote it.
        Raises what the filesystem raises (a full disk): the caller decides whether that matters."""
        entry = {"format": FORMAT_VERSION, "key": key.as_dict(), "meta": dict(meta or {}),
                 "state_dict": module.state_dict(), "buffers": _non_persistent_buffers(module),
                 # quantized weights are parameters that need no gradient (torchao's): so they come back
                 "frozen": [name for name, p in module.named_parameters() if not p.requires_grad]}
        if self.remote:
            target = f"{self._base}/{key.path}"
            if self._fs.exists(target):
                return False
            directory = target.rsplit("/", 1)[0]
            self._fs.makedirs(directory, exist_ok=True)
            tmp = f"{directory}/.tmp-{uuid.uuid4().hex}{SUFFIX}"
            with self._fs.open(tmp, "wb") as f:
                torch.save(entry, f)
            try:
                self._fs.mv(tmp, target)  # object stores: the copy appears whole or not at all
            except BaseException:
                with contextlib.suppress(Exception):
                    self._fs.rm(tmp)
                raise
            return True
        target = os.path.join(self._base, key.path)
        os.makedirs(os.path.dirname(target), exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=os.path.dirname(target), prefix=".tmp-", suffix=SUFFIX)
        try:
            with os.fdopen(fd, "wb") as f:
                torch.save(entry, f)
                f.flush()
                os.fsync(f.fileno())
            try:
                os.link(tmp, target)  # fails when the name exists: of racing writers exactly one wins
            except FileExistsError:
                return False
            return True
        finally:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(tmp)

    # -- loading -----------------------------------------------------------------------------------

    def load_into(self, module: torch.nn.Module, key: WeightsKey, device=None, prepare=None) -> Optional[dict]:
        """Replace `module`'s tensors by the entry of `key`, straight to `device` (default: where the
        entry's tensors were); returns the entry's ``meta`` with ``seconds`` (the load) and ``path``, or
        None when there is no usable entry (a miss; a bad file is warned about once). A module built on
        the meta device is whole afterwards. `prepare(module, state_dict)`, when given, runs once the entry
        is read and found valid, before its tensors are assigned (a form that adds tensors to the module)."""
        t0 = time.perf_counter()
        path = self._local_path(key)
        if path is None:
            return None
        before = _snapshot(module)
        try:
            entry = _load_trusting(path, device, self.trusted)
            problem = _entry_problem(entry, key)
            if problem is None:
                if prepare is not None:
                    prepare(module, entry["state_dict"])
                module.load_state_dict(entry["state_dict"], strict=True, assign=True)
                for name, tensor in entry["buffers"].items():
                    owner, _, leaf = name.rpartition(".")
                    module.get_submodule(owner).register_buffer(leaf, tensor, persistent=False)
                for name in entry.get("frozen", ()):
                    module.get_parameter(name).requires_grad_(False)
                left = [n for n, t in _tensors(module) if t.is_meta]
                if left:
                    problem = f"the entry leaves {len(left)} tensors without values (e.g. {left[0]!r})"
        except Exception as exc:  # noqa: BLE001 -- a torn, foreign or refused file is a miss
            problem = f"{type(exc).__name__}: {exc}"
        if problem is not None:
            # a miss leaves the module as it came (layers `prepare` swapped in, tensors assigned before the
            # failure), so what the caller does next (quantize it) starts from its own weights
            _restore(before)
            logger.warning("quantized weights store %s: ignoring %s: %s", self.root, key.path, problem)
            return None
        seconds = time.perf_counter() - t0
        logger.info("%s: reloaded from %s in %.2f s", type(module).__name__, path, seconds)
        return {**entry["meta"], "seconds": seconds, "path": path}


def _snapshot(module: torch.nn.Module) -> list:
    """Each submodule's children, parameters and buffers as they are (references, no copies)."""
    return [(m, dict(m._modules), dict(m._parameters), dict(m._buffers), set(m._non_persistent_buffers_set))
            for m in module.modules()]


def _restore(snapshot: list) -> None:
    """Put back what `_snapshot` saw: a failed load's swapped layers and assigned tensors undone."""
    for m, children, parameters, buffers, non_persistent in snapshot:
        for held, saved in ((m._modules, children), (m._parameters, parameters), (m._buffers, buffers),
                            (m._non_persistent_buffers_set, non_persistent)):
            held.clear()
            held.update(saved)


def _load_trusting(path: str, device, trusted: tuple):
    """``torch.load(weights_only=True)`` of `path` with the globals it holds allowed where they come from a
    `trusted` package; ValueError naming them where one does not."""
    names = torch.serialization.get_unsafe_globals_in_checkpoint(path)
    untrusted = [n for n in names if not n.startswith(trusted)]
    if untrusted:
        raise ValueError(f"it holds globals from untrusted packages: {untrusted[:3]}")
    allowed = []
    for name in names:
        module, _, attr = name.rpartition(".")
        allowed.append(getattr(importlib.import_module(module), attr))
    with torch.serialization.safe_globals(allowed):
        return torch.load(path, mmap=True, weights_only=True, map_location=indexed_device(device))


def indexed_device(device) -> Optional[torch.device]:
    """`device` with its index (``"cuda"`` is the current CUDA device, ``cuda:0``; None stays None): tensors
    loaded to an index-less ``cuda`` and assigned into a module on ``cuda:0`` are refused by torch ("Attempted to
    set the storage of a tensor on device cuda:0 to a storage on different device cuda", H100, torch 2.11)."""
    if device is None:
        return None
    device = torch.device(device)
    if device.type == "cuda" and device.index is None and torch.cuda.is_available():
        return torch.device("cuda", torch.cuda.current_device())
    return device


def _tensors(module: torch.nn.Module):
    yield from module.named_parameters()
    yield from module.named_buffers()


def _non_persistent_buffers(module: torch.nn.Module) -> dict:
    """The buffers `state_dict` leaves out (``persistent=False``), by qualified name."""
    persistent = set(module.state_dict(keep_vars=True))
    return {name: tensor for name, tensor in module.named_buffers() if name not in persistent}


def _entry_problem(entry: Any, key: WeightsKey) -> Optional[str]:
    if not isinstance(entry, dict) or not {"format", "key", "state_dict", "buffers"} <= set(entry):
        return "not a weights entry (foreign file)"
    if entry["format"] != FORMAT_VERSION:
        return f"format version {entry['format']}, this code reads {FORMAT_VERSION}"
    try:
        stored = WeightsKey.make(entry["key"]["name"], entry["key"]["fields"])
    except (KeyError, TypeError):
        return "its key is unreadable (corrupted)"
    if stored != key:
        return "made for another key: " + "; ".join(key.diff(stored))
    return None


def open_weights_store(root: Optional[str]) -> Optional[WeightsStore]:
    """`WeightsStore` for `root`, None for None, "" or "off"."""
    if root is None or str(root).strip().lower() in ("", "off", "none"):
        return None
    return WeightsStore(root)
