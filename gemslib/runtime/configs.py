"""The tune-config files: their schema (``tune_configs/README.md``), validation, and which
file is in use (:func:`config_choice`): ``GEMSLIB_TUNE_CONFIG=path`` explicitly; else the
device's ``<name>.yaml`` tuned on this machine (``python -m gemslib.tune --user``, in gemslib's
cache), else shipped; else the shipped file of the nearest GPU of the same compute capability;
else ``default.yaml``. A malformed file raises :class:`TuneConfigError` naming the file and
the key."""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import logging
import os
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Mapping

import yaml

from gemslib.runtime import env
from gemslib.runtime.cuda import device_name

log = logging.getLogger("gemslib.runtime")

CONFIG_ENV = "GEMSLIB_TUNE_CONFIG"
SCHEMA_VERSION = 1
_LAUNCH_KEYS = ("num_warps", "num_stages")


class TuneConfigError(ValueError):
    """A tune-config file is malformed or does not fit the kernel it configures."""


@dataclass(frozen=True)
class LaunchConfig:
    """Meta-parameters (constexpr block sizes) plus Triton's launch options."""

    meta: tuple[tuple[str, int], ...]
    num_warps: int = 4
    num_stages: int = 1

    @functools.cached_property
    def meta_dict(self) -> dict[str, int]:
        return dict(self.meta)

    @functools.cached_property
    def launch_kwargs(self) -> dict[str, int]:
        """What the Triton launch takes: meta-parameters plus num_warps and num_stages."""
        return {**self.meta_dict, "num_warps": self.num_warps, "num_stages": self.num_stages}


@dataclass(frozen=True)
class Bucket:
    """Configs for the calls whose shape keys are all <= ``max`` (``None``: every call)."""

    max: Mapping[str, int] | None
    configs: tuple[LaunchConfig, ...]
    autotune: bool
    where: str  # "file: ops.silu.silu_fwd[0]", for error messages

    def matches(self, shape: Mapping[str, int]) -> bool:
        return within(self.max, shape)


def within(bound: Mapping[str, int] | None, shape: Mapping[str, int]) -> bool:
    """Whether a bucket's ``max`` admits the call: ``shape[key] <= bound[key]`` for every key
    of ``bound`` (``None``: no bound, every call)."""
    return bound is None or all(shape[k] <= v for k, v in bound.items())


@dataclass(frozen=True)
class TuneConfigFile:
    path: Path
    device: str
    ops: Mapping[str, Mapping[str, tuple[Bucket, ...]]]
    # fusion -> ((max or None, "gemslib" or "inductor"), ...): which path was measured faster
    verdicts: Mapping[str, tuple[tuple[Mapping[str, int] | None, str], ...]] = \
        dataclasses.field(default_factory=dict)


VERDICT_PATHS = ("gemslib", "inductor")


def _parse_verdicts(path: Path, raw: Any) -> dict[str, tuple]:
    """``verdicts: {fusion: [{max: {rows: .., cols: ..}, use: gemslib|inductor}, ...]}``: per
    fusion of the graph passes, buckets tried in order like a kernel's, the last without max."""
    if not isinstance(raw, dict):
        raise _fail(path, "verdicts", f"expected a mapping of fusions, got {raw!r}")
    verdicts = {}
    for fusion, buckets in raw.items():
        where = f"verdicts.{fusion}"
        if not isinstance(buckets, list) or not buckets:
            raise _fail(path, where, "expected a non-empty list of buckets")
        parsed = []
        for i, bucket in enumerate(buckets):
            here = f"{where}[{i}]"
            if not isinstance(bucket, dict) or set(bucket) - {"max", "use"} or "use" not in bucket:
                raise _fail(path, here, f"expected {{max: {{...}}, use: gemslib|inductor}}, "
                                        f"got {bucket!r}")
            if bucket["use"] not in VERDICT_PATHS:
                raise _fail(path, f"{here}.use", f"expected one of {', '.join(VERDICT_PATHS)}, "
                                                 f"got {bucket['use']!r}")
            bound = _parse_bound(path, f"{here}.max", bucket["max"]) if "max" in bucket else None
            parsed.append((bound, bucket["use"]))
        if parsed[-1][0] is not None:
            raise _fail(path, f"{where}[{len(parsed) - 1}]",
                        "the last bucket must have no 'max' so that every shape has a verdict")
        verdicts[fusion] = tuple(parsed)
    return verdicts


