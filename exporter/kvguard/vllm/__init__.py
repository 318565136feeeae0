"""Everything kvguard knows about vLLM, vllm-ascend and vllm-mindspore releases.

- ``eras``: the era table, one row per release range, each citing the upstream file:line
  its budget formula, startup-log lines and worker hooks follow;
- ``log``: the startup-log reader;
- ``metrics``: vLLM's own ``/metrics``;
- ``plugin``: the ``vllm.general_plugins`` entry point that runs inside vLLM's workers.

Supporting the next release touches this folder and its tests, nothing else. The formulas
themselves stay pure in :mod:`kvguard.budget.estimator`.
"""
