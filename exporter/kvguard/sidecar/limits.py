"""What one sidecar exports at most, whatever the spool holds: sized for one node (at most 16
accelerators, a few processes on each).

Any process that can write the spool (every container of the pod) could otherwise decide the size
of /metrics: 4,096 files of distinct models made 155,671 series, text fields at their length caps a
512 MB /metrics and 1.4 GiB of sidecar memory. Past a cap a rank is left out and counted by reason
(kvguard_ranks_cut); a longer label value is cut and counted (kvguard_label_values_truncated).
Imports nothing, so the CLI can show the defaults without loading the sidecar.
"""

MAX_RANKS = 128
MAX_ENGINES = 64  # distinct (engine_id, engine) label pairs
MAX_MODELS = 32  # distinct model_name labels
MAX_PODS = 64  # distinct (namespace, pod) label pairs
MAX_LABEL_CHARS = 128
MAX_METRICS_BYTES = 4_000_000  # the ranks' series; the rest of /metrics is a few kB
