"""Kernels with tuned launch configurations: :class:`TunedKernel` selects the bucket matching
a call's shape and launches with that bucket's fixed config, or with the best of its
candidates, measured once per (bucket, dtype, size class) on the GPU. Under the interpreter
nothing is benchmarked: the first candidate is used."""

from __future__ import annotations

import contextlib
import logging
from typing import Callable, Sequence

import torch

from gemslib.runtime import configs, env, state
from gemslib.runtime.configs import Bucket, LaunchConfig, TuneConfigError, active_configs
from gemslib.runtime.env import DIRECT_LAUNCH, quiet_interpreter
from gemslib.runtime.launch import launch_kept, launch_key
from gemslib.runtime.plans import clear_call_plans

log = logging.getLogger("gemslib")

KERNELS: dict[str, TunedKernel] = {}  # "op.name" -> kernel, every one declared


class TunedKernel:
    """A Triton kernel whose constexpr ``tunables`` and launch options come from the config files.

    ``launcher_knobs`` are config keys the launcher reads (in ``grid(meta)`` and its plan) that
    are not kernel parameters: they are not passed to the kernel, so they do not specialise its
    compilation. A config holds exactly ``tunables`` plus ``launcher_knobs``.

    ``shape_keys`` name the sizes a launcher passes to :meth:`launch`; buckets in the YAML are
    bounded by those names. The entry for kernel ``name`` of operator ``op`` lives under
    ``ops.<op>.<name>`` in the config file.

    ``cluster_knob``: the launcher knob whose value is the number of CTAs in a thread-block
    cluster (Triton's ``num_ctas`` compile option), for kernels written for clusters.

    ``device_asserts``: the kernel's ``tl.device_assert`` checks of its inputs' values (which
    Triton compiles only in debug mode) are compiled in, without debug mode's integer-overflow
    checks. A failed one stops the kernel with a device-side assert, which torch reports at
    the next synchronisation (and which leaves the CUDA context unusable, as torch's own do).

    ``dependent_launch``: the kernel has a ``PDL`` constexpr and, where it is set, calls
    ``gdc_wait()`` before its first load or store; :func:`dependent_launch_here` says whether
    it is then set and the kernel launched with Triton's ``launch_pdl``; such a kernel also has
    a ``PDL_EARLY`` constexpr, set where :func:`early_dependents_here` says: right after its
    wait it calls ``gdc_launch_dependents()``, and before it, it may prefetch what no kernel
    before it writes (a GEMV's weights).
    """

    def __init__(self, op: str, name: str, fn, tunables: Sequence[str], shape_keys: Sequence[str],
                 launcher_knobs: Sequence[str] = (), cluster_knob: str | None = None,
                 device_asserts: bool = False, dependent_launch: bool = False):
        self.op, self.name, self.fn = op, name, fn
        self.launcher_knobs = frozenset(launcher_knobs)
        if cluster_knob is not None and cluster_knob not in self.launcher_knobs:
            raise ValueError(f"{name}: cluster_knob {cluster_knob!r} must be one of the "
                             f"launcher_knobs {sorted(self.launcher_knobs)}")
        self.cluster_knob = cluster_knob
        self.tunables = frozenset(tunables) | self.launcher_knobs  # every key of a config
        self.shape_keys = tuple(shape_keys)
        self.options = {"debug": True, "sanitize_overflow": False} if device_asserts else {}
        self.dependent_launch = dependent_launch
        self._chosen: dict[tuple, LaunchConfig] = {}
        self._checked: set[str] = set()
        self._forced: LaunchConfig | None = None
        self._recording: list[tuple[int, ...]] | None = None  # shapes seen inside forced()
        self._kernel_kwargs: dict[LaunchConfig, dict[str, int]] = {}
        self._compiled: dict[tuple, tuple] = {}  # replay key -> (launcher, constexprs)
        KERNELS[f"{op}.{name}"] = self

    def clear_cache(self) -> None:
        clear_call_plans()
        self._chosen.clear()
        self._checked.clear()
        self._kernel_kwargs.clear()
        self._compiled.clear()

    @contextlib.contextmanager
    def forced(self, config: LaunchConfig):
        """Launch every call with ``config`` inside the block (for sweeps and the tuner).

        Yields a list that collects the shapes (in ``shape_keys`` order) of the calls made in
        the block, launched or planned, in order: how the tuner learns which bucket a problem
        reaches, even when ``config`` cannot run there."""
        names = set(config.meta_dict)
        if names != self.tunables:
            raise ValueError(f"{self.name}: config parameters {sorted(names)} do not match the "
                             f"kernel's tunables {sorted(self.tunables)}")
        previous, self._forced = self._forced, config
        outer, self._recording = self._recording, []
        state.forcing += 1
        try:
            yield self._recording
        finally:
            state.forcing -= 1
            self._forced, self._recording = previous, outer

    def buckets(self) -> tuple[Bucket, ...]:
        for config_file in active_configs():
            buckets = config_file.ops.get(self.op, {}).get(self.name)
            if buckets is not None:
                return buckets
        selected, default = active_configs()
        raise TuneConfigError(f"no launch config for ops.{self.op}.{self.name} in "
                              f"{selected.path} or {default.path}")

    def _check_bucket(self, bucket: Bucket) -> None:
        if bucket.where in self._checked:
            return
        if bucket.max is not None:
            unknown = set(bucket.max) - set(self.shape_keys)
            if unknown:
                raise TuneConfigError(f"tune config {bucket.where}.max: unknown shape keys "
                                      f"{sorted(unknown)} (kernel {self.name} has {list(self.shape_keys)})")
        for config in bucket.configs:
            names = set(config.meta_dict)
            if names != self.tunables:
                raise TuneConfigError(
                    f"tune config {bucket.where}: parameters {sorted(names)} do not match kernel "
                    f"{self.name}'s tunables {sorted(self.tunables)}")
        self._checked.add(bucket.where)

    def select(self, shape: Sequence[int]) -> tuple[int, Bucket]:
        """The first bucket whose bounds admit ``shape`` (given in ``shape_keys`` order)."""
        named = dict(zip(self.shape_keys, shape))
        for index, bucket in enumerate(self.buckets()):
            self._check_bucket(bucket)
            if bucket.matches(named):
                return index, bucket
        raise AssertionError("unreachable: the last bucket has no bound")

    def launch(self, grid: Callable[[dict], tuple], *args, shape: Sequence[int],
               restore: Sequence[torch.Tensor] = (), config: LaunchConfig | None = None) -> None:
        """Launch on ``grid(meta)`` with the config chosen for ``shape``.

        ``restore`` lists tensors the kernel overwrites that are also inputs (in-place calls):
        they are saved and restored around autotuning runs. ``config`` forces a config (tuner).
        """
        workload = state.workload
        if workload is not None:
            workload.launches.append((self, tuple(int(size) for size in shape)))
        if config is None:
            config = self._forced
            if config is not None:
                self._recording.append(tuple(shape))
        if config is None:
            key = tuple(shape)
            config = self._chosen.get(key)
            if config is None:
                config = self._choose(grid, args, shape, restore)
                if len(self._chosen) < 4096:
                    self._chosen[key] = config
        if DIRECT_LAUNCH.on and not env.INTERPRETER:
            grid_size = tuple(grid(config.meta_dict))
            key, launch_args = launch_key(config, grid_size, args)
            if key is not None:
                self.replay(key, config, grid_size, args, launch_args)
                return
        self.run(config, grid, args)

    def planned_config(self, shape: Sequence[int]) -> LaunchConfig:
        """The config a call of ``shape`` runs with when the bucket has one (or one is forced);
        for an autotuned bucket, its first candidate (the choice is made at launch)."""
        workload = state.workload
        if workload is not None:  # a call routed by its config may launch nothing of ours
            workload.launches.append((self, tuple(int(size) for size in shape)))
        if self._forced is not None:
            self._recording.append(tuple(shape))
            return self._forced
        key = ("planned", *shape)
        config = self._chosen.get(key)
        if config is None:
            config = self.select(shape)[1].configs[0]
            if len(self._chosen) < 4096:
                self._chosen[key] = config
        return config

    def config_for(self, shape: Sequence[int]) -> LaunchConfig | None:
        """The config a call of ``shape`` would use, if already decided (for reports)."""
        return self._forced or self._chosen.get(tuple(shape))

    def kernel_kwargs(self, config: LaunchConfig) -> dict[str, int]:
        """What the kernel's launch takes from ``config``: its constexprs (the launcher's knobs
        left out), num_warps, num_stages, num_ctas (from ``cluster_knob``) and the kernel's
        compile options."""
        kwargs = self._kernel_kwargs.get(config)
        if kwargs is None:
            kwargs = {key: value for key, value in config.launch_kwargs.items()
                      if key not in self.launcher_knobs}
            if self.cluster_knob is not None:
                kwargs["num_ctas"] = config.meta_dict[self.cluster_knob]
            kwargs.update(self.options)
            if self.dependent_launch:
                kwargs["PDL"] = env.dependent_launch_here()
                if kwargs["PDL"]:
                    kwargs["launch_pdl"] = True
                    kwargs["PDL_EARLY"] = env.early_dependents_here()
            if len(self._kernel_kwargs) < 4096:
                self._kernel_kwargs[config] = kwargs
        return kwargs

    def run(self, config: LaunchConfig, grid, args) -> None:
        state.not_plannable()
        if env.INTERPRETER:
            with quiet_interpreter():
                self.fn[grid(config.meta_dict)](*args, **self.kernel_kwargs(config))
            return
        self.fn[grid(config.meta_dict)](*args, **self.kernel_kwargs(config))

    def replay(self, key: tuple, config: LaunchConfig, grid: tuple[int, ...], args,
               launch_args) -> None:
        """:meth:`run` for a launch that repeats every step with new tensors (decode).

        ``key`` determines the config, the grid, every argument that is not a tensor and each
        tensor's dtype and alignment, and ``launch_args`` are ``args`` with the tensors' data
        pointers in their place (:func:`launch_key` makes both; :func:`tensor_key` gives the
        tensors' part). The first call with a key goes through Triton and keeps the compiled
        kernel; later calls hand it to the compiled launcher directly on the current stream,
        skipping Triton's argument binding, heuristics, cache lookup and launcher wrapper,
        which are most of a small launch's host time. Kept only where every parameter after
        ``args`` is a constexpr the config or a heuristic of the key's values gives (a
        default left to Triton would be missing from the direct launch) and the kernel needs
        no scratch memory; with a launch hook installed (a profiler), Triton's own launch
        runs, so the hook sees it.
        """
        if env.INTERPRETER:
            self.run(config, lambda meta: grid, args)
            return
        launch_kept(self._compiled, key, self.fn, grid, args, lambda: self.kernel_kwargs(config),
                     launch_args)

    def _choose(self, grid, args, shape, restore) -> LaunchConfig:
        index, bucket = self.select(shape)
        if not bucket.autotune or len(bucket.configs) == 1 or env.INTERPRETER:
            return bucket.configs[0]
        dtypes = tuple(a.dtype for a in args if isinstance(a, torch.Tensor))
        size_class = tuple(1 << max(int(s) - 1, 0).bit_length() for s in shape)
        key = ("autotune", index, dtypes, size_class)
        if key not in self._chosen:
            self._chosen[key] = self._autotune(bucket, grid, args, restore)
        return self._chosen[key]

    def _autotune(self, bucket: Bucket, grid, args, restore) -> LaunchConfig:
        import triton.testing

        saved = [t.clone() for t in restore]
        timings = []
        for config in bucket.configs:
            try:
                ms = triton.testing.do_bench(lambda: self.run(config, grid, args),
                                             warmup=5, rep=25, return_mode="median")
            except Exception as err:  # a candidate that does not compile (resources) is skipped
                log.debug("gemslib autotune %s: %s failed: %s", self.name, config, err)
                continue
            finally:
                for tensor, copy in zip(restore, saved):
                    tensor.copy_(copy)
            timings.append((ms, config))
        if not timings:
            raise RuntimeError(f"gemslib: no candidate config of {bucket.where} runs on this GPU")
        best = min(timings, key=lambda item: item[0])[1]
        log.debug("gemslib autotune %s: picked %s", self.name, best.launch_kwargs)
        return best


def reload_configs() -> None:
    """Forget loaded files and chosen configs (after changing ``GEMSLIB_TUNE_CONFIG``)."""
    configs.forget_loaded()
    for kernel in KERNELS.values():
        kernel.clear_cache()