def _fail(path: Path, where: str, message: str) -> TuneConfigError:
    return TuneConfigError(f"tune config {path}: {where}: {message}")


def _positive_int(path: Path, where: str, value: Any, minimum: int = 1) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        kind = "a positive integer" if minimum == 1 else f"an integer >= {minimum}"
        raise _fail(path, where, f"expected {kind}, got {value!r}")
    return value


def parse_launch_config(path: Path, where: str, raw: Any) -> LaunchConfig:
    """One config (a mapping of meta-parameters, num_warps, num_stages), validated; errors
    name ``path`` and ``where``."""
    if not isinstance(raw, dict) or not raw:
        raise _fail(path, where, f"expected a mapping of parameters, got {raw!r}")
    meta = []
    for key, value in raw.items():
        if not isinstance(key, str):
            raise _fail(path, where, f"parameter names must be strings, got {key!r}")
        # meta-parameters may be 0 (a kernel's way to say "off", e.g. softmax_split_fwd CHUNK)
        _positive_int(path, f"{where}.{key}", value, minimum=1 if key in _LAUNCH_KEYS else 0)
        if key not in _LAUNCH_KEYS:
            meta.append((key, value))
    num_warps = raw.get("num_warps", 4)
    if num_warps & (num_warps - 1) or num_warps > 32:
        raise _fail(path, f"{where}.num_warps", f"expected a power of two <= 32, got {num_warps}")
    return LaunchConfig(meta=tuple(sorted(meta)), num_warps=num_warps,
                        num_stages=raw.get("num_stages", 1))


def _parse_bound(path: Path, where: str, raw: Any) -> dict[str, int]:
    """A bucket's ``max``: shape key -> bound, each an integer >= 0 (0: a flag off)."""
    if not isinstance(raw, dict) or not raw:
        raise _fail(path, where, f"expected a mapping of shape keys, got {raw!r}")
    return {k: _positive_int(path, f"{where}.{k}", v, minimum=0) for k, v in raw.items()}


def _parse_bucket(path: Path, where: str, raw: Any) -> Bucket:
    if not isinstance(raw, dict):
        raise _fail(path, where, f"expected a mapping with 'config' or 'autotune', got {raw!r}")
    unknown = set(raw) - {"max", "config", "autotune"}
    if unknown:
        raise _fail(path, where, f"unknown keys {sorted(unknown)} (allowed: max, config, autotune)")
    if ("config" in raw) == ("autotune" in raw):
        raise _fail(path, where, "needs exactly one of 'config' (fixed) or 'autotune' (candidates)")
    bound = _parse_bound(path, f"{where}.max", raw["max"]) if "max" in raw else None
    if "config" in raw:
        configs = (parse_launch_config(path, f"{where}.config", raw["config"]),)
    else:
        candidates = raw["autotune"]
        if not isinstance(candidates, list) or not candidates:
            raise _fail(path, f"{where}.autotune", "expected a non-empty list of configs")
        configs = tuple(parse_launch_config(path, f"{where}.autotune[{i}]", c)
                        for i, c in enumerate(candidates))
    return Bucket(max=bound, configs=configs, autotune="autotune" in raw, where=f"{path}: {where}")


def parse_tune_config(path: Path, data: Any) -> TuneConfigFile:
    """Validate the YAML document ``data`` read from ``path``; see tune_configs/README.md."""
    if not isinstance(data, dict):
        raise _fail(path, "<top level>", f"expected a mapping, got {type(data).__name__}")
    for key in ("schema", "device", "ops"):
        if key not in data:
            raise _fail(path, key, "missing")
    unknown = set(data) - {"schema", "device", "source", "tuned", "ops", "verdicts"}
    if unknown:
        raise _fail(path, "<top level>", f"unknown keys {sorted(unknown)}")
    if data["schema"] != SCHEMA_VERSION:
        raise _fail(path, "schema", f"expected {SCHEMA_VERSION}, got {data['schema']!r}")
    if "tuned" in data and not isinstance(data["tuned"], dict):
        raise _fail(path, "tuned", f"expected a mapping (gpu, torch, triton, date, ...), got "
                                   f"{data['tuned']!r}")
    if not isinstance(data["device"], str):
        raise _fail(path, "device", f"expected a string, got {data['device']!r}")
    if not isinstance(data["ops"], dict):
        raise _fail(path, "ops", f"expected a mapping of operators, got {data['ops']!r}")
    ops: dict[str, dict[str, tuple[Bucket, ...]]] = {}
    for op, kernels in data["ops"].items():
        if not isinstance(kernels, dict):
            raise _fail(path, f"ops.{op}", f"expected a mapping of kernels, got {kernels!r}")
        ops[op] = {}
        for kernel, buckets in kernels.items():
            where = f"ops.{op}.{kernel}"
            if not isinstance(buckets, list) or not buckets:
                raise _fail(path, where, "expected a non-empty list of buckets")
            parsed = tuple(_parse_bucket(path, f"{where}[{i}]", b) for i, b in enumerate(buckets))
            if parsed[-1].max is not None:
                raise _fail(path, f"{where}[{len(parsed) - 1}]",
                            "the last bucket must have no 'max' so that every shape has a config")
            ops[op][kernel] = parsed
    verdicts = _parse_verdicts(path, data["verdicts"]) if "verdicts" in data else {}
    return TuneConfigFile(path=path, device=data["device"], ops=ops, verdicts=verdicts)


