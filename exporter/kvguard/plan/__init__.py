"""``kvguard plan``: what a vLLM release will decide at startup, from the serve command and the model's
``config.json`` alone, before launch.

Nothing here is a second budget formula: the weights and the profile run's activation peak come from the
workload model driven through the platform's allocator model (``kvguard.sim``, as ``kvguard simulate``
runs it); the KV-cache budget is the era's formula (``kvguard.budget.estimator``, rows of
``kvguard.vllm.eras``), the one ``kvguard budget`` applies.

- ``devices``: named devices and their memory, each cited to its vendor's spec sheet.
- ``command``: a ``vllm serve`` / ``api_server`` / vllm-mindspore command line, read as vLLM reads it.
- ``planner``: the plan for one rank.
"""
