"""vLLM's argument parser refusing a ``--block-size`` outside its choices, in its own words, per release.

The parser exits (code 2) before any engine or device exists. The choices, read from the wheels:

- vLLM 0.7.3: ``choices=[8, 16, 32, 64, 128]`` (``vllm/engine/arg_utils.py`` 0.7.3:438-441);
- vLLM 0.11.0: ``BlockSize = Literal[1, 8, 16, 32, 64, 128]`` (``vllm/config/cache.py`` 0.11.0:24), which
  ``EngineArgs.add_cli_args`` turns into argparse choices: the real 0.11.0 parser answers ``--block-size 24``
  with "vllm serve: error: argument --block-size: invalid choice: 24 (choose from 1, 8, 16, 32, 64, 128)";
- vLLM 0.14.0: 256 added (``vllm/config/cache.py`` 0.14.0:23);
- vLLM 0.20.0 on: any positive integer (``vllm/config/cache.py`` 0.20.0:47 ``SkipValidation[int]``;
  0.27.0:49 ``Field(gt=0)``): no choices.

Releases between those read take the nearest earlier one's rule. Not checked: the attention backend's own
rule (FlashAttention's "Block size must be a multiple of 16.", ``vllm/v1/attention/backends/flash_attn.py``
0.11.0:85-86), raised when the KV cache is shaped, after the profile run.
"""

from __future__ import annotations

# (first vLLM release, its --block-size choices or None for any positive integer, where it was read)
CHOICES: tuple[tuple[tuple[int, ...], tuple[int, ...] | None, str], ...] = (
    ((0, 7, 3), (8, 16, 32, 64, 128), "vllm/engine/arg_utils.py 0.7.3:438-441"),
    ((0, 11, 0), (1, 8, 16, 32, 64, 128), "vllm/config/cache.py 0.11.0:24 (BlockSize)"),
    ((0, 14, 0), (1, 8, 16, 32, 64, 128, 256), "vllm/config/cache.py 0.14.0:23 (BlockSize)"),
    ((0, 20, 0), None, "vllm/config/cache.py 0.20.0:47 (any positive integer)"),
)


def block_size_choices(vllm_version: tuple[int, ...]) -> tuple[tuple[int, ...] | None, str]:
    """The parser's --block-size choices for a vLLM release (None: any positive integer), and where read."""
    rows = [row for row in CHOICES if row[0] <= vllm_version] or [CHOICES[0]]
    _, choices, cite = rows[-1]
    return choices, cite


def block_size_refusal(block_size: int, vllm_version: tuple[int, ...], prog: str) -> dict[str, str] | None:
    """argparse's error for a given --block-size outside the release's choices, or None."""
    choices, cite = block_size_choices(vllm_version)
    if choices is None or block_size in choices:
        return None
    listed = ", ".join(str(choice) for choice in choices)
    return {
        "code": "block_size_invalid_choice",
        "cite": cite,
        "message": f"{prog}: error: argument --block-size: invalid choice: {block_size} (choose from {listed})",
    }
