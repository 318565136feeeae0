"""A fake GPUModelRunner: the one part of vLLM's startup the harness replaces outright.

vLLM's worker calls load_model / profile_run / profile_cudagraph_memory / capture_model /
initialize_kv_cache on its model runner; this one allocates on the fake device what the
scenario says a real model would, and builds its KV-cache specs with the release's own
spec classes from the model's config.json. Runs inside a release's environment.
"""

from __future__ import annotations

import contextlib
import dataclasses
import inspect
import time
import types

import torch

SCENARIO: dict = {}
DEVICE = None  # the FakeDevice, set by worker_main before the worker is built


def _spec_kwargs(cls, **wanted):
    """Keep the arguments this release's spec dataclass takes (fields differ per release)."""
    names = (
        {f.name for f in dataclasses.fields(cls)}
        if dataclasses.is_dataclass(cls)
        else set(inspect.signature(cls).parameters)
    )
    return {k: v for k, v in wanted.items() if k in names}


def kv_cache_tensors(kv_cache_config) -> list:
    """A KVCacheConfig's KVCacheTensors: its list (0.10+), or through 0.9.x its layer -> tensor dict ``tensors``
    (v1/kv_cache_interface.py 0.9.0:179-186)."""
    tensors = getattr(kv_cache_config, "kv_cache_tensors", None)
    return list(tensors if tensors is not None else kv_cache_config.tensors.values())