def load_tune_config(path: str | os.PathLike) -> TuneConfigFile:
    path = Path(path)
    try:
        text = path.read_text()
    except OSError as err:
        raise TuneConfigError(f"tune config {path}: cannot read: {err}") from None
    try:
        data = yaml.safe_load(text)
    except yaml.YAMLError as err:
        raise TuneConfigError(f"tune config {path}: not valid YAML: {err}") from None
    return parse_tune_config(path, data)


def shipped_configs_dir() -> Path:
    from gemslib import tune_configs

    return Path(tune_configs.__file__).parent


_config_lock = threading.Lock()
_active: tuple[TuneConfigFile, TuneConfigFile] | None = None


_choice: tuple[tuple, tuple[Path, str]] | None = None  # (what decided it, (file, why))


def user_configs_dir() -> Path:
    """Where ``python -m gemslib.tune --user`` writes a GPU's file and gemslib looks for it
    first: ``<gemslib's cache>/tune_configs`` (``$GEMSLIB_CACHE_DIR``, or ~/.cache/gemslib)."""
    return env.cache_dir() / "tune_configs"


@dataclass(frozen=True)
class Hardware:
    """What decides which tuned file fits a GPU best, as a file's ``tuned:`` section records
    it: (major, minor) compute capability, multiprocessors, GiB of memory."""
    capability: tuple[int, int]
    multiprocessors: int
    memory_gib: float

    @classmethod
    def of_tuned(cls, tuned: Any) -> "Hardware | None":
        """From a file's ``tuned:`` mapping (``capability: '9.0'``, ``multiprocessors``,
        ``memory_gib``); None where it does not say."""
        try:
            major, minor = (int(part) for part in str(tuned["capability"]).split("."))
            return cls((major, minor), int(tuned["multiprocessors"]), float(tuned["memory_gib"]))
        except (KeyError, TypeError, ValueError):
            return None

    def distance(self, other: "Hardware") -> tuple[float, float]:
        """How far ``other`` is, for files of one capability: the relative difference in
        multiprocessors (what the grids fill), then in memory (its size follows its kind and
        bandwidth: HBM3 80 GB, HBM3e 141 GB)."""
        return (abs(self.multiprocessors - other.multiprocessors) / self.multiprocessors,
                abs(self.memory_gib - other.memory_gib) / self.memory_gib)


def current_hardware() -> Hardware | None:
    """The current GPU's :class:`Hardware`, or None under the interpreter or without a GPU."""
    import torch

    if env.INTERPRETER or not torch.cuda.is_available():
        return None
    props = torch.cuda.get_device_properties(torch.cuda.current_device())
    return Hardware((props.major, props.minor), props.multi_processor_count,
                    props.total_memory / 2**30)


def _shipped_hardware() -> dict[Path, Hardware]:
    """Each shipped GPU file's hardware, as its ``tuned:`` section records it."""
    found = {}
    for path in sorted(shipped_configs_dir().glob("*.yaml")):
        if path.name == "default.yaml":
            continue
        try:
            data = yaml.safe_load(path.read_text())
        except (OSError, yaml.YAMLError):
            continue
        hardware = Hardware.of_tuned(data.get("tuned")) if isinstance(data, dict) else None
        if hardware is not None:
            found[path] = hardware
    return found


