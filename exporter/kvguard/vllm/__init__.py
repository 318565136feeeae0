"""Everything kvguard knows about vLLM, vllm-ascend and vllm-mindspore releases.

- ``eras``: the era table, one row per release range, each citing the upstream file:line
  its budget formula, startup-log lines and worker hooks follow;
- ``log``: the startup-log reader;
- ``metrics``: vLLM's own ``/metrics``;
- ``log_profile``, ``log_verdict``, ``oom``: a log's profile, what a log itself proves, OOM messages as facts;
- ``source_index``: the logger calls of each release's source, by file:line.

The ``vllm.general_plugins`` entry point that runs inside vLLM's workers is :mod:`kvguard.plugin`, not here:
this folder holds what a release is and says, not the wiring.

Supporting the next release touches this folder and its tests, nothing else. The formulas
themselves stay pure in :mod:`kvguard.budget.estimator`.
"""