class FakeModelRunner:
    def __init__(self, vllm_config, device, *args, **kwargs):
        self.vllm_config = vllm_config
        self.model_config = vllm_config.model_config
        self.cache_config = vllm_config.cache_config
        self.scheduler_config = vllm_config.scheduler_config
        self.parallel_config = vllm_config.parallel_config
        self.compilation_config = vllm_config.compilation_config
        self.load_config = vllm_config.load_config
        self.lora_config = getattr(vllm_config, "lora_config", None)
        self.device = device
        self.model = None
        self.model_memory_usage = 0
        self.kv_caches = []
        self.kv_caches_by_layer = {}
        self.kv_cache_config = None
        self.extensible_kv_cache = None
        self.is_pooling_model = False
        self.is_encoder_decoder = False
        self.kernel_block_sizes = None
        self.attn_groups = []
        self.speculator = None
        self.kv_connector = None
        self.max_num_reqs = vllm_config.scheduler_config.max_num_seqs
        self.max_model_len = vllm_config.model_config.max_model_len
        self.eplb = types.SimpleNamespace(suppress=contextlib.nullcontext)
        self.events: list[dict] = []

    # -- what the worker calls -----------------------------------------------------------------
    def _event(self, what, **figures):
        self.events.append({"event": what, **figures, "device": DEVICE.snapshot()})

    def load_model(self, *args, **kwargs):
        t0 = time.perf_counter()
        before = DEVICE.allocated
        DEVICE.alloc(SCENARIO["weights_bytes"])
        self.model = torch.nn.Module()
        self.model_memory_usage = DEVICE.allocated - before
        self.load_seconds = time.perf_counter() - t0
        self._event("load_model", weights_bytes=SCENARIO["weights_bytes"])

    def get_model(self):
        return self.model

    def profile_run(self, *args, **kwargs):
        peak = SCENARIO.get("profile_transient_bytes", 0)
        # An earlier activation whose cached block the peak cannot reuse (a smaller size class, or a
        # split block): torch's reserved peak outgrows its allocated peak by that much. Once the run
        # is over the block is whole and free again, so empty_cache hands it back.
        unusable = SCENARIO.get("profile_unreusable_bytes", 0)
        if unusable:
            DEVICE.alloc(unusable)
            DEVICE.release(unusable, fragment=unusable)
        DEVICE.alloc(peak)
        DEVICE.stuck -= unusable
        DEVICE.non_torch += SCENARIO.get("profile_non_torch_bytes", 0)
        DEVICE.release(peak, fragment=SCENARIO.get("profile_fragment_bytes", 0))
        DEVICE.alloc(SCENARIO.get("profile_residual_bytes", 0))
        self._event("profile_run", transient_bytes=peak)

    def profile_cudagraph_memory(self, *args, **kwargs):
        estimate = SCENARIO.get("cudagraph_estimate_bytes", SCENARIO.get("cudagraph_bytes", 0))
        self._event("profile_cudagraph_memory", estimate_bytes=estimate)
        return estimate

    def capture_model(self, *args, **kwargs):
        graphs = SCENARIO.get("cudagraph_bytes", 0)
        DEVICE.alloc(graphs)
        self._event("capture_model", cudagraph_bytes=graphs)
        return graphs

    def warmup_step(self):
        """One warm-up step (0.34 sizing warm-up): a transient allocation freed again."""
        peak = SCENARIO.get("warmup_transient_bytes", SCENARIO.get("profile_transient_bytes", 0))
        DEVICE.alloc(peak)
        DEVICE.release(peak, fragment=SCENARIO.get("warmup_fragment_bytes", 0))
        self._event("warmup_step", transient_bytes=peak)

    def needs_cudagraph_capture(self):
        return not self.model_config.enforce_eager

    def _dummy_run(self, *args, **kwargs):
        return None, None

    def _dummy_sampler_run(self, *args, **kwargs):
        return None

    def maybe_remove_all_loras(self, *args, **kwargs):
        return None

    def get_kv_cache_spec(self):
        from vllm.v1.kv_cache_interface import FullAttentionSpec

        hf = self.model_config.hf_text_config
        tp = self.parallel_config.tensor_parallel_size
        heads = hf.num_attention_heads
        kv_heads = getattr(hf, "num_key_value_heads", heads)
        head_size = getattr(hf, "head_dim", None) or hf.hidden_size // heads
        kv_dtype = self.model_config.dtype  # cache_dtype "auto": the model's dtype
        spec = FullAttentionSpec(
            **_spec_kwargs(
                FullAttentionSpec,
                block_size=self.cache_config.block_size,
                num_kv_heads=max(kv_heads // tp, 1),
                head_size=head_size,
                dtype=kv_dtype,
                use_mla=False,  # a field without a default through 0.9.0 (kv_cache_interface.py)
            )
        )
        return {f"model.layers.{i}.self_attn.attn": spec for i in range(hf.num_hidden_layers)}

    def initialize_kv_cache(self, kv_cache_config, *args, extensible=False, **kwargs):
        self.kv_cache_config = kv_cache_config
        if extensible:
            from vllm.v1.worker.extensible_kv_cache import ExtensibleKVCache

            layout = self.cache_config.get_resolved_kv_cache_layout()
            self.extensible_kv_cache = ExtensibleKVCache(kv_cache_config, self.device, layout)
            for tensor in kv_cache_tensors(kv_cache_config):
                self.extensible_kv_cache.allocate(tensor.size)
                break  # one backing allocation shared by every tensor
        else:
            for tensor in kv_cache_tensors(kv_cache_config):
                DEVICE.alloc(tensor.size)
        self._event(
            "initialize_kv_cache",
            num_blocks=kv_cache_config.num_blocks,
            tensor_bytes=sum(t.size for t in kv_cache_tensors(kv_cache_config)),
        )


class FakeExtensibleTensor:
    """Stands in for vllm.utils.extensible_tensor.ExtensibleTensor (CUDA VMM: cuMemCreate /
    cuMemMap): reserves address space for `size` bytes, maps pages on the fake device as
    segments grow. Pages are `mapped` memory, outside torch's caching allocator."""

    granularity = 2 << 20

    def __init__(self, size, device=None, segment_capacities=None, export_handle_types=0, **_):
        self.size = size
        self.device = device
        self.segment_capacities = list(segment_capacities or [size])
        self.sizes = [0] * len(self.segment_capacities)
        self.physical_bytes = 0

    def _round(self, n):
        return -(-n // self.granularity) * self.granularity

    def resize_segments_(self, sizes, zero_new=True):
        new = sum(self._round(s) for s in sizes)
        DEVICE.map_pages(max(new - self.physical_bytes, 0))
        DEVICE.mapped -= max(self.physical_bytes - new, 0)
        self.physical_bytes = new
        self.sizes = list(sizes)

    def segments_backed_by_one_chunk(self, sizes):
        return [True] * len(sizes)

    def release_physical(self):
        DEVICE.mapped -= self.physical_bytes
        self.physical_bytes = 0
        self.sizes = [0] * len(self.sizes)

    def full_view(self):
        return torch.empty(self.size, dtype=torch.uint8, device="meta")

    def segment_view(self, index):
        return torch.empty(self.segment_capacities[index], dtype=torch.uint8, device="meta")

    def free(self):
        self.release_physical()