def config_choice() -> tuple[Path, str]:
    """(the file in use, why that one), decided once per device and environment:

    1. ``$GEMSLIB_TUNE_CONFIG``;
    2. ``<device>.yaml`` in :func:`user_configs_dir` (tuned on this machine);
    3. ``<device>.yaml`` shipped in ``tune_configs/``;
    4. the shipped file of the same compute capability whose GPU is nearest
       (:meth:`Hardware.distance`): an H100 PCIe or an H800 takes the H100's, say;
    5. ``default.yaml``, which says how to tune this GPU.
    """
    global _choice
    explicit = os.environ.get(CONFIG_ENV)
    name = device_name()
    decided_by = (explicit, name, os.environ.get("GEMSLIB_CACHE_DIR"))
    if _choice is not None and _choice[0] == decided_by:
        return _choice[1]
    choice = _choose(explicit, name)
    if _choice is None or _choice[1] != choice:
        log.info("gemslib: tune config %s (%s)", choice[0], choice[1])
    _choice = (decided_by, choice)
    return choice


def _choose(explicit: str | None, name: str) -> tuple[Path, str]:
    if explicit:
        return Path(explicit), f"${CONFIG_ENV}"
    own = user_configs_dir() / f"{name}.yaml"
    if own.is_file():
        return own, f"tuned on this machine for {name}"
    shipped = shipped_configs_dir() / f"{name}.yaml"
    if shipped.is_file():
        return shipped, f"shipped for {name}"
    default = shipped_configs_dir() / "default.yaml"
    hardware = current_hardware()
    if hardware is None:
        return default, f"untuned defaults ({name})"
    same_kind = {path: other for path, other in _shipped_hardware().items()
                 if other.capability == hardware.capability}
    tune_hint = f"`python -m gemslib.tune --user` tunes this GPU into {user_configs_dir()}"
    sm = "sm_{}{}".format(*hardware.capability)
    if not same_kind:
        return default, f"untuned defaults: no tuned file for {name} nor any {sm} GPU; {tune_hint}"
    nearest = min(same_kind, key=lambda path: hardware.distance(same_kind[path]))
    return nearest, (f"no file for {name}: the nearest tuned {sm} GPU's ({nearest.stem}); "
                     f"{tune_hint}")


def config_path() -> Path:
    """The file in use (see :func:`config_choice`)."""
    return config_choice()[0]


def active_configs() -> tuple[TuneConfigFile, TuneConfigFile]:
    """(file in use, default.yaml); a kernel missing from the first is looked up in the second."""
    global _active
    with _config_lock:
        if _active is None:
            selected = load_tune_config(config_path())
            default_path = shipped_configs_dir() / "default.yaml"
            default = selected if selected.path == default_path else load_tune_config(default_path)
            _active = (selected, default)
        return _active


_verdicts_ignored = 0  # ignoring_verdicts() blocks open


@contextlib.contextmanager
def ignoring_verdicts():
    """Inside the block the file's verdicts are set aside: every fusion switched on is used
    wherever it applies (the tuner measuring both paths, whatever the file in use decided);
    one on only where measured is off unless switched on."""
    global _verdicts_ignored
    _verdicts_ignored += 1
    try:
        yield
    finally:
        _verdicts_ignored -= 1


VERDICTS_ENV = "GEMSLIB_VERDICTS"  # "0": the verdicts set aside, as in ignoring_verdicts()


def verdicts_ignored() -> bool:
    """Whether the file's verdicts are set aside: inside :func:`ignoring_verdicts`, or with
    ``GEMSLIB_VERDICTS=0`` (read at each call: it decides compiles, not launches)."""
    return bool(_verdicts_ignored) or os.environ.get(VERDICTS_ENV, "1").strip() == "0"


def fusion_verdict(fusion: str, shape: Mapping[str, int]) -> str | None:
    """``"gemslib"`` or ``"inductor"``: which path the file in use measured faster for
    ``fusion`` at ``shape`` (its ``verdicts``); None where it has no verdict for it there, or
    where :func:`verdicts_ignored`. A bucket bounding a key the shape does not give does not
    apply."""
    if verdicts_ignored():
        return None
    for bound, use in active_configs()[0].verdicts.get(fusion, ()):
        if bound is None or (set(bound) <= set(shape) and within(bound, shape)):
            return use
    return None


def forget_loaded() -> None:
    """Forget the loaded files and the choice: the next :func:`active_configs` makes it and
    reads them again."""
    global _active, _choice
    with _config_lock:
        _active = _choice = None
