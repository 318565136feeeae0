"""vLLM integration: the probe in every worker, the startup profile, and an opt-in reserved-aware KV budget.

vLLM calls ``register()`` (entry point ``vllm.general_plugins: kvguard``) in every process
it starts: the API server, the engine core and each worker, before the worker class is
resolved. ``register()`` is idempotent, cheap, and does nothing unless asked through the
environment:

``KVGUARD_SPOOL_DIR``   start the probe in each worker, writing snapshots here.
``KVGUARD_INTERVAL``    seconds between samples (default 5).
``KVGUARD_SOURCE``      the probe's source (default ``auto``: the worker's own allocator).
``KVGUARD_MINDSPORE_DUMP``  ``1`` (every 100 graph runs) or N: exact mode on MindSpore, the pool's own dump of its
                        buffers merged into ``MS_ALLOC_CONF`` (``kvguard.plugin.hooks``), read by the probe.
``KVGUARD_BUDGET``      ``stock`` (default, vLLM's own budget) or ``reserved``: size the KV
                        cache with :func:`kvguard.budget.estimator.reserved_kv_cache_bytes`, the
                        formula of ``kvguard budget`` (never more than vLLM's own figure);
                        ``guard``: the largest budget the budget-time verdict predicts fits
                        (``kvguard.guard.judge.judge_at_budget``), never more than vLLM's figure.

It wraps three methods of the worker class (``vllm.v1.worker.gpu_worker.Worker``;
``vllm_ascend.worker.worker.NPUWorker`` and ``worker_v1.NPUWorker``), patched when their
module is imported, or at once if it already is:

- ``init_device``: starts the probe once the worker's device is set (rank = worker rank), and
  names the engine in its snapshots as vLLM's own series label it: ``model_name`` is
  ``model_config.served_model_name`` (one name: ``get_served_model_name`` keeps the first of a list,
  config/model.py 0.34.0), ``engine`` the data-parallel index (``parallel_config.data_parallel_index``,
  else ``data_parallel_rank``: the engine indices the API server's stat loggers label, loggers.py);
- ``determine_available_memory``: while it runs, the ``memory_profiling`` context manager
  it calls (whatever object that name holds in the worker's module then, vllm-mindspore's
  replacement included) is wrapped to read the allocator's reserved peak before and after
  the profile run; afterwards the result's named fields (``weights_memory``,
  ``torch_peak_increase``, ``non_torch_increase``, ``before_create.total_memory``) and
  ``cache_config.gpu_memory_utilization`` make the estimator's :class:`Profile`; vLLM 0.8.5-0.9.0's Worker
  and vllm-ascend <= 0.14's NPUWorker run no ``memory_profiling``, so their own ``torch.cuda`` /
  ``torch_npu.npu`` reads make it instead (:func:`profile_from_device_readings`,
  :mod:`kvguard.plugin.inline_readings`); on vllm-mindspore, which measures ``memory_reserved()`` at the
  profile run's end only, the run's reserved peak is read from MindSpore's own statistics too and recorded
  beside it (:func:`reserved_peak_from`; the guard counts it where it is higher);
- ``initialize_from_config``: records the KV cache vLLM allocated (``KVCacheConfig``).

Once the budget is fixed (``determine_available_memory`` returned, the KV cache not allocated yet)
the plugin also judges it: the era's KV tensors for that budget (the worker's ``get_kv_cache_spec``)
placed into a model of this rank's allocator built from its counters now
(``kvguard.guard.at_budget.allocator_from_counters``), and the serving peak beside them. The verdict goes
into the rank's snapshot at once (``budget_verdict``; ``/guard``'s ``at_budget``).

Every hook is wrapped: a failure is logged once, counted (:data:`hook_errors`), and the
original method's result passes through untouched. kvguard never makes vLLM fail.

The wing's modules: :mod:`~kvguard.plugin.hooks` (registration and the wrappers), :mod:`~kvguard.plugin.state`
(settings, counts, what was registered), :mod:`~kvguard.plugin.profile` (pure conversions from vLLM's objects,
typed by :mod:`~kvguard.plugin.objects`), :mod:`~kvguard.plugin.capture` and :mod:`~kvguard.plugin.inline_readings`
(what is read while the profile run runs), :mod:`~kvguard.plugin.budget` (the ``KVGUARD_BUDGET`` decisions).
"""

from __future__ import annotations

from kvguard.plugin.hooks import WORKER_CLASSES, register, reset_for_tests
from kvguard.plugin.profile import (
    engine_identity,
    kv_cache_allocation,
    profile_from,
    profile_from_device_readings,
    reserved_peak_from,
    running_release,
)
from kvguard.plugin.state import BUDGETS, DEFAULT_INTERVAL, Settings, hook_errors

__all__ = [
    "BUDGETS",
    "DEFAULT_INTERVAL",
    "WORKER_CLASSES",
    "Settings",
    "engine_identity",
    "hook_errors",
    "kv_cache_allocation",
    "profile_from",
    "profile_from_device_readings",
    "register",
    "reserved_peak_from",
    "reset_for_tests",
    "running_release",
]
